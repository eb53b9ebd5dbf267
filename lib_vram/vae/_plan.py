"""Analytic peak-memory estimate of a VAE pass and the tile choice built on it.

The estimate walks the same :class:`VAESpec` the engine runs and adds up, op by op, the tensors
that are alive at once (inputs kept for the residual, the normalised copy, the conv output), at
the window size a tile has at that level, plus what is held across the whole tiled stage (the
mid-block output, the output image, and in exact mode the activations of the tiles waiting at a
GroupNorm when they stay on the device). It counts tensor bytes only: framework workspaces and
allocator rounding are not in it (the planner calibrates them by a dry run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lib_vram.core.geometry import grid, overhead
from lib_vram.core.livebytes import itemsize
from lib_vram.core.predict import WORKSPACE_TERMS

from ._attention import DEFAULT_SCORE_BYTES, cpu_flash_kernel
from ._engine import needs, split_first_level
from ._layout import Resnet, VAESpec, decoder_spec, encoder_spec

TILE_CANDIDATES = (256, 192, 160, 128, 112, 96, 80, 64, 56, 48, 40, 32, 24, 16, 8)
"""Tile sizes (latent px) tried by the auto planner and the out-of-memory retry, largest first."""


def _itemsize(dtype: torch.dtype) -> int:
    return itemsize(dtype)


def _resnet_units(blk: Resnet) -> tuple[int, int]:
    """(working channels, parked channels) of one ResNet block, in channel x pixel units."""
    cin, cout = blk.in_channels, blk.out_channels
    seg_a = 2 * cin + cout
    res = cout if (blk.shortcut is not None and cout < cin) else cin
    seg_b = res + 3 * cout
    parked = max(cin, cout + res)
    return max(seg_a, seg_b), parked


def _mid_units(spec: VAESpec) -> int:
    c = spec.mid_channels
    return 6 * c


def _levels(spec: VAESpec, h: int, w: int) -> list[tuple[int, int]]:
    """(H, W) at each level's blocks, in processing order, starting from the tiled input size."""
    sizes = []
    for lv in spec.levels:
        sizes.append((h, w))
        if lv.resample_kind == "up":
            h, w = h * 2, w * 2
        elif lv.resample_kind == "down":
            h, w = (h + 1 - 3) // 2 + 1, (w + 1 - 3) // 2 + 1
    sizes.append((h, w))
    return sizes


