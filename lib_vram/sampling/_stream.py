"""Budgeted UNet residency: keep what the budget holds on the card, stream the other blocks.

When the sampling stage does not fit even at micro-batch 1 with the idle parts off the card, the
UNet's weights are what is left to give. The UNet's forward touches its top-level *units* in a
fixed order (ldm/sgm ``UNetModel``: ``time_embed``, ``label_emb``, ``input_blocks[i]``,
``middle_block``, ``output_blocks[i]``, ``out``). :func:`plan_stream` keeps the largest units
resident within the weights' budget (the stage's budget less the activations that
:func:`estimate_sampling` predicts at the chosen micro-batch, the inputs and the streaming
buffers); :class:`StreamedUNet` streams the others: a streamed unit's weights come to the device
just before its forward and leave right after it. Leaving is free (the host copy is kept) unless a
weight changed on the device: ``param._version`` moved, as when the WebUI's Lora extension merges
its weights in place inside the forward; then the device copy is written back to the host copy,
so the merge is neither lost nor applied twice.

While a streamed unit computes, the next streamed unit's weights are copied in (prefetch depth 1):
on CUDA on a side stream from pinned host memory, the compute stream waiting on the copy's event
and each buffer marked as used by the compute stream (``record_stream``) so the caching allocator
does not hand it out again before the forward that reads it has run. On the CPU and on an emulated
card the same code runs with plain copies; each arriving weight is a real allocation on the card
(it counts, and it can raise the card's out-of-memory error), each leaving one is freed.

Why the largest units stay resident (numbers: ``docs/streaming.md``): for a given number of
resident bytes the bytes streamed per forward are the same whichever units hold them, but

* the streaming buffer is the largest *pair* of consecutive streamed units (the one computing and
  the one arriving), so streaming only small units keeps the buffer small and leaves more of the
  budget for residency (SDXL's middle block and its 10-deep transformer blocks are ~6-7 % of the
  UNet each; a ResBlock of the first level is 0.1 %);
* the big units are the low-resolution transformer blocks, which do the least compute per byte of
  weight, so a copy of one of them would be the hardest to hide behind compute; the small
  high-resolution units do the most compute per byte: their copies hide behind the previous unit.

The plan is learned like the engines' (:data:`lib_vram.planning.planner.MEMORY`): candidates are
nested resident sets, and a set that ran out of memory is not chosen again for the same model,
size, dtype, attention and budget bucket; the next plan keeps fewer units resident.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lib_vram.core import emulate
from lib_vram.core.device import is_oom_error, release
from lib_vram.planning import planner

from ._estimate import Step
from ._plan import MAX_BUDGET, SamplingPlan, check_bytes, learned_choice, plan_step, step_key
from ._spec import UNetSpec

logger = logging.getLogger(__name__)

MiB = 1 << 20
MAX_FORWARDS_PER_STEP = 64
"""The most UNet forwards one sampling step is modelled with (micro-batches x CFG passes)."""

LOWVRAM_UNITS_PREFIXES = ("time_embed", "input_blocks", "middle_block", "output_blocks")
"""The units the WebUI's ``--lowvram`` swaps one at a time (v1.10.1 ``modules/lowvram.py``: it
keeps the rest of the diffusion model, ``label_emb`` and ``out``, on the device)."""


# -- the units -----------------------------------------------------------------------------------


UNIT_PARTS = 64
"""A unit larger than 1/64 of the UNet is split into its children (in the order the forward calls
them) where the layout allows: SDXL's 10-deep transformer stacks stream one transformer block at
a time instead of 760 MiB at once, which keeps the streaming buffers small."""


def unet_units(unet: torch.nn.Module, parts: int = UNIT_PARTS) -> list[tuple[str, torch.nn.Module]]:
    """The units of an ldm/sgm ``UNetModel`` in the order its forward runs them: the top-level
    ones (``time_embed``, ``label_emb``, ``input_blocks.i``, ``middle_block``, ``output_blocks.i``,
    ``out``), each larger than ``1/parts`` of the UNet split into its weighted children in their
    registration order (ldm's and sgm's blocks call their children in that order), recursively;
    a container that is never called (``ModuleList``) is always split; a module with weights of
    its own stays whole. ``parts=1``: the top level only. Duck-typed by attribute names (nothing
    of ldm or sgm is imported); one clear error when ``unet`` does not have the layout."""
    if not isinstance(unet, torch.nn.Module):
        raise ValueError(f"`unet` must be a torch.nn.Module, got {type(unet).__name__}")
    if not isinstance(parts, int) or not 1 <= parts <= 4096:
        raise ValueError(f"`parts` must be an integer in 1..4096, got {parts!r}")
    names = ("time_embed", "input_blocks", "middle_block", "output_blocks", "out")
    missing = [n for n in names if not hasattr(unet, n)]
    if missing:
        raise ValueError(
            f"`unet` must be an ldm/sgm UNetModel (time_embed, input_blocks, middle_block, "
            f"output_blocks, out); {type(unet).__name__} lacks {', '.join(missing)}"
        )
    top: list[tuple[str, torch.nn.Module]] = [("time_embed", unet.time_embed)]
    if isinstance(getattr(unet, "label_emb", None), torch.nn.Module):
        top.append(("label_emb", unet.label_emb))
    top += [(f"input_blocks.{i}", m) for i, m in enumerate(unet.input_blocks)]
    top.append(("middle_block", unet.middle_block))
    top += [(f"output_blocks.{i}", m) for i, m in enumerate(unet.output_blocks)]
    top.append(("out", unet.out))
    if parts == 1:
        return top
    limit = sum(_module_bytes(m) for _, m in top) // parts
    out: list[tuple[str, torch.nn.Module]] = []

    def visit(name: str, m: torch.nn.Module) -> None:
        own = any(t is not None for t in (*m._parameters.values(), *m._buffers.values()))
        kids = [(f"{name}.{n}", c) for n, c in m.named_children() if _module_bytes(c) > 0]
        never_called = isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))
        if kids and not own and (never_called or _module_bytes(m) > limit):
            for n, c in kids:
                visit(n, c)
        else:
            out.append((name, m))

    for name, m in top:
        visit(name, m)
    return out


def _module_bytes(m: torch.nn.Module) -> int:
    return sum(_nbytes(getattr(o, n)) for o, n, _ in _tensors(m))


def _tensors(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, bool]]:
    """(owner, name, is_parameter) of every parameter and buffer under ``module``."""
    out = []
    for owner in module.modules():
        for name, p in owner._parameters.items():
            if p is not None:
                out.append((owner, name, True))
        for name, b in owner._buffers.items():
            if b is not None:
                out.append((owner, name, False))
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def unit_bytes(unet: torch.nn.Module, parts: int = UNIT_PARTS) -> list[tuple[str, int]]:
    """(name, bytes of its parameters and buffers) of each unit of ``unet`` (:func:`unet_units`),
    in forward order."""
    return [(name, _module_bytes(m)) for name, m in unet_units(unet, parts)]


def lowvram_bytes_per_forward(units: Sequence[tuple[str, int]]) -> int:
    """Bytes ``--lowvram`` copies host<->device for one UNet forward on the same unit list: each
    swapped unit (:data:`LOWVRAM_UNITS_PREFIXES`) goes to the device before its forward and back
    to the CPU when the next one comes (``module.to``: a full copy each way, changed or not), so
    every swapped unit crosses twice per forward (the last one of a forward leaves at the first
    of the next)."""
    swapped = sum(b for n, b in units if n.split(".")[0] in LOWVRAM_UNITS_PREFIXES)
    return 2 * swapped


def _buffer_bytes(units: Sequence[tuple[str, int]], resident: set[str]) -> int:
    """The streaming buffers at prefetch depth 1: the unit computing and the one arriving, bounded
    by the two largest streamed units (whatever order the forward calls them in: a transformer
    block registers ``attn1, ff, attn2, norm1..3`` but calls them interleaved)."""
    streamed = sorted((b for n, b in units if n not in resident), reverse=True)
    return sum(streamed[:2])


# -- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamPlan:
    """Which UNet units stay on the device and which stream, and what it costs per step."""

    resident: tuple[str, ...]
    streamed: tuple[str, ...]
    unet_bytes: int
    resident_bytes: int
    """Bytes of the resident units."""
    buffer_bytes: int
    """Device bytes the streamed units take at most at once (the computing and the arriving one)."""
    weights_budget_bytes: int
    """What the budget leaves for the UNet's weights after the activations and inputs."""
    activation_bytes: int
    """The step's activations at ``micro_batch`` (:func:`estimate_sampling`'s numbers)."""
    micro_batch: int
    forwards_per_step: int
    """UNet forwards per sampling step: ``ceil(batch / micro_batch)``."""
    bytes_moved_per_step: int
    """Host->device bytes per sampling step (streamed bytes x forwards; a write-back of a weight
    changed on the device adds to this once, not counted here)."""
    lowvram_bytes_per_step: int
    """What ``--lowvram`` moves per step for the same UNet (:func:`lowvram_bytes_per_forward`)."""
    fits: bool
    key: tuple = ()
    candidates: tuple[planner.Candidate, ...] = ()
    notes: tuple[str, ...] = ()
    batch: int = 0
    """Samples of the host's UNet call (0: not known, as from :func:`choose_resident`)."""

    @property
    def streamed_bytes(self) -> int:
        return self.unet_bytes - self.resident_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        """Resident weights + streaming buffers + activations (the inputs and other models come on
        top, as in :class:`SamplingPlan`)."""
        return self.resident_bytes + self.buffer_bytes + self.activation_bytes

    @property
    def label(self) -> str:
        """``"UNet streamed: 1234 of 4900 MiB resident, micro-batch 1 of 2"`` (readout, infotext;
        ``", batch 2 in one forward"`` when the whole batch runs at once)."""
        head = f"UNet streamed: {self.resident_bytes / MiB:.0f} of {self.unet_bytes / MiB:.0f} MiB resident"
        if self.batch > self.micro_batch:
            return f"{head}, micro-batch {self.micro_batch} of {self.batch}"
        if self.batch > 1:
            return f"{head}, batch {self.batch} in one forward"
        return head

    def modelled_step_seconds(
        self, bandwidth_bytes_per_s: float, compute_seconds: float
    ) -> tuple[float, float]:
        """A model, not a measurement: (best, worst) seconds of one step whose forwards compute for
        ``compute_seconds`` in all, with the copies at ``bandwidth_bytes_per_s``. Best: prefetch hides
        every copy behind compute (``max``); worst: none is hidden (sum)."""
        if bandwidth_bytes_per_s <= 0:
            raise ValueError(f"`bandwidth_bytes_per_s` must be > 0, got {bandwidth_bytes_per_s!r}")
        copy = self.bytes_moved_per_step / bandwidth_bytes_per_s
        return max(compute_seconds, copy), compute_seconds + copy


