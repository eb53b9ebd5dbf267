"""Public entry points: :func:`tiled_decode`, :func:`tiled_encode`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable

import torch
from torch import nn

from lib_vram.core import emulate
from lib_vram.core.device import backend_of, capabilities, free_bytes, is_oom_error, release
from lib_vram.core.geometry import grid
from lib_vram.core.tracker import StageTracker
from lib_vram.planning import planner

from ._config import TiledVAEConfig, VAEOutOfMemory, VAEReport
from ._engine import (
    Program,
    Run,
    Ticker,
    TileState,
    decoder_global,
    decoder_tiles,
    encoder_global,
    encoder_tiles,
    finite,
    lockstep,
    replay,
)
from ._layout import UnsupportedLayout, VAESpec, decoder_spec, encoder_spec
from ._plan import (
    PassPlanner,
    VAEPlan,
    _levels,
    estimate_components,
    fast_sample_for,
    plan_vae,
    sample_boxes,
    smaller,
)
from ._window import TT, Box, needs, split_first_level, sync_count

logger = logging.getLogger(__name__)

SAFETY_MARGIN = 0.15
"""Share of the free memory left alone when ``budget_bytes`` is None (other allocations,
fragmentation, framework workspaces the estimate does not count)."""
MIN_MARGIN = 256 * 2**20


def _supported(module: nn.Module, spec_of: Callable[[nn.Module], VAESpec], role: str) -> bool:
    try:
        spec_of(module)
    except UnsupportedLayout as exc:
        logger.debug("%s not supported: %s", role, exc)
        return False
    return True


def is_supported_decoder(module: nn.Module) -> bool:
    """True if :func:`tiled_decode` can run ``module`` (ldm/sgm or diffusers decoder layout)."""
    return _supported(module, decoder_spec, "decoder")


def is_supported_encoder(module: nn.Module) -> bool:
    """True if :func:`tiled_encode` can run ``module`` (ldm/sgm or diffusers encoder layout)."""
    return _supported(module, encoder_spec, "encoder")


def _module_dtype(spec: VAESpec) -> torch.dtype:
    return spec.conv_out.weight.dtype


def _budget(config: TiledVAEConfig, device: torch.device) -> int:
    if config.budget_bytes is not None:
        return config.budget_bytes
    free = free_bytes(device)
    # An emulated card counts exactly the live tensor bytes and the convolution scratch the
    # estimate also counts: no allocator fragmentation or uncounted workspace to keep a floor for.
    floor = 0 if emulate.running_here(device) is not None and device.type == "cpu" else MIN_MARGIN
    return max(1, free - max(floor, int(free * SAFETY_MARGIN)))


class _Pass:
    """One decode or encode call: planning, stages, OOM retries."""

    def __init__(
        self,
        spec: VAESpec,
        x: torch.Tensor,
        config: TiledVAEConfig,
        report: VAEReport,
        should_interrupt: Callable[[], bool] | None,
        progress: Callable[[int, int], None] | None,
        tracker: StageTracker | None,
        memory: planner.PlanMemory | None = None,
    ) -> None:
        self.spec = spec
        self.memory = planner.MEMORY if memory is None else memory
        self.x = x
        self.config = config
        self.report = report
        self.device = x.device
        self.backend = backend_of(self.device).value
        self.dtype = config.dtype or _module_dtype(spec)
        self.out_dtype = x.dtype
        self.should_interrupt = should_interrupt
        self.progress = progress
        self.tracker = tracker
        self.budget = _budget(config, self.device)
        self.halo, _ = needs(spec)
        self.tile_spec = spec
        self.global_blocks: tuple = ()
        f = spec.factor
        b, _, h, w = x.shape
        self.align = f if spec.kind == "encoder" else 1
        self.lat_shape = (
            (b, spec.in_channels, h, w)
            if spec.kind == "decoder"
            else (b, spec.out_channels, math.ceil(h / f), math.ceil(w / f))
        )
        self.plan = PassPlanner(
            spec,
            tuple(x.shape),
            self.dtype,
            self.budget,
            out_dtype=self.out_dtype,
            backend=self.backend,
            host_apart=emulate.separate_host(self.device),
            state_offload=config.state_offload,
            fast_sample=config.fast_sample,
            memory=self.memory,
        )
        self.plan.notes = report.notes  # the planner's notes go straight into the report
        report.kind = spec.kind
        report.layout = spec.layout
        report.dtype = str(self.dtype).replace("torch.", "")
        report.halo = self.halo
        report.budget_bytes = self.budget

    # -- planning (all of it in :class:`lib_vram.vae._plan.PassPlanner`) ------------------------
    def offload_for(self, tile: int, mode: str) -> torch.device | None:
        choice = self.plan.offload(tile, mode)
        self.report.state_offload = choice
        # On a CPU device "cpu" moves nothing, but the parked bytes are still accounted (reports,
        # ``parked_bytes()``; an emulated card stops counting them), which is how a CPU run shows
        # what a GPU would hold on the device.
        return None if choice == "device" else torch.device("cpu")

    def pick_tile(self, mode: str) -> int:
        if self.config.tile is not None:
            return self.config.tile
        return self.plan.pick_tile(mode)

    def record(self, mode: str, tile: int | None, *, oom: bool, measured: int | None = None) -> None:
        """Tell the planner memory what a plan did (with its raw estimate: what ``adjust`` scales)."""
        outcome = planner.Outcome.of(self.plan.candidate(tile, mode), oom=oom, measured_peak_bytes=measured)
        self.memory.record(self.plan.key(mode), outcome)

    def new_run(self, offload: torch.device | None) -> Run:
        return Run(
            device=self.device,
            dtype=self.dtype,
            guard=self.config.guard,
            wide=self.config.guard_dtype
            or (torch.bfloat16 if capabilities(self.device).bf16 else torch.float32),
            offload=offload,
            report=self.report,
        )

    # -- stages --------------------------------------------------------------------------------
    def tiles(self, h: int, w: int, tile: int) -> list[Box]:
        core = tile * self.align
        return [
            Box(t.y.core_start, t.y.core_end, t.x.core_start, t.x.core_end)
            for t in grid(h, w, core, core, 0, align=self.align)
        ]

    def run_global(self, run: Run, data: torch.Tensor, ticker: Ticker) -> torch.Tensor:
        run.stage = "global"
        b, c, h, w = data.shape
        st = TileState(0, TT(data, 0, 0, h, w), Box(0, h, 0, w))
        if self.spec.kind == "decoder":
            prog = decoder_global(run, st, self.spec, self.global_blocks)
        else:
            prog = encoder_global(run, st, self.spec)
        lockstep([prog], ticker)
        assert st.h is not None
        out = st.h.data
        st.h = None
        return out

    def tile_program(
        self, run: Run, src: torch.Tensor, box: Box, index: int, target: torch.Tensor
    ) -> Program:
        _, _, h, w = src.shape
        y0, y1 = max(0, box.y0 - self.halo), min(h, box.y1 + self.halo)
        x0, x1 = max(0, box.x0 - self.halo), min(w, box.x1 + self.halo)
        st = TileState(index, TT(src[..., y0:y1, x0:x1], y0, x0, h, w), box)
        if self.spec.kind == "decoder":
            return decoder_tiles(run, st, self.tile_spec, target)
        return encoder_tiles(run, st, self.tile_spec, target)

    def target_for(self, src: torch.Tensor) -> torch.Tensor:
        b, _, h, w = src.shape
        if self.spec.kind == "decoder":
            f = self.spec.factor
            c = (
                self.spec.levels[-1].blocks[-1].out_channels
                if self.spec.give_pre_end
                else self.spec.out_channels
            )
            return torch.empty((b, c, h * f, w * f), dtype=self.out_dtype, device=self.device)
        hh, ww = _levels(self.spec, h, w)[-1]
        return torch.empty((b, self.spec.mid_channels, hh, ww), dtype=self.dtype, device=self.device)

    def run_tiles(self, run: Run, src: torch.Tensor, tile: int, mode: str, ticker: Ticker) -> torch.Tensor:
        """The tiled stage at one tile size (raises on OOM; the caller retries smaller)."""
        run.stage = "tiles"
        _, _, h, w = src.shape
        boxes = self.tiles(h, w, tile)
        self.report.tiles = len(boxes)
        target = self.target_for(src)
        if mode == "exact" or len(boxes) == 1:
            gens = [self.tile_program(run, src, bx, i, target) for i, bx in enumerate(boxes)]
            lockstep(gens, ticker)
            del gens
            return target
        # fast: GroupNorm statistics once, from the image subsampled by fast_sample per axis (for
        # the decoder: the exact first-level output, strided) or from full-scale sample crops
        # covering ~1/fast_sample^2 of it, in exact lock-step among themselves; then every tile
        # on its own with those fixed statistics.
        record: list = []
        estimate = self.config.fast_estimate
        if estimate == "auto":
            estimate = "downsample" if self.spec.kind == "decoder" else "crops"
        f = fast_sample_for(self.config.fast_sample, self.spec.kind, h, w)
        self.report.fast_sample = f
        if estimate == "downsample" and f > 1:
            if self.spec.kind == "decoder":
                small = src[..., ::f, ::f]
            else:
                small = torch.nn.functional.avg_pool2d(src, f, ceil_mode=True)
            sh, sw = small.shape[-2:]
            scratch = self.target_for(small)
            sgens = [
                self.tile_program(run, small, bx, -1 - i, scratch)
                for i, bx in enumerate(self.tiles(sh, sw, tile))
            ]
        else:
            sgens = [
                self.tile_program(run, src, bx, -1 - i, target)
                for i, bx in enumerate(Box(*c) for c in sample_boxes(h, w, f, self.align))
            ]
        lockstep(sgens, Ticker(1, ticker.should_interrupt, None, ticker.sample), record)
        del sgens
        gens = (self.tile_program(run, src, bx, i, target) for i, bx in enumerate(boxes))
        run.stats = False
        replay(gens, record, ticker)
        return target

    # -- the whole pass --------------------------------------------------------------------------
    def tile_steps(self, n_tiles: int, mode: str) -> int:
        return n_tiles * ((sync_count(self.tile_spec, "tiles") + 1) if mode == "exact" else 1)

    def event(self, text: str) -> None:
        """An out-of-memory error of this pass, onto the tracker's memory timeline (at this moment)."""
        if self.tracker is not None:
            self.tracker.event("oom", f"{self.spec.kind}: {text}")

    def tiled(self, mode: str, tile: int | None = None) -> torch.Tensor:
        spec = self.spec
        tile = self.pick_tile(mode) if tile is None else tile
        if mode == "fast" and spec.kind == "decoder":
            # The first level's ResNets run at latent resolution: on the whole latent with the mid
            # block (exact statistics, no halo to recompute, memory like the mid block's).
            self.global_blocks, self.tile_spec = split_first_level(spec)
            self.halo, _ = needs(self.tile_spec)
            self.report.halo = self.halo
        sample = self.tracker.sample if self.tracker is not None else None
        x = self.x.to(self.dtype)
        b, _, h, w = x.shape
        n_tiles = len(self.tiles(h, w, tile))
        g = sync_count(spec, "global")
        global_after = g + 1 if spec.kind == "encoder" else 0  # the encoder's global stage, after the tiles
        total = self.tile_steps(n_tiles, mode) + g + 2 * len(self.global_blocks) + 1
        ticker = Ticker(total, self.should_interrupt, self.progress, sample)
        ticker.check()
        if spec.kind == "decoder":
            # conv_in + mid block on the whole latent, once (no tile to shrink: an OOM here is
            # reported as such, see ``whole_latent``)
            src = self.whole_latent(x, ticker)
            del x
        else:
            src = x
        while True:
            offload = self.offload_for(tile, mode)
            self.report.mode = mode
            self.report.tile = tile
            # the estimate as learned for this key (a measured/estimated ratio above 1 raises it)
            raw = self.plan.estimate(tile, mode, offload is None)
            self.report.peak_estimate_bytes = int(raw * self.memory.ratio(self.plan.key(mode)))
            n_tiles = len(self.tiles(src.shape[-2], src.shape[-1], tile))
            ticker.total = max(ticker.total, ticker.done + self.tile_steps(n_tiles, mode) + global_after)
            run = self.new_run(offload)
            out = _unless_oom(run.close, self.run_tiles, run, src, tile, mode, ticker)
            if out is not None:
                break
            logger.info("%s: out of memory at tile %d, retrying smaller", spec.kind, tile)
            self.report.oom_retries.append(tile)
            self.record(mode, tile, oom=True)
            release(self.device)
            nxt = smaller(tile)
            if nxt is None and self.report.oom_retries.count(tile) == 1:
                # the smallest tile, first failure: once more after the release (the error may
                # have been a moment of pressure, not this tile's own size)
                nxt = tile
            if nxt is None:
                self.event(f"out of memory at tile {tile}, the smallest: the pass stops")
                raise VAEOutOfMemory(
                    f"{spec.kind}: out of memory even with the smallest tile ({tile}); "
                    f"tried {self.report.oom_retries}"
                )
            self.event(f"out of memory at tile {tile}: released, retrying at tile {nxt}")
            tile = nxt
        del src
        if spec.kind == "encoder":
            out = self.whole_latent(out, ticker)
        if self.config.guard and self.dtype in (torch.float32, torch.float64) and not finite(out):
            logger.warning(
                "%s: non-finite values in the %s output: nothing wider to recompute in", spec.kind, self.dtype
            )
            self.report.notes.append(
                f"non-finite values in the output ({self.dtype}): nothing wider to recompute in"
            )
        return out.to(self.out_dtype)

    def whole_latent(self, data: torch.Tensor, ticker: Ticker) -> torch.Tensor:
        """The global stage (decoder: ``conv_in`` + mid block; encoder: mid block + output) on the
        whole latent. Its size is set by the latent, not by a tile: an out-of-memory error here is
        released and raised as :class:`VAEOutOfMemory` naming the stage, the latent and the estimate."""
        for attempt in range(2):
            grun = self.new_run(None)
            out = _unless_oom(grun.close, self.run_global, grun, data, ticker)
            if out is not None:
                return out
            release(self.device)
            if attempt == 0:
                # once more after the release: the error may have come from cached blocks or a
                # moment of pressure (another process), not from the stage's own size
                self.report.notes.append("out of memory in the whole-latent stage: released, retried once")
                self.event("out of memory in the whole-latent stage: released, retrying once")
                logger.info(
                    "%s: out of memory in the whole-latent stage; released, retrying once", self.spec.kind
                )
        b, _, h, w = self.lat_shape
        part = "conv_in and mid block" if self.spec.kind == "decoder" else "mid block and output layers"
        self.report.notes.append(f"out of memory in the whole-latent stage ({part})")
        self.event(f"out of memory in the whole-latent stage ({part}) again: the pass stops")
        raise VAEOutOfMemory(
            f"{self.spec.kind}: out of memory in the whole-latent stage ({part} on a {b}x{h}x{w} "
            f"latent, about {self.global_bytes() / 2**20:.0f} MiB estimated at any tile size): no "
            "tile size makes this stage smaller. Free memory (unload other models) or make the "
            "image smaller."
        )

    def global_bytes(self) -> int:
        """The global stage's own peak estimate (the part no tile size changes)."""
        return estimate_components(
            self.spec, tuple(self.x.shape), self.dtype, tile=1, mode="exact", backend=self.backend
        ).global_peak

    def untiled_host(self, original_forward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        """Try the host's own forward; None on OOM (after release) or on non-finite output."""
        self.report.mode = "untiled"
        raw = self.plan.estimate(None, "untiled")
        self.report.peak_estimate_bytes = int(raw * self.memory.ratio(self.plan.key("exact")))
        failed = False
        try:
            out = original_forward(self.x)
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            failed = True
        if failed:
            self.report.oom_retries.append(0)
            self.record("exact", None, oom=True)
            release(self.device)
            self.event("out of memory untiled: released, running tiled")
            return None
        if self.config.guard and not finite(out):
            self.report.notes.append("untiled output had NaN/Inf: rerun by the guarded engine")
            del out
            return None
        return out


def _unless_oom(
    close: Callable[[], None] | None, fn: Callable[..., torch.Tensor], *args: object
) -> torch.Tensor | None:
    """``fn(*args)``, or None when it ran out of memory (other errors and :class:`VAEOutOfMemory`
    propagate); ``close()`` either way. The caller releases memory after it: out of the ``except``
    block, the traceback's frames and the tensors they held are gone."""
    try:
        return fn(*args)
    except Exception as exc:
        if not is_oom_error(exc) or isinstance(exc, VAEOutOfMemory):
            raise
    finally:
        if close is not None:
            close()
    return None


def _run_pass(
    module: nn.Module,
    x: torch.Tensor,
    kind: str,
    config: TiledVAEConfig,
    original_forward: Callable[[torch.Tensor], torch.Tensor] | None,
    should_interrupt: Callable[[], bool] | None,
    progress: Callable[[int, int], None] | None,
    tracker: StageTracker | None,
    report: VAEReport | None,
    memory: planner.PlanMemory | None,
) -> torch.Tensor:
    role, name = ("decoder", "z") if kind == "decode" else ("encoder", "x")
    try:
        spec = decoder_spec(module) if kind == "decode" else encoder_spec(module)
    except UnsupportedLayout as exc:
        raise ValueError(f"`{role}` is not a supported VAE {role}: {exc}") from exc
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"`{name}` must be a 4-D tensor (B, C, H, W), got {getattr(x, 'shape', type(x))}")
    if x.shape[1] != spec.in_channels:
        raise ValueError(f"`{name}` has {x.shape[1]} channels, the module expects {spec.in_channels}")
    stage = f"vae_{kind}"
    if not isinstance(config, TiledVAEConfig):
        raise ValueError(f"`config` must be a TiledVAEConfig, got {type(config).__name__}")
    rep = report if report is not None else VAEReport()
    t0 = time.perf_counter()
    with tracker.stage(stage) if tracker is not None else contextlib.nullcontext(), torch.no_grad():
        p = _Pass(spec, x, config, rep, should_interrupt, progress, tracker, memory)
        out = _unless_oom(None, _attempt, p, original_forward)
        if out is None:
            # an allocation outside the tile loop (the input's cast, the output's dtype, the final
            # check) failed: release and run the pass once more
            release(p.device)
            rep.notes.append("out of memory outside the tile loop: released and ran the pass again")
            p.event("out of memory outside the tile loop: released, running the pass again")
            logger.info(
                "%s: out of memory outside the tile loop; released, running the pass again", spec.kind
            )
            out = _attempt(p, original_forward)
        rep.seconds = time.perf_counter() - t0
        if tracker is not None:
            tracker.note(
                plan=rep.plan,
                tiles=rep.tiles,
                recomputed=len(rep.recomputed),
                oom_retries=list(rep.oom_retries),
            )
    measured = None
    if tracker is not None:
        measured = planner.learnable_peak(tracker.last(stage), x.numel() * p.dtype.itemsize)
    ran_mode = "exact" if rep.mode == "untiled" else rep.mode
    p.record(ran_mode, None if rep.mode == "untiled" else rep.tile, oom=False, measured=measured)
    return out


