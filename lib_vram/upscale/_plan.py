"""The upscaler's plan for one call, and its predicted peak: what :func:`upscale_tensor` runs.

:func:`decide` is the engine's own choice (whole image or tiles, tile size, batch, where the output
accumulates), made from numbers only: the input shape, the budget, the model's forward working set
per input pixel (calibrated once per model, :func:`lib_vram.upscale.bytes_per_px`) and its overlap.
The engine calls it at the start of every call; :func:`plan_upscale` calls it for ``python -m
lib_vram plan`` and anyone who wants the plan before running (a reference architecture stands in
for a model when there is none).

Peak model (:meth:`UpscalePlan.candidate`), from the engine's loop: the padded input and the output
accumulator where they sit on the device, plus the larger of

* the forward pass of a batch: its stacked windows and ``batch x window px x forward bytes/px``
  (the accumulator is not allocated yet while the first batch runs: it is left out when one batch
  covers everything), and
* the blend of a batch: the stacked windows, the model's output in float32 (and in the compute
  dtype while it is converted), and each tile's cross-faded core (one more while it is computed).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lib_vram.core.geometry import split_axis
from lib_vram.core.livebytes import itemsize as elem_size
from lib_vram.planning import planner

from ._adapter import ModelSpec, _legal_len, _round_up

AUTO_TILE_MAX = 512
"""Largest automatic tile core (input px) when the whole image does not fit: a 512² tile keeps any
current GPU busy, so larger tiles would only raise the peak. ``DISCOURAGED`` models ignore it."""
MAX_AUTO_BATCH = 16
MIN_TILE = 16
INPUT_ON_DEVICE_FRACTION = 0.25
"""The input image goes to the device once unless it would take more than this share of the
budget (a huge image then stays in host memory and only its tiles travel)."""


@dataclass(frozen=True)
class _Tile:
    b: int
    y0: int
    y1: int
    x0: int
    x1: int
    wy0: int
    wy1: int
    wx0: int
    wx1: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.wy1 - self.wy0, self.wx1 - self.wx0)


def _grow(start: int, end: int, need: int, limit: int) -> tuple[int, int]:
    """Grow ``[start, end)`` to length ``need`` inside ``[0, limit)`` (after first, then before)."""
    extra = need - (end - start)
    if extra <= 0:
        return start, end
    new_end = min(limit, end + extra)
    start = max(0, start - (extra - (new_end - end)))
    return start, new_end


def _axis_windows(
    spec: ModelSpec, c0: int, c1: int, tile: int, halo: int, n: int
) -> list[tuple[int, int, int, int]]:
    """Cores of ``[c0, c1)`` (at most ``tile``) with their windows ``(core0, core1, win0, win1)``.

    Windows are the core plus ``halo`` clipped to ``[0, n)``, widened to the model's grid (start
    and end on multiples of ``spec.grid``, so a window-attention model partitions each tile as it
    partitions the whole image), made legal for the model, and then equalised within their class
    (touching one image border, both, or none) so that tiles of a class can share a batch: balanced
    cores differ by a pixel, and such a pixel would otherwise split every batch.
    """
    g = max(1, spec.grid)
    cores = [(c0 + sp.core_start, c0 + sp.core_end) for sp in split_axis(c1 - c0, tile)]
    wins = [(max(0, (a - halo) // g * g), min(n, _round_up(b + halo, g))) for a, b in cores]
    lens = [_legal_len(spec, e - s) for s, e in wins]

    def cls(i: int) -> int:
        return (wins[i][0] == 0) + (wins[i][1] == n)

    target: dict[int, int] = {}
    for i, length in enumerate(lens):
        target[cls(i)] = max(target.get(cls(i), 0), length)
    out = []
    for i, (a, b) in enumerate(cores):
        s0, e0 = _grow(wins[i][0], wins[i][1], min(n, target[cls(i)]), n)
        if s0 % g:  # growth toward the start left the grid (n is not on it): back onto it
            s0 = s0 // g * g
        out.append((a, b, s0, e0))
    return out


def _make_tiles(
    spec: ModelSpec, b: int, region: tuple[int, int, int, int], tile: int, halo: int, h: int, w: int
) -> list[_Tile]:
    y0, y1, x0, x1 = region
    ys = _axis_windows(spec, y0, y1, tile, halo, h)
    xs = _axis_windows(spec, x0, x1, tile, halo, w)
    tiles = []
    for cy0, cy1, wy0, wy1 in ys:
        for cx0, cx1, wx0, wx1 in xs:
            if spec.square:
                side = max(wy1 - wy0, wx1 - wx0)
                wy0, wy1 = _grow(wy0, wy1, side, h)
                wx0, wx1 = _grow(wx0, wx1, side, w)
            tiles.append(_Tile(b, cy0, cy1, cx0, cx1, wy0, wy1, wx0, wx1))
    return tiles


def _padded_size(spec: ModelSpec, h: int, w: int) -> tuple[int, int]:
    """The size the model computes on for an ``h x w`` input: spandrel's size requirements, then
    the model's own padding (``spec.pre_pad``, evaluated on a shape-only tensor)."""
    hp, wp = spec.pad_to(h, w)
    if spec.pre_pad is None:
        return hp, wp
    with torch.inference_mode():
        probe = spec.pre_pad(torch.empty(1, 1, hp, wp, device="meta"))
    return int(probe.shape[-2]), int(probe.shape[-1])


