"""One VRAM Guard job inside the WebUI: what it installed, and what it measured.

A :class:`Job` owns an ``ExitStack`` with every patch it made (VAE hooks, upscaler patches, Forge
wrappers). It is closed by the script's ``postprocess``, at the next ``setup``/``process`` of the
same script (the WebUI skips ``postprocess`` when the job raised), by the ``p.close`` safety net
(:meth:`~lib_vram.webui.session.ScriptJobs._safety_net`) in the host's own ``finally``, and on script
unload (:meth:`Session.close_all`). While open, every hook it installed passes straight through
unless :meth:`Job.current` (its job is still the WebUI's running one, ``shared.state.time_start``),
so even a patch that outlived its job does nothing.

Host access goes through ``host`` (by default :mod:`lib_vram.webui.host`), so tests can drive a job
with real torch modules and a plain object for the host state.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import torch

from lib_vram.core import emulate
from lib_vram.core.device import release
from lib_vram.core.hooks import register_hook, remove_hook
from lib_vram.core.readout import stage_words, vae_pass_note
from lib_vram.core.timeline import Timeline
from lib_vram.core.tracker import StageTracker

from . import host as default_host
from .host import ask
from .options import INFOTEXT_PLAN_KEY, to_infotext
from .settings import JobSettings

logger = logging.getLogger(__name__)

HOOK_NAME = "vram_guard"
"""Name of our hook in a module's hook registry."""
_UNREADABLE = object()  # the job token when the host cannot tell it (equal to no job's)


