"""The sampling stage inside the WebUI: plan each pass, make room, micro-batch, or stop early.

Before each sampling pass (``process_before_every_sampling``; a pass another extension runs with
VRAM Guard filtered out of its scripts, ADetailer's inpainting, at its first step through
``on_cfg_denoiser``: :meth:`SamplingGuard.step`) :meth:`SamplingGuard.before` plans it
(:func:`.passplan.plan_pass`) and acts in the order of docs/sampling.md ("In the WebUI"): nothing,
micro-batches, the VAE and text encoders off the card for the pass, or a named stop. The stop is
raised by the UNet's first call, not in ``process_before_every_sampling``: the WebUI swallows
errors raised there.

A forward another extension changed (:mod:`.forwards`) is not acted on by the stock estimate: it
runs as the WebUI runs it, its first forward is measured, and an out-of-memory error in it is
answered by the means that never change a picture: the idle parts off the card, micro-batches only
where every part of the forward keeps samples independent, else the one-line stop naming the
extension. The forward is checked again at every call (Kohya's Deep Shrink swaps UNet blocks at
its first step).

The patch (an instance attribute on ``sd_model.model.diffusion_model``) is undone at the end of
the pass (the job's next stage or boundary), on an error (the job's close), at the next run and on
script unload; when another extension wrapped the same forward after us (ControlNet does), ours
turns into a pass-through under theirs and a warning says so once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from contextlib import ExitStack
from typing import Any

import torch

from lib_vram.core import emulate
from lib_vram.core.device import is_oom_error, release
from lib_vram.core.readout import FIRST_FORWARD
from lib_vram.sampling import ATTENTION_WORDS, Finding, ForwardCheck

from .forwards import check_pass
from .host import ask
from .models import model_skip_reason
from .passplan import (
    MiB,
    PassPlan,
    SamplingOutOfMemory,
    _Idle,
    _placed,
    dm_device,
    plan_pass,
)
from .patching import patch_attr

logger = logging.getLogger(__name__)

__all__ = ["PassPlan", "SamplingGuard", "SamplingOutOfMemory"]


class SamplingGuard:
    """The sampling stage of one :class:`~lib_vram.webui.job.Job` (see the module docstring)."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self.stack: ExitStack | None = None
        self.current: PassPlan | None = None
        self.passes: list[PassPlan] = []
        self._patch: Any = None
        self._dm: Any = None
        self._computing: list = []
        """The pass's control models (busy while a UNet forward runs)."""
        self._controls: Any = None
        """The job's :class:`~lib_vram.residency.controlnet.Controls` (ControlNet's models in the owner)."""
        self._seen: Any = None
        """A weak reference to the ``p`` of the last pass :meth:`before` was asked to plan."""

    # -- the pass ----------------------------------------------------------------------------
    def before(self, p: Any, stage: str, *, x: Any = None, c: Any = None, uc: Any = None) -> PassPlan | None:
        """Plan the pass that starts now; make room, install the wrapper (see the module
        docstring). Never raises for a planning problem: the pass then runs as the WebUI runs it."""
        self.end()
        self._seen = _ref(p)
        from .stream import restore_pending

        restore_pending()  # a streamed UNet whose move back could not fit at its pass's end
        job = self.job
        model = job.current_model()
        skip = self._skip_reason(model)
        if skip is not None:
            logger.debug("VRAM Guard: %s not guarded: %s", stage, skip)
            return None
        dm = job.host.unet_of(model).diffusion_model
        cards = job.cards()
        if cards is not None:
            cards.models(model)
            cards.owner.settle()  # parts woken before the pass (the conditioning) go home first
        try:
            check = self._check(p, model, dm)
            planned = plan_pass(
                job, p, stage, model, dm, x=x, c=c, uc=uc, idle=self._movable(p, stage, model),
                ctl=self._job_controls(cards), check=check,
            )  # fmt: skip
        except (ValueError, TypeError, AttributeError, RuntimeError) as exc:
            if is_oom_error(exc):
                raise
            job.warn_once(
                f"sampling-plan-{type(exc).__name__}", f"VRAM Guard: {stage}: no sampling plan ({exc})"
            )
            return None
        planned.p_ref = _ref(p)
        planned.error = planned.error or job.stop_line  # (a preprocessor's model did not fit)
        self.current = planned
        self.passes.append(planned)
        self.stack = ExitStack()
        job.stack.callback(self.end)
        if cards is not None:
            owner = cards.owner
            owner.begin(stage, busy=cards.models(model, ["UNet"]))  # (ControlNet's: while_running)
            self.stack.callback(owner.end, stage)  # what moved for the pass goes home after it
        placed = _placed(job, model)
        if planned.placed and placed is not None:  # (checkpoint placement) its streamer stays in force:
            self.stack.callback(placed.settle)  # a pass cut short leaves no streamed unit on the card
            job.note(f"VRAM Guard: {placed.label}")
        go = planned.error is None  # (a pass the plan stops moves nothing: its first forward says why)
        try:
            if go and planned.moved:
                self._move_off(
                    stage, planned.moved.split(", "), "the sampling plan does not fit with them there"
                )
            if go and planned.stream is not None:  # (first: the room it frees is what the ControlNets need)
                planned.stream.enter(self.stack)
                if cards is not None:
                    for m in cards.models(model, ["UNet"]):
                        why = "the pass does not fit with the whole UNet on the card"
                        self.stack.callback(cards.owner.streams(m, planned.stream.resident_bytes, stage, why))
                job.note(f"VRAM Guard: {stage.replace('_', ' ')}: {planned.stream.describe()}")
            if go and cards is not None and self._controls is not None:
                flow = getattr(planned.stream, "controls", ())  # (streamed block by block)
                self._computing = self._controls.start_pass(planned.controls, stage, self.stack, flow)
            self._install(dm, planned)
        except BaseException as exc:
            self.end()
            if not (isinstance(exc, Exception) and is_oom_error(exc)):
                raise
            planned.error = self._stop_at_move(planned, dm, exc)
        if planned.error is not None and self.stack is None:  # (a move ran out of memory)
            self.stack = ExitStack()
            self._install(dm, planned)  # the pass's first forward raises the line
        self._record(planned)
        return planned

    def _stop_at_move(self, planned: PassPlan, dm: Any, exc: BaseException) -> str:
        """A move the pass needed (a control model, a streamed unit, a part woken) ran out of memory
        in :meth:`before`: everything it moved is back where it was (the stack closed); the pass
        stops at its first forward with one line, not with a traceback in VRAM Guard's hook (the
        WebUI would log it and run on into the same error)."""
        release(dm_device(dm))
        what = "the hires pass" if planned.stage == "hires_sampling" else planned.stage.replace("_", " ")
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        return (
            f"VRAM Guard stopped {what} before it ran out of memory: moving its models onto the card "
            f"for the pass ran out of memory ({first}); nothing was left half-moved. "
            "Fewer ControlNet units, a smaller image or batch may fit"
        )

    def step(self, params: Any) -> PassPlan | None:
        """``on_cfg_denoiser`` (each step, before the UNet runs): a pass whose ``p`` VRAM Guard has
        not planned yet is one another extension runs inside the job without VRAM Guard's script
        (ADetailer filters the scripts of its inpaint passes): plan it now, as a pass of the job."""
        p = getattr(getattr(params, "denoiser", None), "p", None)
        if p is None or (self._seen is not None and self._seen() is p):
            return None
        x = getattr(params, "x", None)
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            x = None
        elif x.shape[0] > 1:  # the UNet's input: cond rows, then one uncond row per image
            x = x[: _rows(getattr(params, "text_uncond", None), x.shape[0] // 2)]
        job = self.job
        job.begin_span("ext_sampling")
        inner = "ADetailer's inpainting" if getattr(p, "_ad_inner", False) else "another extension's pass"
        job.note(f"VRAM Guard: a sampling pass of {inner} runs inside this job: guarded as one of its passes")
        uc = getattr(params, "text_uncond", None)
        return self.before(p, "ext_sampling", x=x, c=getattr(params, "text_cond", None), uc=uc)

    def end(self) -> None:
        """Undo the pass's patch and bring moved parts back (idempotent; the job's next stage or
        boundary, its close, the next pass)."""
        patch, dm = self._patch, self._dm
        stack, self.stack = self.stack, None
        self._patch = self._dm = None
        try:
            if patch is not None and dm is not None and dm.__dict__.get("forward") is not patch:
                self.job.warn_once(
                    "sampling-foreign-forward",
                    "VRAM Guard: another extension wrapped the UNet's forward after VRAM Guard "
                    "(ControlNet?); VRAM Guard's wrapper stays under it as a pass-through",
                )
            if stack is not None:
                stack.close()
        finally:
            self._computing = []

    # -- deciding ----------------------------------------------------------------------------
    def _skip_reason(self, model: Any) -> str | None:
        job = self.job
        if not getattr(job.settings, "guard_sampling", True):
            return "'Guard sampling' is off"
        why = model_skip_reason(model)
        if why is not None:
            return why
        handle = job.host.unet_of(model)
        if handle is None or handle.kind != "ldm":
            return "not an ldm/sgm UNet"
        if _placed(job, model) is not None:
            return None  # (checkpoint placement) streamed blocks are in host memory between forwards
        where = next(handle.diffusion_model.parameters(), None)
        if where is None or where.device.type == "meta":
            return "no weights"
        if where.device.type == "cpu" and emulate.running_here("cpu") is None:
            return "the UNet runs on the CPU"
        return None

    def _check(self, p: Any, model: Any, dm: Any) -> Any:
        """The pass's forward (:func:`.forwards.check_pass`); ControlNet's hook is known where its
        units are in the plan (:mod:`lib_vram.residency.controlnet`)."""
        from lib_vram.residency.controlnet import hook_of

        return check_pass(p, model, dm, controlnet=hook_of(p, dm))

    def _job_controls(self, cards: Any) -> Any:
        """The job's ControlNet models in the owner (:class:`~lib_vram.residency.controlnet.Controls`,
        made at the job's first pass; they go home and leave the owner at the job's end)."""
        if self._controls is None and cards is not None:
            from lib_vram.residency.controlnet import Controls

            self._controls = controls = Controls(cards, self.job)
            self.job.stack.callback(controls.release)
        return self._controls

    def _movable(self, p: Any, stage: str, model: Any) -> _Idle | None:
        """The VAE and text encoders on the card that may leave it for this pass (None: none may).
        Not from a live preview's thread; not the VAE while live previews decode with it during the
        pass; not the text encoders with a Refiner or a hires checkpoint (they compute new
        conditioning mid-job); only the kinds the preset lets move. A placed checkpoint's woken
        parts may always leave (they wake again when used)."""
        job = self.job
        cards = job.cards()
        if cards is None or threading.get_ident() != job.thread:
            return None
        names = {"VAE", "text encoders"}
        if _placed(job, model) is None:
            s = job.settings
            switches = bool(getattr(p, "refiner_checkpoint", None)) or (
                stage == "sampling" and bool(getattr(p, "hr_checkpoint_name", None))
            )
            if switches or not s.offload_text_encoders:
                names.discard("text encoders")
            if bool(ask(job.host, "live_previews_full", False)) or not s.offload_unet:
                names.discard("VAE")
        mine = {id(m) for m in cards.models(model)}  # (reported first when the owner has not seen it)
        cands = [m for m in cards.owner.candidates() if id(m) in mine and m.name in names]
        return _Idle(cands) if cands else None

    # -- acting ------------------------------------------------------------------------------
    def _move_off(self, stage: str, names: list[str], why: str) -> bool:
        """The owner sends ``names`` to host memory for the pass (back after it); False when a move
        ran out of memory (those moved stay off until the pass ends, the pass may run out)."""
        job = self.job
        cards = job.cards()
        model = job.current_model()
        try:
            room = cards.room(stage, model, movable=names, why=f"{stage.replace('_', ' ')}: {why}")
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            room = None
        if room is None:  # out of the except block: what the failed copy held is gone
            release(cards.device())
            job.warn_once(
                "sampling-move-failed",
                f"VRAM Guard: {stage.replace('_', ' ')}: moving the {', '.join(names)} off the card ran out "
                "of memory; they stay (the pass may run out of memory)",
            )
            return False
        text = (
            f"{stage.replace('_', ' ')}: moved the {room.names} ({room.nbytes / 2**30:.2f} GiB) off the card "
            f"for this pass: {why}"
        )
        job.note_moved(stage, text, room.nbytes)
        return bool(room.moved)

    def _install(self, dm: Any, planned: PassPlan) -> None:
        assert self.stack is not None
        guard = self
        state: dict[str, Any] = {"calls": 0, "mb": None}

        def forward(previous: Any, *args: Any, **kwargs: Any) -> Any:
            streamer = planned.stream.streamer if planned.stream is not None else None
            first = state["calls"] == 0
            state["calls"] += 1
            if planned.error is not None:
                raise SamplingOutOfMemory(planned.error)
            if guard._recheck(planned, dm):
                state["mb"] = None  # the forward changed: its runner is made anew
            if state["mb"] is None:
                state["mb"] = guard._runner(planned, previous, streamer)
            while True:
                try:
                    return guard._run(planned, state["mb"], args, kwargs)
                except Exception as exc:
                    if not is_oom_error(exc):
                        raise
                    if streamer is not None:
                        streamer.report(oom=True)  # the next plan for this step keeps fewer units
                    reacted = guard._react(planned, first, _batch_of(args, kwargs))
                    if reacted is None:
                        raise
                # out of the except block: the failed step's tensors are gone with its traceback
                release(dm_device(dm))
                if reacted == "split":
                    state["mb"] = guard._runner(planned, previous, streamer)

        self._patch = patch_attr(dm, "forward", forward, self.stack)
        self._dm = dm

    def _runner(self, planned: PassPlan, previous: Any, streamer: Any) -> Any:
        """What runs one UNet call of the pass: the forward (streamed where the UNet streams), in
        micro-batches where the plan (or a measured pass's reaction) splits it, with the pass's
        control models busy while it runs."""
        from lib_vram.sampling import micro_batched

        inner = previous
        if streamer is not None:
            # each micro-batch is a UNet forward for the streamer (it calls the original
            # forward, which fires none of the UNet module's hooks): the first learns the
            # streamed units' order, prefetch runs from the second micro-batch on
            inner = streamer.forward_of(previous)
        # (through ControlNet's wrapper: each micro-batch computes its rows' control)
        if planned.split is not None:
            run = micro_batched(inner, planned.split)
        elif planned.whole or planned.measured:
            run = inner
        else:
            run = micro_batched(inner, planned.plan.micro_batch, key=planned.plan.key)
        if self._computing:
            from lib_vram.residency.controlnet import while_running

            run = while_running(self._controls.cards.owner, self._computing, run)
        return run

    def _run(self, planned: PassPlan, run: Any, args: tuple, kwargs: dict) -> Any:
        """One UNet call; a measured pass's first call that runs to the end is measured (its peak
        on the card: the job's tracker, a nested stage)."""
        if not planned.measured or planned.measured_bytes is not None:
            return run(*args, **kwargs)
        job = self.job
        with job.tracker.stage(planned.stage + FIRST_FORWARD) as rec:
            out = run(*args, **kwargs)
        planned.measured_bytes, planned.measured_exact = rec.peak_bytes, rec.exact
        self._record_measured(planned)
        return out

    def _recheck(self, planned: PassPlan, dm: Any) -> bool:
        """The forward checked again at a call (extensions change it at a step: Kohya's Deep Shrink
        swaps UNet blocks at the first one). A change the estimate does not model makes the rest of
        the pass a measured one; a part not known to keep samples independent stops its
        micro-batches. True when the pass's runner must change."""
        if planned.p_ref is None:
            return False  # (a pass not planned by :meth:`before`)
        now = self._check(planned.p_ref(), self.job.current_model(), dm)
        seen = {(f.what, f.origin) for f in planned.check.findings}
        # (new ones are not in the pass's plan, HyperTile's and token merging's neither)
        new = [_unmodelled(f) for f in now.findings if (f.what, f.origin) not in seen]
        if not new:
            return False
        now = ForwardCheck(tuple(new))
        planned.check = planned.check + now
        changed = False
        if not now.modelled and not planned.measured:
            planned.measured = planned.check.reason()
            changed = True
        if not now.per_sample and planned.whole is None:
            planned.whole = planned.check.reason()
            planned.split = None
            changed = True
        if changed:
            self.job.note(
                f"VRAM Guard: {planned.stage.replace('_', ' ')}: {planned.check.reason()} from this step "
                f"on: the rest of the pass runs as the WebUI runs it ({planned.label()})",
                logging.WARNING,
            )
            self.job.tracker.note(plan=planned.label())
        return changed

    def _react(self, planned: PassPlan, first: bool, batch: int | None) -> str | None:
        """An out-of-memory error in a UNet call: "moved" when the parts that may move left the card
        (once), "split" when a measured pass whose forward keeps samples independent is split in
        micro-batches (halving from half its batch); None when nothing is left (a predicted pass:
        the error stands; a measured one: the one-line stop naming the extension). A predicted
        pass reacts only in its first step: its micro-batches already halve on their own."""
        if not (first or planned.measured):
            return None
        if not planned.moved:
            idle = self._movable(self.job.p, planned.stage, self.job.current_model())
            why = f"its {'first ' if first else ''}step ran out of memory with them there"
            if idle is not None and self._move_off(planned.stage, idle.names.split(", "), why):
                planned.moved = idle.names
                self.job.tracker.note(plan=f"{planned.label()} after OOM")
                return "moved"
        if not planned.measured:
            return None
        if planned.whole is None and planned.split is None and batch is not None and batch > 1:
            planned.split = max(1, batch // 2)
            self.job.tracker.note(plan=f"{planned.label()} after OOM")
            self.job.note(
                f"VRAM Guard: {planned.stage.replace('_', ' ')} ran out of memory with its whole batch: "
                f"it runs in micro-batches of {planned.split} (halving further if needed); each sample "
                f"is computed alone by every part of its forward ({planned.measured})"
            )
            return "split"
        raise SamplingOutOfMemory(_measured_stop(planned)) from None

    def _record(self, planned: PassPlan) -> None:
        """The prediction onto the pass's stage (the readout shows it next to the measured peak),
        a note, and the infotext's plan entry when VRAM Guard changed something."""
        job = self.job
        plan = planned.plan
        stage, label = planned.stage, planned.label()
        words = stage.replace("_", " ")
        if planned.measured:
            job.tracker.note(plan=label, stock_predicted_bytes=plan.predicted_peak_bytes, batch=planned.batch)
            job.note(
                f"VRAM Guard: {words}: runs as the WebUI runs it and is planned from its measured first "
                f"step, not from a prediction: {planned.measured} (the stock UNet's prediction, "
                f"{plan.predicted_peak_bytes / MiB:.0f} MiB, does not apply)"
            )
            return
        predicted = f"predicted {plan.predicted_peak_bytes / MiB:.0f} MiB"
        peak = f"{words}: predicted peak {plan.predicted_peak_bytes / MiB:.0f} MiB"
        job.tracker.note(
            plan=f"{label} ({predicted})" if planned.error is None else f"stopped: {predicted}",
            predicted_bytes=plan.predicted_peak_bytes,
            predicted_activation_bytes=plan.activation_bytes,
            micro_batch=plan.micro_batch,
            batch=planned.batch,
        )
        job.tracker.event("plan", f"{peak} ({label})", at=stage, predicted_bytes=plan.predicted_peak_bytes)
        h, w = planned.latent_hw
        attention = ATTENTION_WORDS.get(planned.attention, planned.attention)
        job.note(
            f"VRAM Guard: {peak} (UNet {plan.weights_bytes / MiB:.0f} MiB, "
            f"activations {plan.activation_bytes / MiB:.0f} MiB) "
            f"for {planned.batch} sample(s) of {w * 8}x{h * 8} px, {attention} attention: "
            + (label if planned.error is None else "does not fit")
        )
        if planned.changed and planned.error is None:
            job.plans[stage] = label
        if planned.error is not None:
            job.note(planned.error, logging.WARNING)  # (the line starts "VRAM Guard stopped ...")

    def _record_measured(self, planned: PassPlan) -> None:
        """A measured pass's first forward ran: its peak onto the pass's stage and the timeline."""
        job = self.job
        at_most = "" if planned.measured_exact else "at most "
        mib = planned.measured_bytes / MiB
        words = planned.stage.replace("_", " ")
        job.tracker.note(plan=planned.label(), measured_bytes=planned.measured_bytes)
        job.tracker.event(
            "plan",
            f"{words}: first step measured at {at_most}{mib:.0f} MiB ({planned.measured})",
            at=planned.stage,
            measured_bytes=planned.measured_bytes,
        )
        if planned.changed:
            job.plans[planned.stage] = planned.label()


def _unmodelled(f: Finding) -> Finding:
    return dataclasses.replace(f, known=dataclasses.replace(f.known, modelled=False))


def _ref(p: Any) -> Any:
    try:
        return weakref.ref(p)
    except TypeError:
        return lambda: p


def _rows(cond: Any, default: int) -> int:
    """The rows of a conditioning (a tensor, or SDXL's dict of them): one per image."""
    if isinstance(cond, dict):
        cond = cond.get("crossattn")
    return int(cond.shape[0]) if isinstance(cond, torch.Tensor) and cond.dim() > 1 else default


def _batch_of(args: tuple, kwargs: dict) -> int | None:
    """The batch of a UNet call (its latent's first dimension)."""
    x = args[0] if args else kwargs.get("x")
    shape = getattr(x, "shape", None)
    return int(shape[0]) if shape else None


def _measured_stop(planned: PassPlan) -> str:
    """The one line of a measured pass that ran out of memory with nothing left to try."""
    what = "the hires pass" if planned.stage == "hires_sampling" else planned.stage.replace("_", " ")
    off = f" and the {planned.moved} off the card" if planned.moved else ""
    how = "in micro-batches of 1" if planned.split is not None else "with its whole batch"
    split = (
        "" if planned.split is not None or planned.whole is None else ", whose batch VRAM Guard never splits"
    )
    return (
        f"VRAM Guard stopped {what}: it ran out of memory {how}{off}; {planned.measured}{split}. "
        "A smaller image or batch (fewer frames) may fit"
    )
