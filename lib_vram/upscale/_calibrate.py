"""Per-model calibration: working-set bytes per input pixel and effective receptive field.

Both are measured once per (model, dtype, device type) with a few small forward passes and kept in
an in-process cache (weakly keyed by the model object, so a dropped model drops its entry).

* **Bytes per pixel** is the peak of live tensor bytes created inside one forward pass on a probe
  tile, divided by its pixels. It is counted with :class:`lib_vram.core.livebytes.LiveBytesCounter`
  (every op's output storage is added when created and subtracted when freed), so it works the
  same on every backend and needs no global peak counters (the WebUI's memory line relies on
  those).
* **Effective context** is how many input pixels of context a tile needs so that its core matches
  the untiled output to within ``CONTEXT_TOL``: three probes (hard edges, noise, smooth with a flat
  band) are upscaled whole, then a core placed off the model's internal grids is re-run as crops
  with growing margins and compared; the halo is 1.5 x the margin found, and a model no margin
  fits is reported as not local (the engine then does not tile it silently). Theoretical receptive fields are
  useless here (RRDBNet's spans hundreds of pixels, almost all of it with negligible weight).
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from lib_vram.core.device import is_oom_error, release
from lib_vram.core.livebytes import LiveBytesCounter, itemsize

from ._adapter import ModelSpec

logger = logging.getLogger(__name__)

DEFAULT_BYTES_PER_PX_FP32 = 16 * 1024
"""Prediction when calibration is off: an RRDBNet x4 (64 features) needs ~10 KiB of live
activations per input pixel in FP32 (its x4 stages hold 16 output pixels of 64 channels); rounded
up for other architectures. Scaled by the element size for FP16/BF16."""
DEFAULT_CONTEXT = 16
"""Halo (input px) when calibration is off. Calibrated values for random-weight Compact and RRDBNet
models are 4-16 (see docs/benchmarks.md); rounded up to the model's grid."""
CONTEXT_CANDIDATES = (2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)
"""Margins probed for a model without a window grid; a gridded model probes multiples of its grid
up to ``max(64, 2 * grid)``."""
CONTEXT_TOL = 0.5 / 255
"""Largest core error accepted: half an 8-bit step."""
CONTEXT_MARGIN = 1.5
"""The halo is at least this times the measured margin: the cross-fade writes pixels up to a
quarter of the halo outside the core (context 3/4 of the halo there), and a probe is a sample."""
PROBE_CORE = 12
PROBE_PX = 64


@dataclass(frozen=True)
class Context:
    """Result of the context calibration."""

    halo: int
    """Overlap (input px) each tile reads beyond its core: the measured margin with its safety
    factor, on the model's grid."""
    measured: int
    """Smallest probed margin whose core matched the untiled output on every probe."""
    sufficient: bool
    """False when even the largest margin probed did not match: the model is not local enough for
    exact tiling (untiled when it fits, else a visible note)."""


LiveBytes = LiveBytesCounter
"""The name this package exported before the counters were merged (:mod:`lib_vram.core.livebytes`)."""


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def clear_calibration() -> None:
    """Forget every calibration (e.g. after the model's weights changed in place)."""
    _cache.clear()


