"""Per-model calibration: working-set bytes per input pixel and effective receptive field.

Both are measured once per (model, dtype, device type) with a few small forward passes and kept in
an in-process cache (weakly keyed by the model object, so a dropped model drops its entry). The
probes (batch, context, reach) and what each decides: docs/upscale-architectures.md, "What
happens with your model".

* **Bytes per pixel** is the peak of live tensor bytes created inside one forward pass on a probe
  tile, divided by its pixels, counted with :class:`lib_vram.core.livebytes.LiveBytesCounter`: the
  same on every backend, and no global peak counters (the WebUI's memory line relies on those).
* **Effective context** (:func:`measure_context`): the halo is 1.5 x the smallest crop margin whose
  core matches the untiled output within ``CONTEXT_TOL``. Theoretical receptive fields are useless
  here (RRDBNet's spans hundreds of pixels, almost all of it with negligible weight).
* **Batching** (:func:`measure_batching`) and **reach** (:func:`measure_reach`): a model that
  rejects or mixes a batch runs one image at a time; one whose output near a corner or inside
  changes when everything farther than the tiles see is replaced has its tiles flagged inexact.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lib_vram.core.device import is_oom_error, release
from lib_vram.core.livebytes import LiveBytesCounter, itemsize

from ._adapter import ModelSpec, _legal_len, _round_up

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
    """The model on a batch of probes (one image per call where the model needs it)."""
    with torch.inference_mode():
        if spec.one_at_a_time and x.shape[0] > 1:
            return torch.cat([spec.forward(x[i : i + 1]).float().clamp(0, 1) for i in range(x.shape[0])])
        return spec.forward(x).float().clamp(0, 1)


def measure_bytes_per_px(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> float:
    """Peak live bytes of a forward pass per input pixel (probe of ``PROBE_PX``², batch 1)."""
    p = _legal_len(spec, PROBE_PX)
    channels = spec.input_channels or 3
    x = _probe_image(p, channels, device, dtype)[:1]
    counter = LiveBytesCounter()
    with torch.inference_mode(), counter:
        y = spec.forward(x)
    del y
    return counter.peak_bytes / float(p * p)


def _core_error(
    spec: ModelSpec, r_max: int, core: int, device: torch.device, dtype: torch.dtype
) -> Callable[[int], float]:
    """The context probe: the largest error of a ``core``-px core computed on a crop with ``r`` px
    of margin (``r <= r_max``) against the same core of the untiled probe. One forward of three
    probes here, one of the crops per call."""
    g = max(1, spec.grid)
    if g == 1:
        c0 = r_max + 3  # odd: off the 2/4/8-px grids of strided layers
    else:
        c0 = _round_up(r_max, g)
        if (c0 // g) % 2 == 0:
            c0 += g  # off the 2 x grid
    x = _probe_image(_legal_len(spec, c0 + core + r_max + 5), spec.input_channels or 3, device, dtype)
    s = spec.scale
    ref = _forward(spec, x)[..., c0 * s : (c0 + core) * s, c0 * s : (c0 + core) * s]

    def error(r: int) -> float:
        crop = x[..., c0 - r : c0 + core + r, c0 - r : c0 + core + r]
        out = _forward(spec, crop)[..., r * s : (r + core) * s, r * s : (r + core) * s]
        return float((out - ref).abs().max())

    return error


def candidates(spec: ModelSpec) -> list[int]:
    """Margins :func:`measure_context` probes for ``spec`` (multiples of its grid)."""
    g = max(1, spec.grid)
    if g == 1:
        return list(CONTEXT_CANDIDATES)
    return [g * k for k in range(1, max(64, 2 * g) // g + 1)]


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
    core = _round_up(PROBE_CORE, max(1, spec.grid))
    error = _core_error(spec, r_max, core, device, dtype)
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


def measure_margin(spec: ModelSpec, device: torch.device, dtype: torch.dtype, overlap: int) -> str | None:
    """For an overlap the caller gave (not calibrated): why tiles with it cannot match the whole
    image, or None. The context probe at one margin - the least context a tile's output pixel gets,
    :func:`reach_distance` of the overlap, on the model's grid - with the core off the grids the
    engine does not align to (a strided stage then sees the crop at another phase, as tiles would).
    One forward of three probes of about ``2 x margin + 20`` px and one of the crops."""
    g = max(1, spec.grid)
    r = max(g, reach_distance(spec, overlap) // g * g) if g > 1 else reach_distance(spec, overlap)
    core = _round_up(PROBE_CORE, g)
    while not _legal(spec, core + 2 * r) and r < 4 * max(64, g):
        r += g
    err = _core_error(spec, r, core, device, dtype)(r)
    if err <= CONTEXT_TOL:
        return None
    return f"tiles with a {overlap} px overlap differ from the whole image by {err * 255:.1f}/255"


BATCH_PROBE_PX = 32


def measure_batching(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the model must get one image per call (None: batches are fine): two probes of
    ``BATCH_PROBE_PX``² as one batch against two single calls. A batch that raises (other than out
    of memory), comes back with another shape, or differs by more than ``CONTEXT_TOL`` from the
    single calls (images mixed in the batch) means one at a time. Three forwards of 32² images.
    A single call that fails propagates: the model fails, not the batch."""
    p = _legal_len(spec, BATCH_PROBE_PX)
    x = _probe_image(p, spec.input_channels or 3, device, dtype)[:2]
    with torch.inference_mode():
        singles = torch.cat([spec.forward(x[i : i + 1]).float() for i in range(2)])
        failed: str | None = None
        try:
            both = spec.forward(x).float()
        except Exception as exc:
            if is_oom_error(exc):
                raise
            text = str(exc).strip().splitlines()
            failed = f"a batch of 2 raises {type(exc).__name__}: {text[0][:120] if text else ''}"
    if failed is not None:
        return failed
    if both.shape != singles.shape:
        return f"a batch of 2 comes back as {tuple(both.shape)}"
    err = float((both.clamp(0, 1) - singles.clamp(0, 1)).abs().max())
    if err > CONTEXT_TOL:
        return f"images in one batch change each other's output ({err * 255:.1f}/255)"
    return None