def _attempt(p: _Pass, original_forward: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """One try of a pass: auto's choice (untiled through the host's forward, or tiled) or the
    configured mode."""
    out = None
    spec, config, rep = p.spec, p.config, p.report
    ran, tile = p.plan.auto(config.mode, config.tile)
    if ran == "untiled":
        if original_forward is not None:
            out = p.untiled_host(original_forward)
        else:
            b, _, h, w = p.x.shape
            full = math.ceil(max(h, w) / (spec.factor if spec.kind == "encoder" else 1))
            whole = dataclasses.replace(config, tile=full, mode="exact")
            p2 = _Pass(spec, p.x, whole, rep, p.should_interrupt, p.progress, p.tracker, p.memory)
            out = p2.tiled("exact")
            if rep.oom_retries:
                p.record("exact", None, oom=True)  # the untiled attempt (tile = everything)
            else:
                rep.mode = "untiled"
        if out is None:
            # the untiled try ran out of memory (or gave NaN/Inf): exact tiles
            out = p.tiled("exact")
    else:
        out = p.tiled(ran, tile)
    return out


def plan_pass(
    module: nn.Module,
    x: torch.Tensor,
    *,
    config: TiledVAEConfig,
    kind: str | None = None,
    memory: planner.PlanMemory | None = None,
) -> VAEPlan:
    """The plan :func:`tiled_decode`/:func:`tiled_encode` would run for ``x`` with ``config`` if
    called now (the free memory read now, as the call reads it), made without running anything.

    A host adapter asks this before a pass to see whether it fits at all (``plan.fits``), e.g. to
    move idle models off the device first. ``kind``: ``"decode"`` or ``"encode"`` (default: a
    module with the decoder layout decodes).
    """
    if kind not in (None, "decode", "encode"):
        raise ValueError(f"`kind` must be 'decode' or 'encode', got {kind!r}")
    decode = is_supported_decoder(module) if kind is None else kind == "decode"
    spec = decoder_spec(module) if decode else encoder_spec(module)
    device = x.device
    return plan_vae(
        spec,
        tuple(x.shape),
        config.dtype or _module_dtype(spec),
        _budget(config, device),
        mode=config.mode,
        tile=config.tile,
        state_offload=config.state_offload,
        out_dtype=x.dtype,
        backend=backend_of(device).value,
        host_apart=emulate.separate_host(device),
        fast_sample=config.fast_sample,
        memory=memory,
    )


def tiled_decode(
    decoder: nn.Module,
    z: torch.Tensor,
    *,
    config: TiledVAEConfig,
    original_forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    should_interrupt: Callable[[], bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
    tracker: StageTracker | None = None,
    report: VAEReport | None = None,
    memory: planner.PlanMemory | None = None,
) -> torch.Tensor:
    """Decode latents ``z`` with ``decoder`` in bounded memory; same result as ``decoder(z)``.

    Never calls ``decoder(...)`` or ``decoder.forward`` (the WebUI glue installs this function as
    ``decoder.forward``): the untiled path calls ``original_forward(z)`` when given, otherwise the
    engine walks the layers itself.

    Args:
        decoder: an ldm/sgm ``Decoder`` or diffusers ``Decoder`` (see :func:`is_supported_decoder`).
        z: ``(B, C, H, W)`` latents (already scaled/post-quant-conv'ed, as ``decoder(z)`` takes them).
        config: :class:`TiledVAEConfig`.
        original_forward: the decoder's own forward, for the untiled path of ``mode="auto"``.
        should_interrupt: polled between tiles; True raises :class:`Interrupted`.
        progress: ``progress(done, total)`` after each tile step.
        tracker: records the stage ``"vae_decode"`` and is sampled between tiles.
        report: filled with what ran (mode, tile, retries, recomputed segments, ...).
        memory: where the automatic tile choice learns (default :data:`lib_vram.planning.planner.MEMORY`),
            under (stage, VAE signature, input shape, dtype, mode); docs/how-it-works.md, "Planning".

    Returns:
        the decoded image ``(B, out_ch, 8H, 8W)`` in ``z``'s dtype, on ``z``'s device.

    Raises:
        ValueError: unsupported module or bad input (the message names it).
        Interrupted: ``should_interrupt()`` returned True.
        VAEOutOfMemory: even the smallest tile did not fit.
    """
    return _run_pass(
        decoder, z, "decode", config, original_forward, should_interrupt, progress, tracker, report, memory
    )


def tiled_encode(
    encoder: nn.Module,
    x: torch.Tensor,
    *,
    config: TiledVAEConfig,
    original_forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    should_interrupt: Callable[[], bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
    tracker: StageTracker | None = None,
    report: VAEReport | None = None,
    memory: planner.PlanMemory | None = None,
) -> torch.Tensor:
    """Encode images ``x`` with ``encoder`` in bounded memory; same result as ``encoder(x)``.

    Returns the encoder's raw output (the moments, before ``quant_conv``), like ``encoder(x)``.
    ``config.tile`` is in latent pixels here too (an SD encoder tile covers ``8 * tile`` image
    pixels). Everything else as :func:`tiled_decode`; the tracker stage is ``"vae_encode"``.
    """
    return _run_pass(
        encoder, x, "encode", config, original_forward, should_interrupt, progress, tracker, report, memory
    )
