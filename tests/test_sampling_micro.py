"""Micro-batching the real ldm ``UNetModel``'s forward, and the sampling plan's learning.

Each sample's result: an SD UNet computes every sample from that sample alone (GroupNorm,
LayerNorm and attention normalise within a sample), so a micro-batched forward computes the same
function per sample; only the kernels' blocking (and so the order of a dot product's sums) may
change with the batch size. Where the wrapper calls the forward unchanged (micro-batch >= batch)
the output is bit-identical. Otherwise the bound is float rounding: a reordered sum of ``k`` terms
differs by at most ``2 k eps sum|a_i b_i|`` (float32 ``eps`` = 2^-24 = 6e-8); the test UNet's
longest reductions are ``k = 9 x 384`` (a 3x3 convolution over the widest concatenation), so one
layer's change is below 4.2e-4 of its output's scale, and the forward chains about 60 such layers
(each GroupNorm/LayerNorm renormalises, so the changes add rather than multiply): 60 x 4.2e-4 =
2.5e-2 of ``max|y|``, the bound used. It is a worst case, far above what a run shows, yet a wrong
split (another sample's context) is outside it by far (``test_the_check_can_fail``).

Out-of-memory errors are real: the emulated card's (``torch.OutOfMemoryError``), injected at the
first, a middle and the last allocation of a micro-batched step.
"""

from __future__ import annotations

import pytest
import torch

from lib_vram.cli.models.unet import build_unet, context_arg
from lib_vram.core.emulate import EmulatedCard
from lib_vram.planning import planner
from lib_vram.sampling import micro_batched, plan_sampling, reference_spec, unet_spec

MICRO_BOUND = 2.5e-2
CTX = 96


