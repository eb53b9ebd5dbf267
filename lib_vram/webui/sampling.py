"""The sampling stage inside the WebUI: plan each pass, make room, micro-batch, or stop early.

Before each sampling pass (``process_before_every_sampling``) :meth:`SamplingGuard.before` plans
it with :func:`lib_vram.sampling.plan_sampling` from the live UNet and acts in the order of
docs/sampling.md ("In the WebUI"): nothing, micro-batches, the VAE and text encoders off the card
for the pass, or a named stop. The stop is raised by the UNet's first call, not in
``process_before_every_sampling``: the WebUI swallows errors raised there.

The patch (an instance attribute on ``sd_model.model.diffusion_model``) is undone at the end of
the pass (the job's next stage or boundary), on an error (the job's close), at the next run and on
script unload; when another extension wrapped the same forward after us (ControlNet does), ours
turns into a pass-through under theirs and a warning says so once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from lib_vram.core import emulate
from lib_vram.core.device import free_bytes, is_oom_error, release

from .host import ask
from .models import model_skip_reason
from .patching import patch_attr

logger = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_TOKENS = 77
"""Context tokens when the conditioning does not tell (one prompt chunk: 75 + 2)."""


class SamplingOutOfMemory(RuntimeError):
    """Nothing VRAM Guard can do fits the sampling pass: one line saying what it needs, what the
    card has and what would fit. Contains "out of memory" so that
    :func:`lib_vram.core.device.is_oom_error` (and a user searching the log) recognise it."""


@dataclass
class PassPlan:
    """What :meth:`SamplingGuard.before` decided for one pass (readout, infotext, tests)."""

    stage: str
    batch: int
    latent_hw: tuple[int, int]
    context_tokens: int
    attention: str
    dtype: torch.dtype
    budget_bytes: int
    plan: Any
    """The :class:`lib_vram.sampling.SamplingPlan` in force."""
    moved: str = ""
    """Names of the parts moved off the card for the pass ("" when none)."""
    error: str | None = None
    """The named error's line when nothing fits."""
    stream: Any = None
    """The :class:`lib_vram.webui.stream.StreamPass` when the UNet streams for this pass."""
    placed: str = ""
    """The checkpoint placement's label when the checkpoint is placed (:mod:`.placement`)."""
    controls: list = dataclasses.field(default_factory=list)
    """The ControlNet units the pass runs (:class:`lib_vram.residency.controlnet.Unit`)."""
    whole: str | None = None
    """Why the pass cannot micro-batch (:func:`lib_vram.residency.controlnet.whole_batch`)."""

    @property
    def changed(self) -> bool:
        """VRAM Guard changed how the pass runs (micro-batches, moves or streaming)."""
        streams = self.stream is not None or bool(self.placed)
        return self.plan.micro_batch < self.batch or bool(self.moved) or streams

    def label(self) -> str:
        if self.stream is not None and not self.placed:
            parts = [self.stream.label]  # (says the micro-batch the streamed pass runs at)
        else:
            parts = [self.plan.label if self.plan.micro_batch < self.batch else f"batch {self.batch}"]
        if self.moved:
            parts.append(f"{self.moved} off the card")
        if self.placed:
            parts += [self.stream.label, self.placed] if self.stream is not None else [self.placed]
        if self.controls:
            n = len(self.controls)
            parts.append(f"{n} ControlNet unit{'s' if n > 1 else ''} on the card")
        return ", ".join(parts)


def context_tokens(*conds: Any) -> int:
    """The longest token count of the WebUI's conditioning objects (``c``/``uc`` of
    ``process_before_every_sampling``: a ``MulticondLearnedConditioning`` or a list of
    ``ScheduledPromptConditioning`` schedules; SD1/2: a ``[tokens, dim]`` tensor, SDXL: a dict
    with ``crossattn``). :data:`DEFAULT_TOKENS` when none is found."""
    return max((_tokens(c, depth=0) or 0 for c in conds), default=0) or DEFAULT_TOKENS


