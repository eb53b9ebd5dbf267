"""The sampling stage's plan: the largest UNet micro-batch whose predicted peak fits the budget.

Candidates are the micro-batches ``m = B .. 1`` of one forward; the peak of each is the UNet's
weights, what else is resident, the forward's inputs (the whole batch: the sampler holds it), the
activations of a forward of ``m`` samples (:func:`estimate_sampling`) and the outputs of the
chunks done so far plus their concatenation. The choice goes through
:data:`lib_vram.planning.planner.MEMORY` (keyed by the UNet's signature, the input shape, the
attention, the dtype and a budget bucket): a micro-batch that ran out of memory is not chosen
again for that key (:func:`micro_batched` reports it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, replace

import torch

from lib_vram.planning import planner

from ._estimate import SamplingEstimate, Step
from ._spec import UNetSpec
from ._tokens import SelfAttention

MiB = 1 << 20
BUDGET_BUCKET = 256 * MiB
"""Budgets within one bucket share what the planner memory learned."""
MAX_BUDGET = 1 << 50


def check_bytes(name: str, value: object, low: int = 0) -> None:
    if not isinstance(value, int) or not low <= value <= MAX_BUDGET:
        raise ValueError(f"`{name}` must be an integer in {low}..{MAX_BUDGET}, got {value!r}")


@dataclass(frozen=True)
class SamplingPlan:
    """How one sampling step's UNet forward runs, and its predicted peak."""

    micro_batch: int
    """Samples per UNet forward (``batch`` when the whole batch runs at once)."""
    predicted_peak_bytes: int
    """Weights + resident + inputs + activations at ``micro_batch`` (learned corrections applied)."""
    activation_bytes: int
    """The forward's activations at ``micro_batch`` plus the chunks' outputs held (above weights,
    resident bytes and inputs)."""
    weights_bytes: int
    fits: bool
    label: str
    """``"micro-batch 2 of 4"``, or ``"batch 4 in one forward"``."""
    suggestion: str | None
    """When nothing fits: one line with the largest image size that fits and the largest batch at
    the asked size (or none)."""
    key: tuple
    """The planner-memory key :func:`micro_batched` reports under."""
    batch: int = 1
    budget_bytes: int = 0
    resident_bytes: int = 0
    input_bytes: int = 0
    attention: str = ""
    candidates: tuple[planner.Candidate, ...] = ()
    notes: tuple[str, ...] = ()
    control_bytes: int = 0
    """The ControlNets' weights of the pass (in the peak, not in ``weights_bytes``)."""


def step_key(step: Step, budget_bytes: int) -> tuple:
    """The planner-memory key of a sampling step (one per budget bucket of :data:`BUDGET_BUCKET`)."""
    h, w = step.latent_hw
    key = planner.plan_key(
        "sample",
        step.spec.signature(),
        (step.batch, step.spec.in_channels, h, w),
        step.dtype,
        step.attention,
        int(step.context_tokens),
        int(budget_bytes) // BUDGET_BUCKET,
    )
    sa = step.self_attention.key() if step.self_attention is not None else ()
    return key + tuple(c.signature() for c in step.controls) + (("whole",) if step.whole else ()) + sa


_PEAKS: OrderedDict[Hashable, dict[int, int]] = OrderedDict()
_PEAKS_LOCK = threading.Lock()


def _remember(key: Hashable, peaks: dict[int, int]) -> None:
    with _PEAKS_LOCK:
        _PEAKS[key] = peaks
        _PEAKS.move_to_end(key)
        while len(_PEAKS) > 64:
            _PEAKS.popitem(last=False)


def candidate_for(key: Hashable, micro_batch: int) -> planner.Candidate | None:
    """The candidate a recent :func:`plan_sampling` made for ``micro_batch`` under ``key``."""
    with _PEAKS_LOCK:
        peak = _PEAKS.get(key, {}).get(micro_batch)
    return None if peak is None else _candidate(micro_batch, peak)


def _candidate(m: int, peak: int) -> planner.Candidate:
    return planner.Candidate(f"micro-batch {m}", int(peak), None, m)


def _peaks(step: Step, budget: int, resident: int) -> tuple[dict[int, int], dict[int, SamplingEstimate]]:
    """Each micro-batch's predicted peak (the weights, ``resident``, the inputs, its activations)
    and estimate, the attention's slices sized from what ``budget`` leaves free."""
    base = step.weights_bytes + step.control_bytes + resident + step.input_bytes
    free = max(0, budget - base)
    peaks, ests = {}, {}
    for m in step.micro_batches:
        act, est = step.activation(m, free)
        peak = base + act
        if est.refused:
            peak = max(peak, budget + 1)  # the host's attention raises: never a fitting plan
        peaks[m] = peak
        ests[m] = est
    return peaks, ests


def learned_choice(
    memory: planner.PlanMemory, key: Hashable | None, candidates: list[planner.Candidate], budget: int
) -> tuple[planner.Choice, int | None]:
    """The candidate that fits ``budget`` once ``memory``'s corrections for ``key`` are applied (no
    key: none are), and the ``batch`` of the one the estimates alone would choose when learning
    changed the choice (else None)."""
    adjusted = memory.adjust(key, candidates) if key is not None else candidates
    choice = planner.choose(adjusted, budget, 0)
    if not choice.fits or key is None:
        return choice, None
    naive = planner.choose(candidates, budget, 0).candidate.batch
    return choice, None if naive == choice.candidate.batch else naive