class Job:
    """A running VRAM Guard job (see the module docstring)."""

    def __init__(
        self,
        settings: JobSettings,
        *,
        kind: str,
        token: Any,
        p: Any = None,
        options: Any = None,
        tracker: StageTracker | None = None,
        device: torch.device | str | None = None,
        session: Any = None,
        host: Any = None,
        total_bytes: int | None = None,
    ) -> None:
        if kind not in ("txt2img", "img2img", "extras"):
            raise ValueError(f"`kind` must be txt2img, img2img or extras, got {kind!r}")
        self.settings = settings
        self.options = options
        self.kind = kind
        self.token = token
        self.host = host if host is not None else default_host
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.tracker = tracker if tracker is not None else StageTracker(self.device, owns_peak_counters=False)
        self.timeline = Timeline(total_bytes=total_bytes, measure=self.tracker.measure)
        """The job's memory over time (:mod:`lib_vram.core.timeline`): the tracker feeds it."""
        self.tracker.timeline = self.timeline
        self.tracker.sample("start")
        self.session = session
        self.stack = ExitStack()
        self.thread = threading.get_ident()
        self.started = time.time()
        self.closed = False
        self.stop_line: str | None = None
        """Why the job cannot run (a preprocessor's model did not fit): its sampling raises it."""
        self.failed = False
        self.postprocessed = False
        self.sampled = False
        """``post_sample`` ran for the current batch: a decode now is the final one (also when an
        interrupted hires job skipped its hires pass), not the hires first-pass decode."""
        self.postprocessing = False
        """The job post-processes the images of its batch (``postprocess_batch`` ran, no pass of
        its own started since): a pass now is another extension's, inside the job (ADetailer)."""
        self.notes: list[str] = []
        self.releases: list[dict] = []
        self.plans: dict[str, str] = {}
        self._p_ref = weakref.ref(p) if p is not None else None
        self._lock = threading.RLock()
        self._vae_lock = threading.RLock()
        self._span: contextlib.AbstractContextManager | None = None
        self._hooked: list[weakref.ref] = []
        self._warned: set[str] = set()
        self.forge_load_vae: Callable[[Any], None] | None = None
        self.unet: Any = None
        """The job's :class:`~lib_vram.webui.unet.UNetFP16` when 'FP16 UNet' is on."""
        self.info: dict | None = None
        """Extras: the image's ``pp.info`` (the plan goes there: Extras has no ``p``)."""
        self.sampling: Any = None
        """The job's :class:`~lib_vram.webui.sampling.SamplingGuard` (created at the first pass)."""
        self.profiler: Any = None
        """'Profile the next job': this job's :class:`~lib_vram.webui.profiling.JobProfiler`, or None."""

    # -- state -------------------------------------------------------------------------------
    @property
    def p(self) -> Any:
        return self._p_ref() if self._p_ref is not None else None

    def adopt(self, p: Any) -> None:
        """The job now runs ``p`` (a script runs the job's processing with a copy of the ``p`` it
        was set up with: X/Y/Z plot's cells)."""
        self._p_ref = weakref.ref(p) if p is not None else None

    def current(self) -> bool:
        """True while this job is open and the WebUI is still running the job that opened it."""
        return not self.closed and ask(self.host, "job_token", _UNREADABLE) == self.token

    def note(self, text: str, level: int = logging.INFO, *, log: bool = True) -> None:
        """A note for the readout (and the log, unless it was logged already: the owner logs moves)."""
        if text not in self.notes:
            self.notes.append(text)
            if log:
                logger.log(level, "%s", text)

    def warn_once(self, key: str, text: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        self.note(text, logging.WARNING)

    # -- stages ------------------------------------------------------------------------------
    def begin_span(self, name: str) -> None:
        """Open a stage that spans host hooks (e.g. ``sampling``); the next stage or boundary ends it."""
        self.end_span()
        if threading.get_ident() != self.thread:
            return
        cm = self.tracker.stage(name)
        cm.__enter__()
        self._span = cm

    def end_span(self) -> None:
        cm, self._span = self._span, None
        try:
            if self.sampling is not None:
                self.sampling.end()  # the pass is over: its patch goes, moved parts come back
        finally:
            if cm is not None:
                cm.__exit__(None, None, None)

    def sampling_guard(self) -> Any:
        from .sampling import SamplingGuard

        if self.sampling is None:
            self.sampling = SamplingGuard(self)
        return self.sampling

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[Any]:
        """A measured stage; on the job thread it ends any open span first."""
        if threading.get_ident() == self.thread:
            self.end_span()
        # (under the PyTorch profiler when this job is profiled: .profiling)
        profiled = self.profiler.stage(name) if self.profiler is not None else contextlib.nullcontext()
        with profiled, self.tracker.stage(name) as rec:
            yield rec
            cards = self.cards() if threading.get_ident() == self.thread else None
            if cards is not None and cards.owner.models:
                rec.notes["models"] = cards.owner.summary()  # where each model is after the stage
        if rec.plan:
            self.plans[name] = rec.plan
            if self.info is not None and (text := self.plan_text()):
                self.info[INFOTEXT_PLAN_KEY] = text

    def boundary(self, name: str) -> None:
        """A stage boundary: release memory there if the settings ask for it, and record it."""
        if threading.get_ident() == self.thread:
            self.end_span()
        if name not in self.settings.release_at:
            return
        try:
            res = release(self.device)
        except RuntimeError as exc:
            logger.warning("memory release at %s failed: %s", name, exc)
            return
        freed = res.freed_device_bytes
        self.releases.append(
            {"at": name, "freed_device_bytes": freed, "collected_objects": res.collected_objects}
        )
        self.tracker.event(
            "release",
            f"released memory at {name.replace('_', ' ')}: {freed / 2**20:.0f} MiB of cache returned, "
            f"{res.collected_objects} objects collected",
            at=name,
            freed_bytes=freed,
        )
        self.tracker.sample("release")

    def vae_stage_name(self, kind: str) -> str:
        """Readout name of a VAE pass from the job's progress (``p``) and the calling thread."""
        if threading.get_ident() != self.thread:
            return "preview_decode" if kind == "decode" else "other_encode"
        if self.postprocessing:
            return "ext_decode" if kind == "decode" else "ext_encode"  # (an extension's pass: ADetailer)
        p = self.p
        hr = bool(getattr(p, "enable_hr", False)) and self.kind == "txt2img"
        in_hr = bool(getattr(p, "is_hr_pass", False))
        if kind == "decode":
            return "hires_decode" if hr and not in_hr and not self.sampled else "decode"
        return "hires_encode" if hr and in_hr else "encode"

    def pass_note(self, stage: str, report: Any) -> bool:
        """Say in words what a tiled VAE pass did to fit (readout, log), e.g. "The VAE decode was
        done in 6 tiles of up to 512x512 px to fit in 3.2 GiB ..."; nothing for a pass that simply
        ran untiled. True if the pass ran out of memory before it finished."""
        whole = [n for n in report.notes if "out of memory" in n]
        oom = bool(report.oom_retries or whole)
        text = vae_pass_note(
            stage,
            mode=report.mode,
            tiles=report.tiles,
            tile=report.tile,
            budget_bytes=report.budget_bytes,
            retries=report.oom_retries,
            whole=whole,
        )
        if text:
            self.note(f"VRAM Guard: {text}", logging.WARNING if oom else logging.INFO)
        return oom

    def upscale_stage_name(self) -> str:
        return {"txt2img": "hires_upscale", "img2img": "img2img_upscale"}.get(self.kind, "upscale")

    # -- VAE ---------------------------------------------------------------------------------
    def hook_vae(self, handle: Any) -> bool:
        """Install our hooks on the VAE of ``handle`` (a :class:`host.VAEHandle`); idempotent.

        Called at ``process()`` and again at every later hook point, because the model (and its
        VAE) can change mid-job (hires checkpoint, refiner). Returns whether anything is hooked.
        """
        if handle is None:
            return False
        done = False
        if handle.kind == "forge":
            from . import forge

            # Forge's slots make its VAE call the decoder/encoder per image; our hooks on those
            # modules (below) then do the tiling, exactly as on A1111.
            done = forge.install(self, handle.forge_vae, load_vae=self.forge_load_vae)
        for kind, module in (("decode", handle.decoder), ("encode", handle.encoder)):
            if module is None:
                continue
            if any(ref() is module for ref in self._hooked):
                done = True
                continue
            register_hook(module, HOOK_NAME, self._make_vae_hook(kind), replace=True)
            mref = weakref.ref(module)
            self._hooked.append(mref)
            self.stack.callback(_unhook, mref)
            done = True
        return done

    def _make_vae_hook(self, kind: str) -> Callable[..., Any]:
        job_ref = weakref.ref(self)

        def hook(
            module: torch.nn.Module, call_next: Callable[..., Any], x: Any, *args: Any, **kwargs: Any
        ) -> Any:
            job = job_ref()
            if job is None or args or not job.current():
                return call_next(x, *args, **kwargs)
            return job.vae_call(kind, module, call_next, x, kwargs)

        return hook

    def vae_call(
        self, kind: str, module: torch.nn.Module, call_next: Callable[..., Any], x: torch.Tensor, kwargs: dict
    ) -> torch.Tensor:
        """Run one VAE decode/encode the way the settings ask (called by our hooks).

        With ``--vram-guard-emulate-vram``, a pass in a thread that does not run on the emulated
        card (a live preview, decoded in the progress request's thread) is put on it: cards are
        entered per thread."""
        emulated = getattr(self.session, "emulated_card", None)
        card = emulated() if emulated is not None else None
        if card is not None and not card.active_here:
            with emulate.running_on(card):
                return self.vae_call(kind, module, call_next, x, kwargs)
        s = self.settings
        name = self.vae_stage_name(kind)
        if kwargs or (s.vae_tiling == "Off" and s.vae_dtype is None):
            with self.stage(name):
                out = call_next(x, **kwargs)
                self.tracker.note(plan="untiled")
            return out
        try:
            from lib_vram import vae as engine
        except ImportError as exc:
            self.warn_once(
                "no-vae-engine", f"VRAM Guard: tiled VAE engine unavailable ({exc}); running untiled"
            )
            with self.stage(name):
                return call_next(x, **kwargs)
        supported = engine.is_supported_decoder if kind == "decode" else engine.is_supported_encoder
        if not supported(module):
            self.warn_once(
                f"unsupported-{kind}",
                f"VRAM Guard: this model's VAE {kind}r ({type(module).__name__}) is not supported; "
                "running it untiled",
            )
            with self.stage(name):
                return call_next(x, **kwargs)
        mode, tile = s.vae_mode, s.vae_tile
        if s.vae_tiling == "Off":
            # Forced precision without tiling: one tile covering the whole pass, so that the
            # per-tile precision guard still applies (it is what keeps FP16 from producing NaNs).
            mode = "exact"
            side = max(int(x.shape[-2]), int(x.shape[-1]))
            tile = side if kind == "decode" else -(-side // 8)
        config = engine.TiledVAEConfig(mode=mode, tile=tile, dtype=s.vae_dtype)
        report = engine.VAEReport()
        run = engine.tiled_decode if kind == "decode" else engine.tiled_encode

        def attempt(rep: Any) -> torch.Tensor:
            return run(module, x, config=config, original_forward=call_next, tracker=self.tracker, report=rep)

        with self._vae_lock, self.stage(name), self.owned_stage(name, "VAE"):
            try:
                moved = ""
                if self.may_make_room(name) and not self._plan_fits(engine, module, x, config, kind):
                    moved = self.make_room(name, "its plan does not fit with them there")
                failed = None
                try:
                    out = attempt(report)
                except engine.VAEOutOfMemory as exc:
                    if moved or not self.may_make_room(name):
                        raise
                    failed = str(exc)
                if failed is not None:  # out of the except block (its traceback holds the failed pass)
                    report = engine.VAEReport()
                    moved = self.make_room(name, "it ran out of memory with them there")
                    if not moved:
                        raise engine.VAEOutOfMemory(failed)
                    out = attempt(report)
            except engine.VAEOutOfMemory as exc:
                self.tracker.note(plan="out of memory")
                self.note(f"VRAM Guard: {name.replace('_', ' ')}: {exc}", logging.WARNING)
                raise
            oom = self.pass_note(name, report)
            off = f", {moved} off the card" if moved else ""
            self.tracker.note(plan=report.plan + (" after OOM" if oom else "") + off)
        if report.recomputed:
            n = len(report.recomputed)
            self.note(
                f"VRAM Guard: {n} part{'s' if n != 1 else ''} of {stage_words(name)} overflowed in "
                f"{report.dtype.upper()} (they would have been black or NaN) and were recomputed in a "
                "wider type"
            )
        return out

    def may_make_room(self, stage: str) -> bool:
        """Whether idle models may leave the card for this stage: only on the job's own thread (a
        live preview runs on another one while the sampler may use them), and only where the owner
        of the card has models (a card, no --medvram/--lowvram, not Forge)."""
        if stage in ("preview_decode", "other_encode") or threading.get_ident() != self.thread:
            return False
        return self.cards() is not None

    def cards(self) -> Any:
        """The session's :class:`~lib_vram.webui.models.CardModels`, or None (no card)."""
        get = getattr(self.session, "card_models", None)
        cards = get() if callable(get) else None
        return cards if cards is not None and cards.has_card() else None

    @contextlib.contextmanager
    def owned_stage(self, stage: str, *uses: str) -> Iterator[None]:
        """The owner's view of a stage: the models named in ``uses`` are busy (and on the card: a
        parked one wakes, room made for it), and whatever moved for the stage goes home after it."""
        cards = self.cards() if self.may_make_room(stage) else None
        if cards is None:
            yield
            return
        owner = cards.owner
        busy = cards.models(self.current_model(), uses)
        owner.begin(stage, busy=busy)
        try:
            for m in busy:
                owner.use(m, stage, why=f"{stage_words(stage)} uses it")
            yield
        finally:
            owner.end(stage)

    def make_room(self, stage: str, why: str) -> str:
        """The idle UNet and text encoders (those the preset lets move: ``offload_unet``,
        ``offload_text_encoders``) leave the card for the stage through the owner, back after it;
        returns their names ("" when none could)."""
        cards = self.cards()
        if cards is None:
            return ""
        s = self.settings
        names = [n for n, ok in (("UNet", s.offload_unet), ("text encoders", s.offload_text_encoders)) if ok]
        if not names:
            return ""
        room = cards.room(stage, self.current_model(), movable=names, why=f"{stage_words(stage)}: {why}")
        if not room.moved:
            return ""
        what = stage_words(stage)
        text = (
            f"{what[:1].upper() + what[1:]}: moved the idle {room.names} ({room.nbytes / 2**30:.2f} GiB) "
            f"off the card for this pass and back after it: {why}"
        )
        self.note_moved(stage, text, room.nbytes)
        return room.names

    def note_moved(self, stage: str, text: str, nbytes: int) -> None:
        """A move the owner made for ``stage``: the readout's note and the timeline's event."""
        self.note(f"VRAM Guard: {text}", log=False)  # (the owner logged each move)
        self.tracker.event("offload", text, at=stage, moved_bytes=nbytes)
        self.tracker.sample("offload")

    def current_model(self) -> Any:
        """The checkpoint the WebUI runs this job with now."""
        p = self.p
        model = getattr(p, "sd_model", None) if p is not None else None
        if model is None:
            model = self.host.loaded_sd_model()
        return model

    def _plan_fits(self, engine: Any, module: Any, x: torch.Tensor, config: Any, kind: str) -> bool:
        """Whether the engine's plan for this pass fits now; a planning error never fails the pass
        (it then runs as planned by the engine, and an out-of-memory error still moves them)."""
        try:
            return bool(engine.plan_pass(module, x, config=config, kind=kind).fits)
        except (ValueError, RuntimeError, engine.UnsupportedLayout) as exc:
            logger.debug("VRAM Guard: no plan for the idle-model check: %s", exc)
            return True

    # -- closing -----------------------------------------------------------------------------
    def close(self, *, failed: bool = False) -> None:
        """Undo everything this job installed (idempotent, thread-safe); release memory."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.failed = failed
        try:
            cm, self._span = self._span, None
            if cm is not None and threading.get_ident() == self.thread:
                # a failed job failed while this span (e.g. sampling) was open: record it so
                stopped = self.sampling.current if self.sampling is not None else None
                why = getattr(stopped, "error", None) or FAILED_IN_STAGE
                cm.__exit__(*((JobFailed, JobFailed(why), None) if failed else (None, None, None)))
            self.boundary("failure" if failed else "job_end")
            self.timeline.finish()
        finally:
            self.stack.close()
            if self.session is not None:
                self.session.job_closed(self)
        logger.debug("job %s closed (%s)", self.kind, "failed" if failed else "ok")

    def summary(self) -> dict:
        """What the readout and the status route show about this job."""
        # Top-level stages only: the engines open their own stages inside ours (same memory).
        records = [r.to_dict() for r in self.tracker.records if r.depth == 0]
        notes = list(self.notes)
        if self.failed and all(r.get("ok", True) for r in records):
            notes.append(FAILED_OUTSIDE_NOTE)
        return {
            "kind": self.kind,
            "settings": self.settings.describe(),
            "records": records,
            "releases": list(self.releases),
            "plans": dict(self.plans),
            "notes": notes,
            "failed": self.failed,
            "closed": self.closed,
            "timeline": self.timeline.to_dict(),
        }

    def plan_text(self, **_: Any) -> str | None:
        """Infotext value for ``VRAM Guard plan``. Put into ``extra_generation_params`` as a
        callable, so it is evaluated when each image's infotext is written (after the stages ran)."""
        if not self.plans or self.options is None:
            return None
        return to_infotext(self.options, plans=self.plans).get(INFOTEXT_PLAN_KEY)


class JobFailed(RuntimeError):
    """Marks the stage during which the WebUI job failed outside VRAM Guard."""


FAILED_IN_STAGE = "the job stopped with an error in this stage (outside VRAM Guard)"
FAILED_OUTSIDE_NOTE = (
    "The last job failed outside VRAM Guard's stages (e.g. in the sampler or another extension); "
    "the stages listed finished before it."
)


def _unhook(module_ref: weakref.ref) -> None:
    module = module_ref()
    if module is not None:
        remove_hook(module, HOOK_NAME)