def _unet(shape: str = "sd15"):
    unet = build_unet(shape, 32, context_dim=CTX, seed=3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in unet.parameters():  # zero-initialised output layers made non-zero
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return unet


def _inputs(batch: int, hw=(16, 16), shape: str = "sd15"):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(batch, 4, *hw, generator=gen, dtype=torch.float32)
    t = torch.linspace(10, 900, batch, dtype=torch.float32)
    c = torch.randn(batch, 77, CTX, generator=gen, dtype=torch.float32)
    return x, t, context_arg(shape, c)


@pytest.fixture(scope="module")
def sd15():
    return _unet("sd15")


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max() <= MICRO_BOUND * b.abs().max(), (a - b).abs().max()


def test_whole_batch_is_the_plain_forward_bit_for_bit(sd15):
    x, t, c = _inputs(4)
    with torch.no_grad():
        ref = sd15(x, t, context=c)
        out = micro_batched(sd15, 4)(x, t, context=c)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("m", [1, 3])
def test_each_sample_equals_the_unsplit_forward(sd15, m):
    x, t, c = _inputs(4)
    with torch.no_grad():
        ref = sd15(x, t, context=c)
        out = micro_batched(sd15, m)(x, t, context=c)
    _close(out, ref)


def test_the_check_can_fail(sd15):
    """A wrong split (every chunk given the first chunk's latents) is far outside the bound."""
    x, t, c = _inputs(4)

    def wrong(xx, tt, context):
        return sd15(x[: xx.shape[0]], tt, context=context)

    with torch.no_grad():
        ref = sd15(x, t, context=c)
        out = micro_batched(wrong, 2)(x, t, context=c)
    assert (out - ref).abs().max() > MICRO_BOUND * ref.abs().max()


def test_lists_of_batch_tensors_are_split_and_others_pass():
    """The SDXL-like ldm UNet takes its context as a list (one per transformer block): each list
    item is cut; a tensor whose dim 0 is not the batch passes whole."""
    unet = _unet("sdxl")
    x, t, c = _inputs(4, shape="sdxl")
    seen = []

    def fwd(x, t, context, extra):
        seen.append((x.shape[0], [ci.shape[0] for ci in context], extra.shape[0]))
        return unet(x, t, context=context)

    extra = torch.zeros(3)
    with torch.no_grad():
        ref = unet(x, t, context=c)
        out = micro_batched(fwd, 2)(x, t, context=c, extra=extra)
    assert seen == [(2, [2, 2], 3), (2, [2, 2], 3)]
    _close(out, ref)


def _plan_for(unet, batch, hw, memory):
    return plan_sampling(
        unet_spec(unet),
        batch=batch,
        latent_hw=hw,
        context_tokens=77,
        attention="none",
        dtype=torch.float32,
        budget_bytes=1 << 40,
        backend="cpu",
        memory=memory,
    )


@pytest.mark.parametrize("point", ["first", "middle", "last"])
def test_an_oom_in_a_micro_batched_step_is_absorbed_and_learned(sd15, point):
    x, t, c = _inputs(4)
    with torch.no_grad():
        ref = sd15(x, t, context=c)
    memory = planner.PlanMemory()
    plan = _plan_for(sd15, 4, (16, 16), memory)
    assert plan.micro_batch == 4  # everything fits the huge budget
    probe = EmulatedCard("64GB", resident=[sd15])
    with probe, torch.no_grad():
        micro_batched(sd15, 2)(x, t, context=c)
    n = probe.allocations
    at = {"first": 1, "middle": n // 2, "last": n}[point]
    card = EmulatedCard("64GB", resident=[sd15], inject_oom_at=at)
    wrapped = micro_batched(sd15, 2, key=plan.key, memory=memory)
    with card, torch.no_grad():
        out = wrapped(x, t, context=c)
    assert card.injected and card.ooms == 1 and wrapped.ooms == 1
    _close(out, ref)
    # learned: micro-batch 2 (and larger) is not chosen again for this key
    again = _plan_for(sd15, 4, (16, 16), memory)
    assert again.micro_batch == 1 and again.notes, again
    if point != "last":
        assert wrapped.micro_batch == 1  # the step went on at half the micro-batch


def test_an_oom_at_micro_batch_1_is_raised(sd15):
    x, t, c = _inputs(2)
    card = EmulatedCard("64GB", resident=[sd15], inject_oom_at=1)
    with card, torch.no_grad(), pytest.raises(torch.OutOfMemoryError):
        micro_batched(sd15, 1)(x, t, context=c)


def test_a_real_capacity_oom_halves_until_it_fits(sd15):
    """No injection: a card just too small for the 4-sample forward (its peak measured on a big
    card) makes the wrapper halve until the step fits, with the plain result."""
    x, t, c = _inputs(4)
    with torch.no_grad():
        ref = sd15(x, t, context=c)
    peaks = {}
    for m in (4, 2, 1):
        probe = EmulatedCard("64GB", resident=[sd15])
        with probe, torch.no_grad():
            micro_batched(sd15, m)(x, t, context=c)
        peaks[m] = probe.peak_bytes
    assert peaks[4] > peaks[2] > peaks[1]
    card = EmulatedCard((peaks[4] + peaks[2]) // 2, resident=[sd15])
    wrapped = micro_batched(sd15, 4)
    with card, torch.no_grad():
        out = wrapped(x, t, context=c)
    assert wrapped.micro_batch == 2 and card.ooms == 1
    _close(out, ref)


def test_plan_picks_the_largest_micro_batch_that_fits():
    spec = reference_spec("sd15")
    kw = dict(batch=8, latent_hw=(128, 128), context_tokens=77, attention="sdp", dtype=torch.float16)
    whole = plan_sampling(spec, budget_bytes=1 << 40, memory=planner.PlanMemory(), **kw)
    assert whole.micro_batch == 8 and whole.fits and whole.label == "batch 8 in one forward"
    peaks = {c.batch: c.peak_bytes for c in whole.candidates}
    budget = (peaks[4] + peaks[5]) // 2
    p = plan_sampling(spec, budget_bytes=budget, memory=planner.PlanMemory(), **kw)
    assert p.micro_batch == 4 and p.fits and p.label == "micro-batch 4 of 8" and p.suggestion is None
    assert p.predicted_peak_bytes <= budget
    none = plan_sampling(spec, budget_bytes=peaks[1] - 1, memory=planner.PlanMemory(), **kw)
    assert not none.fits and none.micro_batch == 1 and "px fits at batch 1" in none.suggestion
    tiny = plan_sampling(spec, budget_bytes=1 << 30, memory=planner.PlanMemory(), **kw)
    assert "weights alone do not fit" in tiny.suggestion


def test_plan_rejects_bad_budgets():
    spec = reference_spec("sd15")
    kw = dict(batch=2, latent_hw=(64, 64), context_tokens=77, attention="sdp", dtype=torch.float16)
    with pytest.raises(ValueError, match="`budget_bytes`"):
        plan_sampling(spec, budget_bytes=-1, **kw)
    with pytest.raises(ValueError, match="`resident_bytes`"):
        plan_sampling(spec, budget_bytes=1 << 30, resident_bytes=-5, **kw)
    with pytest.raises(ValueError, match="`micro_batch`"):
        micro_batched(lambda x: x, 0)
