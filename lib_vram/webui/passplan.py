"""One sampling pass's plan in the WebUI: what VRAM Guard predicts, and what it does about it.

:func:`plan_pass` reads the live UNet, the batch the sampler feeds it, the latent, the prompt's
tokens, the attention the WebUI applied, the dtype and the free memory, and decides in the order
of docs/sampling.md ("In the WebUI"): nothing, micro-batches, the VAE and text encoders off the
card for the pass, the streamed UNet, or the named error (:class:`SamplingOutOfMemory`). A
forward the estimate does not model (:mod:`.forwards`: another extension changed it) gets none of
that: it runs as the WebUI runs it and is planned from its measured first forward (:func:`_measured`,
:class:`~.sampling.SamplingGuard`). :class:`PassPlan` is the result the guard acts on and the
readout shows.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from lib_vram.core import emulate
from lib_vram.core.device import free_bytes
from lib_vram.sampling import ForwardCheck

from .host import ask

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
    """What :meth:`~.sampling.SamplingGuard.before` decided for one pass (readout, infotext, tests)."""

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
    """Why the pass cannot micro-batch (:func:`lib_vram.residency.controlnet.whole_batch`, or a
    forward not known to keep samples independent)."""
    check: ForwardCheck = dataclasses.field(default_factory=ForwardCheck)
    """The pass's forward (:func:`.forwards.check_pass`)."""
    measured: str | None = None
    """Why the pass runs on its measured rather than its predicted peak (a forward the estimate
    does not model: ``check.reason()``); None for a predicted pass."""
    measured_bytes: int | None = None
    """The measured peak of its first forward that ran to the end (None until then)."""
    measured_exact: bool = True
    """False when that forward stayed below an earlier peak of the job: the peak is at most
    ``measured_bytes`` (the high-water mark so far), see :mod:`lib_vram.core.tracker`."""
    split: int | None = None
    """A measured pass split into micro-batches of this many samples after an out-of-memory error."""
    p_ref: Any = None
    """A weak reference to the pass's ``p``."""

    @property
    def changed(self) -> bool:
        """VRAM Guard changed how the pass runs (micro-batches, moves or streaming)."""
        streams = self.stream is not None or bool(self.placed)
        return self.micro_batch < self.batch or bool(self.moved) or streams

    @property
    def micro_batch(self) -> int:
        """Samples per UNet forward as the pass runs them."""
        return self.split if self.split is not None else self.plan.micro_batch

    def label(self) -> str:
        if self.stream is not None and not self.placed:
            parts = [self.stream.label]  # (says the micro-batch the streamed pass runs at)
        else:
            mb = self.micro_batch
            parts = [f"micro-batch {mb} of {self.batch}" if mb < self.batch else f"batch {self.batch}"]
        if self.moved:
            parts.append(f"{self.moved} off the card")
        if self.placed:
            parts += [self.stream.label, self.placed] if self.stream is not None else [self.placed]
        flow = {id(u.module) for u in getattr(self.stream, "controls", ())}  # (streamed: the stream's label)
        if n := sum(id(u.module) not in flow for u in self.controls):
            parts.append(f"{n} ControlNet unit{'s' if n > 1 else ''} on the card")
        if self.measured:
            parts.append("measured, not predicted")
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