def _tokens(obj: Any, depth: int) -> int | None:
    if depth > 6 or obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        return int(obj.shape[-2]) if obj.dim() >= 2 else None
    if isinstance(obj, dict):
        return _tokens(obj.get("crossattn"), depth + 1)
    if isinstance(obj, (list, tuple)):
        return max((n for o in obj[:8] if (n := _tokens(o, depth + 1))), default=None)
    for attr in ("batch", "schedules", "cond"):
        if hasattr(obj, attr):
            return _tokens(getattr(obj, attr), depth + 1)
    return None


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

    # -- the pass ----------------------------------------------------------------------------
    def before(self, p: Any, stage: str, *, x: Any = None, c: Any = None, uc: Any = None) -> PassPlan | None:
        """Plan the pass that starts now; make room, install the wrapper (see the module
        docstring). Never raises for a planning problem: the pass then runs as the WebUI runs it."""
        self.end()
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
            planned = self._plan(p, stage, model, dm, x, c, uc)
        except (ValueError, TypeError, AttributeError, RuntimeError) as exc:
            if is_oom_error(exc):
                raise
            job.warn_once(
                f"sampling-plan-{type(exc).__name__}", f"VRAM Guard: {stage}: no sampling plan ({exc})"
            )
            return None
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
        try:
            if planned.moved:
                self._move_off(
                    stage, planned.moved.split(", "), "the sampling plan does not fit with them there"
                )
            if planned.stream is not None:  # (first: the room it frees is what the ControlNets need)
                planned.stream.enter(self.stack)
                if cards is not None:
                    for m in cards.models(model, ["UNet"]):
                        why = "the pass does not fit with the whole UNet on the card"
                        self.stack.callback(cards.owner.streams(m, planned.stream.resident_bytes, stage, why))
                job.note(f"VRAM Guard: {stage.replace('_', ' ')}: {planned.stream.describe()}")
            if cards is not None and self._controls is not None:
                self._computing = self._controls.start_pass(planned.controls, stage, self.stack)
            self._install(dm, planned)
        except BaseException:
            self.end()
            raise
        self._record(planned)
        return planned

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

    def _plan(self, p: Any, stage: str, model: Any, dm: Any, x: Any, c: Any, uc: Any) -> PassPlan:
        from lib_vram import sampling
        from lib_vram.residency.controlnet import whole_batch

        job = self.job
        host = job.host
        spec = sampling.unet_spec(dm)
        images, hw = _latent_of(p, x)
        cond_uncond = bool(ask(host, "batch_cond_uncond", True))
        batch = images * (2 if cond_uncond else 1)
        tokens = context_tokens(c, uc)
        placed = _placed(job, model)  # (checkpoint placement) its device, not a streamed block's
        device = placed.device if placed is not None else next(dm.parameters()).device
        backend = "cpu" if device.type == "cpu" else "cuda"
        attention = _attention(host, backend)
        dtype = _dtype_of(host, dm)
        free = free_bytes(device)
        unet_bytes = emulate.module_bytes([dm])
        idle = self._movable(p, stage, model)
        cards = job.cards()
        parts = cards.models(model, ["text encoders", "VAE"]) if cards is not None else []
        others = sum(m.card_bytes for m in parts)
        margin = int(getattr(job.settings, "sampling_margin_bytes", 0))
        # ControlNet's units of the pass: their weights and activations in the plan (on the card
        # for the pass, see lib_vram.residency.controlnet); the job's models on the card now count free
        ctl = self._job_controls(cards)
        used, controls, unsized, on_card = (
            ctl.plan_pass(p, dm, stage == "hires_sampling") if ctl else ([], (), 0, 0)
        )
        others += unsized
        free += on_card
        whole = whole_batch(p, dm) if used else None  # (a unit that cannot split: the pass runs whole)
        # the checkpoint placement (issue 22 item 2): its streamer is the UNet's; plan with what
        # it keeps on the card (resident part + stream buffer; the plans count the whole UNet: inflate);
        # a pass that is short streams more of it with a second streamer for the pass (_more_streamed)
        resident = placed.unet_resident_bytes if placed is not None else unet_bytes
        budget = max(0, free + resident + others - margin)
        inflate = max(0, unet_bytes - placed.unet_device_bytes) if placed is not None else 0
        kw = dict(
            batch=batch, latent_hw=hw, context_tokens=tokens, attention=attention, dtype=dtype,
            budget_bytes=budget + inflate, backend=backend, controls=controls, whole=whole is not None,
        )  # fmt: skip
        plan = sampling.plan_sampling(spec, resident_bytes=others, **kw)
        moved, rest = "", others
        if not plan.fits and idle is not None:
            # the owner chooses the fewest bytes of them whose leaving lets the plan fit
            def fits(freed: int) -> bool:
                return sampling.plan_sampling(spec, resident_bytes=max(0, others - freed), **kw).fits

            chosen = cards.owner.choose(idle.models, fits)
            if chosen is not None:
                rest = max(0, others - sum(m.card_bytes for m in chosen))
                plan = sampling.plan_sampling(spec, resident_bytes=rest, **kw)
                moved = ", ".join(m.name for m in chosen)
        error = streamed = None
        if placed is not None:  # (checkpoint placement) its numbers; more of its UNet streams if short
            more = None
            if not plan.fits:
                more, plan = _more_streamed(placed, dm, spec, plan, kw, rest)
            plan = dataclasses.replace(plan, predicted_peak_bytes=plan.predicted_peak_bytes - inflate)
            if not plan.fits:
                error = _placed_error(stage, plan, placed, budget, idle, whole)
            args = (stage, batch, hw, tokens, attention, dtype, budget, plan, moved, error, more)
            return PassPlan(*args, placed.label, used, whole)
        base = plan
        if not plan.fits:
            # the last rung before the named error: stream the UNet (lib_vram.webui.stream)
            from .stream import plan_pass

            base, rest = plan, others
            if idle is not None and not moved:
                base = sampling.plan_sampling(spec, resident_bytes=max(0, others - idle.nbytes), **kw)
                rest = max(0, others - idle.nbytes)
            streamed = plan_pass(
                model, dm, spec, base, latent_hw=hw, context_tokens=tokens, attention=attention,
                dtype=dtype, budget_bytes=budget, resident_bytes=rest, backend=backend, settings=job.settings,
                controls=controls, whole=whole is not None,
            )  # fmt: skip
            if streamed is not None:
                # the readout's prediction for the pass: the resident part of the UNet, the
                # streaming buffers, the activations, the inputs and what else stays on the card
                # the pass runs at the streamed plan's micro-batch (the one moving the fewest bytes)
                sp = streamed.plan
                peak = sp.resident_bytes + sp.buffer_bytes + sp.activation_bytes + base.input_bytes + rest
                plan = dataclasses.replace(
                    base,
                    predicted_peak_bytes=peak,
                    micro_batch=sp.micro_batch,
                    activation_bytes=sp.activation_bytes,
                    label=(
                        f"micro-batch {sp.micro_batch} of {batch}"
                        if sp.micro_batch < batch
                        else f"batch {batch} in one forward"
                    ),
                )
                if idle is not None and not moved:
                    moved = idle.names
        if not plan.fits and streamed is None:
            # what would fit is said for the card VRAM Guard would give the pass: the idle parts
            # off it where they may move (with them counted, the UNet's weights plus them can
            # exceed the budget and the line said "no size or batch does" where a smaller one fits)
            error = _error_line(stage, base, idle, whole)
            plan = base  # the readout's "stopped: predicted N MiB" gives the line's numbers
        args = (stage, batch, hw, tokens, attention, dtype, budget, plan, moved, error, streamed)
        return PassPlan(*args, controls=used, whole=whole)

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
        from lib_vram.sampling import micro_batched

        assert self.stack is not None
        if "forward" in dm.__dict__ and not planned.controls:  # (not ControlNet's: the job knows it)
            other = dm.__dict__["forward"]
            self.job.warn_once(
                "sampling-wrapped-before",
                "VRAM Guard: another extension wraps the UNet's forward "
                f"({getattr(other, '__qualname__', type(other).__name__)}); VRAM Guard's micro-batches "
                "run through it",
            )
        guard = self
        state = {"calls": 0, "mb": None}

        def forward(previous: Any, *args: Any, **kwargs: Any) -> Any:
            streamer = planned.stream.streamer if planned.stream is not None else None
            first = state["calls"] == 0
            state["calls"] += 1
            if planned.error is not None:
                raise SamplingOutOfMemory(planned.error)
            if state["mb"] is None:
                inner = previous
                if streamer is not None:
                    # each micro-batch is a UNet forward for the streamer (it calls the original
                    # forward, which fires none of the UNet module's hooks): the first learns the
                    # streamed units' order, prefetch runs from the second micro-batch on
                    inner = streamer.forward_of(previous)
                # (through ControlNet's wrapper: each micro-batch computes its rows' control)
                mb_of = planned.plan.micro_batch
                state["mb"] = inner if planned.whole else micro_batched(inner, mb_of, key=planned.plan.key)
                if guard._computing:
                    from lib_vram.residency.controlnet import while_running

                    state["mb"] = while_running(guard._controls.cards.owner, guard._computing, state["mb"])
            mb = state["mb"]
            try:
                return mb(*args, **kwargs)
            except Exception as exc:
                if streamer is not None and is_oom_error(exc):
                    streamer.report(oom=True)  # the next plan for this step keeps fewer units
                if not (first and is_oom_error(exc) and guard._react(planned)):
                    raise
            # out of the except block: the failed step's tensors are gone with its traceback
            release(dm_device(dm))
            return mb(*args, **kwargs)

        self._patch = patch_attr(dm, "forward", forward, self.stack)
        self._dm = dm

    def _react(self, planned: PassPlan) -> bool:
        """An out-of-memory error in the pass's first step even at micro-batch 1: the parts that
        may move leave the card (once); True when something moved."""
        if planned.moved:
            return False
        idle = self._movable(self.job.p, planned.stage, self.job.current_model())
        if idle is None:
            return False
        if not self._move_off(
            planned.stage, idle.names.split(", "), "its first step ran out of memory with them there"
        ):
            return False
        planned.moved = idle.names
        self.job.tracker.note(plan=f"{planned.label()} after OOM")
        return True

    def _record(self, planned: PassPlan) -> None:
        """The prediction onto the pass's stage (the readout shows it next to the measured peak),
        a note, and the infotext's plan entry when VRAM Guard changed something."""
        job = self.job
        plan = planned.plan
        stage, label = planned.stage, planned.label()
        predicted = f"predicted {plan.predicted_peak_bytes / MiB:.0f} MiB"
        peak = f"{stage.replace('_', ' ')}: predicted peak {plan.predicted_peak_bytes / MiB:.0f} MiB"
        job.tracker.note(
            plan=f"{label} ({predicted})" if planned.error is None else f"stopped: {predicted}",
            predicted_bytes=plan.predicted_peak_bytes,
            predicted_activation_bytes=plan.activation_bytes,
            micro_batch=plan.micro_batch,
            batch=planned.batch,
        )
        job.tracker.event("plan", f"{peak} ({label})", at=stage, predicted_bytes=plan.predicted_peak_bytes)
        h, w = planned.latent_hw
        job.note(
            f"VRAM Guard: {peak} (UNet {plan.weights_bytes / MiB:.0f} MiB, "
            f"activations {plan.activation_bytes / MiB:.0f} MiB) "
            f"for {planned.batch} sample(s) of {w * 8}x{h * 8} px, {planned.attention} attention: "
            + (label if planned.error is None else "does not fit")
        )
        if planned.changed and planned.error is None:
            job.plans[stage] = label
        if planned.error is not None:
            job.note(planned.error, logging.WARNING)  # (the line starts "VRAM Guard stopped ...")