def _label(m: int, batch: int) -> str:
    return f"batch {batch} in one forward" if m >= batch else f"micro-batch {m} of {batch}"


def plan_sampling(
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
    memory: planner.PlanMemory | None = None,
    controls: tuple[UNetSpec, ...] = (),
    whole: bool = False,
    self_attention: SelfAttention | None = None,
) -> SamplingPlan:
    """The micro-batch one sampling step runs and its predicted peak (see the module docstring).

    Args:
        batch: samples of the host's UNet forward (``2 x images`` with CFG: cond and uncond).
        budget_bytes: device memory the stage may use in all (the card's free memory with nothing
            of the job on it, minus the safety margin): the UNet's weights, ``resident_bytes``
            (other models left on the card) and the step's inputs and activations.
        backend: see :func:`estimate_sampling`.
        memory: the planner memory consulted (default :data:`lib_vram.planning.planner.MEMORY`).
        controls: the ControlNets of the pass (their weights and activations are in the peak).
        whole: the forward cannot split its batch (only ``batch`` is a candidate).
        self_attention: HyperTile and token merging on the UNet (see :func:`estimate_sampling`).
    """
    step = Step(spec, batch, latent_hw, context_tokens, attention, dtype, backend, tuple(controls), whole)
    step = replace(step, self_attention=self_attention)
    return plan_step(step, budget_bytes, resident_bytes, memory)


def plan_step(
    step: Step, budget_bytes: int, resident_bytes: int = 0, memory: planner.PlanMemory | None = None
) -> SamplingPlan:
    """:func:`plan_sampling` of ``step``."""
    check_bytes("budget_bytes", budget_bytes)
    check_bytes("resident_bytes", resident_bytes)
    mem = planner.MEMORY if memory is None else memory
    peaks, ests = _peaks(step, budget_bytes, resident_bytes)
    key = step_key(step, budget_bytes)
    _remember(key, peaks)
    cands = [_candidate(m, p) for m, p in peaks.items()]
    choice, naive = learned_choice(mem, key, cands, budget_bytes)
    notes: list[str] = []
    # nothing fits: the smallest micro-batch is the step's best chance
    m = choice.candidate.batch if choice.fits else min(peaks)
    if naive is not None:
        notes.append(f"micro-batch {m} instead of {naive}: learned from an earlier out-of-memory error")
    peak = int(peaks[m] * mem.ratio(key))
    wb, ib, cb = step.weights_bytes, step.input_bytes, step.control_bytes
    suggestion = None
    if not choice.fits:
        suggestion = _suggest(step, budget_bytes, resident_bytes)
        if ests[m].refused:
            notes.append(ests[m].refused)
    return SamplingPlan(
        micro_batch=m,
        predicted_peak_bytes=peak,
        activation_bytes=peak - wb - cb - resident_bytes - ib,
        weights_bytes=wb,
        fits=choice.fits,
        label=_label(m, step.batch),
        suggestion=suggestion,
        key=key,
        batch=step.batch,
        budget_bytes=budget_bytes,
        resident_bytes=resident_bytes,
        input_bytes=ib,
        attention=step.attention,
        candidates=tuple(cands),
        notes=tuple(notes),
        control_bytes=cb,
    )


def _fits(step: Step, budget: int, resident: int) -> bool:
    peaks = _peaks(step, budget, resident)[0]
    return peaks[min(peaks)] <= budget


def _suggest(step: Step, budget_bytes: int, resident_bytes: int) -> str:
    h, w = step.latent_hw
    peaks, _ = _peaks(step, budget_bytes, resident_bytes)
    m = min(peaks)
    need, wb, cb = peaks[m], step.weights_bytes, step.control_bytes
    cn = f", ControlNet {cb / MiB:.0f} MiB" if cb else ""
    head = (
        f"sampling {w * 8}x{h * 8} px needs {need / MiB:.0f} MiB at micro-batch {m} "
        f"(UNet weights {wb / MiB:.0f} MiB{cn}), the card offers {budget_bytes / MiB:.0f} MiB"
    )
    if wb + cb + resident_bytes >= budget_bytes:
        what = "the UNet's and the ControlNets' weights" if cb else "the UNet's weights alone"
        return head + f": {what} do not fit; no size or batch does"
    size = None
    side = max(h, w)
    # the longer side in steps of 8 latent px (64 px); the shorter keeps the aspect
    for long_lat in range((side // 8) * 8, 7, -8):
        if long_lat >= side:
            continue
        short = max(8, int(round(min(h, w) * long_lat / side / 8)) * 8)
        hw = (long_lat, short) if h >= w else (short, long_lat)
        if _fits(replace(step, batch=1, latent_hw=hw), budget_bytes, resident_bytes):
            size = hw
            break
    best_b = None
    for b in range(step.batch - 1, 0, -1):
        if _fits(replace(step, batch=b), budget_bytes, resident_bytes):
            best_b = b
            break
    size_txt = f"{size[1] * 8}x{size[0] * 8} px fits at batch 1" if size else "no size fits"
    batch_txt = f"a batch of {best_b} fits at this size" if best_b else "no batch fits at this size"
    return f"{head}: {size_txt}; {batch_txt}"
