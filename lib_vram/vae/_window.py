"""Tile windows: a tile's tensor and where it sits, its core, and the halo each op of the tiled
part needs (from the layer list); how fast mode splits a decoder between the global part and the
tiles. Shared by the engine (:mod:`._engine`), the pass driver (:mod:`._api`) and the plan
(:mod:`._plan`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ._layout import Resnet, VAESpec

# -- tensors with a window ---------------------------------------------------------------------


class TT(NamedTuple):
    """A tile's tensor and where it sits: rows ``[y0, y0+h)``, cols ``[x0, x0+w)`` of an ``H x W``
    feature map at the current resolution."""

    data: torch.Tensor
    y0: int
    x0: int
    H: int
    W: int

    @property
    def y1(self) -> int:
        return self.y0 + self.data.shape[-2]

    @property
    def x1(self) -> int:
        return self.x0 + self.data.shape[-1]

    def with_data(self, data: torch.Tensor) -> TT:
        return TT(data, self.y0, self.x0, self.H, self.W)


class Box(NamedTuple):
    """A core ``[y0, y1) x [x0, x1)`` at the current resolution."""

    y0: int
    y1: int
    x0: int
    x1: int


def crop(t: TT, box: Box, need: int = 0) -> TT:
    """Crop ``t`` to ``box`` grown by ``need`` (clipped to the image); errors if ``t`` is too small."""
    y0, y1 = max(0, box.y0 - need), min(t.H, box.y1 + need)
    x0, x1 = max(0, box.x0 - need), min(t.W, box.x1 + need)
    if t.y0 > y0 or t.y1 < y1 or t.x0 > x0 or t.x1 < x1:
        raise RuntimeError(
            f"internal error: tile window {(t.y0, t.y1, t.x0, t.x1)} does not cover {(y0, y1, x0, x1)}"
        )
    if (y0, y1, x0, x1) == (t.y0, t.y1, t.x0, t.x1):
        return t
    d = t.data[..., y0 - t.y0 : y1 - t.y0, x0 - t.x0 : x1 - t.x0]
    return TT(d, y0, x0, t.H, t.W)


def up_box(box: Box) -> Box:
    return Box(box.y0 * 2, box.y1 * 2, box.x0 * 2, box.x1 * 2)


def down_box(box: Box, H: int, W: int, Hn: int, Wn: int) -> Box:
    """Core after a stride-2 conv; starts are even (tile cores are aligned to the latent grid)."""
    return Box(
        box.y0 // 2,
        Hn if box.y1 >= H else box.y1 // 2,
        box.x0 // 2,
        Wn if box.x1 >= W else box.x1 // 2,
    )


def down_size(n: int) -> int:
    """Output length of the VAE's (0,1)-padded, stride-2, 3x3 conv."""
    return (n + 1 - 3) // 2 + 1


# -- needed halo, from the layer list ----------------------------------------------------------


def _ops(spec: VAESpec) -> list[str]:
    """The spatial ops of the tiled part, in order: ``conv`` (3x3), ``up`` (nearest x2), ``down``."""
    ops: list[str] = []
    if spec.kind == "encoder":
        ops.append("conv" if spec.conv_in.kernel_size[0] == 3 else "pw")
    for lv in spec.levels:
        ops += ["conv", "conv"] * len(lv.blocks)
        if lv.resample_kind == "up":
            ops.append("up")
            if lv.resample is not None:
                ops.append("conv")
        elif lv.resample_kind == "down":
            ops.append("down")
    if spec.kind == "decoder" and not spec.give_pre_end and spec.conv_out.kernel_size[0] == 3:
        ops.append("conv")
    return ops


def needs(spec: VAESpec) -> tuple[int, list[int]]:
    """Halo needed at the start of the tiled part, and after each op of :func:`_ops`."""
    ops = _ops(spec)
    after = [0] * len(ops)
    need = 0
    for i in reversed(range(len(ops))):
        after[i] = need
        op = ops[i]
        if op == "conv":
            need += 1
        elif op == "up":
            need = (need + 1) // 2
        elif op == "down":
            need = 2 * need + 1
    return need, after


def resample_needs(spec: VAESpec) -> list[int]:
    """Halo to keep after each level's resampling (before its conv, for the decoder)."""
    ops = _ops(spec)
    _, after = needs(spec)
    out = [i for i, op in enumerate(ops) if op in ("up", "down")]
    return [after[i] for i in out]


def sync_count(spec: VAESpec, part: str) -> int:
    """GroupNorms a tile program meets: ``part`` is ``"tiles"`` or ``"global"``."""
    n_mid = sum(2 if isinstance(m, Resnet) else 1 for m in spec.mid)
    n_levels = sum(2 * len(lv.blocks) for lv in spec.levels)
    if spec.kind == "decoder":
        return n_mid if part == "global" else n_levels + (0 if spec.give_pre_end else 1)
    return n_levels if part == "tiles" else n_mid + 1


def split_first_level(spec: VAESpec) -> tuple[tuple[Resnet, ...], VAESpec]:
    """Fast mode's split of a decoder: the first level's ResNets (at latent resolution, as cheap
    and as small as the mid block) join the global part; the returned spec is the tiled rest."""
    if spec.kind != "decoder" or not spec.levels:
        return (), spec
    first = spec.levels[0]
    rest = dataclasses.replace(spec, levels=(dataclasses.replace(first, blocks=()), *spec.levels[1:]))
    return first.blocks, rest
