"""Per-model calibration: working-set bytes per input pixel and effective receptive field.

Both are measured once per (model, dtype, device type) with a few small forward passes and kept in
an in-process cache (weakly keyed by the model object, so a dropped model drops its entry).

* **Bytes per pixel** is the peak of live tensor bytes created inside one forward pass on a probe
  tile, divided by its pixels. It is counted with :class:`lib_vram.livebytes.LiveBytesCounter`
  (every op's output storage is added when created and subtracted when freed), so it works the
  same on every backend and needs no global peak counters (the WebUI's memory line relies on
  those).
* **Effective context** is how many input pixels of context a tile needs so that its core matches
  the untiled output to within ``CONTEXT_TOL``: a random image-like probe is upscaled whole, then
  its centre is re-run as crops with growing margins and compared. Theoretical receptive fields are
  useless here (RRDBNet's spans hundreds of pixels, almost all of it with negligible weight).
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import Tensor

from ..device import is_oom_error, release
from ..livebytes import LiveBytesCounter, itemsize
from ._adapter import ModelSpec

logger = logging.getLogger(__name__)

DEFAULT_BYTES_PER_PX_FP32 = 16 * 1024
"""Prediction when calibration is off: an RRDBNet x4 (64 features) needs ~10 KiB of live
activations per input pixel in FP32 (its x4 stages hold 16 output pixels of 64 channels); rounded
up for other architectures. Scaled by the element size for FP16/BF16."""
DEFAULT_CONTEXT = 16
"""Halo (input px) when calibration is off. Calibrated values for random-weight Compact and RRDBNet
models are 12-16 (see docs/benchmarks.md)."""
CONTEXT_CANDIDATES = (2, 4, 6, 8, 12, 16, 20, 24, 32)
CONTEXT_TOL = 0.5 / 255
"""Largest core error accepted: half an 8-bit step."""
PROBE_CORE = 8
PROBE_PX = 64


LiveBytes = LiveBytesCounter
"""The name this package exported before the counters were merged (:mod:`lib_vram.livebytes`)."""

_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def clear_calibration() -> None:
    """Forget every calibration (e.g. after the model's weights changed in place)."""
    _cache.clear()


def _probe_image(size: int, channels: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """An image-like probe: smooth colour fields plus texture, fixed seed, in [0, 1]."""
    g = torch.Generator().manual_seed(1234)
    coarse = torch.rand(1, channels, max(2, size // 8), max(2, size // 8), generator=g)
    smooth = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    texture = torch.rand(1, channels, size, size, generator=g)
    return (0.75 * smooth + 0.25 * texture).to(device=device, dtype=dtype)


def _legal(spec: ModelSpec, n: int) -> bool:
    return n >= spec.minimum and n % spec.multiple_of == 0


def _forward(spec: ModelSpec, x: Tensor) -> Tensor:
    with torch.inference_mode():
        return spec.forward(x).float().clamp(0, 1)


def measure_bytes_per_px(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> float:
    """Peak live bytes of a forward pass per input pixel (probe of ``PROBE_PX``², batch 1)."""
    p = PROBE_PX
    while not _legal(spec, p):
        p += 1
    channels = spec.input_channels or 3
    x = _probe_image(p, channels, device, dtype)
    counter = LiveBytesCounter()
    with torch.inference_mode(), counter:
        y = spec.forward(x)
    del y
    return counter.peak_bytes / float(p * p)


def measure_context(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> int:
    """Smallest halo (input px) whose tile core matches the untiled output within ``CONTEXT_TOL``.

    Returns the largest candidate when none is good enough (the probe cannot see further).
    """
    r_max = CONTEXT_CANDIDATES[-1]
    size = PROBE_CORE + 2 * r_max
    while not _legal(spec, size):
        size += 1
    channels = spec.input_channels or 3
    x = _probe_image(size, channels, device, dtype)
    s = spec.scale
    c0 = (size - PROBE_CORE) // 2
    ref = _forward(spec, x)[..., c0 * s : (c0 + PROBE_CORE) * s, c0 * s : (c0 + PROBE_CORE) * s]

    def error(r: int) -> float:
        crop = x[..., c0 - r : c0 + PROBE_CORE + r, c0 - r : c0 + PROBE_CORE + r]
        out = _forward(spec, crop)[..., r * s : (r + PROBE_CORE) * s, r * s : (r + PROBE_CORE) * s]
        return float((out - ref).abs().max())

    # Binary search (the error falls with the margin): about log2(len) forwards of small crops.
    cands = [r for r in CONTEXT_CANDIDATES if _legal(spec, PROBE_CORE + 2 * r)]
    lo, hi = 0, len(cands)
    while lo < hi:
        mid = (lo + hi) // 2
        if error(cands[mid]) <= CONTEXT_TOL:
            hi = mid
        else:
            lo = mid + 1
    if lo < len(cands):
        return cands[lo]
    logger.info("%s: effective context exceeds %d px; using %d", spec.name, r_max, r_max)
    return r_max


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


def context(spec: ModelSpec, device: torch.device, dtype: torch.dtype, *, measure: bool = True) -> int:
    """Effective context (input px): measured once per (model, dtype, device type), else
    ``DEFAULT_CONTEXT``."""
    if not measure:
        return DEFAULT_CONTEXT
    key = ("context", dtype, device.type)
    return _cached(spec, key, lambda: measure_context(spec, device, dtype), DEFAULT_CONTEXT)
