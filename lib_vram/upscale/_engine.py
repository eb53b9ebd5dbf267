"""The tiled upscaling engine: batched tiles on the device, seamless blending, OOM continuation.

Geometry. The (padded) image is split into balanced tile **cores** (:func:`lib_vram.core.geometry.
split_axis`); each tile reads its core plus ``overlap`` input pixels of context on every side
(clipped at the image border, grown where the model's size requirements ask for more). Windows
of equal shape are stacked into one batch per forward pass.

Blending. Every output pixel belongs to one core. Across each boundary between two cores the two
tiles cross-fade linearly over ``feather`` input pixels centred on the boundary (``feather`` =
half the overlap); outside that band a tile has weight 1 on its core and 0 elsewhere. So the outer
three quarters of each halo - the pixels computed with the least context - never reach the
output, the weights are a partition of unity by construction (no weight buffer), and they remain
one after a tile is split into smaller tiles (the split only adds boundaries inside its core).

Out of memory. The error is noted inside the ``except`` block, which is then left (its traceback
holds the batch's tensors), memory is released, and the batch goes back to the queue: first the
batch is halved, then the tile size (the tiles not yet done are re-split; finished tiles stay in
the accumulator).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lib_vram.core import emulate
from lib_vram.core.device import free_bytes, is_oom_error, release, resolve_device
from lib_vram.core.geometry import split_axis
from lib_vram.core.livebytes import itemsize as elem_size
from lib_vram.planning import planner

from ._adapter import ModelSpec, as_spec, choose_dtype
from ._calibrate import bytes_per_px, context_info
from ._types import Interrupted, UpscaleConfig, UpscaleError, UpscaleReport

logger = logging.getLogger(__name__)

BUDGET_FRACTION = 0.8
"""Share of the free device memory an automatic plan uses (the rest absorbs fragmentation)."""
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


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _legal_len(spec: ModelSpec, n: int) -> int:
    n = max(n, spec.minimum, 1)
    return _round_up(n, math.lcm(spec.multiple_of, spec.grid))


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


def _pad_like_model(spec: ModelSpec, x: Tensor, hp: int, wp: int) -> Tensor:
    """``x`` padded as an untiled call pads it: spandrel's padding for its size requirements, then
    the model's own (e.g. reflect to a window multiple), once for the whole image - so edge tiles
    see exactly the padding the whole image gets, and the model pads no tile again."""
    h1, w1 = spec.pad_to(*x.shape[-2:])
    x = _pad(x, h1 - x.shape[-2], w1 - x.shape[-1])
    if spec.pre_pad is not None and (h1, w1) != (hp, wp):
        with torch.inference_mode():
            x = spec.pre_pad(x)
    if tuple(x.shape[-2:]) != (hp, wp):  # square models: the engine's own growth
        x = _pad(x, hp - x.shape[-2], wp - x.shape[-1])
    return x


def _pad(x: Tensor, pad_h: int, pad_w: int) -> Tensor:
    """Pad bottom/right the way spandrel does (reflect up to size-1, then replicate)."""
    if not pad_h and not pad_w:
        return x
    h, w = x.shape[-2:]
    rh, rw = min(pad_h, h - 1), min(pad_w, w - 1)
    if rh or rw:
        x = torch.nn.functional.pad(x, (0, rw, 0, rh), mode="reflect")
    if pad_h - rh or pad_w - rw:
        x = torch.nn.functional.pad(x, (0, pad_w - rw, 0, pad_h - rh), mode="replicate")
    return x


def _axis_weights(
    c0: int, c1: int, n: int, s: int, feather: int, device: torch.device
) -> tuple[int, int, Tensor | None]:
    """Output range ``[lo, hi)`` a tile writes on one axis and its weights (``None`` = all 1)."""
    fs = feather * s
    lo = c0 * s if c0 == 0 or fs == 0 else c0 * s - fs // 2
    hi = c1 * s if c1 == n or fs == 0 else c1 * s + fs // 2
    hi = min(hi, n * s)
    if fs == 0 or (c0 == 0 and c1 == n):
        return lo, hi, None
    p = torch.arange(lo, hi, device=device, dtype=torch.float32) + 0.5
    w = torch.ones_like(p)
    if c0 > 0:
        w = w * ((p - (c0 * s - fs / 2.0)) / fs).clamp(0, 1)
    if c1 < n:
        w = w * (((c1 * s + fs / 2.0) - p) / fs).clamp(0, 1)
    return lo, hi, w


def signature(spec: ModelSpec) -> tuple:
    """What an upscaler's memory depends on besides the input: architecture name, scale, input
    channels and parameter count (which tells widths apart); the planner memory's model key."""
    n_params = sum(p.numel() for p in spec.module.parameters()) if spec.module is not None else 0
    return (spec.name, spec.scale, spec.input_channels, n_params)


