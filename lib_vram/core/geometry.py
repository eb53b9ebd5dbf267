"""Tiling geometry shared by the tiled VAE and the tiled upscaler.

A tile has a **core** (the part of the output it owns; the cores partition the image) and an
**input window** (the core grown by a halo on each side, clipped to the image). Pure functions of
integers, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A 1-D tile: ``[start, end)`` is read, ``[core_start, core_end)`` is owned."""

    start: int
    end: int
    core_start: int
    core_end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Tile:
    """A 2-D tile: one :class:`Span` per axis."""

    y: Span
    x: Span

    @property
    def pixels(self) -> int:
        return self.y.size * self.x.size


def split_axis(length: int, tile: int, halo: int = 0, *, align: int = 1) -> list[Span]:
    """Partition ``[0, length)`` into cores of at most ``tile`` (balanced), each grown by ``halo``.

    Core boundaries fall on multiples of ``align`` (except the image end). The number of cores is
    the smallest that keeps every core within ``tile``; their sizes differ by at most ``align``.
    """
    checks = (("length", length, 1), ("tile", tile, 1), ("halo", halo, 0), ("align", align, 1))
    for name, value, low in checks:
        if value < low:
            raise ValueError(f"`{name}` must be >= {low}, got {value}")
    if tile % align:
        raise ValueError(f"`tile` ({tile}) must be a multiple of `align` ({align})")
    units = math.ceil(length / align)
    tile_units = tile // align
    n = math.ceil(units / tile_units)
    # Balanced split of `units` into n parts.
    bounds = [min(length, (i * units // n) * align) for i in range(n)] + [length]
    return [
        Span(start=max(0, a - halo), end=min(length, b + halo), core_start=a, core_end=b)
        for a, b in zip(bounds[:-1], bounds[1:])
    ]


def grid(
    height: int, width: int, tile_h: int, tile_w: int | None = None, halo: int = 0, *, align: int = 1
) -> list[Tile]:
    """Row-major tiles covering a ``height`` x ``width`` image (see :func:`split_axis`)."""
    tile_w = tile_h if tile_w is None else tile_w
    ys = split_axis(height, tile_h, halo, align=align)
    xs = split_axis(width, tile_w, halo, align=align)
    return [Tile(y=y, x=x) for y in ys for x in xs]


def overhead(tiles: list[Tile], height: int, width: int) -> float:
    """Pixels processed (input windows) over image pixels: the FLOP overhead of a tile plan."""
    return sum(t.pixels for t in tiles) / float(height * width)
