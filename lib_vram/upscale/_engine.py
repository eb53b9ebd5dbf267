"""The tiled upscaling engine: batched tiles on the device, seamless blending, OOM continuation.

How tiles, blending and the out-of-memory continuation behave: docs/how-it-works.md, "How the
upscale engine works". Why the blend needs no weight buffer: every output pixel belongs to one core
and the cross-fades across core boundaries sum to one by construction, also after a tile is split
(the split only adds boundaries inside its core). An out-of-memory error is only noted inside the
``except`` block (its traceback holds the batch's tensors); memory is released after it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor

from lib_vram.core import emulate
from lib_vram.core.device import free_bytes, is_oom_error, release, resolve_device
from lib_vram.planning import planner

from ._adapter import ModelSpec, as_spec, choose_dtype
from ._calibrate import batching, bytes_per_px, tiling_verdict
from ._plan import (  # noqa: F401  (re-exported: the engine's sizes and geometry)
    AUTO_TILE_MAX,
    INPUT_ON_DEVICE_FRACTION,
    MAX_AUTO_BATCH,
    MIN_TILE,
    _legal_len,
    _make_tiles,
    _padded_size,
    _Tile,
    decide,
    signature,
)
from ._types import Interrupted, TileError, UpscaleConfig, UpscaleError, UpscaleReport

logger = logging.getLogger(__name__)

ONE_AT_A_TIME = "model takes one image at a time"
"""What the plan says after ``b1`` for a model that rejects batches."""


def _why(exc: BaseException) -> str:
    """An exception as one short clause (its type and the first line of its message)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160]}" if lines else type(exc).__name__