class _Run:
    def __init__(
        self,
        spec: ModelSpec,
        cfg: UpscaleConfig,
        device: torch.device,
        dtype: torch.dtype,
        rep: UpscaleReport,
        tracker: object | None,
        should_interrupt: Callable[[], bool] | None,
        progress: Callable[[int, int], None] | None,
        memory: planner.PlanMemory,
    ) -> None:
        self.spec, self.cfg, self.device, self.dtype = spec, cfg, device, dtype
        self.rep, self.tracker = rep, tracker
        self.should_interrupt, self.progress = should_interrupt, progress
        self.memory = memory
        self.key: tuple = ()
        self.ran: planner.Candidate | None = None
        """The plan that finished (after any out-of-memory retries)."""
        self.predict: Callable[[int, int], planner.Candidate] | None = None
        """(tile, batch) -> the plan as a planner candidate with its predicted peak (at the overlap
        in use, :attr:`halo_px`)."""
        self.halo_px = 0
        self.feather = 0
        self.min_tile = MIN_TILE
        self.inexact: str | None = None
        """Why the tiled result may differ from the untiled model (None: exact by construction)."""
        self.host_roles = (False, False)
        """Whether the accumulator and the padded input sit in host memory apart from the device's
        (tells an emulated card not to count them, :func:`lib_vram.core.emulate.to_host`)."""

    def learn_oom(self, tile: int, batch: int) -> None:
        if self.predict is not None:
            self.memory.record(self.key, planner.Outcome.of(self.predict(tile, batch), oom=True))

    def halo(self) -> int:
        """The overlap tiles of this model need: the configured one, else calibrated. A model whose
        tiles cannot match the whole image (image-wide statistics, a context beyond the largest
        probe) is noted in :attr:`inexact`."""
        reason = self.spec.global_stats
        if self.cfg.overlap is not None:
            halo = self.cfg.overlap
        else:
            ctx = context_info(self.spec, self.device, self.dtype, measure=self.cfg.calibrate)
            halo = ctx.halo
            if not ctx.sufficient and reason is None:
                reason = f"its effective context exceeds {ctx.measured} px"
        if reason is not None:
            self.inexact = reason
        return halo

    def set_halo(self, halo: int, tile: int) -> None:
        self.halo_px = halo
        self.feather = min(halo // 2, tile // 2)
        self.min_tile = max(MIN_TILE, 2 * self.feather)

    def describe(self, tiled: bool, acc_dev: torch.device) -> None:
        """Fill the report's plan fields from the plan in use (called again after OOM retries, so
        the report shows the plan that finished)."""
        rep = self.rep
        if self.inexact is None and tiled:
            self.inexact = self.spec.global_stats  # also when the overlap was given
        rep.tiled = tiled
        rep.overlap, rep.feather = (self.halo_px, self.feather) if tiled else (0, 0)
        rep.exact = not (tiled and self.inexact is not None)
        tiles = f"tiled t{rep.tile} o{rep.overlap} f{rep.feather}"
        shape = f"{tiles} b{rep.batch}" if tiled else f"whole b{rep.batch}"
        rep.plan = f"{shape} {rep.dtype} acc={acc_dev.type}"
        if not rep.exact:
            rep.plan += " inexact"
            note = (
                f"{self.spec.name}: tiled output can differ from the untiled model ({self.inexact}); "
                "it did not fit untiled "
                + ("in the budget" if self.cfg.tile is None else "at the set tile size")
            )
            if note not in rep.notes:
                rep.notes.append(note)
                logger.warning("upscale: %s", note)

    def auto_tile(self, tile_budget: int, per_px: float, halo: int) -> int:
        side = math.isqrt(max(0, int(tile_budget / per_px)))
        tile = max(MIN_TILE, (side - 2 * halo) // 8 * 8)
        # An inexact model gets the largest tile that fits (fewest boundaries), like DISCOURAGED.
        largest = self.spec.tiling == "discouraged" or self.inexact is not None
        return tile if largest else min(tile, AUTO_TILE_MAX)

    # -- model call with the precision guard ----------------------------------------------
    def forward(self, inp: Tensor) -> Tensor:
        spec, rep = self.spec, self.rep
        rep.forward_calls += 1
        with torch.inference_mode():
            raw = spec.forward(inp)
        if self.cfg.check_finite and self.dtype != torch.float32:
            # per tile: min and max propagate NaN and hold any infinity (no bool mask of the batch)
            lo, hi = torch.aminmax(raw.flatten(1), dim=1)
            bad = ~(torch.isfinite(lo) & torch.isfinite(hi))
            if bool(bad.any()):  # the guard's one host sync per batch
                idx = bad.nonzero().flatten().tolist()
                rep.recomputed_batches += 1
                rep.events.append(f"non-finite {self.dtype} output in {len(idx)} tile(s): recomputed in fp32")
                logger.info("non-finite %s output in %d tile(s): recomputing in fp32", self.dtype, len(idx))
                spec.set_dtype(torch.float32)
                try:
                    rep.forward_calls += 1
                    with torch.inference_mode():
                        fixed = spec.forward(inp[idx].float())
                finally:
                    spec.set_dtype(self.dtype)
                raw = raw.float()
                raw[idx] = fixed.float()
        return raw.float().clamp_(0, 1)

    # -- planning ---------------------------------------------------------------------------
    def run(self, x: Tensor) -> Tensor:
        spec, cfg, rep, device, dtype = self.spec, self.cfg, self.rep, self.device, self.dtype
        bsz, ch, h, w = x.shape
        s = spec.scale
        itemsize = elem_size(dtype)
        auto_size = cfg.tile is None or cfg.batch is None
        per_px = bytes_per_px(spec, device, dtype, measure=cfg.calibrate and auto_size) + ch * itemsize
        rep.bytes_per_px = per_px
        hp, wp = _padded_size(spec, h, w)
        budget = cfg.budget_bytes
        if budget is None:
            budget = int(free_bytes(device) * BUDGET_FRACTION)
        rep.budget_bytes = budget
        acc_bytes = bsz * ch * hp * s * wp * s * 4
        in_bytes = bsz * ch * hp * wp * itemsize
        # host memory is distinct from the device's on an accelerator and on an emulated card
        host_apart = emulate.separate_host(device)
        if cfg.accumulate_on == "auto":
            acc_host = host_apart and acc_bytes + in_bytes > budget // 2
        else:
            acc_host = cfg.accumulate_on != "device"
        acc_dev = torch.device("cpu") if acc_host else device
        in_host = acc_host and in_bytes > budget * INPUT_ON_DEVICE_FRACTION
        in_dev = acc_dev if in_host else device
        self.host_roles = (acc_host and host_apart, in_host and host_apart)
        tile_budget = budget - (0 if acc_host else acc_bytes) - (0 if in_host else in_bytes)

        max_dim = max(hp, wp)
        whole = spec.tiling == "internal" or (cfg.tile is None and hp * wp * per_px <= tile_budget)
        halo = 0
        if not whole and (cfg.tile is None or cfg.tile < max_dim):
            halo = self.halo()
        if whole:
            tile = max_dim
        elif cfg.tile is not None:
            tile = cfg.tile
        else:
            tile = self.auto_tile(tile_budget, per_px, halo)
        tile = min(tile, max_dim)
        resident = budget - tile_budget

        def area_of(t: int, o: int) -> int:
            if t >= max_dim:
                return hp * wp
            wins = _make_tiles(spec, 0, (0, hp, 0, wp), t, o, hp, wp)
            return max(w.shape[0] * w.shape[1] for w in wins)

        def auto_batch(t: int, o: int) -> int:
            n = bsz * math.ceil(hp / t) * math.ceil(wp / t)
            return int(max(1, min(MAX_AUTO_BATCH, n, tile_budget // max(1.0, area_of(t, o) * per_px))))

        def candidate(t: int, b: int, o: int) -> planner.Candidate:
            # peak = accumulator and input where they sit on the device + b windows at per_px
            peak = resident + int(b * area_of(t, o) * per_px)
            if t >= max_dim:
                return planner.Candidate(f"whole b{b}", peak, None, b)
            return planner.Candidate(f"tiled t{t} o{o} b{b}", peak, t, b)

        self.key = planner.plan_key("upscale", signature(spec), x.shape, dtype)
        learned_batch = None
        mem = self.memory
        learned = mem.limit(self.key) is not None or mem.ratio(self.key) > 1.0
        if auto_size and spec.tiling != "internal" and learned:
            # This process learned something for this model and shape (an out-of-memory error, a
            # peak measured above the prediction): choose among the plans the OOM path would try.
            if halo == 0 and (cfg.tile is None or cfg.tile < max_dim):
                halo = self.halo()
            cands = []
            if cfg.tile is None:
                cands += [candidate(max_dim, b, 0) for b in _halvings(cfg.batch or bsz)]
            t = tile if (cfg.tile is not None or not whole) else self.auto_tile(tile_budget, per_px, halo)
            t = min(t, max_dim)
            while True:
                cands += [candidate(t, b, halo) for b in _halvings(cfg.batch or auto_batch(t, halo))]
                if cfg.tile is not None or t // 2 < max(MIN_TILE, 2 * (halo // 2)):
                    break
                t //= 2
            pick = planner.choose_learned(self.key, cands, budget, 0, mem).candidate
            whole = pick.tile is None
            tile, halo = (max_dim, 0) if whole else (pick.tile, halo)
            learned_batch = pick.batch
            rep.events.append(f"learned for this model and shape: {pick.plan}")
        self.set_halo(halo, tile)
        self.predict = lambda t, b: candidate(t, b, self.halo_px)
        self.candidate = candidate

        if spec.square:
            need = _legal_len(spec, min(tile + 2 * halo, max_dim))
            hp, wp = max(hp, need), max(wp, need)
        tiles = [t for b in range(bsz) for t in _make_tiles(spec, b, (0, hp, 0, wp), tile, halo, hp, wp)]
        area = tiles[0].shape[0] * tiles[0].shape[1]
        if cfg.batch is not None:
            batch = cfg.batch
        elif learned_batch is not None:
            batch = learned_batch
        else:
            batch = int(max(1, min(MAX_AUTO_BATCH, len(tiles), tile_budget // max(1.0, area * per_px))))

        rep.tile, rep.batch = tile, batch
        rep.dtype, rep.device, rep.accumulate_on = str(dtype).replace("torch.", ""), str(device), str(acc_dev)
        rep.tiles_total = len(tiles)
        self.max_dim, self.acc_dev = max_dim, acc_dev
        self.describe(len(tiles) > bsz, acc_dev)
        note = getattr(self.tracker, "note", None)
        if note is not None:
            note(plan=rep.plan, tiles=len(tiles), bytes_per_px=round(per_px))
        logger.debug("upscale plan: %s, %d tiles, budget %.0f MiB", rep.plan, len(tiles), budget / 2**20)

        def place_input() -> Tensor:
            xp = _pad_like_model(spec, x.to(device=in_dev, dtype=dtype), hp, wp)
            if self.host_roles[1]:
                emulate.to_host(xp)
            else:
                emulate.to_device(xp)  # the input on the device (a GPU run copies it there)
            return xp

        xp = _once_more(place_input, rep, device, "the input")
        out = self.loop(xp, tiles, tile, batch, acc_dev)
        del xp
        self.ran = self.predict(rep.tile, rep.batch)
        if note is not None:
            note(plan=rep.plan)
        res = out[:, :, : h * s, : w * s]
        if (hp, wp) == (h, w):
            return res
        try:
            return res.contiguous()
        except Exception as exc:
            if not is_oom_error(exc):
                raise
        # a view of the padded accumulator is a valid result too (it only keeps the padding alive)
        rep.ooms += 1
        rep.events.append("out of memory copying the cropped output: returned as a view")
        return res

    # -- the tile loop ----------------------------------------------------------------------
    def check_shape(self, out: Tensor, inp: Tensor, n: int, shape: tuple[int, int]) -> None:
        s = self.spec.scale
        if out.shape[0] != n or tuple(out.shape[-2:]) != (shape[0] * s, shape[1] * s):
            raise UpscaleError(
                f"{self.spec.name} returned {tuple(out.shape)} for input {tuple(inp.shape)}; "
                f"expected scale {s} (is `scale` right?)"
            )

    def new_accumulator(self, b: int, c: int, h: int, w: int, acc_dev: torch.device) -> Tensor:
        """The output accumulator (float32 zeros); where the device has no room for it, in host
        memory (an accelerator's, or an emulated card's host)."""
        try:
            acc = torch.zeros(b, c, h, w, dtype=torch.float32, device=acc_dev)
        except Exception as exc:
            if not is_oom_error(exc) or not emulate.separate_host(self.device) or self.host_roles[0]:
                raise
            acc = None
        if acc is None:  # out of the except block: release, then keep the output in host memory
            release(self.device)
            self.rep.ooms += 1
            self.rep.events.append("out of memory for the output: accumulating in host memory")
            self.rep.accumulate_on = "cpu"
            self.host_roles = (True, self.host_roles[1])
            acc = torch.zeros(b, c, h, w, dtype=torch.float32, device="cpu")
        if self.host_roles[0]:
            emulate.to_host(acc)
        return acc

    def weighted(self, out: Tensor, group: list, hp: int, wp: int) -> list:
        """Each tile's core (with its cross-fade weights applied) and where it goes."""
        s, feather = self.spec.scale, self.feather
        pieces = []
        for i, t in enumerate(group):
            ly0, ly1, wy = _axis_weights(t.y0, t.y1, hp, s, feather, out.device)
            lx0, lx1, wx = _axis_weights(t.x0, t.x1, wp, s, feather, out.device)
            piece = out[i, :, ly0 - t.wy0 * s : ly1 - t.wy0 * s, lx0 - t.wx0 * s : lx1 - t.wx0 * s]
            if wy is not None:
                piece = piece * wy[:, None]
            if wx is not None:
                piece = piece * wx[None, :]
            pieces.append((t, (ly0, ly1, lx0, lx1), piece))
        return pieces

    def loop(
        self,
        xp: Tensor,
        tiles: list[_Tile],
        tile: int,
        batch: int,
        acc_dev: torch.device,
    ) -> Tensor:
        spec, rep, device = self.spec, self.rep, self.device
        bsz, _, hp, wp = xp.shape
        h_out, w_out = hp * spec.scale, wp * spec.scale
        acc: Tensor | None = None
        pending: deque[_Tile] = deque(tiles)
        processed_px = 0
        while pending:
            if self.should_interrupt is not None and self.should_interrupt():
                if acc is not None:
                    rep.partial = acc
                raise Interrupted(f"upscale interrupted after {rep.tiles_done} of {rep.tiles_total} tiles")
            shape = pending[0].shape
            group: list[_Tile] = []
            rest: deque[_Tile] = deque()
            for t in pending:
                (group if len(group) < batch and t.shape == shape else rest).append(t)
            out: Tensor | None = None
            inp: Tensor | None = None
            pieces: list = []
            oom = False
            try:
                # everything of this batch that allocates, before the accumulator changes: an
                # out-of-memory error anywhere here leaves the finished tiles as they are
                inp = torch.stack([xp[t.b, :, t.wy0 : t.wy1, t.wx0 : t.wx1] for t in group]).to(device)
                out = self.forward(inp)
                self.check_shape(out, inp, len(group), shape)
                if acc is None:
                    acc = self.new_accumulator(bsz, out.shape[1], h_out, w_out, acc_dev)
                pieces = self.weighted(out.to(acc.device), group, hp, wp)
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                oom = True
                logger.debug("OOM at tile %d batch %d: %s", tile, len(group), exc)
            if oom:
                inp = out = None
                pieces = []
                rep.ooms += 1
                release(device)
                self.learn_oom(tile, min(batch, len(group)))
                if batch > 1:
                    batch = max(1, min(batch, len(group)) // 2)
                    rep.events.append(f"out of memory: batch -> {batch}")
                elif tile // 2 >= self.min_tile:
                    tile //= 2
                    if self.halo_px == 0 and self.cfg.overlap != 0:
                        # The plan was untiled: from now on tiles need the model's overlap and
                        # cross-fade (tiles finished so far were whole images, exact either way).
                        self.set_halo(self.halo(), tile)
                    rep.events.append(f"out of memory: tile -> {tile}")
                    halo = self.halo_px
                    pending = deque(
                        sub
                        for t in pending
                        for sub in _make_tiles(spec, t.b, (t.y0, t.y1, t.x0, t.x1), tile, halo, hp, wp)
                    )
                    rep.tiles_total = rep.tiles_done + len(pending)
                else:
                    raise UpscaleError(
                        f"out of memory even with one {tile}px tile (overlap {self.halo_px}) on {device}; "
                        "free memory or lower `budget_bytes`"
                    )
                rep.tile, rep.batch = tile, batch
                self.describe(rep.tiled or tile < self.max_dim, self.acc_dev)
                logger.info("upscale: %s", rep.events[-1])
                continue
            assert out is not None and acc is not None
            lh, lw = shape
            for t, (ly0, ly1, lx0, lx1), piece in pieces:
                acc[t.b, :, ly0:ly1, lx0:lx1] += piece  # in place: allocates nothing
                processed_px += lh * lw
            del pieces
            pending = rest
            del inp, out
            rep.tiles_done += len(group)
            if self.progress is not None:
                self.progress(rep.tiles_done, rep.tiles_total)
            sample = getattr(self.tracker, "sample", None)
            if sample is not None:
                sample()
        assert acc is not None
        rep.flop_ratio = processed_px / float(bsz * hp * wp)
        return acc.clamp_(0, 1)


def upscale_tensor(
    model: object,
    x: Tensor,
    *,
    config: UpscaleConfig | None = None,
    scale: int | None = None,
    should_interrupt: Callable[[], bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
    tracker: object | None = None,
    report: UpscaleReport | None = None,
    memory: planner.PlanMemory | None = None,
) -> Tensor:
    """Upscale ``x`` (``[B, C, H, W]``, float in [0, 1]) with ``model``, tiled as memory requires.

    Args:
        model: a spandrel ``ImageModelDescriptor`` or a callable ``[N,C,h,w] -> [N,C',h*s,w*s]``
            (then ``scale`` is required). The model is moved to the device/dtype for the call and
            put back afterwards.
        config: :class:`UpscaleConfig` (defaults: everything automatic).
        should_interrupt: polled before each batch; True raises :class:`Interrupted`.
        progress: called as ``progress(tiles_done, tiles_total)`` after each batch (the total grows
            when an out-of-memory error makes the remaining tiles smaller).
        tracker: a :class:`lib_vram.core.tracker.StageTracker`; the run is its stage ``"upscale"``.
        memory: where automatic sizing learns (default :data:`lib_vram.planning.planner.MEMORY`): every
            out-of-memory retry and the finished plan (with the tracker's measured peak when it is
            an exact accelerator one) are recorded under (``"upscale"``, model signature, input
            shape, dtype); automatic tile/batch sizing for that key then starts below a plan that
            failed and scales its predictions by a measured/predicted ratio above 1.
        report: an :class:`UpscaleReport` to fill in (readable also after an exception).

    Returns:
        ``[B, C', H*s, W*s]`` float32 in [0, 1]. It lives where it was accumulated: on the device
        when the output fitted the budget there (``report.accumulate_on``), else on the CPU.
    """
    cfg = config if config is not None else UpscaleConfig()
    rep = report if report is not None else UpscaleReport()
    spec = as_spec(model, scale)
    if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"`x` must be a float tensor [B, C, H, W], got {getattr(x, 'shape', type(x))}")
    if spec.input_channels is not None and x.shape[1] != spec.input_channels:
        raise ValueError(f"`x` has {x.shape[1]} channels; {spec.name} expects {spec.input_channels}")
    if x.shape[-1] < 1 or x.shape[-2] < 1 or x.shape[0] < 1:
        raise ValueError(f"`x` is empty: {tuple(x.shape)}")
    device = resolve_device(cfg.device)
    dtype = choose_dtype(cfg.precision, spec, device)
    t0 = time.perf_counter()
    stage = tracker.stage("upscale") if tracker is not None else contextlib.nullcontext()  # type: ignore[attr-defined]
    mem = planner.MEMORY if memory is None else memory
    run = _Run(spec, cfg, device, dtype, rep, tracker, should_interrupt, progress, mem)
    try:
        with stage, spec.placed(device, dtype), torch.inference_mode():
            out = run.run(x)
    finally:
        rep.seconds = time.perf_counter() - t0
    if run.ran is not None:
        last = getattr(tracker, "last", None)
        in_bytes = x.numel() * x.element_size() if x.device == device else 0
        measured = planner.learnable_peak(last("upscale") if last is not None else None, in_bytes)
        mem.record(run.key, planner.Outcome.of(run.ran, measured_peak_bytes=measured))
    return out


def _once_more(fn: Callable[[], Tensor], rep: UpscaleReport, device: torch.device, what: str) -> Tensor:
    """``fn()``; after an out-of-memory error, release and try once more (the error may have been a
    moment of pressure); a second one propagates."""
    try:
        return fn()
    except Exception as exc:
        if not is_oom_error(exc):
            raise
    release(device)
    rep.ooms += 1
    rep.events.append(f"out of memory placing {what}: released, tried again")
    return fn()


def _halvings(n: int) -> list[int]:
    out = [n]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out