def lowvram_step_seconds(
    lowvram_bytes_per_step: int, bandwidth_bytes_per_s: float, compute_seconds: float
) -> float:
    """A model: ``--lowvram``'s copies are synchronous (``module.to`` in a forward pre-hook), so
    they add to compute."""
    return compute_seconds + lowvram_bytes_per_step / bandwidth_bytes_per_s


def _chain(units: Sequence[tuple[str, int]], weights_budget: int) -> list[str]:
    """Units in the order they become resident: the largest-first greedy selection that fits the
    budget (each unit kept if the resident bytes plus the buffers left still fit), then the rest,
    largest first. Every prefix is a candidate resident set; the greedy one is the longest that
    fits."""
    by_size = sorted(units, key=lambda u: (-u[1], u[0]))
    kept: list[str] = []
    rest: list[str] = []
    total = 0
    for name, b in by_size:
        trial = set(kept) | {name}
        if total + b + _buffer_bytes(units, trial) <= weights_budget:
            kept.append(name)
            total += b
        else:
            rest.append(name)
    return kept + rest


def stream_key(sampling: SamplingPlan | tuple, forwards_per_step: int = 1) -> tuple:
    """The planner-memory key of a streamed sampling step (the sampling plan's key + ``stream``)."""
    key = sampling.key if isinstance(sampling, SamplingPlan) else tuple(sampling)
    return ("sample_stream", *key[1:], int(forwards_per_step))


