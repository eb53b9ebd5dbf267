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

import torch
from torch import nn

from ..geometry import grid, overhead
from ._attention import DEFAULT_SCORE_BYTES
from ._engine import needs
from ._layout import Resnet, VAESpec, decoder_spec, encoder_spec

TILE_CANDIDATES = (256, 192, 160, 128, 112, 96, 80, 64, 56, 48, 40, 32, 24, 16, 8)
"""Tile sizes (latent px) tried by the auto planner and the out-of-memory retry, largest first."""


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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


def estimate_spec_bytes(
    spec: VAESpec,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    tile: int | None,
    mode: str = "exact",
    state_on_device: bool = True,
    out_dtype: torch.dtype | None = None,
) -> int:
    """Peak bytes of one pass of ``spec`` on ``input_shape`` (see :func:`estimate_peak_bytes`)."""
    if len(input_shape) != 4:
        raise ValueError(f"`input_shape` must be (B, C, H, W), got {input_shape}")
    if mode not in ("untiled", "exact", "fast"):
        raise ValueError(f"`mode` must be 'untiled', 'exact' or 'fast', got {mode!r}")
    b, _, h, w = (int(v) for v in input_shape)
    s = _itemsize(dtype)
    so = _itemsize(out_dtype or dtype)
    f = spec.factor
    if spec.kind == "decoder":
        lat_h, lat_w = h, w
        tiled_h, tiled_w = h, w
        out_c = spec.levels[-1].blocks[-1].out_channels if spec.give_pre_end else spec.out_channels
        out_bytes = b * out_c * h * f * w * f * so
        in_bytes = b * spec.in_channels * h * w * s
    else:
        lat_h, lat_w = (h + f - 1) // f, (w + f - 1) // f
        tiled_h, tiled_w = h, w
        out_bytes = b * spec.out_channels * lat_h * lat_w * so
        in_bytes = b * spec.in_channels * h * w * s
    lat_px = lat_h * lat_w
    mid_c = spec.mid_channels
    tokens = lat_px
    scores = min(DEFAULT_SCORE_BYTES, b * tokens * tokens * 4)
    global_peak = b * lat_px * s * max(_mid_units(spec), 2 * mid_c + spec.in_channels) + scores
    held_mid = b * mid_c * lat_px * s  # decoder: mid output; encoder: assembled features

    if tile is None or mode == "untiled":
        core = None
    else:
        core = int(tile) * (f if spec.kind == "encoder" else 1)
    sizes = _levels(spec, tiled_h, tiled_w)
    lneeds = _level_needs(spec)
    work = 0
    parked = 0
    for i, lv in enumerate(spec.levels):
        lh, lw = sizes[i]
        scale = lh / tiled_h
        if core is None:
            wh, ww = lh, lw
            ov = 1.0
        else:
            c = max(1, int(round(core * scale)))
            wh, ww = min(lh, c + 2 * lneeds[i]), min(lw, c + 2 * lneeds[i])
            ov = overhead(grid(lh, lw, c, c, lneeds[i]), lh, lw)
        px = wh * ww
        for blk in lv.blocks:
            wu, pu = _resnet_units(blk)
            work = max(work, b * px * s * wu)
            parked = max(parked, int(b * lh * lw * ov * s * pu))
        c_last = lv.blocks[-1].out_channels if lv.blocks else mid_c
        if lv.resample_kind == "up":
            work = max(work, int(b * px * s * c_last * 2.25 * 4))
        elif lv.resample_kind == "down":
            work = max(work, int(b * px * s * c_last * 2.25))
    if spec.kind == "decoder" and not spec.give_pre_end:
        lh, lw = sizes[-1]
        c = spec.norm_out.num_channels
        if core is None:
            px = lh * lw
        else:
            cc = core * lh // tiled_h
            px = min(lh, cc + 2 * lneeds[-1]) * min(lw, cc + 2 * lneeds[-1])
        work = max(work, b * px * s * (2 * c + spec.out_channels))

    if spec.kind == "decoder":
        tiled = (
            held_mid + out_bytes + work + (parked if (mode == "exact" and state_on_device and core) else 0)
        )
        if mode == "fast" and core is not None:
            tiled += b * mid_c * lat_px * s // 16
        return int(max(in_bytes + global_peak, tiled))
    # encoder: tiled down path first, then the global end on the assembled features
    tiled = in_bytes + held_mid + work + (parked if (mode == "exact" and state_on_device and core) else 0)
    return int(max(tiled, held_mid + global_peak + out_bytes))


def estimate_peak_bytes(
    module: nn.Module,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    tile: int | None,
    mode: str,
) -> int:
    """Analytic peak bytes on the compute device of one decode/encode pass.

    Args:
        module: a supported VAE decoder or encoder (see :func:`lib_vram.vae.is_supported_decoder`).
        input_shape: ``(B, C, H, W)`` of the latent (decoder) or image (encoder).
        dtype: compute dtype.
        tile: tile core in latent pixels; ``None`` = untiled.
        mode: ``"untiled"``, ``"exact"`` (activations of waiting tiles counted on the device) or
            ``"fast"``.
    """
    spec = _spec_of(module)
    return estimate_spec_bytes(spec, tuple(input_shape), dtype, tile=tile, mode=mode)


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
) -> tuple[int, int]:
    """Largest tile (latent px) whose estimate fits ``budget``; (tile, estimate). Falls back to
    the smallest candidate when nothing fits."""
    b, c, h, w = input_shape
    f = spec.factor if spec.kind == "encoder" else 1
    lat_max = math.ceil(max(h, w) / f)
    best = None
    for t in candidates(lat_max):
        est = estimate_spec_bytes(
            spec, input_shape, dtype, tile=t, mode=mode, state_on_device=state_on_device
        )
        best = (t, est)
        if est <= budget:
            return best
    assert best is not None
    return best
