"""The streamed plan: which UNet units stay resident within the budget, and what streams.

When the sampling step does not fit even at micro-batch 1 with the idle parts off the card, the
UNet's weights are what is left to give. :func:`plan_stream` keeps the largest units
(:func:`~._units.unit_bytes`) resident within the weights' budget (the stage's budget less the
activations the sampling plan predicts at the chosen micro-batch, the inputs and the streaming
buffers); :class:`~._stream.StreamedUNet` streams the others.

Why the largest units stay resident, and how the plan learns from an out-of-memory error
(:data:`lib_vram.planning.planner.MEMORY`; candidates are nested resident sets): docs/streaming.md,
"Which units stay resident, and why (numbers)".
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import torch

from lib_vram.planning import planner

from ._estimate import Step
from ._plan import MAX_BUDGET, SamplingPlan, check_bytes, learned_choice, plan_step, step_key
from ._spec import UNetSpec
from ._tokens import SelfAttention
from ._units import unit_bytes

MiB = 1 << 20
MAX_FORWARDS_PER_STEP = 64
"""The most UNet forwards one sampling step is modelled with (micro-batches x CFG passes)."""

LOWVRAM_UNITS_PREFIXES = ("time_embed", "input_blocks", "middle_block", "output_blocks")
"""The units the WebUI's ``--lowvram`` swaps one at a time (v1.10.1 ``modules/lowvram.py``: it
keeps the rest of the diffusion model, ``label_emb`` and ``out``, on the device)."""


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


def more_streamed(
    units: Sequence[tuple[str, int]], resident: Sequence[str], need_bytes: int
) -> tuple[tuple[str, ...], int, int] | None:
    """Resident units to stream as well for one pass that is ``need_bytes`` short (a placed
    checkpoint's pass with a ControlNet beside it, a larger hires pass): the set that frees at least
    ``need_bytes`` with the fewest bytes streamed per forward. A second streamer carries them, so
    its buffer (the two largest of them: the one computing and the one arriving) is on the card
    too and does not count as freed. Returns (names in ``units``' order, their bytes, their
    buffer), () when nothing is short, or None when streaming every resident unit frees too little.

    For each size bound, the largest units under it are taken until they free enough; the bound
    with the fewest bytes wins (the largest units free the most per unit, and a bound keeps the
    buffer they add small)."""
    if need_bytes <= 0:
        return (), 0, 0
    sizes = {n: b for n, b in units if n in set(resident)}
    best: tuple[int, list[str], int] | None = None
    for bound in sorted(set(sizes.values())):
        taken: list[str] = []
        total = 0
        for name, b in sorted(((n, b) for n, b in sizes.items() if b <= bound), key=lambda u: (-u[1], u[0])):
            taken.append(name)
            total += b
            buf = sum(sorted((sizes[n] for n in taken), reverse=True)[:2])
            if total - buf >= need_bytes:
                if best is None or total < best[0]:
                    best = (total, list(taken), buf)
                break
    if best is None:
        return None
    total, taken, buf = best
    chosen = set(taken)
    return tuple(n for n, _ in units if n in chosen), total, buf


def more_streamed_pass(
    units: Sequence[tuple[str, int]],
    resident: Sequence[str],
    plan: SamplingPlan,
    already_bytes: int,
    *,
    freed_bytes: int = 0,
    streamed_bytes: int = 0,
) -> tuple[tuple[str, ...], int, int] | None:
    """:func:`more_streamed` for a pass whose ``plan`` (its budget raised by what the placement does
    not keep on the card) does not fit, over its micro-batches: the one whose shortfall costs the
    fewest bytes streamed per step (``already_bytes`` + these, x forwards). ``freed_bytes``,
    ``streamed_bytes``: what other streamed models (control models) free and stream. None: none
    frees enough."""
    best = None
    for c in plan.candidates:
        got = more_streamed(units, resident, c.peak_bytes - plan.budget_bytes - freed_bytes)
        if got and (got[0] or streamed_bytes):
            cost = ((already_bytes + got[1] + streamed_bytes) * -(-plan.batch // c.batch), -c.batch)
            best = min(best, (cost, got)) if best is not None else (cost, got)
    return best[1] if best is not None else None


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
    controls: tuple[UNetSpec, ...] = (),
    whole: bool = False,
    self_attention: SelfAttention | None = None,
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
    same step (the same ``batch``). ``controls``: the pass's ControlNets (resident); ``whole``: as
    :func:`plan_sampling` takes them (and ``self_attention``)."""
    units = unit_bytes(unet) if isinstance(unet, torch.nn.Module) else list(unet)
    mem = planner.MEMORY if memory is None else memory
    if sampling is not None and sampling.batch != batch:
        raise ValueError(f"`sampling` plans a batch of {sampling.batch}, not the step's {batch}")
    step = Step(spec, batch, latent_hw, context_tokens, attention, dtype, backend, tuple(controls), whole)
    step = replace(step, self_attention=self_attention)
    sp = plan_step(step, budget_bytes, resident_bytes, mem) if sampling is None else sampling
    notes = list(sp.notes)
    wb, ib, res = sp.weights_bytes, sp.input_bytes, sp.resident_bytes
    ratio = mem.ratio(sp.key) if sp.key else 1.0
    refused = any("refuses" in n for n in sp.notes)
    peaks = {c.batch: c.peak_bytes for c in sp.candidates}
    key = step_key(step, budget_bytes)
    plans: list[StreamPlan] = []
    for m in sorted(step.micro_batches):
        if m in peaks and not refused:
            # the sampling plan's own candidate for this micro-batch (its activations, the
            # chunks' outputs and their concatenation), the learned correction applied as there
            act = int(peaks[m] * ratio) - wb - res - ib
        else:
            # the attention refused at the free memory the whole UNet would leave: with the
            # weights streamed the free memory is larger; estimate at what the budget leaves
            # without them
            act, est = step.activation(m, max(0, budget_bytes - resident_bytes - ib))
            act += step.control_bytes  # (on the card beside the resident units)
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