def signature(spec: ModelSpec) -> tuple:
    """What an upscaler's memory depends on besides the input: architecture name, scale, input
    channels and parameter count (which tells widths apart); the planner memory's model key."""
    n_params = sum(p.numel() for p in spec.module.parameters()) if spec.module is not None else 0
    return (spec.name, spec.scale, spec.input_channels, n_params)


def _halvings(n: int) -> list[int]:
    out = [n]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


@dataclass(frozen=True)
class UpscalePlan:
    """One upscale call as the engine runs it (see :func:`decide`)."""

    tile: int
    """Tile core in input px (``max_dim``: the whole image)."""
    batch: int
    halo: int
    """Overlap (input px) each tile reads beyond its core (0: whole image)."""
    whole: bool
    acc_host: bool
    """The output accumulates in host memory (only where host memory is apart from the device's)."""
    in_host: bool
    padded: tuple[int, int]
    """The size the model computes on (size requirements, own padding, square growth)."""
    max_dim: int
    tiles: int
    bytes_per_px: float
    """Working set of a forward per input px, with the stacked input (what the sizing uses)."""
    budget_bytes: int
    peak_bytes: int
    """Predicted peak on the device: input and accumulator where they sit there, plus the larger of
    a batch's forward and its blend, with learned corrections applied (weights not included)."""
    raw_peak_bytes: int
    key: tuple
    learned: str | None = None
    """The learned plan's label when this process learned something for the key, else None."""
    inexact: bool = False
    candidate: Callable[[int, int, int], planner.Candidate] = field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    """``(tile, batch, halo) -> Candidate`` with the raw predicted peak (the engine's OOM records)."""

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    @property
    def plan(self) -> str:
        return f"whole b{self.batch}" if self.whole else f"tiled t{self.tile} o{self.halo} b{self.batch}"