BUDGET_FRACTION = 0.8
"""Share of the free device memory an automatic plan uses (the rest absorbs fragmentation)."""


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
        self.force_whole = False
        """Run the whole image in one window (after the model failed on tiles): no probes."""
        self.budget = 0
        self.fwd_px = 0.0
        self.plan: object | None = None
        self.host_roles = (False, False)
        """Whether the accumulator and the padded input sit in host memory apart from the device's
        (tells an emulated card not to count them, :func:`lib_vram.core.emulate.to_host`)."""

    def oom_event(self, text: str) -> None:
        """An out-of-memory error this run recovered from: the report's events, and the tracker's
        (its memory timeline) at this moment."""
        self.rep.events.append(text)
        event = getattr(self.tracker, "event", None)
        if event is not None:
            event("oom", f"upscale: {text}")

    def learn_oom(self, tile: int, batch: int) -> None:
        if self.predict is not None:
            self.memory.record(self.key, planner.Outcome.of(self.predict(tile, batch), oom=True))

    def halo(self) -> int:
        """The overlap tiles of this model need: the configured one, else calibrated. A model whose
        tiles cannot match the whole image (no margin fits, or content beyond the tiles' reach
        changes the output: :func:`lib_vram.upscale._calibrate.tiling_verdict`) is noted in
        :attr:`inexact`. A probe that fails other than for memory is a :class:`TileError`."""
        if self.force_whole:
            return self.cfg.overlap or 0
        try:
            halo, why = tiling_verdict(
                self.spec, self.device, self.dtype, self.cfg.overlap, measure=self.cfg.calibrate
            )
        except UpscaleError:
            raise
        except Exception as exc:
            if is_oom_error(exc):
                raise
            raise TileError(
                f"{self.spec.name} fails on the small tiles of its calibration ({_why(exc)})"
            ) from exc
        if why is not None:
            self.inexact = why
        return halo

    def check_batching(self) -> None:
        """Probe once per model whether it takes a batch (cached); mark it one at a time if not."""
        if self.force_whole or self.spec.one_at_a_time:
            return
        try:
            why = batching(self.spec, self.device, self.dtype, measure=self.cfg.calibrate)
        except Exception as exc:
            if is_oom_error(exc):
                raise
            raise TileError(f"{self.spec.name} fails on a small probe image ({_why(exc)})") from exc
        if why is not None:
            self.one_at_a_time(why)

    def one_at_a_time(self, why: str) -> None:
        self.spec.one_at_a_time = True
        text = f"{self.spec.name}: {ONE_AT_A_TIME} ({why})"
        if text not in self.rep.events:
            self.rep.events.append(text)
            logger.info("upscale: %s", text)

    def set_halo(self, halo: int, tile: int) -> None:
        self.halo_px = halo
        self.feather = min(halo // 2, tile // 2)
        self.min_tile = max(MIN_TILE, 2 * self.feather)

    def describe(self, tiled: bool, acc_dev: torch.device) -> None:
        """Fill the report's plan fields from the plan in use (called again after OOM retries, so
        the report shows the plan that finished)."""
        rep = self.rep
        rep.tiled = tiled
        rep.overlap, rep.feather = (self.halo_px, self.feather) if tiled else (0, 0)
        rep.exact = not (tiled and self.inexact is not None)
        tiles = f"tiled t{rep.tile} o{rep.overlap} f{rep.feather}"
        b = f"b{rep.batch}" + (f" ({ONE_AT_A_TIME})" if self.spec.one_at_a_time else "")
        shape = f"{tiles} {b}" if tiled else f"whole {b}"
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

    # -- planning (all of it in :func:`decide`) ---------------------------------------------
    def run(self, x: Tensor) -> Tensor:
        spec, cfg, rep, device, dtype = self.spec, self.cfg, self.rep, self.device, self.dtype
        bsz, ch, h, w = x.shape
        s = spec.scale
        auto_size = cfg.tile is None or cfg.batch is None
        self.check_batching()
        try:
            fwd_px = bytes_per_px(
                spec, device, dtype, measure=cfg.calibrate and auto_size and not self.force_whole
            )
        except Exception as exc:
            if is_oom_error(exc):
                raise
            raise TileError(f"{spec.name} fails on a small probe image ({_why(exc)})") from exc
        budget = cfg.budget_bytes
        if budget is None:
            budget = int(free_bytes(device) * BUDGET_FRACTION)
        self.budget, self.fwd_px = budget, fwd_px
        tile_arg, batch_arg = cfg.tile, cfg.batch
        if self.force_whole:
            tile_arg = max(_padded_size(spec, h, w))
        if spec.one_at_a_time:
            batch_arg = 1
        # host memory is distinct from the device's on an accelerator and on an emulated card
        host_apart = emulate.separate_host(device)
        plan = decide(
            spec,
            tuple(x.shape),
            dtype,
            budget,
            fwd_px,
            lambda: (self.halo(), self.inexact),
            tile=tile_arg,
            batch=batch_arg,
            accumulate_on=cfg.accumulate_on,
            host_apart=host_apart,
            memory=self.memory,
        )
        self.plan = plan
        rep.bytes_per_px = plan.bytes_per_px
        rep.budget_bytes = budget
        if plan.learned is not None:
            rep.events.append(f"learned for this model and shape: {plan.learned}")
        acc_dev = torch.device("cpu") if plan.acc_host else device
        in_dev = acc_dev if plan.in_host else device
        self.host_roles = (plan.acc_host and host_apart, plan.in_host and host_apart)
        self.key = plan.key
        tile, halo, batch, max_dim = plan.tile, plan.halo, plan.batch, plan.max_dim
        hp, wp = plan.padded
        self.set_halo(halo, tile)
        self.predict = lambda t, b: plan.candidate(t, b, self.halo_px)
        tiles = [t for b in range(bsz) for t in _make_tiles(spec, b, (0, hp, 0, wp), tile, halo, hp, wp)]

        rep.tile, rep.batch = tile, batch
        rep.dtype, rep.device, rep.accumulate_on = str(dtype).replace("torch.", ""), str(device), str(acc_dev)
        rep.tiles_total = len(tiles)
        self.max_dim, self.acc_dev = max_dim, acc_dev
        self.describe(len(tiles) > bsz, acc_dev)
        note = getattr(self.tracker, "note", None)
        if note is not None:
            note(plan=rep.plan, tiles=len(tiles), bytes_per_px=round(plan.bytes_per_px))
        logger.debug("upscale plan: %s, %d tiles, budget %.0f MiB", rep.plan, len(tiles), budget / 2**20)

        def place_input() -> Tensor:
            xp = _pad_like_model(spec, x.to(device=in_dev, dtype=dtype), hp, wp)
            if self.host_roles[1]:
                emulate.to_host(xp)
            else:
                emulate.to_device(xp)  # the input on the device (a GPU run copies it there)
            return xp

        try:
            xp = place_input()
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            xp = None
        if xp is None:  # out of the except block: release and try once more (a moment of pressure)
            release(device)
            rep.ooms += 1
            self.oom_event("out of memory placing the input: released, tried again")
            xp = place_input()
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
        self.oom_event("out of memory copying the cropped output: returned as a view")
        return res

    # -- the tile loop ----------------------------------------------------------------------
    def failure(self, exc: BaseException, group: list, shape: tuple[int, int]) -> Exception | None:
        """What a forward that failed other than for memory means: None when the batch held several
        images and the model is not yet run one at a time (it is from now on: try again), else the
        error to raise - a :class:`TileError` for a tile (the whole image may work), an
        :class:`UpscaleError` for the whole image - in one line naming the model and the reason."""
        if isinstance(exc, UpscaleError):
            return exc
        if len(group) > 1 and not self.spec.one_at_a_time:
            self.one_at_a_time(f"a batch of {len(group)} raised {_why(exc)}")
            return None
        if self.rep.tiled:
            return TileError(f"{self.spec.name} fails on a {shape[0]}x{shape[1]} px tile ({_why(exc)})")
        return UpscaleError(f"{self.spec.name} fails on this image ({shape[0]}x{shape[1]} px): {_why(exc)}")

    def whole_fits(self, x: Tensor) -> bool:
        """Whether the whole image fits the budget in one window (the plan's own peak model, with
        the calibrated bytes per pixel where there are some, else the prediction)."""
        spec, cfg = self.spec, self.cfg
        budget = cfg.budget_bytes or int(free_bytes(self.device) * BUDGET_FRACTION)
        fwd = self.fwd_px or bytes_per_px(spec, self.device, self.dtype, measure=False)
        hp, wp = _padded_size(spec, *x.shape[-2:])
        apart = emulate.separate_host(self.device)
        plan = decide(
            spec, tuple(x.shape), self.dtype, budget, fwd, lambda: (0, None), tile=max(hp, wp), batch=1,
            accumulate_on=cfg.accumulate_on, host_apart=apart, memory=self.memory,
        )  # fmt: skip
        return plan.peak_bytes <= budget

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
            self.oom_event("out of memory for the output: accumulating in host memory")
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
                s = spec.scale
                if out.shape[0] != len(group) or tuple(out.shape[-2:]) != (shape[0] * s, shape[1] * s):
                    raise UpscaleError(
                        f"{spec.name} returned {tuple(out.shape)} for input {tuple(inp.shape)}; "
                        f"expected scale {s} (is `scale` right?)"
                    )
                if acc is None:
                    acc = self.new_accumulator(bsz, out.shape[1], h_out, w_out, acc_dev)
                pieces = self.weighted(out.to(acc.device), group, hp, wp)
            except Exception as exc:
                if isinstance(exc, UpscaleError) or not is_oom_error(exc):
                    failed = self.failure(exc, group, shape)
                    if failed is not None:
                        raise failed from exc
                    batch = rep.batch = 1  # the model takes one image at a time: this batch again, singly
                    self.describe(rep.tiled, self.acc_dev)
                    continue
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
                    self.oom_event(f"out of memory: batch -> {batch}")
                elif tile // 2 >= self.min_tile:
                    tile //= 2
                    if self.halo_px == 0 and self.cfg.overlap != 0:
                        # The plan was untiled: from now on tiles need the model's overlap and
                        # cross-fade (tiles finished so far were whole images, exact either way).
                        self.set_halo(self.halo(), tile)
                    self.oom_event(f"out of memory: tile -> {tile}")
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
        memory: where automatic sizing learns (default :data:`lib_vram.planning.planner.MEMORY`),
            under (``"upscale"``, model signature, input shape, dtype); docs/how-it-works.md, "Planning".
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
            try:
                out = run.run(x)
            except TileError as exc:
                if not run.whole_fits(x):
                    raise TileError(f"{exc}; the whole image does not fit untiled either") from exc
                note = f"{exc}: ran untiled (the whole image fits)"
                logger.warning("upscale: %s", note)
                run = _Run(spec, cfg, device, dtype, rep, tracker, should_interrupt, progress, mem)
                run.force_whole = True
                rep.tiles_done = 0
                rep.notes.append(note)
                out = run.run(x)
    finally:
        rep.seconds = time.perf_counter() - t0
    if run.ran is not None:
        last = getattr(tracker, "last", None)
        in_bytes = x.numel() * x.element_size() if x.device == device else 0
        measured = planner.learnable_peak(last("upscale") if last is not None else None, in_bytes)
        mem.record(run.key, planner.Outcome.of(run.ran, measured_peak_bytes=measured))
    return out
