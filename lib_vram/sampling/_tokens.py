"""The WebUI's own options that shrink the UNet's self-attention: HyperTile and token merging.

Both change the token counts the self-attention layers see, so both change the memory of a
forward whose attention holds per-query or quadratic tensors:

* **HyperTile** (WebUI v1.10.1, ``extensions-builtin/hypertile``; Settings -> Optimizations) wraps
  the ``attn1`` (self-attention) of chosen transformer blocks: it cuts the block's token grid into
  ``nh x nw`` tiles and runs the attention on them as a batch ``nh x nw`` times larger with
  ``1 / (nh x nw)`` of the tokens each. :class:`HyperTile` states its rule: which blocks (by their
  ldm names; SD1/SD2 and SDXL differ), the tile size from the image's size, and the ``swap`` choice.
* **Token merging** (tomesd 0.1.3, which the WebUI applies with ``merge_attn`` only and
  ``max_downsample=1``) merges ``int(N x ratio)`` of the ``N`` tokens of each transformer block at
  the full latent resolution before its self-attention and puts them back after it; choosing
  which tokens merge holds a cosine-similarity matrix of the block's input (:class:`TokenMerging`).

:class:`SelfAttention` holds both; the estimate (:mod:`._estimate`) walks their tensors at each
affected block. ``None`` everywhere (the default) is the stock forward: the same numbers as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

MAX_TILE_PX = 4096
MAX_SWAP = 64
MAX_DEPTH = 3


@dataclass(frozen=True)
class HyperTile:
    """HyperTile on the UNet as the WebUI's settings configure it (``hypertile_max_tile_unet``,
    ``hypertile_max_depth_unet``, ``hypertile_swap_size_unet``; ``sdxl``: the model is SDXL, whose
    layers HyperTile picks differently).

    The rule (v1.10.1): the tile side is ``min(the largest power of two dividing both image sides,
    max_tile_px)``, at least 128 px, in latent px; a wrapped layer of HyperTile depth ``d`` (at most
    ``max_depth``) takes as its smallest tile that side times ``2**d`` tokens per side of its token
    grid (the grid factored from its token count and the image's aspect ratio) and splits each side
    into a count of tiles drawn among the ``swap`` largest counts whose tiles are at least that
    (``swap`` 0 or 1: the largest count). The estimate counts the fewest tiles of those (the
    largest: the most memory), so it holds for any draw."""

    max_tile_px: int = 256
    max_depth: int = 3
    swap: int = 3
    sdxl: bool = False

    def __post_init__(self) -> None:
        for name, hi in (("max_tile_px", MAX_TILE_PX), ("max_depth", MAX_DEPTH), ("swap", MAX_SWAP)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
                raise ValueError(f"HyperTile `{name}` must be an integer in 0..{hi}, got {v!r}")

    def depth_of(self, site: tuple[str, int], block: int) -> int | None:
        """HyperTile's depth of the ``attn1`` of transformer block ``block`` at ``site``
        (``("input", i)``: ``input_blocks.i``; ``("output", i)``; ``("middle", 0)``), or None where
        HyperTile wraps none. SD1/SD2: only each SpatialTransformer's first block, the depth its
        level's (input blocks 1-2, 4-5, 7-8; output blocks 9-11, 6-8, 3-5), the middle at depth 3.
        SDXL: input blocks 4-5 / output blocks 3-5, block 0 at depth 0 and block 1 at depth 1;
        input blocks 7-8 / output blocks 0-2, blocks 0-9 at depth 1; the middle's blocks 0-9 at 2."""
        kind, i = site
        if self.sdxl:
            if kind == "middle":
                return 2 if block < 10 else None
            near, far = ((4, 5), (7, 8)) if kind == "input" else ((3, 4, 5), (0, 1, 2))
            if i in near and block < 2:
                return block
            return 1 if i in far and block < 10 else None
        if block != 0:
            return None
        if kind == "middle":
            return 3
        levels = ((1, 2), (4, 5), (7, 8)) if kind == "input" else ((9, 10, 11), (6, 7, 8), (3, 4, 5))
        return next((d for d, idx in enumerate(levels) if i in idx), None)

    def split(self, depth: int, tokens: int, image_wh: tuple[int, int]) -> tuple[int, bool]:
        """The tiles (``nh x nw``) a layer of ``depth`` cuts ``tokens`` into for an image of
        ``image_wh`` px, the fewest the rule allows (see the class docstring; 1 when the layer is
        off: deeper than ``max_depth``), and whether the rearrangement into tiles copies (it does
        not where every tile is whole rows of the grid's first factor, or one row of it)."""
        if depth > self.max_depth:
            return 1, False
        w, h = image_wh
        tile = max(128, min(_pow2_dividing(math.gcd(w, h)), self.max_tile_px)) // 8
        a, b = _grid(tokens, w / h)
        least = tile * 2**depth
        nh, nw = _fewest(a, least, self.swap), _fewest(b, least, self.swap)
        return nh * nw, nh * nw > 1 and nw > 1 and a // nh > 1

    def key(self) -> tuple:
        return ("hypertile", self.max_tile_px, self.max_depth, self.swap, self.sdxl)


@dataclass(frozen=True)
class TokenMerging:
    """tomesd's token merging as the WebUI applies it (``token_merging_ratio``, its img2img and
    hires variants): ``ratio`` of the tokens merged for the self-attention of the transformer
    blocks whose downsampling is at most ``max_downsample`` (the WebUI: 1, the full-resolution
    blocks only), destination tokens one per ``sx x sy`` cell (tomesd's default 2 x 2)."""

    ratio: float
    max_downsample: int = 1
    sx: int = 2
    sy: int = 2

    def __post_init__(self) -> None:
        r = self.ratio
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0.0 <= r < 1.0:
            raise ValueError(f"token merging `ratio` must be in [0, 1), got {r!r}")
        for name in ("max_downsample", "sx", "sy"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64:
                raise ValueError(f"token merging `{name}` must be an integer in 1..64, got {v!r}")

    def merged(self, latent_hw: tuple[int, int], tokens: int) -> tuple[int, int]:
        """``(r, dst)`` at a block of ``tokens`` tokens in a forward on a ``latent_hw`` latent: the
        tokens merged away and the destination tokens they merge into; ``(0, 0)`` where the block
        is not merged (deeper than ``max_downsample``, or nothing to merge)."""
        h0, w0 = latent_hw
        down = math.ceil(math.sqrt((h0 * w0) // tokens))
        if down > self.max_downsample:
            return 0, 0
        r = int(tokens * self.ratio)
        if r <= 0:
            return 0, 0
        h, w = math.ceil(h0 / down), math.ceil(w0 / down)
        dst = (h // self.sy) * (w // self.sx)
        return min(tokens - dst, r), dst

    def key(self) -> tuple:
        return ("tome", float(self.ratio), self.max_downsample, self.sx, self.sy)


@dataclass(frozen=True)
class SelfAttention:
    """What the WebUI's own options do to the UNet's self-attention (see the module docstring):
    ``hypertile`` (None: off) and ``merging`` (None: off); and what IP-Adapter does to its
    cross-attention: ``image_tokens``, the image tokens of each IP-Adapter unit (4 for ip-adapter,
    16 for ip-adapter-plus), whose keys and values, cached per layer at ``cache_itemsize`` bytes
    (sd-webui-controlnet runs IP-Adapter's layers in float32), every cross-attention of the UNet
    attends to beside the prompt's (:func:`._attention.attend_ip`)."""

    hypertile: HyperTile | None = None
    merging: TokenMerging | None = None
    image_tokens: tuple[int, ...] = ()
    cache_itemsize: int = 4

    def __post_init__(self) -> None:
        t = self.image_tokens
        if not isinstance(t, tuple) or not all(isinstance(n, int) and 1 <= n <= 1024 for n in t):
            raise ValueError(f"`image_tokens` must be a tuple of integers in 1..1024, got {t!r}")

    @property
    def active(self) -> bool:
        merging = self.merging is not None and self.merging.ratio > 0
        return self.hypertile is not None or merging or bool(self.image_tokens)

    def key(self) -> tuple:
        """A hashable key for the planner memory (empty when nothing is active)."""
        if not self.active:
            return ()
        ip = (("ip-adapter", self.image_tokens, self.cache_itemsize),) if self.image_tokens else ()
        return tuple(o.key() for o in (self.hypertile, self.merging) if o is not None) + ip

    def describe(self) -> str:
        parts = []
        if self.hypertile is not None:
            parts.append(f"HyperTile (max tile {self.hypertile.max_tile_px} px)")
        if self.merging is not None and self.merging.ratio > 0:
            parts.append(f"token merging {self.merging.ratio:g}")
        if self.image_tokens:
            parts.append(f"IP-Adapter ({' + '.join(map(str, self.image_tokens))} image tokens)")
        return ", ".join(parts)


def _pow2_dividing(n: int) -> int:
    p = 1
    while n and n % (p * 2) == 0:
        p *= 2
    return p


@lru_cache(maxsize=256)
def _grid(tokens: int, aspect: float) -> tuple[int, int]:
    """The token grid HyperTile factors ``tokens`` into for an image of ``aspect`` (width /
    height): ``round(sqrt(tokens x aspect))`` by ``round(sqrt(tokens / aspect))`` where that is
    exact or one side divides ``tokens``; else the divisor pair ``(i, tokens / i)`` whose ratio
    ``tokens / i / i`` is closest to ``aspect``."""
    a, b = round(math.sqrt(tokens * aspect)), round(math.sqrt(tokens / aspect))
    if a * b == tokens:
        return a, b
    if a and tokens % a == 0:
        return a, tokens // a
    if b and tokens % b == 0:
        return tokens // b, b
    pairs = [(i, tokens // i) for i in range(2, tokens + 1) if tokens % i == 0]
    return min(pairs, key=lambda p: abs(p[1] / p[0] - aspect)) if pairs else (1, tokens)


def _fewest(side: int, least: int, swap: int) -> int:
    """The fewest tiles HyperTile may cut a grid ``side`` into: of the counts whose tiles are at
    least ``least`` (or the whole side), the ``swap`` largest are drawn from."""
    least = min(least, side)
    sizes = [t for t in range(least, side + 1) if side % t == 0][: max(1, swap)]
    return side // sizes[-1]