def plan_pass(
    job: Any, p: Any, stage: str, model: Any, dm: Any, *, x: Any, c: Any, uc: Any, idle: _Idle | None,
    ctl: Any, check: ForwardCheck,
) -> PassPlan:  # fmt: skip
    """Plan one sampling pass (docs/sampling.md, "In the WebUI"): the plan in force, what leaves the
    card, the streamed UNet or the named error. ``idle``: the parts that may leave the card for it;
    ``ctl``: the job's ControlNet models (or None); ``check``: its forward
    (:func:`.forwards.check_pass`): a forward the estimate does not model runs as the WebUI runs
    it, planned from its measured first forward (:func:`_measured`)."""
    from lib_vram import sampling
    from lib_vram.residency.controlnet import whole_batch

    from .selfattn import read

    # the WebUI's HyperTile and token merging, IP-Adapter, as the UNet carries them for this pass
    sa, check, random_tiles = read(model, dm, check, p)
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
    cards = job.cards()
    parts = cards.models(model, ["text encoders", "VAE"]) if cards is not None else []
    others = sum(m.card_bytes for m in parts)
    margin = int(getattr(job.settings, "sampling_margin_bytes", 0))
    # ControlNet's units of the pass: their weights and activations in the plan (on the card
    # for the pass, see lib_vram.residency.controlnet); the job's models on the card now count free
    used, controls, unsized, on_card = (
        ctl.plan_pass(p, dm, stage == "hires_sampling") if ctl else ([], (), 0, 0)
    )
    others += unsized
    free += on_card
    whole = whole_batch(p, dm) if used else None  # (a unit that cannot split: the pass runs whole)
    if whole is None and not check.per_sample:
        whole = check.reason()
    whole = whole or random_tiles
    # the checkpoint placement (issue 22 item 2): its streamer is the UNet's; plan with what
    # it keeps on the card (resident part + stream buffer; the plans count the whole UNet: inflate);
    # a pass that is short streams more of it with a second streamer for the pass (_more_streamed)
    resident = placed.unet_resident_bytes if placed is not None else unet_bytes
    budget = max(0, free + resident + others - margin)
    inflate = max(0, unet_bytes - placed.unet_device_bytes) if placed is not None else 0
    kw = dict(
        batch=batch, latent_hw=hw, context_tokens=tokens, attention=attention, dtype=dtype,
        budget_bytes=budget + inflate, backend=backend, controls=controls, whole=whole is not None,
        self_attention=sa,
    )  # fmt: skip
    plan = sampling.plan_sampling(spec, resident_bytes=others, **kw)
    if not check.modelled:
        stock = dataclasses.replace(plan, predicted_peak_bytes=plan.predicted_peak_bytes - inflate)
        planned = PassPlan(stage, batch, hw, tokens, attention, dtype, budget, stock)
        planned.placed = placed.label if placed is not None else ""
        return _measured(planned, used, whole, check)
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
            more, plan = _more_streamed(placed, dm, spec, plan, kw, rest, used)
        plan = dataclasses.replace(plan, predicted_peak_bytes=plan.predicted_peak_bytes - inflate)
        if not plan.fits:
            error = _placed_error(stage, plan, placed, budget, idle, whole)
        args = (stage, batch, hw, tokens, attention, dtype, budget, plan, moved, error, more)
        return PassPlan(*args, placed.label, used, whole, check=check)
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
            controls=controls, whole=whole is not None, self_attention=sa,
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
    return PassPlan(*args, controls=used, whole=whole, check=check)


def _measured(planned: PassPlan, used: list, whole: str | None, check: ForwardCheck) -> PassPlan:
    """A pass whose forward the estimate does not model: the whole batch in one forward, nothing
    moved, no stop; the stock plan stays for its prediction only (the readout shows both)."""
    planned.controls, planned.whole, planned.check = used, whole, check
    planned.measured = check.reason()
    planned.plan = dataclasses.replace(
        planned.plan, micro_batch=planned.batch, fits=True, suggestion=None, label=f"batch {planned.batch}"
    )
    return planned


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


def _more_streamed(
    placed: Any, dm: Any, spec: Any, plan: Any, kw: dict, rest: int, used: list = ()
) -> tuple[Any, Any]:  # fmt: skip
    """A placed checkpoint's pass that does not fit (``plan``, made with ``kw``'s budget raised by
    what the placement does not keep on the card): resident units of its UNet that stream for this
    pass as well (:class:`~.stream.MoreStreamed`) and the plan with the room they free; where that
    is not enough, the pass's cldm control models (``used``), the largest first, stream block by
    block too (:func:`lib_vram.residency.controlnet.stream`; each frees its weights less its own
    buffer, its two largest blocks); (None, ``plan``) when even streaming all of them is not enough
    (:func:`~lib_vram.sampling.more_streamed_pass` picks the micro-batch)."""
    from lib_vram import sampling
    from lib_vram.residency.controlnet import distinct

    from .stream import MoreStreamed

    already = placed.plan.unet_bytes - placed.unet_resident_bytes
    ctl = []  # (unit, its bytes, what streaming it frees), the largest first
    for u in distinct(used) if used else ():
        if u.spec is not None:
            net = getattr(u.module, "control_model", u.module)
            sizes = sorted((b for _, b in sampling.unit_bytes(net)), reverse=True)
            ctl.append((u, sum(sizes), sum(sizes) - sum(sizes[:2])))
    ctl.sort(key=lambda c: -c[1])
    units = sampling.unit_bytes(dm)
    for k in range(len(ctl) + 1):
        ctl_bytes, ctl_freed = sum(c[1] for c in ctl[:k]), sum(c[2] for c in ctl[:k])
        got = sampling.more_streamed_pass(
            units, placed.plan.resident, plan, already, freed_bytes=ctl_freed, streamed_bytes=ctl_bytes
        )
        if got is None:
            continue
        names, nbytes, buffer = got
        freed = nbytes - buffer + ctl_freed
        wider = sampling.plan_sampling(
            spec, resident_bytes=rest, **{**kw, "budget_bytes": kw["budget_bytes"] + freed}
        )
        if wider.fits:
            wider = dataclasses.replace(wider, predicted_peak_bytes=wider.predicted_peak_bytes - freed)
            args = dict(placed=placed, nbytes=nbytes, buffer_bytes=buffer, controls=[c[0] for c in ctl[:k]])
            return MoreStreamed(names, dm, placed.device, control_bytes=ctl_bytes, **args), wider
    return None, plan


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