def _axis_samples(n: int, frac: float, align: int) -> list[tuple[int, int]]:
    want = max(1, math.ceil(n * frac))
    k = 1 if want < 16 else 2 if want < 64 else 4
    size = max(align, math.ceil(want / k / align) * align)
    out = []
    for i in range(k):
        centre = (i + 0.5) * n / k
        a = max(0, min(n - size, int(centre - size / 2)))
        a = (a // align) * align
        out.append((a, min(n, a + size)))
    return sorted(set(out))


def sample_boxes(h: int, w: int, sample: int, align: int) -> list[tuple[int, int, int, int]]:
    """Cores of the fast-mode statistics pass: a few crops spread over the image, covering about
    ``1/sample`` of each axis (the whole image when ``sample`` is 1)."""
    if sample <= 1:
        return [(0, h, 0, w)]
    ys = _axis_samples(h, 1 / sample, align)
    xs = _axis_samples(w, 1 / sample, align)
    return [(y0, y1, x0, x1) for y0, y1 in ys for x0, x1 in xs]


def _window(n: int, core: int, need: int) -> int:
    """The largest tile window along an axis of ``n`` pixels cut into cores of ``core``: the halo
    is on both sides only for an inner tile (three tiles or more), on one side with two tiles, and
    there is none with one."""
    tiles = -(-n // max(1, core))
    return min(n, core + need * min(2, tiles - 1))


def _level_needs(spec: VAESpec) -> list[int]:
    """Halo at the start of each level (tiled part), at that level's resolution."""
    start, after = needs(spec)
    out = [start]
    i = 1 if spec.kind == "encoder" else 0
    for lv in spec.levels:
        i += 2 * len(lv.blocks)
        if lv.resample_kind == "up":
            i += 1 + (1 if lv.resample is not None else 0)
            out.append(after[i - 1])
        elif lv.resample_kind == "down":
            i += 1
            out.append(after[i - 1])
        else:
            out.append(out[-1])
    return out


@dataclass(frozen=True)
class Step:
    """One level of the tiled path (the decoder's output convolution is a step of its own)."""

    work: int
    """The largest working set of one tile at this level: the inputs a segment keeps, its
    normalised copy and outputs."""
    parked: int
    """Exact mode with the state on the device: what the other tiles hold while one tile works at
    this level (their activations, waiting at the level's GroupNorms)."""
    workspace: int
    """The backend's convolution scratch (:data:`lib_vram.core.predict.WORKSPACE_TERMS`) at the
    level's largest convolution: transient, next to the working set."""


@dataclass(frozen=True)
class Components:
    """The terms of an analytic estimate, in bytes (see :func:`estimate_components`)."""

    global_peak: int
    """The global stage (decoder: input, ``conv_in`` and mid block on the whole latent; encoder:
    the assembled features, mid block and output), its own peak, with its convolution scratch."""
    held: int
    """What the tiled stage holds throughout: mid-block output or input image, the output, fast
    mode's statistics scratch."""
    steps: tuple[Step, ...]
    """The tiled path, level by level."""
    stats_steps: tuple[Step, ...] = ()
    """Fast mode: the statistics pass (lock-step tiles of the subsampled image or sample crops)."""
    kind: str = "decoder"
    tiled: bool = True
    fast: bool = False
    """Fast mode: the tiles of the main pass run one after another (nothing parked), their working
    set is weighted by the ``work_fast`` factor."""


def estimate_components(
    spec: VAESpec,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    tile: int | None,
    mode: str = "exact",
    state_on_device: bool = True,
    out_dtype: torch.dtype | None = None,
    backend: str = "cpu",
    fast_sample: int = 2,
) -> Components:
    """The terms of the analytic estimate of one pass (see :class:`Components`)."""
    if len(input_shape) != 4:
        raise ValueError(f"`input_shape` must be (B, C, H, W), got {input_shape}")
    if mode not in ("untiled", "exact", "fast"):
        raise ValueError(f"`mode` must be 'untiled', 'exact' or 'fast', got {mode!r}")
    b, _, h, w = (int(v) for v in input_shape)
    s = _itemsize(dtype)
    so = _itemsize(out_dtype or dtype)
    f = spec.factor
    ws_term = WORKSPACE_TERMS.get(backend)

    def ws(cin: int, cout: int, k: int, px_in: int, px_out: int) -> int:
        if ws_term is None:
            return 0
        return ws_term((b, cin, px_in, 1), (cout, cin, k, k), (b, cout, px_out, 1), s, True)

    if spec.kind == "decoder":
        lat_h, lat_w = h, w
        out_c = spec.levels[-1].blocks[-1].out_channels if spec.give_pre_end else spec.out_channels
        out_bytes = b * out_c * h * f * w * f * so
    else:
        lat_h, lat_w = (h + f - 1) // f, (w + f - 1) // f
        out_bytes = b * spec.out_channels * lat_h * lat_w * so
    in_bytes = b * spec.in_channels * h * w * s
    lat_px = lat_h * lat_w
    mid_c = spec.mid_channels
    # one query chunk's scores and their softmax (the math kernel holds both), at most
    # DEFAULT_SCORE_BYTES each (the engine's attention chunks the queries); none where the CPU's
    # blocked flash kernel runs the attention in one call
    flash = backend == "cpu" and cpu_flash_kernel(dtype)
    scores = 0 if flash else 2 * min(DEFAULT_SCORE_BYTES, b * lat_px * lat_px * 4)
    global_peak = b * lat_px * s * max(_mid_units(spec), 2 * mid_c + spec.in_channels) + scores
    held_mid = b * mid_c * lat_px * s  # decoder: mid output; encoder: assembled features
    ws_global = ws(mid_c, mid_c, 3, lat_px, lat_px)

    core = None if (tile is None or mode == "untiled") else int(tile) * (f if spec.kind == "encoder" else 1)
    lock_step = mode == "exact" and state_on_device and core is not None
    offloaded = mode == "exact" and not state_on_device and core is not None
    # fast decode tiles only what follows the first level's ResNets (they run on the whole latent
    # with the mid block): a shorter path and a smaller halo
    tspec = split_first_level(spec)[1] if mode == "fast" and core is not None else spec

    def walk(th: int, tw: int, parks: bool, share: float | None = None) -> tuple[Step, ...]:
        """The steps of the tiled path on a ``th`` x ``tw`` input (``parks``: lock-step tiles;
        ``share``: the tiles' windows cover this share of the input, instead of the tile grid's
        overhead)."""
        sizes = _levels(tspec, th, tw)
        lneeds = _level_needs(tspec)
        steps = []
        c_prev = mid_c if spec.kind == "decoder" else spec.in_channels
        for i, lv in enumerate(tspec.levels):
            lh, lw = sizes[i]
            if core is None:
                wh, ww, ov = lh, lw, 1.0
            else:
                c = max(1, int(round(core * lh / th)))
                wh, ww = _window(lh, c, lneeds[i]), _window(lw, c, lneeds[i])
                ov = overhead(grid(lh, lw, c, c, lneeds[i]), lh, lw) if share is None else share
            px = wh * ww
            work = parked = wsp = 0
            if i == 0 and spec.kind == "encoder":
                wsp = ws(spec.in_channels, spec.conv_in.out_channels, 3, px, px)
            for blk in lv.blocks:
                wu, pu = _resnet_units(blk)
                work = max(work, b * px * s * wu)
                if parks:
                    parked = max(parked, int(b * lh * lw * ov * s * pu))
                elif offloaded:
                    # state parked off the device: the tile being worked on still holds its own
                    parked = max(parked, int(b * px * s * pu))
                wsp = max(wsp, ws(blk.in_channels, blk.out_channels, 3, px, px))
                c_prev = blk.out_channels
            c_last = lv.blocks[-1].out_channels if lv.blocks else c_prev
            if lv.resample_kind == "up":
                work = max(work, int(b * px * s * c_last * 2.25 * 4))
                if lv.resample is not None:
                    wsp = max(wsp, ws(c_last, c_last, 3, 4 * px, 4 * px))
            elif lv.resample_kind == "down":
                work = max(work, int(b * px * s * c_last * 2.25))
                wsp = max(wsp, ws(c_last, c_last, 3, px, px // 4))
            steps.append(Step(work, parked, wsp))
        if spec.kind == "decoder" and not spec.give_pre_end:
            lh, lw = sizes[-1]
            c = spec.norm_out.num_channels
            if core is None:
                px = lh * lw
            else:
                cc = core * lh // th
                px = _window(lh, cc, lneeds[-1]) * _window(lw, cc, lneeds[-1])
            steps.append(
                Step(b * px * s * (2 * c + spec.out_channels), 0, ws(c, spec.out_channels, 3, px, px))
            )
        return tuple(steps)

    steps = walk(h, w, lock_step)
    stats: tuple[Step, ...] = ()
    held = held_mid + out_bytes if spec.kind == "decoder" else in_bytes + held_mid
    if mode == "fast" and core is not None:
        k = max(1, fast_sample)
        if spec.kind == "decoder":
            # the first-level output subsampled k x per axis, decoded in lock-step into a scratch
            # output of that size
            stats = walk(-(-h // k), -(-w // k), True)
            held += out_bytes // (k * k)
        else:
            # sample crops in lock-step among themselves: their windows (core + halo) cover this
            # share of the image
            halo = needs(spec)[0]
            crops = sample_boxes(h, w, k, f)
            area = sum(
                (min(h, y1 + halo) - max(0, y0 - halo)) * (min(w, x1 + halo) - max(0, x0 - halo))
                for y0, y1, x0, x1 in crops
            )
            stats = walk(h, w, True, share=area / float(h * w))
    return Components(
        global_peak=(in_bytes if spec.kind == "decoder" else held_mid + out_bytes) + global_peak + ws_global,
        held=held,
        steps=steps,
        stats_steps=stats,
        kind=spec.kind,
        tiled=core is not None,
        fast=mode == "fast" and core is not None,
    )


UNIT = {"work": 1.0, "parked": 1.0}

FACTORS: dict[str, dict[str, float]] = {
    "decoder": {"work": 0.6, "parked": 1.0, "work_fast": 1.0},
    "encoder": {"work": 0.2, "parked": 1.15},
}
"""Factors of the tiled terms per VAE kind, fitted against the fake-tensor prediction of the engine
(``python -m lib_vram bench vae-estimate --fit``; docs/benchmarks.md, "Planner"). The untiled pass
needs none (its count matches the prediction)."""


def factors_for(kind: str, comps: Components) -> dict[str, float]:
    return FACTORS[kind] if comps.tiled else UNIT


def combine(c: Components, factors: dict[str, float] | None = None) -> int:
    """Peak bytes from the terms: the larger of the global stage and the tiled one, whose peak is
    at the level where one tile's working set and scratch plus what the other tiles park is
    largest."""
    k = factors_for(c.kind, c) if factors is None else factors

    def peak(steps: tuple[Step, ...], work: float) -> float:
        return max((work * st.work + k["parked"] * st.parked + st.workspace for st in steps), default=0)

    main = peak(c.steps, k.get("work_fast", k["work"]) if c.fast else k["work"])
    tiled = c.held + max(main, peak(c.stats_steps, k["work"]))
    return int(max(c.global_peak, tiled))


def estimate_spec_bytes(
    spec: VAESpec,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    tile: int | None,
    mode: str = "exact",
    state_on_device: bool = True,
    out_dtype: torch.dtype | None = None,
    backend: str = "cpu",
    fast_sample: int = 2,
) -> int:
    """Peak bytes of one pass of ``spec`` on ``input_shape`` (see :func:`estimate_peak_bytes`)."""
    comps = estimate_components(
        spec,
        input_shape,
        dtype,
        tile=tile,
        mode=mode,
        state_on_device=state_on_device,
        out_dtype=out_dtype,
        backend=backend,
        fast_sample=fast_sample,
    )
    return combine(comps)


def estimate_peak_bytes(
    module: nn.Module,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    tile: int | None,
    mode: str,
    backend: str = "cpu",
) -> int:
    """Analytic peak bytes on the compute device of one decode/encode pass (milliseconds).

    Tensor bytes counted along the engine's own structure (what a tile keeps, what the waiting
    tiles park, what the tiled stage holds), the tiled terms scaled by factors fitted against the
    fake-tensor prediction of the engine (:data:`FACTORS`), plus the backend's convolution scratch
    (:data:`lib_vram.core.predict.WORKSPACE_TERMS`, the predictor's own term).

    Args:
        module: a supported VAE decoder or encoder (see :func:`lib_vram.vae.is_supported_decoder`).
        input_shape: ``(B, C, H, W)`` of the latent (decoder) or image (encoder).
        dtype: compute dtype.
        tile: tile core in latent pixels; ``None`` = untiled.
        mode: ``"untiled"``, ``"exact"`` (activations of waiting tiles counted on the device) or
            ``"fast"``.
        backend: ``"cpu"``, ``"cuda"``, ... (:class:`lib_vram.core.device.Backend` values): which
            convolution scratch term applies.
    """
    spec = _spec_of(module)
    return estimate_spec_bytes(spec, tuple(input_shape), dtype, tile=tile, mode=mode, backend=backend)


def _spec_of(module: nn.Module) -> VAESpec:
    if hasattr(module, "up") or hasattr(module, "up_blocks"):
        return decoder_spec(module)
    return encoder_spec(module)


def candidates(latent_max: int) -> list[int]:
    """Tile sizes to try for a latent whose longer side is ``latent_max``, largest first."""
    out = [latent_max] + [t for t in TILE_CANDIDATES if t < latent_max]
    return out


def smaller(tile: int) -> int | None:
    """The next candidate below ``tile`` (at most 3/4 of it), or None at the bottom."""
    limit = (tile * 3) // 4
    for t in TILE_CANDIDATES:
        if t <= limit:
            return t
    return None


def choose_tile(
    spec: VAESpec,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    budget: int,
    *,
    mode: str,
    state_on_device: bool,
    backend: str = "cpu",
) -> tuple[int, int]:
    """Largest tile (latent px) whose estimate fits ``budget``; (tile, estimate). Falls back to
    the smallest candidate when nothing fits."""
    b, c, h, w = input_shape
    f = spec.factor if spec.kind == "encoder" else 1
    lat_max = math.ceil(max(h, w) / f)
    best = None
    for t in candidates(lat_max):
        est = estimate_spec_bytes(
            spec, input_shape, dtype, tile=t, mode=mode, state_on_device=state_on_device, backend=backend
        )
        best = (t, est)
        if est <= budget:
            return best
    assert best is not None
    return best