def decide(
    spec: ModelSpec,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    budget: int,
    fwd_px: float,
    halo_fn: Callable[[], tuple[int, object]],
    *,
    tile: int | None = None,
    batch: int | None = None,
    accumulate_on: str = "auto",
    host_apart: bool = False,
    memory: planner.PlanMemory | None = None,
) -> UpscalePlan:
    """The engine's plan for an ``input_shape`` upscale within ``budget`` bytes.

    ``fwd_px``: peak live bytes of the model's forward per input px (calibrated or predicted);
    ``halo_fn()``: ``(overlap, inexact)``, called only when tiles are needed (calibrating the
    overlap runs the model). ``tile``/``batch``: the user's sizes (None: automatic).
    """

    mem = planner.MEMORY if memory is None else memory
    bsz, ch, h, w = (int(v) for v in input_shape)
    s = spec.scale
    itemsize = elem_size(dtype)
    per_px = fwd_px + ch * itemsize
    hp, wp = _padded_size(spec, h, w)
    acc_bytes = bsz * ch * hp * s * wp * s * 4
    in_bytes = bsz * ch * hp * wp * itemsize
    if accumulate_on == "auto":
        acc_host = host_apart and acc_bytes + in_bytes > budget // 2
    else:
        acc_host = accumulate_on != "device"
    in_host = acc_host and in_bytes > budget * INPUT_ON_DEVICE_FRACTION
    tile_budget = budget - (0 if acc_host else acc_bytes) - (0 if in_host else in_bytes)
    auto_size = tile is None or batch is None
    inexact = [False]

    def get_halo() -> int:
        o, why = halo_fn()
        inexact[0] = why is not None
        return o

    def auto_tile(o: int) -> int:
        side = math.isqrt(max(0, int(tile_budget / per_px)))
        t = max(MIN_TILE, (side - 2 * o) // 8 * 8)
        # An inexact model gets the largest tile that fits (fewest boundaries), like DISCOURAGED.
        largest = spec.tiling == "discouraged" or inexact[0]
        return t if largest else min(t, AUTO_TILE_MAX)

    max_dim = max(hp, wp)
    whole = spec.tiling == "internal" or (tile is None and hp * wp * per_px <= tile_budget)
    halo = 0
    if not whole and (tile is None or tile < max_dim):
        halo = get_halo()
    if whole:
        t0 = max_dim
    elif tile is not None:
        t0 = tile
    else:
        t0 = auto_tile(halo)
    t0 = min(t0, max_dim)

    def windows(t: int, o: int) -> tuple[int, int, int]:
        """(largest window px, largest blended core px at the output scale, tiles per image)."""
        if t >= max_dim:
            return hp * wp, 0, 1
        wins = _make_tiles(spec, 0, (0, hp, 0, wp), t, o, hp, wp)
        feather = min(o // 2, t // 2)
        core = 0
        for wn in wins:
            ly = min(hp, wn.y1 + feather // 2 + 1) - max(0, wn.y0 - feather // 2 - 1)
            lx = min(wp, wn.x1 + feather // 2 + 1) - max(0, wn.x0 - feather // 2 - 1)
            core = max(core, ly * lx)
        return max(wn.shape[0] * wn.shape[1] for wn in wins), core * s * s, len(wins)

    def peak(t: int, b: int, o: int) -> int:
        area, core, n = windows(t, o)
        b = max(1, min(b, bsz * n))
        inp = b * ch * area * itemsize
        out32 = b * ch * area * s * s * 4
        raw = b * ch * area * s * s * itemsize if dtype != torch.float32 else 0
        pieces = (b + 1) * ch * core * 4 if core else 0
        acc = 0 if acc_host else acc_bytes
        one_batch = -(-bsz * n // b) == 1
        fwd = inp + int(b * area * fwd_px) + (0 if one_batch else acc)
        blend = inp + out32 + max(raw, pieces) + acc
        return (0 if in_host else in_bytes) + max(fwd, blend)

    def candidate(t: int, b: int, o: int) -> planner.Candidate:
        if t >= max_dim:
            return planner.Candidate(f"whole b{b}", peak(t, b, o), None, b)
        return planner.Candidate(f"tiled t{t} o{o} b{b}", peak(t, b, o), t, b)

    def auto_batch(t: int, o: int) -> int:
        n = bsz * math.ceil(hp / t) * math.ceil(wp / t)
        return int(max(1, min(MAX_AUTO_BATCH, n, tile_budget // max(1.0, windows(t, o)[0] * per_px))))

    key = planner.plan_key("upscale", signature(spec), (bsz, ch, h, w), dtype)
    learned_batch = None
    learned_label = None
    learned = mem.limit(key) is not None or mem.ratio(key) > 1.0
    if auto_size and spec.tiling != "internal" and learned:
        # This process learned something for this model and shape (an out-of-memory error, a
        # peak measured above the prediction): choose among the plans the OOM path would try.
        if halo == 0 and (tile is None or tile < max_dim):
            halo = get_halo()
        cands = []
        if tile is None:
            cands += [candidate(max_dim, b, 0) for b in _halvings(batch or bsz)]
        t = t0 if (tile is not None or not whole) else auto_tile(halo)
        t = min(t, max_dim)
        while True:
            cands += [candidate(t, b, halo) for b in _halvings(batch or auto_batch(t, halo))]
            if tile is not None or t // 2 < max(MIN_TILE, 2 * (halo // 2)):
                break
            t //= 2
        pick = planner.choose_learned(key, cands, budget, 0, mem).candidate
        whole = pick.tile is None
        t0, halo = (max_dim, 0) if whole else (pick.tile, halo)
        learned_batch = pick.batch
        learned_label = pick.plan
    if spec.square:
        need = _legal_len(spec, min(t0 + 2 * halo, max_dim))
        hp, wp = max(hp, need), max(wp, need)
    first = _make_tiles(spec, 0, (0, hp, 0, wp), t0, halo, hp, wp)
    n_tiles = bsz * len(first)
    area0 = first[0].shape[0] * first[0].shape[1]
    if batch is not None:
        b0 = batch
    elif learned_batch is not None:
        b0 = learned_batch
    else:
        b0 = int(max(1, min(MAX_AUTO_BATCH, n_tiles, tile_budget // max(1.0, area0 * per_px))))
        # the sizing rule counts the forward only; the batch's blend (its float32 output and the
        # cross-faded cores) can be larger: a batch this plan's own peak says does not fit is
        # made smaller (one tile at a time is the floor; the tile itself is the OOM path's)
        while b0 > 1 and candidate(t0, b0, halo).peak_bytes > budget:
            b0 -= 1
    raw_peak = candidate(t0, b0, halo).peak_bytes
    return UpscalePlan(
        tile=t0,
        batch=b0,
        halo=halo,
        whole=t0 >= max_dim,
        acc_host=acc_host,
        in_host=in_host,
        padded=(hp, wp),
        max_dim=max_dim,
        tiles=n_tiles,
        bytes_per_px=per_px,
        budget_bytes=int(budget),
        peak_bytes=int(raw_peak * mem.ratio(key)),
        raw_peak_bytes=raw_peak,
        key=key,
        learned=learned_label,
        inexact=inexact[0],
        candidate=candidate,
    )


@functools.lru_cache(maxsize=16)
def fake_bytes_per_px(module: torch.nn.Module, dtype: torch.dtype, channels: int = 3) -> float:
    """:func:`lib_vram.upscale.bytes_per_px` without running anything: the model's forward on a
    fake probe of the calibration's size, counted by the same live-byte counter (for a model with
    no weights, e.g. a reference architecture built on the meta device)."""
    from lib_vram.core.predict import count_peak, fake_call, fake_state, new_fake_mode

    from ._calibrate import PROBE_PX

    mode = new_fake_mode()
    call = fake_call(module, fake_state(module, mode, dtype))
    with mode:
        x = torch.empty(1, channels, PROBE_PX, PROBE_PX, dtype=dtype)
    peak, _ = count_peak(call, x, fake_mode=mode)
    return peak / float(PROBE_PX * PROBE_PX)


def plan_upscale(
    model: object,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    budget_bytes: int,
    *,
    scale: int | None = None,
    tile: int | None = None,
    batch: int | None = None,
    overlap: int | None = None,
    accumulate_on: str = "auto",
    device: torch.device | str = "cpu",
    host_apart: bool | None = None,
    calibrate: bool = True,
    memory: planner.PlanMemory | None = None,
) -> UpscalePlan:
    """The plan :func:`lib_vram.upscale.upscale_tensor` runs for an ``input_shape`` upscale with
    the same sizes, ``budget_bytes`` and ``dtype``, and its predicted peak, without running it.

    ``model``: what ``upscale_tensor`` takes (a spandrel descriptor, or an ``nn.Module`` with
    ``scale``). A module on the meta device has its forward bytes per px from its own count (a
    :mod:`lib_vram.planning.reference` upscaler's ``peak_bytes_per_px``) or else counted on fake
    tensors, and the default overlap; a real one is
    calibrated like the engine does (once per model, cached). ``host_apart``: host memory distinct
    from the device's (default: ``device`` is not the CPU).
    """
    from ._adapter import as_spec
    from ._calibrate import batching, bytes_per_px, tiling_verdict

    spec = as_spec(model, scale)
    dev = torch.device(device)
    apart = dev.type != "cpu" if host_apart is None else host_apart
    meta = spec.module is not None and any(p.is_meta for p in spec.module.parameters())
    measure = calibrate and (tile is None or batch is None) and not meta

    def halo() -> tuple[int, object]:
        return tiling_verdict(spec, dev, dtype, overlap, measure=calibrate and not meta)

    if meta:
        count = getattr(spec.module, "peak_bytes_per_px", None)
        if callable(count):  # a reference architecture knows its forward's count: no fake run
            fwd = float(count(torch.empty((), dtype=dtype).element_size()))
        else:
            fwd = fake_bytes_per_px(spec.module, dtype, spec.input_channels or int(input_shape[1]))
        return decide(
            spec, tuple(input_shape), dtype, budget_bytes, fwd, halo, tile=tile, batch=batch,
            accumulate_on=accumulate_on, host_apart=apart, memory=memory,
        )  # fmt: skip
    with spec.placed(dev, dtype), torch.inference_mode():
        if batching(spec, dev, dtype, measure=calibrate) is not None:
            spec.one_at_a_time, batch = True, 1
        fwd = bytes_per_px(spec, dev, dtype, measure=measure)
        return decide(
            spec, tuple(input_shape), dtype, budget_bytes, fwd, halo, tile=tile, batch=batch,
            accumulate_on=accumulate_on, host_apart=apart, memory=memory,
        )  # fmt: skip