def _probe_image(size: int, channels: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Three probes in one batch, fixed seed, in [0, 1]: hard-edged blocks of 5 px (edges not on any
    power-of-two grid), white noise, and a smooth field with a flat band."""
    g = torch.Generator().manual_seed(1234)
    n = -(-size // 5)
    blocks = torch.rand(1, channels, n, n, generator=g).round()
    blocks = blocks.repeat_interleave(5, -1).repeat_interleave(5, -2)[..., :size, :size]
    noise = torch.rand(1, channels, size, size, generator=g)
    coarse = torch.rand(1, channels, max(2, size // 8), max(2, size // 8), generator=g)
    smooth = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    smooth[..., size // 3 : size // 2, :] = 0.5
    return torch.cat([blocks, noise, smooth]).to(device=device, dtype=dtype)


def _legal(spec: ModelSpec, n: int) -> bool:
    return n >= spec.minimum and n % spec.multiple_of == 0 and n % spec.grid == 0


def _forward(spec: ModelSpec, x: Tensor) -> Tensor:
    with torch.inference_mode():
        return spec.forward(x).float().clamp(0, 1)


def measure_bytes_per_px(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> float:
    """Peak live bytes of a forward pass per input pixel (probe of ``PROBE_PX``², batch 1)."""
    p = PROBE_PX
    while not _legal(spec, p):
        p += 1
    channels = spec.input_channels or 3
    x = _probe_image(p, channels, device, dtype)[:1]
    counter = LiveBytesCounter()
    with torch.inference_mode(), counter:
        y = spec.forward(x)
    del y
    return counter.peak_bytes / float(p * p)


def candidates(spec: ModelSpec) -> list[int]:
    """Margins :func:`measure_context` probes for ``spec`` (multiples of its grid)."""
    g = max(1, spec.grid)
    if g == 1:
        return list(CONTEXT_CANDIDATES)
    return [g * k for k in range(1, max(64, 2 * g) // g + 1)]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def halo_for(spec: ModelSpec, margin: int) -> int:
    """The overlap for a measured ``margin``: times ``CONTEXT_MARGIN``, even, on the model's grid."""
    return _round_up(max(2, math.ceil(margin * CONTEXT_MARGIN)), math.lcm(2, max(1, spec.grid)))


def measure_context(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> Context:
    """Smallest margin (input px) whose tile core matches the untiled output within ``CONTEXT_TOL``
    on three probes (hard edges, noise, smooth/flat), with the core placed off every internal grid
    the engine does not align to; the halo adds ``CONTEXT_MARGIN``.

    When no candidate is good enough the result says so (``sufficient=False``), loudly in the log:
    the engine then runs the model untiled where it fits and notes the approximation where not.
    """
    cands = candidates(spec)
    r_max = cands[-1]
    g = max(1, spec.grid)
    core = _round_up(PROBE_CORE, g)
    if g == 1:
        c0 = r_max + 3  # odd: off the 2/4/8-px grids of strided layers
    else:
        c0 = _round_up(r_max, g)
        if (c0 // g) % 2 == 0:
            c0 += g  # off the 2 x grid
    size = c0 + core + r_max + 5
    while not _legal(spec, size):
        size += 1
    channels = spec.input_channels or 3
    x = _probe_image(size, channels, device, dtype)
    s = spec.scale
    ref = _forward(spec, x)[..., c0 * s : (c0 + core) * s, c0 * s : (c0 + core) * s]

    def error(r: int) -> float:
        crop = x[..., c0 - r : c0 + core + r, c0 - r : c0 + core + r]
        out = _forward(spec, crop)[..., r * s : (r + core) * s, r * s : (r + core) * s]
        return float((out - ref).abs().max())

    cands = [r for r in cands if _legal(spec, core + 2 * r)]
    # Binary search (the error falls with the margin): about log2(len) forwards of small crops.
    lo, hi = 0, len(cands)
    while lo < hi:
        mid = (lo + hi) // 2
        if error(cands[mid]) <= CONTEXT_TOL:
            hi = mid
        else:
            lo = mid + 1
    if lo < len(cands):
        return Context(halo_for(spec, cands[lo]), cands[lo], True)
    logger.warning(
        "%s: tiles do not match the whole image even with %d px of context (error %.1f/255): "
        "the model is not local enough for exact tiling",
        spec.name,
        r_max,
        error(r_max) * 255,
    )
    return Context(halo_for(spec, r_max), r_max, False)


def _cached(spec: ModelSpec, key: tuple, compute, fallback):  # noqa: ANN001
    """``compute()`` once per (model, key); an OOM during the probe gives ``fallback`` (uncached)."""
    try:
        per_model = _cache.setdefault(spec.owner, {})
    except TypeError:  # not weak-referenceable: measure every time
        per_model = {}
    if key in per_model:
        return per_model[key]
    oom = False
    try:
        value = compute()
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        oom = True
    if oom:
        release(key[-1])
        logger.info("calibration probe of %s ran out of memory; using the prediction", spec.name)
        return fallback
    per_model[key] = value
    logger.debug("calibrated %s %s: %s", spec.name, key, value)
    return value


def bytes_per_px(spec: ModelSpec, device: torch.device, dtype: torch.dtype, *, measure: bool = True) -> float:
    """Working-set bytes per input pixel: measured once per (model, dtype, device type), else
    predicted from ``DEFAULT_BYTES_PER_PX_FP32``."""
    predicted = DEFAULT_BYTES_PER_PX_FP32 * itemsize(dtype) / 4.0
    if not measure:
        return predicted
    key = ("bpp", dtype, device.type)
    return _cached(spec, key, lambda: measure_bytes_per_px(spec, device, dtype), predicted)


def context_info(
    spec: ModelSpec, device: torch.device, dtype: torch.dtype, *, measure: bool = True
) -> Context:
    """Effective context: measured once per (model, dtype, device type), else ``DEFAULT_CONTEXT``
    (rounded up to the model's grid)."""
    default = Context(_round_up(DEFAULT_CONTEXT, math.lcm(2, max(1, spec.grid))), DEFAULT_CONTEXT, True)
    if not measure:
        return default
    key = ("context", dtype, device.type)
    return _cached(spec, key, lambda: measure_context(spec, device, dtype), default)


def context(spec: ModelSpec, device: torch.device, dtype: torch.dtype, *, measure: bool = True) -> int:
    """The overlap (input px) tiles of this model need (see :func:`context_info`)."""
    return context_info(spec, device, dtype, measure=measure).halo