@dataclasses.dataclass
class _Idle:
    """The owner's models that may leave the card for a pass."""

    models: list

    @property
    def names(self) -> str:
        return ", ".join(m.name for m in self.models)

    @property
    def nbytes(self) -> int:
        return sum(m.card_bytes for m in self.models)


def _placed(job: Any, model: Any) -> Any:
    """The checkpoint placement's :class:`~lib_vram.webui.placed.Placed` of ``model``, or None."""
    placement = getattr(getattr(job, "session", None), "placement", None)
    return placement.placed_for(model) if placement is not None else None


def _more_streamed(placed: Any, dm: Any, spec: Any, plan: Any, kw: dict, rest: int) -> tuple[Any, Any]:
    """A placed checkpoint's pass that does not fit (``plan``, made with ``kw``'s budget raised by
    what the placement does not keep on the card): resident units of its UNet that stream for this
    pass as well (:class:`~.stream.MoreStreamed`) and the plan with the room they free; (None,
    ``plan``) when even streaming every resident unit is not enough. Of the micro-batches, the one
    whose shortfall costs the fewest bytes streamed per step (both streamers' bytes x forwards)."""
    from lib_vram import sampling

    from .stream import MoreStreamed

    units = sampling.unit_bytes(dm)
    already = placed.plan.unet_bytes - placed.unet_resident_bytes
    best = None
    for c in plan.candidates:
        got = sampling.more_streamed(units, placed.plan.resident, c.peak_bytes - kw["budget_bytes"])
        if got and got[0]:
            cost = ((already + got[1]) * -(-plan.batch // c.batch), -c.batch)
            best = min(best, (cost, got)) if best is not None else (cost, got)
    if best is None:
        return None, plan
    names, nbytes, buffer = best[1]
    freed = nbytes - buffer
    kw = {**kw, "budget_bytes": kw["budget_bytes"] + freed}
    wider = sampling.plan_sampling(spec, resident_bytes=rest, **kw)
    if not wider.fits:
        return None, plan
    wider = dataclasses.replace(wider, predicted_peak_bytes=wider.predicted_peak_bytes - freed)
    return MoreStreamed(names, dm, placed.device, placed=placed, nbytes=nbytes, buffer_bytes=buffer), wider


def _placed_error(stage: str, plan: Any, placed: Any, budget: int, idle: Any, whole: str | None) -> str:
    """The named error's line for a placed checkpoint's pass that does not fit even so."""
    off = f", the {idle.names} off the card" if idle is not None else ""
    # the suggestion's sizes and batches are right (the budget was raised by what the UNet does not
    # keep on the card); its head's MiB are not: ours replace them
    rest = plan.suggestion.split(": ", 1)[1] if plan.suggestion and ": " in plan.suggestion else ""
    fit = rest or "a smaller image or batch may fit"
    need = f"needs {plan.predicted_peak_bytes / MiB:.0f} MiB, the card offers {budget / MiB:.0f} MiB"
    return _stopped(stage, whole, f", {placed.label}{off}", f"{need}: {fit}")


def dm_device(dm: Any) -> torch.device:
    """Where the UNet computes: its first weight off the CPU (a placed checkpoint's streamed blocks
    are in host memory between forwards), else the CPU."""
    return next((t.device for t in dm.parameters() if t.device.type != "cpu"), torch.device("cpu"))


def _attention(host: Any, backend: str) -> str:
    """The modelled attention for the optimization the WebUI applied (``none`` when it applied
    none; ``Automatic`` resolved as the WebUI does when the host cannot tell)."""
    from lib_vram.sampling import attention_of

    name = ask(host, "cross_attention", None)
    if name is None:
        return attention_of("Automatic", backend=backend)
    if not str(name).strip():
        return "none"
    try:
        return attention_of(str(name), backend=backend)
    except ValueError:
        logger.info("VRAM Guard: unknown cross-attention optimization %r: planned as sdp", name)
        return "sdp"


def _dtype_of(host: Any, dm: Any) -> torch.dtype:
    """The dtype the UNet computes in: the WebUI's ``devices.dtype_unet`` (what ``apply_model``
    casts its inputs to) where it is a float type, else the UNet's weights'."""
    state = ask(host, "unet_state", None)
    dtype = getattr(state, "dtype_unet", None)
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return dtype
    first = next(dm.parameters(), None)
    return first.dtype if first is not None and first.is_floating_point() else torch.float16


def _latent_of(p: Any, x: Any) -> tuple[int, tuple[int, int]]:
    """Images of the batch and the latent size of the pass: from the latent the pass starts from
    (``x`` of ``process_before_every_sampling``), else from ``p``."""
    if isinstance(x, torch.Tensor) and x.dim() == 4:
        return int(x.shape[0]), (int(x.shape[-2]), int(x.shape[-1]))
    images = int(getattr(p, "batch_size", 1) or 1)
    hr = getattr(p, "is_hr_pass", False)  # (the hires pass: its target size where set)
    h = int((hr and getattr(p, "hr_upscale_to_y", 0)) or getattr(p, "height", 512))
    w = int((hr and getattr(p, "hr_upscale_to_x", 0)) or getattr(p, "width", 512))
    return images, (max(1, h // 8), max(1, w // 8))


def _stopped(stage: str, whole: str | None, tried: str, text: str) -> str:
    """The named error's line: what the pass tried (micro-batch 1, or its whole batch where a
    ControlNet unit cannot split; then ``tried``) and ``text``."""
    what = "the hires pass" if stage == "hires_sampling" else "sampling"
    how = f"with the whole batch, as {whole}" if whole else "with micro-batch 1"
    return f"VRAM Guard stopped {what} before it ran out of memory ({how}{tried}): {text}"


def _error_line(stage: str, plan: Any, idle: Any, whole: str | None = None) -> str:
    text = plan.suggestion or (
        f"needs {plan.predicted_peak_bytes / MiB:.0f} MiB, the card offers {plan.budget_bytes / MiB:.0f} MiB"
    )
    return _stopped(stage, whole, f" and the {idle.names} off the card" if idle is not None else "", text)