REACH_TOL = CONTEXT_TOL
"""Largest change of a probe block accepted from content beyond the tiles' reach: half an 8-bit
step, the context calibration's own bound (a stricter one flags models whose influence merely
fades slowly, e.g. a U-Net, as whole-image models). A cyclic shift changes the border by many steps
(DCTLSA: 20/255); global pooling whose effect stays below half a step on a probe that replaces
most of the image is below it on tiles too."""
REACH_GLOBAL_PX = 48
"""A model flagged at a shorter distance (a small overlap) is probed again at this one: what still
changes the output there is called a whole-image dependence, else a context beyond the overlap."""
REACH_FAR_PX = 16
"""Width (input px) of the replaced band beyond the kept neighbourhood on each side of a probe."""


def reach_distance(spec: ModelSpec, halo: int) -> int:
    """Distance (input px) beyond which content must not change a tile's output: the least context
    any output pixel of a tile is computed with, three quarters of the halo (the cross-fade writes
    pixels up to a quarter of the halo outside the core)."""
    return max(1, (3 * halo) // 4)


def measure_reach(spec: ModelSpec, device: torch.device, dtype: torch.dtype, halo: int) -> str | None:
    """Why tiles with ``halo`` px of overlap cannot equal the whole image although the context
    calibration found a margin (None: nothing beyond the tiles' reach changes the output).

    Three observed blocks - the top-left and bottom-right corners and one in the interior, off the
    model's grids - on a probe of hard-edged blocks; for each, a copy of the probe with everything
    farther than :func:`reach_distance` from the block set to white. One batch of four images of
    about ``2 x (reach + REACH_FAR_PX) + 12`` px a side (68-240 px); the block's output must stay
    within ``CONTEXT_TOL`` of the unchanged probe's.
    """
    d = reach_distance(spec, halo)
    c, far = PROBE_CORE, REACH_FAR_PX
    p = d + far
    p += 1 - p % 2  # odd: off the 2/4/8-px grids of strided layers and windows
    n = _legal_len(spec, p + c + d + far)
    channels = spec.input_channels or 3
    base = _probe_image(n, channels, device, dtype)[:1]
    blocks = {
        "at the image border": (0, 0),
        "at the far image border": (n - c, n - c),
        "inside the image": (p, p),
    }
    variants = [base]
    for y, x in blocks.values():
        keep = torch.zeros(1, 1, n, n, dtype=torch.bool, device=base.device)
        keep[..., max(0, y - d) : y + c + d, max(0, x - d) : x + c + d] = True
        variants.append(torch.where(keep, base, torch.ones_like(base)))
    out = _forward(spec, torch.cat(variants))
    s = spec.scale
    errs = {}
    for i, (where, (y, x)) in enumerate(blocks.items(), start=1):
        window = (..., slice(y * s, (y + c) * s), slice(x * s, (x + c) * s))
        errs[where] = float((out[i : i + 1][window] - out[:1][window]).abs().max())
    logger.debug("%s: reach probe beyond %d px: %s", spec.name, d, errs)
    where, err = max(errs.items(), key=lambda kv: kv[1])
    if err <= REACH_TOL:
        return None
    if d < REACH_GLOBAL_PX and measure_reach(spec, device, dtype, -(-4 * REACH_GLOBAL_PX // 3)) is None:
        # nothing beyond REACH_GLOBAL_PX matters: a local model whose context exceeds this overlap
        return (
            f"its context exceeds the {halo} px overlap (content {d} px away changes it by "
            f"{err * 255:.1f}/255)"
        )
    return (
        f"it depends on the whole image: its output {where} changes by {err * 255:.1f}/255 "
        f"with content more than {d} px away (global pooling, global attention or a cyclic shift)"
    )


def _cached(
    name: str,
    probe: Callable[..., Any],
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    fallback: Any,
    measure: bool,
    *extra: Any,
) -> Any:
    """``probe(spec, device, dtype, *extra)`` once per (model, ``name``, ``extra``, dtype, device
    type); ``fallback`` when not measuring, and (uncached) when the probe runs out of memory."""
    if not measure:
        return fallback
    key = (name, *extra, dtype, device.type)
    try:
        per_model = _cache.setdefault(spec.owner, {})
    except TypeError:  # not weak-referenceable: measure every time
        per_model = {}
    if key in per_model:
        return per_model[key]
    oom = False
    try:
        value = probe(spec, device, dtype, *extra)
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
    return _cached("bpp", measure_bytes_per_px, spec, device, dtype, predicted, measure)


def context_info(
    spec: ModelSpec, device: torch.device, dtype: torch.dtype, *, measure: bool = True
) -> Context:
    """Effective context: measured once per (model, dtype, device type), else ``DEFAULT_CONTEXT``
    (rounded up to the model's grid)."""
    default = Context(_round_up(DEFAULT_CONTEXT, math.lcm(2, max(1, spec.grid))), DEFAULT_CONTEXT, True)
    return _cached("context", measure_context, spec, device, dtype, default, measure)


def batching(
    spec: ModelSpec, device: torch.device, dtype: torch.dtype, *, measure: bool = True
) -> str | None:
    """Why the model takes one image per call (:func:`measure_batching`, once per model, dtype and
    device type), or None; None too when not measuring (the engine then learns it from a failing
    batch)."""
    return _cached("batching", measure_batching, spec, device, dtype, None, measure)


def reach(
    spec: ModelSpec, device: torch.device, dtype: torch.dtype, halo: int, *, measure: bool = True
) -> str | None:
    """:func:`measure_reach` once per (model, dtype, device type, halo); None when not measuring."""
    return _cached("reach", measure_reach, spec, device, dtype, None, measure, halo)


def tiling_verdict(
    spec: ModelSpec, device: torch.device, dtype: torch.dtype, overlap: int | None, *, measure: bool = True
) -> tuple[int, str | None]:
    """``(overlap, why tiles may differ from the whole image or None)``: the given ``overlap`` or
    the calibrated one, and the reason from the context calibration (no margin fits), for a given
    overlap from the context probe at its margin (:func:`measure_margin`), or from the reach probe
    (content beyond the tiles' reach changes the output)."""
    why = None
    if overlap is not None:
        halo = overlap
        why = _cached("margin", measure_margin, spec, device, dtype, None, measure, overlap)
    else:
        ctx = context_info(spec, device, dtype, measure=measure)
        halo = ctx.halo
        if not ctx.sufficient:
            why = f"its effective context exceeds {ctx.measured} px"
    if why is None:
        why = reach(spec, device, dtype, halo, measure=measure)
    return halo, why


def context(spec: ModelSpec, device: torch.device, dtype: torch.dtype, *, measure: bool = True) -> int:
    """The overlap (input px) tiles of this model need (see :func:`context_info`)."""
    return context_info(spec, device, dtype, measure=measure).halo