def choose_resident(
    units: Sequence[tuple[str, int]],
    *,
    weights_budget_bytes: int,
    activation_bytes: int,
    micro_batch: int = 1,
    forwards_per_step: int = 1,
    key: Hashable | None = None,
    memory: planner.PlanMemory | None = None,
) -> StreamPlan:
    """The resident set for ``units`` (:func:`unit_bytes`) within ``weights_budget_bytes``.

    Candidates are the prefixes of :func:`_chain` (``batch`` = resident units + 1, so an
    out-of-memory error rules out that set and every larger one); their predicted peak is resident
    bytes + buffers. The most resident candidate that fits (learned corrections applied) wins."""
    if not units:
        raise ValueError("`units` must not be empty")
    check_bytes("weights_budget_bytes", weights_budget_bytes, -MAX_BUDGET)
    check_bytes("activation_bytes", activation_bytes, -MAX_BUDGET)
    if not isinstance(forwards_per_step, int) or not 1 <= forwards_per_step <= MAX_FORWARDS_PER_STEP:
        raise ValueError(
            f"`forwards_per_step` must be an integer in 1..{MAX_FORWARDS_PER_STEP}, got {forwards_per_step!r}"
        )
    mem = planner.MEMORY if memory is None else memory
    sizes = dict(units)
    total = sum(sizes.values())
    chain = _chain(units, weights_budget_bytes)
    cands = []
    for k in range(len(chain) + 1):
        res = set(chain[:k])
        peak = sum(sizes[n] for n in res) + _buffer_bytes(units, res)
        cands.append(planner.Candidate(f"{k} units resident", peak, None, k + 1))
    choice, naive = learned_choice(mem, key, cands, max(0, weights_budget_bytes))
    k = choice.candidate.batch - 1 if choice.fits else 0
    notes = []
    if naive is not None:
        notes.append(
            f"{k} units resident instead of {naive - 1}: learned from an earlier out-of-memory error"
        )
    res = set(chain[:k])
    resident = tuple(n for n, _ in units if n in res)
    streamed = tuple(n for n, _ in units if n not in res)
    rb = sum(sizes[n] for n in resident)
    moved = (total - rb) * forwards_per_step
    return StreamPlan(
        resident=resident,
        streamed=streamed,
        unet_bytes=total,
        resident_bytes=rb,
        buffer_bytes=_buffer_bytes(units, res),
        weights_budget_bytes=weights_budget_bytes,
        activation_bytes=activation_bytes,
        micro_batch=micro_batch,
        forwards_per_step=forwards_per_step,
        bytes_moved_per_step=moved,
        # the host with --lowvram runs the step's whole batch (cond/uncond, images) in one UNet
        # forward (v1.10.1's ``batch_cond_uncond``, default on): VRAM Guard's micro-batches are its
        # own, they do not multiply --lowvram's traffic
        lowvram_bytes_per_step=lowvram_bytes_per_forward(units),
        fits=choice.fits,
        key=tuple(key) if isinstance(key, tuple) else (),
        candidates=tuple(cands),
        notes=tuple(notes),
    )


def plan_stream(
    unet: torch.nn.Module | Sequence[tuple[str, int]],
    spec: UNetSpec,
    *,
    batch: int,
    latent_hw: tuple[int, int],
    context_tokens: int,
    attention: str,
    dtype: torch.dtype,
    budget_bytes: int,
    resident_bytes: int = 0,
    backend: str = "cuda",
    sampling: SamplingPlan | None = None,
    memory: planner.PlanMemory | None = None,
) -> StreamPlan:
    """The streamed plan of a sampling step that does not fit with the whole UNet resident.

    For each micro-batch ``m`` of ``1..batch`` the activations are the sampling stage's own
    (:func:`plan_sampling`'s candidate for ``m``: the forward's activations, the chunks' outputs
    and their concatenation; no second estimate), and the weights' budget is ``budget_bytes`` less
    those, the step's inputs and ``resident_bytes`` (other models left on the card). A larger
    micro-batch leaves fewer bytes for residency but brings the streamed units in fewer times:
    bytes moved per step = streamed bytes x ``ceil(batch / m)``. The plan is the fitting ``m`` that
    moves the fewest bytes per step (a tie: the fewer forwards); its notes say which and what the
    runner-up would move. When none fits: the plan at micro-batch 1, ``fits`` False.

    ``unet``: the live module, or its :func:`unit_bytes`. ``sampling``: a plan already made for the
    same step (the same ``batch``)."""
    units = unit_bytes(unet) if isinstance(unet, torch.nn.Module) else list(unet)
    mem = planner.MEMORY if memory is None else memory
    if sampling is not None and sampling.batch != batch:
        raise ValueError(f"`sampling` plans a batch of {sampling.batch}, not the step's {batch}")
    step = Step(spec, batch, latent_hw, context_tokens, attention, dtype, backend)
    sp = plan_step(step, budget_bytes, resident_bytes, mem) if sampling is None else sampling
    notes = list(sp.notes)
    wb, ib, res = sp.weights_bytes, sp.input_bytes, sp.resident_bytes
    ratio = mem.ratio(sp.key) if sp.key else 1.0
    refused = any("refuses" in n for n in sp.notes)
    peaks = {c.batch: c.peak_bytes for c in sp.candidates}
    key = step_key(step, budget_bytes)
    plans: list[StreamPlan] = []
    for m in range(1, max(1, batch) + 1):
        if m in peaks and not refused:
            # the sampling plan's own candidate for this micro-batch (its activations, the
            # chunks' outputs and their concatenation), the learned correction applied as there
            act = int(peaks[m] * ratio) - wb - res - ib
        else:
            # the attention refused at the free memory the whole UNet would leave: with the
            # weights streamed the free memory is larger; estimate at what the budget leaves
            # without them
            act, est = step.activation(m, max(0, budget_bytes - resident_bytes - ib))
            if est.refused:
                continue
        if act < 0:
            continue
        forwards = -(-batch // m)
        if forwards > MAX_FORWARDS_PER_STEP:
            continue
        weights_budget = budget_bytes - resident_bytes - ib - act
        plans.append(
            choose_resident(
                units,
                weights_budget_bytes=weights_budget,
                activation_bytes=act,
                micro_batch=m,
                forwards_per_step=forwards,
                key=stream_key(key, forwards),
                memory=mem,
            )
        )
    if not plans:
        raise ValueError(f"no micro-batch of 1..{batch} can be planned for a streamed step")
    fitting = [p for p in plans if p.fits]
    if fitting:
        # the fewest bytes moved per step; on a tie the fewer forwards, then the lower peak
        plan = min(
            fitting, key=lambda p: (p.bytes_moved_per_step, p.forwards_per_step, p.predicted_peak_bytes)
        )
        others = [p for p in fitting if p is not plan]
        if others:
            alt = min(others, key=lambda p: p.bytes_moved_per_step)
            notes.append(
                f"streamed at micro-batch {plan.micro_batch} of {batch}: "
                f"{plan.bytes_moved_per_step / MiB:.1f} MiB per step "
                f"(micro-batch {alt.micro_batch}: {alt.bytes_moved_per_step / MiB:.1f} MiB)"
            )
        else:
            notes.append(f"streamed at micro-batch {plan.micro_batch} of {batch}: the only one that fits")
    else:
        plan = plans[0]  # the smallest micro-batch: the step's best chance
    return replace(plan, batch=batch, notes=plan.notes + tuple(notes))


# -- the streamer --------------------------------------------------------------------------------


@dataclass(eq=False)
class _Slot:
    """One tensor of a streamed unit."""

    owner: torch.nn.Module
    name: str
    is_param: bool
    host: torch.Tensor
    """The host copy (pinned on CUDA); the tensor the module holds while the unit is away."""
    origin: torch.Tensor | None = None
    """Where the tensor was before streaming (its data), restored at the end."""
    dev: torch.Tensor | None = None
    version: int = 0

    def current(self) -> torch.Tensor:
        return getattr(self.owner, self.name)

    def put(self, t: torch.Tensor) -> None:
        if self.is_param:
            self.owner._parameters[self.name].data = t
        else:
            self.owner._buffers[self.name] = t

    def version_now(self) -> int:
        return int(self.current()._version)


@dataclass(eq=False)
class _Unit:
    name: str
    module: torch.nn.Module
    slots: list[_Slot]
    nbytes: int
    state: str = "away"
    """``away`` (host copy in place), ``coming`` (prefetch issued), ``here`` (device copy in place)."""
    event: Any = None


@dataclass
class StreamStats:
    """What a :class:`StreamedUNet` did (reset by :meth:`StreamedUNet.reset_stats`)."""

    forwards: int = 0
    bytes_in: int = 0
    """Host->device bytes of streamed weights."""
    bytes_back: int = 0
    """Device->host bytes written back because a weight changed on the device."""
    prefetched: int = 0
    """Arrivals issued ahead (prefetch) ..."""
    on_demand: int = 0
    """... and arrivals loaded when the unit's forward began (nothing was prefetched)."""
    most_units_here: int = 0
    """The most streamed units on the device at once (2 at prefetch depth 1)."""
    prefetch_ooms: int = 0
    """Prefetches that ran out of memory (the unit then came on demand, after the current left)."""
    trace: list[tuple[str, str, int, int]] = field(default_factory=list)
    """(what, unit, first allocation, last allocation) on an emulated card: ``fetch`` (on
    demand), ``prefetch``, ``back``
    with the card's allocation counter around it (how the tests aim an out-of-memory error)."""


class StreamedUNet:
    """Stream the non-resident units of ``unet`` through ``device`` (see the module docstring).

    ``with StreamedUNet(unet, plan, device):`` moves the streamed units' weights to host memory and
    hooks their forwards; at the exit (also on an error or an interrupt) it removes the hooks and
    moves every weight back where it was, bit for bit. When the move back itself runs out of
    memory, it releases the cache and tries once more; if that fails too the weights stay on the
    host, :attr:`pending` is True and :meth:`restore` can be called again (the WebUI does at the
    next job and at script unload).

    Args:
        unet: an ldm/sgm ``UNetModel`` whose weights are on ``device``.
        plan: a :class:`StreamPlan` for it, or the names of the units to stream.
        device: the compute device (where the weights are).
        card: the emulated card the weights count on (CPU; default: the one running in this
            thread), whose resident bytes drop by the streamed bytes while they are away.
        prefetch: copy the next streamed unit in while the current one computes (default True).
    """

    def __init__(
        self,
        unet: torch.nn.Module,
        plan: StreamPlan | Sequence[str],
        device: torch.device | str,
        *,
        card: emulate.EmulatedCard | None = None,
        prefetch: bool = True,
        memory: planner.PlanMemory | None = None,
        adopt_host: bool = False,
    ) -> None:
        self.unet = unet
        self.adopt_host = bool(adopt_host)
        """(The checkpoint placement, issue 22 item 2) a streamed weight already in host memory while
        ``device`` is CUDA is taken as its host copy (pinned) instead of being left alone: the
        placement loads the streamed units on the CPU and never has them on the card at once."""
        self.device = torch.device(device)
        self.plan = plan if isinstance(plan, StreamPlan) else None
        names = plan.streamed if isinstance(plan, StreamPlan) else tuple(plan)
        order = {n: i for i, (n, _) in enumerate(unet.named_modules())}
        bad = [n for n in names if n not in order]
        if bad:
            raise ValueError(f"`plan` streams units the UNet does not have: {', '.join(bad)}")
        # forward order: the modules' registration order (ldm/sgm call their children in it)
        self._names = tuple(sorted(set(names), key=order.__getitem__))
        self._known = {n: unet.get_submodule(n) for n in self._names}
        nested = [a for a in self._names for b in self._names if a != b and a.startswith(b + ".")]
        if nested:
            raise ValueError(f"`plan` streams a unit inside another: {', '.join(nested)}")
        self._card_arg = card
        self.card: emulate.EmulatedCard | None = None
        self.prefetch = bool(prefetch)
        self.memory = planner.MEMORY if memory is None else memory
        self.stats = StreamStats()
        self.pending = False
        self._units: list[_Unit] = []
        self._hooks: list[Any] = []
        self._side: Any = None
        self._resident_removed: int | None = None
        self._cuda = self.device.type == "cuda"
        self._reported = False
        self._open = 0
        self._seen: list[_Unit] = []
        self._inner: list[bool] = []
        self._cycle: list[_Unit] | None = None
        self._pos: dict[str, int] = {}
        self._ahead: _Unit | None = None

    # -- setup / teardown ---------------------------------------------------------------------
    @property
    def streamed_bytes(self) -> int:
        return sum(u.nbytes for u in self._units)

    def __enter__(self) -> StreamedUNet:
        self.card = self._card_arg
        if self.card is None and self.device.type == "cpu":
            self.card = emulate.running_here(self.device)
        seen: set[int] = set()
        shared = set()
        for m in [self.unet]:
            for o, n, _ in _tensors(m):
                k = id(getattr(o, n))
                if k in seen:
                    shared.add(k)
                seen.add(k)
        if self._cuda:
            self._side = torch.cuda.Stream(self.device)
        try:
            for name in self._names:
                self._units.append(self._take(name, shared))
            if self.card is not None and self.device.type == "cpu":
                # what leaves the card's resident count; given back as a delta at the end, so
                # that parts which came back meanwhile (the idle VAE/text encoders woken by the
                # next stage before this pass's stack closed) stay counted
                self._resident_removed = min(self.card.resident_bytes, self.streamed_bytes)
                self.card.set_resident(self.card.resident_bytes - self._resident_removed)
            for u in self._units:
                self._hooks.append(u.module.register_forward_pre_hook(self._make_pre(u)))
                self._hooks.append(u.module.register_forward_hook(self._make_post(u)))
            self._hooks.append(self.unet.register_forward_pre_hook(self._started))
            self._hooks.append(self.unet.register_forward_hook(self._finished))
        except BaseException:
            self.restore()
            raise
        logger.info(
            "VRAM Guard streams %d UNet units (%.0f MiB), %.0f MiB stay resident",
            len(self._units),
            self.streamed_bytes / MiB,
            (_module_bytes(self.unet) - self.streamed_bytes) / MiB,
        )
        return self

    def _take(self, name: str, shared: set[int]) -> _Unit:
        """Move ``name``'s weights to host memory (on the CPU they already are: nothing copies)."""
        module = self._known[name]
        slots: list[_Slot] = []
        unit = _Unit(name, module, slots, 0)
        try:
            for o, n, is_param in _tensors(module):
                t = getattr(o, n)
                adopt = self.adopt_host and self._cuda and t.device.type == "cpu"  # (placement)
                if id(t) in shared or (t.device.type != self.device.type and not adopt):
                    continue  # tied weights and weights elsewhere stay where they are
                origin = t.data if is_param else t
                if adopt:
                    host = origin.pin_memory()
                elif self._cuda and t.device.type == "cuda":
                    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                    host.copy_(origin)
                else:
                    host = origin
                slot = _Slot(o, n, is_param, host, origin)
                slots.append(slot)
                slot.put(host)
                unit.nbytes += _nbytes(host)
        except BaseException:
            for s in slots:
                s.put(s.origin)
            raise
        for s in slots:
            if self._cuda:
                s.origin = None  # the device copy is freed; the move back makes a new one
        return unit

    def _started(self, module: Any = None, args: Any = None) -> None:
        self._open += 1
        self._inner.append(False)

    def _finished(self, module: Any = None, args: Any = None, output: Any = None) -> None:
        self._open -= 1
        inner = self._inner.pop() if self._inner else False
        if self._inner:
            self._inner[-1] = True
        if inner:
            return  # the forwards inside it (micro-batches, see :meth:`forward_of`) counted
        self.stats.forwards += 1
        if self._cycle is None:
            # the order the forward called the streamed units in (the first call of each): what
            # prefetch follows from the next forward on (the first runs on demand)
            order: list[_Unit] = []
            for u in self._seen:
                if u not in order:
                    order.append(u)
            self._cycle = order
            self._pos = {u.name: i for i, u in enumerate(order)}

    def forward_of(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` (the UNet's own ``forward``, called without ``Module.__call__``: the sampling
        guard's micro-batch wrapper calls it once per micro-batch) with each call counted as one
        UNet forward: the first call learns the order of the streamed units, prefetch follows it
        from the second call on. A call through the UNet module around such calls (the host's one
        call of the whole batch) then does not count again; one without them counts as before."""

        @functools.wraps(forward)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._started()
            try:
                out = forward(*args, **kwargs)
            except BaseException:
                # cut short: ``_open`` stays counted (no success is reported at the exit, as for
                # an error inside the module's own call); its nesting entry goes
                if self._inner:
                    self._inner.pop()
                raise
            self._finished()
            return out

        return counted

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None and is_oom_error(exc):
            self.report(oom=True)
        elif exc is None and self._open == 0 and self.stats.forwards:
            self.report(oom=False)  # (a forward cut short by an error that did not reach here: no report)
        self.restore()

    def restore(self) -> None:
        """Remove the hooks, send every streamed unit away (writing back changed weights) and move
        every weight back to the device. Idempotent; see the class docstring for an error here."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._side is not None:
            self._side.synchronize()
        for u in self._units:
            self._leave(u)
        self._ahead = None
        try:
            self._move_back()
        except BaseException as exc:
            if not is_oom_error(exc):
                raise
            logger.info("VRAM Guard: moving the streamed UNet back ran out of memory; releasing and retrying")
            release(self.device)
            try:
                self._move_back()
            except BaseException as exc2:
                if is_oom_error(exc2):
                    self.pending = True
                    raise RuntimeError(
                        "VRAM Guard: the streamed UNet's weights could not move back to the device "
                        f"({self.streamed_bytes / MiB:.0f} MiB); they stay in host memory until the next job"
                    ) from exc2
                raise
        self.pending = False

    def _move_back(self) -> None:
        if not self._units:
            return
        first = self.card.allocations if self.card is not None else 0
        if self.card is not None and self.device.type == "cpu":
            # the weights are in place already; the card admits their bytes one tensor at a time
            # (each may raise its out-of-memory error) and then counts them as resident again
            admitted: list[torch.Tensor] = []
            try:
                for u in self._units:
                    for s in u.slots:
                        self.card.to_device(s.host)
                        admitted.append(s.host)
            finally:
                for t in admitted:
                    self.card.to_host(t)
            self.card.set_resident(self.card.resident_bytes + (self._resident_removed or 0))
            self._resident_removed = 0
        elif self._cuda and self._model_device().type == "cpu":
            # the host moved the rest of the UNet to the CPU meanwhile (a Refiner or checkpoint
            # switch unloaded this model): the streamed units stay with it, in host memory
            for u in self._units:
                for s in u.slots:
                    s.put(s.host)
        elif self._cuda:
            for u in self._units:
                for s in u.slots:
                    if s.current().device.type != "cuda":  # (a retry skips what already moved)
                        s.put(s.host.to(self.device))
        else:
            for u in self._units:
                for s in u.slots:
                    s.put(s.origin)
        if self.card is not None:
            self.stats.trace.append(("back", "*", first + 1, self.card.allocations))
        self._units.clear()

    def _model_device(self) -> torch.device:
        """Where the UNet's resident weights are now."""
        streamed = {s.host.data_ptr() for u in self._units for s in u.slots}
        for t in self.unet.parameters():
            if t.device.type != "meta" and t.data_ptr() not in streamed:
                return t.device
        return self.device

    # -- hooks --------------------------------------------------------------------------------
    def _make_pre(self, unit: _Unit):  # noqa: ANN202
        def pre(module: torch.nn.Module, args: Any) -> None:
            if self._ahead is not None and self._ahead is not unit:
                # the prediction missed (a unit called out of the learned order): drop it, so no
                # more than two units are on the device at once
                self._leave(self._ahead)
            self._ahead = None
            self._arrive(unit)
            if self._cycle is None:
                self._seen.append(unit)
            elif self.prefetch:
                nxt = self._next(unit)
                if nxt is not None and nxt.state == "away":
                    try:
                        self._fetch(nxt, ahead=True)
                        self._ahead = nxt
                    except BaseException as exc:
                        if not is_oom_error(exc):
                            raise
                        # no room for the next unit beside this one: it comes when its forward
                        # begins, after this one left
                        self.stats.prefetch_ooms += 1
                        self._leave(nxt)
                        logger.debug("VRAM Guard: prefetch of %s ran out of memory; on demand", nxt.name)

        return pre

    def _make_post(self, unit: _Unit):  # noqa: ANN202
        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            self._leave(unit)

        return post

    def _next(self, unit: _Unit) -> _Unit | None:
        """The unit after ``unit`` in the order the first forward called them (cyclic)."""
        cycle = self._cycle or []
        if len(cycle) < 2 or unit.name not in self._pos:
            return None
        return cycle[(self._pos[unit.name] + 1) % len(cycle)]

    def _arrive(self, unit: _Unit) -> None:
        if unit.state == "away":
            self._fetch(unit, ahead=False)
        if unit.state == "coming":
            if unit.event is not None:
                torch.cuda.current_stream(self.device).wait_event(unit.event)
                cur = torch.cuda.current_stream(self.device)
                for s in unit.slots:
                    if s.dev is not None:
                        s.dev.record_stream(cur)
                unit.event = None
            for s in unit.slots:
                s.put(s.dev)
                s.version = s.version_now()
            unit.state = "here"

    def _fetch(self, unit: _Unit, *, ahead: bool) -> None:
        """Copy ``unit``'s weights to the device (side stream on CUDA); they are put in place at
        :meth:`_arrive`."""
        first = self.card.allocations if self.card is not None else 0
        unit.state = "coming"
        try:
            if self._cuda:
                with torch.cuda.stream(self._side):
                    for s in unit.slots:
                        s.dev = torch.empty_like(s.host, device=self.device)
                        s.dev.copy_(s.host, non_blocking=True)
                    unit.event = torch.cuda.Event()
                    unit.event.record(self._side)
            else:
                for s in unit.slots:
                    d = torch.empty_like(s.host)
                    d.copy_(s.host)
                    s.dev = d
        except BaseException:
            # a copy that could not be made (out of memory, an interrupt): the unit is away again,
            # with no half-made device copies, so the next forward (a smaller micro-batch, the next
            # pass) fetches it afresh instead of putting a missing tensor in place
            for s in unit.slots:
                s.dev = None
            unit.event = None
            unit.state = "away"
            raise
        self.stats.bytes_in += unit.nbytes
        here = sum(u.state != "away" for u in self._units)
        self.stats.most_units_here = max(self.stats.most_units_here, here)
        if ahead:
            self.stats.prefetched += 1
        else:
            self.stats.on_demand += 1
        if self.card is not None:
            what = "prefetch" if ahead else "fetch"
            self.stats.trace.append((what, unit.name, first + 1, self.card.allocations))

    def _leave(self, unit: _Unit) -> None:
        """Put the host copies back in place; a weight changed on the device is written back first."""
        if unit.state == "away":
            return
        if unit.event is not None:
            unit.event.synchronize()
            unit.event = None
        for s in unit.slots:
            if unit.state == "here" and s.dev is not None and s.version_now() != s.version:
                s.host.copy_(s.current().detach())
                self.stats.bytes_back += _nbytes(s.host)
            s.put(s.host)
            s.dev = None
        unit.state = "away"

    # -- the checkpoint placement (issue 22 item 2): a session-long streamer ------------------
    def settle(self) -> None:
        """After a forward cut short by an error (the streamer stays in force for the next one):
        every streamed unit away again (changed weights written back), the prefetch dropped."""
        if self._side is not None:
            self._side.synchronize()
        for u in self._units:
            self._leave(u)
        self._ahead = None
        self._open = 0

    def release_to_host(self) -> None:
        """End streaming with the model going to host memory (a checkpoint switch or unload, a card
        too small for the move back): remove the hooks and put every streamed unit's host copy in
        place (changed weights written back); nothing moves to the device. The emulated card's
        resident bytes are left to the caller."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.settle()
        for u in self._units:
            for s in u.slots:
                s.put(s.host)
        self._units.clear()
        self._resident_removed = 0
        self.pending = False

    # -- learning -----------------------------------------------------------------------------
    def report(self, *, oom: bool) -> None:
        """Tell the planner memory how the plan did (once): an out-of-memory error rules out this
        resident set and larger ones for the step's key. The ``with`` exit reports by itself; a
        caller that sees the error where the exit does not (the WebUI's forward wrapper) calls it."""
        plan = self.plan
        if plan is None or not plan.key or self._reported:
            return
        k = len(plan.resident)
        cand = next((c for c in plan.candidates if c.batch == k + 1), None)
        if cand is None:
            return
        self.memory.record(plan.key, planner.Outcome.of(cand, oom=oom))
        self._reported = True

    def reset_stats(self) -> None:
        self.stats = StreamStats()


@contextlib.contextmanager
def streamed(
    unet: torch.nn.Module,
    plan: StreamPlan | Sequence[str],
    device: torch.device | str,
    **kwargs: Any,
) -> Iterator[StreamedUNet]:
    """``with streamed(unet, plan, device) as s:`` (see :class:`StreamedUNet`)."""
    s = StreamedUNet(unet, plan, device, **kwargs)
    with s:
        yield s
