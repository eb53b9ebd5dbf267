"""Budgeted UNet residency with prefetch (lib_vram.sampling._stream) on the real ldm UNetModel.

Every memory claim runs on the emulated card (CPU): a streamed unit's weights are real allocations
on it while they are on the "device". Bit-identity holds on the CPU because streaming changes only
where a weight lives: the forward runs the same operators in the same order on a copy with the same
bits (nothing is cast or recomputed).
"""

from __future__ import annotations

import copy
import gc
import sys
import types

import pytest
import torch
from ldm.modules.diffusionmodules.openaimodel import UNetModel
from webui_fakes import tiny_unet

from lib_vram.core.emulate import EmulatedCard
from lib_vram.planning import planner
from lib_vram.sampling import (
    StreamedUNet,
    choose_resident,
    lowvram_bytes_per_forward,
    micro_batched,
    plan_sampling,
    plan_stream,
    unet_spec,
    unet_units,
    unit_bytes,
)

MiB = 1 << 20


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine more threads thrash (the results are the
    same; only the time differs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def ctx_unet(monkeypatch: pytest.MonkeyPatch) -> UNetModel:
    """A small SD1-shaped ldm UNetModel with SpatialTransformers (cross-attention). ldm's
    constructor imports ``omegaconf.listconfig.ListConfig`` for a type check of ``context_dim``
    only; the test environment lacks omegaconf, so a placeholder stands in for the constructor."""
    if "omegaconf" not in sys.modules:
        om, lc = types.ModuleType("omegaconf"), types.ModuleType("omegaconf.listconfig")
        lc.ListConfig = type("ListConfig", (list,), {})
        om.listconfig = lc
        monkeypatch.setitem(sys.modules, "omegaconf", om)
        monkeypatch.setitem(sys.modules, "omegaconf.listconfig", lc)
    torch.manual_seed(3)
    unet = UNetModel(
        image_size=16,
        in_channels=4,
        out_channels=4,
        model_channels=32,
        num_res_blocks=1,
        attention_resolutions=[1, 2],
        channel_mult=(1, 2, 2),
        num_head_channels=16,
        use_spatial_transformer=True,
        context_dim=64,
        legacy=False,
    ).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in unet.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return unet


def _inputs(batch: int = 2, side: int = 8, ctx: bool = True) -> dict:
    g = torch.Generator().manual_seed(7)
    kw = {"x": torch.randn(batch, 4, side, side, generator=g), "timesteps": torch.tensor([10, 700][:batch])}
    if ctx:
        kw["context"] = torch.randn(batch, 5, 64, generator=g)
    return kw


def _bits(unet: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in unet.state_dict().items()}


def _same_bits(unet: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = unet.state_dict()
    return set(now) == set(before) and all(
        torch.equal(now[n].view(torch.int32), before[n].view(torch.int32)) for n in before
    )


def _no_hooks(unet: torch.nn.Module) -> bool:
    return all(not m._forward_pre_hooks and not m._forward_hooks for m in unet.modules())


def _plan_holding(unet: torch.nn.Module, fraction: float):
    """A plan whose resident units hold at least ``fraction`` of the UNet (the smallest budget
    for which the planner keeps that much)."""
    units = unit_bytes(unet)
    total = sum(b for _, b in units)
    for budget in range(int(total * fraction), 2 * total, max(1, total // 200)):
        plan = choose_resident(units, weights_budget_bytes=budget, activation_bytes=0)
        if plan.resident_bytes >= fraction * total and plan.streamed:
            return plan
    raise AssertionError("no budget keeps that much resident")


def _activations(unet: torch.nn.Module, kw: dict) -> int:
    """The forward's measured activations on a roomy card (for sizing a tight one)."""
    card = EmulatedCard(1 << 40, resident=[unet])
    with torch.no_grad(), card:
        unet(**kw)
    return card.peak_bytes - card.resident_bytes


# -- output and restore ---------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.0, 0.4, 2 / 3])
@pytest.mark.parametrize("prefetch", [True, False])
def test_streamed_forward_is_bit_identical_and_restores(ctx_unet, fraction, prefetch):
    kw = _inputs()
    before = _bits(ctx_unet)
    with torch.no_grad():
        ref = ctx_unet(**kw)
    plan = (
        choose_resident(unit_bytes(ctx_unet), weights_budget_bytes=0, activation_bytes=0)
        if fraction == 0
        else _plan_holding(ctx_unet, fraction)
    )
    assert plan.streamed
    card = EmulatedCard(1 << 30, resident=[ctx_unet])
    with torch.no_grad(), card, StreamedUNet(ctx_unet, plan, "cpu", prefetch=prefetch) as s:
        assert card.resident_bytes == sum(b for _, b in unit_bytes(ctx_unet)) - plan.streamed_bytes
        outs = [ctx_unet(**kw) for _ in range(2)]
    for out in outs:
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
    assert _same_bits(ctx_unet, before)
    assert _no_hooks(ctx_unet)
    assert card.resident_bytes == sum(b for _, b in unit_bytes(ctx_unet))
    assert s.stats.forwards == 2
    assert (s.stats.prefetched > 0) == prefetch
    # every weight is the module's own tensor again (not a copy left behind)
    assert all(p.device.type == "cpu" for p in ctx_unet.parameters())


def test_only_streamed_weights_count_and_the_plain_forward_does_not_fit(ctx_unet):
    """A card below the UNet plus its activations: the plain forward runs out of memory, the
    streamed one finishes with the same output, its peak within resident + buffers + activations."""
    kw = _inputs(side=16)
    with torch.no_grad():
        ref = ctx_unet(**kw)
    act = _activations(ctx_unet, kw)
    plan = _plan_holding(ctx_unet, 2 / 3)
    # room for the streamed step, and for the whole UNet beside the step's output (the move back)
    capacity = max(plan.resident_bytes + plan.buffer_bytes + act, plan.unet_bytes + 4 * ref.numel() * 4)
    assert capacity < plan.unet_bytes + act
    plain = EmulatedCard(capacity, resident=[ctx_unet])
    with torch.no_grad(), plain, pytest.raises(torch.OutOfMemoryError):
        ctx_unet(**kw)
    card = EmulatedCard(capacity, resident=[ctx_unet])
    with torch.no_grad(), card, StreamedUNet(ctx_unet, plan, "cpu") as s:
        outs = [ctx_unet(**kw) for _ in range(2)]  # the second one prefetches
    assert all(torch.equal(out, ref) for out in outs)
    # never more than the resident units, two streamed ones and the activations (+ the outputs)
    assert card.peak_bytes <= plan.resident_bytes + plan.buffer_bytes + act + 2 * ref.numel() * 4
    assert s.stats.prefetched > 0 and s.stats.prefetch_ooms == 0
    assert s.stats.most_units_here == 2


def test_lowvram_traffic_is_one_forward_per_step_whatever_vram_guards_micro_batch(ctx_unet):
    # the host with --lowvram runs the cond/uncond batch in one forward per step (counted in the
    # real WebUI v1.10.1: docs/webui-acceptance.md, issue 22 run): VRAM Guard's micro-batch 1 doubles
    # its own streamed bytes, not --lowvram's
    units = unit_bytes(ctx_unet)
    total = sum(b for _, b in units)
    one = choose_resident(units, weights_budget_bytes=total // 2, activation_bytes=0, forwards_per_step=1)
    two = choose_resident(
        units, weights_budget_bytes=total // 2, activation_bytes=0, micro_batch=1, forwards_per_step=2
    )
    assert one.lowvram_bytes_per_step == two.lowvram_bytes_per_step == lowvram_bytes_per_forward(units)
    assert two.bytes_moved_per_step == 2 * one.bytes_moved_per_step > 0


def test_bytes_per_step_at_most_a_third_of_lowvram_where_two_thirds_stay(ctx_unet):
    kw = _inputs()
    plan = _plan_holding(ctx_unet, 2 / 3)
    units = unit_bytes(ctx_unet)
    lowvram = lowvram_bytes_per_forward(units)
    # --lowvram's model on the same unit list: time_embed, every input block, the middle block and
    # every output block go in and out once per forward; label_emb and out stay
    assert lowvram == 2 * sum(b for n, b in units if n != "out")
    card = EmulatedCard(1 << 30, resident=[ctx_unet])
    forwards = 3
    with torch.no_grad(), card, StreamedUNet(ctx_unet, plan, "cpu") as s:
        for _ in range(forwards):
            ctx_unet(**kw)
    first = next(b for n, b in units if n == plan.streamed[0])
    # each forward brings every streamed unit once; the last one prefetched the next forward's
    # first unit (cyclic prefetch), which the job's end dropped unused
    assert s.stats.bytes_in == forwards * plan.streamed_bytes + first
    assert s.stats.bytes_back == 0
    per_forward = (s.stats.bytes_in - first) / forwards
    assert per_forward == plan.bytes_moved_per_step
    assert per_forward <= lowvram / 3
    assert plan.lowvram_bytes_per_step == lowvram


def test_lora_style_in_place_merge_is_kept_once(ctx_unet):
    """The Lora extension merges its weights in place inside the forward (once, with a CPU backup
    kept on the module) and skips the merge when already merged. A streamed weight that changed
    on the device is written back to the host copy: the merge persists and is not doubled."""
    kw = _inputs()
    plan = choose_resident(unit_bytes(ctx_unet), weights_budget_bytes=0, activation_bytes=0)
    target = ctx_unet.input_blocks[1][1].transformer_blocks[0].attn1.to_q
    delta = torch.full_like(target.weight, 0.01)

    def merge(module, args):
        with torch.no_grad():
            if getattr(module, "merged", False):
                return
            module.network_weights_backup = module.weight.to("cpu", copy=True)
            module.weight += delta
            module.merged = True

    # the unstreamed reference: the same merge on a plain copy of the UNet
    plain = copy.deepcopy(ctx_unet)
    h1 = plain.input_blocks[1][1].transformer_blocks[0].attn1.to_q.register_forward_pre_hook(merge)
    h2 = target.register_forward_pre_hook(merge)
    try:
        with torch.no_grad():
            refs = [plain(**kw) for _ in range(2)]
        card = EmulatedCard(1 << 30, resident=[ctx_unet])
        with torch.no_grad(), card, StreamedUNet(ctx_unet, plan, "cpu") as s:
            outs = [ctx_unet(**kw) for _ in range(2)]
    finally:
        h1.remove()
        h2.remove()
    for out, ref in zip(outs, refs, strict=True):
        assert torch.equal(out, ref)
    assert torch.equal(target.weight, target.network_weights_backup + delta)
    assert s.stats.bytes_back == target.weight.numel() * 4


# -- the fault matrix -----------------------------------------------------------------------------


def _dry_trace(unet, plan, kw, card_bytes):
    """Two forwards (the first learns the call order and runs on demand, the second prefetches):
    the streamer's trace and the second forward's allocation range."""
    card = EmulatedCard(card_bytes, resident=[unet])
    with torch.no_grad(), card, StreamedUNet(unet, plan, "cpu") as s:
        unet(**kw)
        start = card.allocations + 1
        unet(**kw)
        step = (start, card.allocations)
    return s.stats.trace, step


def _run_faulted(unet, plan, kw, card_bytes, at):
    card = EmulatedCard(card_bytes, resident=[unet], inject_oom_at=at)
    err = None
    try:
        with torch.no_grad(), card, StreamedUNet(unet, plan, "cpu") as s:
            unet(**kw)
            out = unet(**kw)
    except Exception as exc:  # the test inspects what came out
        # its type only: the traceback's frames hold the step's tensors (alive on the card)
        err, out = type(exc), None
    gc.collect()
    return card, s, out, err


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_oom_in_a_streamed_step_restores_everything(ctx_unet, where):
    kw = _inputs()
    plan = _plan_holding(ctx_unet, 0.5)
    before = _bits(ctx_unet)
    _, (first, last) = _dry_trace(ctx_unet, plan, kw, 1 << 30)
    at = {"first": first, "middle": (first + last) // 2, "last": last}[where]
    card, s, out, err = _run_faulted(ctx_unet, plan, kw, 1 << 30, at)
    assert card.injected
    assert err is torch.OutOfMemoryError
    assert _same_bits(ctx_unet, before)
    assert _no_hooks(ctx_unet)
    assert card.resident_bytes == plan.unet_bytes
    assert card.ledger.live_bytes == 0


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_oom_in_a_prefetch_falls_back_to_on_demand(ctx_unet, where):
    kw = _inputs()
    with torch.no_grad():
        ref = ctx_unet(**kw)
    plan = _plan_holding(ctx_unet, 0.5)
    before = _bits(ctx_unet)
    trace, _ = _dry_trace(ctx_unet, plan, kw, 1 << 30)
    # a prefetch with several tensors (the second forward's)
    fetch = next(t for t in trace if t[0] == "prefetch" and t[3] - t[2] >= 2)
    at = {"first": fetch[2], "middle": (fetch[2] + fetch[3]) // 2, "last": fetch[3]}[where]
    card, s, out, err = _run_faulted(ctx_unet, plan, kw, 1 << 30, at)
    assert err is None and card.injected
    assert s.stats.prefetch_ooms == 1
    assert torch.equal(out, ref)
    assert _same_bits(ctx_unet, before)
    assert card.resident_bytes == plan.unet_bytes


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_oom_in_the_move_back_retries_and_restores(ctx_unet, where):
    kw = _inputs()
    plan = _plan_holding(ctx_unet, 0.5)
    before = _bits(ctx_unet)
    trace, _ = _dry_trace(ctx_unet, plan, kw, 1 << 30)
    back = next(t for t in trace if t[0] == "back")
    assert back[3] - back[2] >= 2
    at = {"first": back[2], "middle": (back[2] + back[3]) // 2, "last": back[3]}[where]
    card, s, out, err = _run_faulted(ctx_unet, plan, kw, 1 << 30, at)
    assert err is None and card.injected and card.ooms == 1
    assert not s.pending
    assert _same_bits(ctx_unet, before)
    assert card.resident_bytes == plan.unet_bytes
    assert card.ledger.live_bytes == out.numel() * out.element_size()  # only the step's output


def test_a_move_back_that_cannot_fit_stays_pending_until_restore(ctx_unet):
    kw = _inputs()
    plan = _plan_holding(ctx_unet, 0.5)
    before = _bits(ctx_unet)
    card = EmulatedCard(1 << 30, resident=[ctx_unet])
    s = StreamedUNet(ctx_unet, plan, "cpu")
    with pytest.raises(RuntimeError, match="could not move back"), torch.no_grad(), card, s:
        ctx_unet(**kw)
        card.capacity = card.resident_bytes + 1  # another process took the memory meanwhile
    assert s.pending
    assert card.resident_bytes == plan.resident_bytes
    card.capacity = 1 << 30
    s.restore()
    assert not s.pending
    assert card.resident_bytes == plan.unet_bytes
    assert _same_bits(ctx_unet, before)


class Interrupted(Exception):
    """What the WebUI's ``state.interrupted`` check raises from inside a block's forward."""


def test_interrupt_mid_step_leaves_every_weight_where_and_as_it_was(ctx_unet):
    kw = _inputs()
    plan = _plan_holding(ctx_unet, 0.5)
    before = _bits(ctx_unet)
    where = {n: t.data_ptr() for n, t in ctx_unet.state_dict().items()}
    inside = ctx_unet.get_submodule(plan.streamed[len(plan.streamed) // 2])

    def interrupt(module, args):
        raise Interrupted("interrupted")

    card = EmulatedCard(1 << 30, resident=[ctx_unet])
    with pytest.raises(Interrupted), torch.no_grad(), card, StreamedUNet(ctx_unet, plan, "cpu") as s:
        # registered after the streamer's: the unit has arrived when the interrupt comes
        h = inside.register_forward_pre_hook(interrupt)
        try:
            ctx_unet(**kw)
        finally:
            h.remove()
    assert s.stats.bytes_in > 0
    assert _same_bits(ctx_unet, before)
    assert {n: t.data_ptr() for n, t in ctx_unet.state_dict().items()} == where
    assert _no_hooks(ctx_unet)
    assert card.resident_bytes == plan.unet_bytes and card.ledger.live_bytes == 0


# -- the plan -------------------------------------------------------------------------------------


def test_plan_uses_the_sampling_estimate_and_learns_from_oom(ctx_unet):
    spec = unet_spec(ctx_unet)
    mem = planner.PlanMemory()
    kw = dict(
        batch=2, latent_hw=(8, 8), context_tokens=5, attention="sdp", dtype=torch.float32, backend="cpu"
    )
    wb = sum(b for _, b in unit_bytes(ctx_unet))
    budget = int(wb * 0.8)
    sp = plan_sampling(spec, budget_bytes=budget, memory=mem, **kw)
    assert not sp.fits
    plan = plan_stream(ctx_unet, spec, budget_bytes=budget, memory=mem, **kw)
    # the weights' budget is what the sampling plan's own numbers for the chosen micro-batch
    # leave: no second estimate
    act = next(c.peak_bytes for c in sp.candidates if c.batch == plan.micro_batch)
    act -= sp.weights_bytes + sp.input_bytes
    assert plan.activation_bytes == act
    assert plan.weights_budget_bytes == budget - sp.input_bytes - act
    assert plan.resident_bytes + plan.buffer_bytes <= plan.weights_budget_bytes
    assert plan.forwards_per_step == 2 // plan.micro_batch
    assert plan.label.startswith("UNet streamed: ") and " MiB resident" in plan.label
    # an out-of-memory error with this plan: the next plan for the same step keeps fewer units
    card = EmulatedCard(1 << 30, resident=[ctx_unet], inject_oom_at=1)
    with (
        pytest.raises(torch.OutOfMemoryError),
        torch.no_grad(),
        card,
        StreamedUNet(ctx_unet, plan, "cpu", memory=mem),
    ):
        ctx_unet(**_inputs())
    again = plan_stream(ctx_unet, spec, budget_bytes=budget, memory=mem, **kw)
    assert len(again.resident) < len(plan.resident)
    assert any("learned" in n for n in again.notes)


def _per_step(unet, plan, kw: dict, capacity: int) -> tuple[int, int, torch.Tensor]:
    """(bytes copied in by the third of three sampling steps of the batch at ``plan.micro_batch``,
    the card's peak, the last output): the steady state, where the last unit of a step prefetches
    the first of the next."""
    card = EmulatedCard(capacity, resident=[unet])
    with torch.no_grad(), card, StreamedUNet(unet, plan, "cpu") as s:
        step = micro_batched(lambda **k: unet(**k), plan.micro_batch, memory=planner.PlanMemory())
        for _ in range(2):
            step(**kw)
        before = s.stats.bytes_in
        out = step(**kw)
        moved = s.stats.bytes_in - before
    assert s.stats.forwards == 3 * plan.forwards_per_step
    return moved, card.peak_bytes, out


def test_the_streamed_plan_picks_the_micro_batch_that_moves_the_fewest_bytes(ctx_unet):
    """A larger micro-batch needs more activations (fewer resident bytes) but brings the streamed
    units in fewer times per step. Cards that hold the UNet but not its step: on an 8x8 latent
    batch 2 in one forward keeps almost as much resident as micro-batch 1 and moves fewer bytes, so
    it is chosen; on a 32x32 latent batch 2's activations leave less than a streaming buffer, only
    micro-batch 1 fits. The bytes per step are the plan's exactly, counted on the real UNet's
    streamed copies, and the output is the unstreamed one's bit for bit."""
    spec = unet_spec(ctx_unet)
    units = unit_bytes(ctx_unet)
    total = sum(b for _, b in units)
    two = sum(sorted((b for _, b in units), reverse=True)[:2])  # the smallest streaming buffer

    def planned(side, budget=None):
        kw = dict(
            batch=2, latent_hw=(side, side), context_tokens=5, attention="none", dtype=torch.float32,
            backend="cpu",
        )  # fmt: skip
        mem = planner.PlanMemory()
        sp = plan_sampling(spec, budget_bytes=budget or 1 << 30, memory=mem, **kw)
        act = {c.batch: c.peak_bytes - sp.weights_bytes - sp.input_bytes for c in sp.candidates}
        if budget is None:
            return sp, act
        return sp, act, plan_stream(ctx_unet, spec, budget_bytes=budget, memory=mem, sampling=sp, **kw)

    # 1. 8x8: batch 2 in one forward moves fewer bytes per step than micro-batch 1
    _, act = planned(8)
    budget = total + act[1] // 2
    sp, act, plan = planned(8, budget)
    assert not sp.fits and sp.micro_batch == 1
    alt = choose_resident(
        units, weights_budget_bytes=budget - sp.input_bytes - act[1], activation_bytes=act[1],
        micro_batch=1, forwards_per_step=2,
    )  # fmt: skip
    assert plan.fits and alt.fits
    assert (plan.micro_batch, plan.forwards_per_step, plan.batch) == (2, 1, 2)
    assert plan.activation_bytes == act[2]  # the sampling plan's own numbers
    assert plan.weights_budget_bytes == budget - sp.input_bytes - act[2]
    assert plan.resident_bytes <= alt.resident_bytes  # more activations: no more resident
    assert plan.bytes_moved_per_step == plan.unet_bytes - plan.resident_bytes
    assert alt.bytes_moved_per_step == 2 * (alt.unet_bytes - alt.resident_bytes)
    assert plan.bytes_moved_per_step < alt.bytes_moved_per_step
    assert plan.label.endswith(", batch 2 in one forward")
    assert any(n.startswith("streamed at micro-batch 2 of 2") for n in plan.notes), plan.notes
    inputs = _inputs(side=8)
    with torch.no_grad():
        ref = ctx_unet(**inputs)
    moved, peak, out = _per_step(ctx_unet, plan, inputs, budget)
    assert moved == plan.bytes_moved_per_step
    assert peak <= budget
    assert torch.equal(out, ref)

    # 2. 32x32: between the UNet and batch 2's activations + the smallest buffer only micro-batch 1
    # fits
    sp, act = planned(32)
    assert sp.input_bytes + act[2] + two > total
    budget = (total + sp.input_bytes + act[2] + two) // 2
    sp, act, plan = planned(32, budget)
    assert budget - sp.input_bytes - act[2] < two  # batch 2 cannot stream even its smallest units
    assert plan.fits and (plan.micro_batch, plan.forwards_per_step) == (1, 2)
    assert plan.activation_bytes == act[1]
    assert plan.bytes_moved_per_step == 2 * (total - plan.resident_bytes)
    assert plan.label.endswith(", micro-batch 1 of 2")
    assert any("the only one that fits" in n for n in plan.notes), plan.notes
    inputs = _inputs(side=32)
    with torch.no_grad():
        ref = micro_batched(lambda **k: ctx_unet(**k), 1, memory=planner.PlanMemory())(**inputs)
    moved, peak, out = _per_step(ctx_unet, plan, inputs, budget)
    assert moved == plan.bytes_moved_per_step
    assert peak <= budget
    assert torch.equal(out, ref)


def test_big_units_stay_resident_small_ones_stream(ctx_unet):
    units = unit_bytes(ctx_unet)
    total = sum(b for _, b in units)
    plan = choose_resident(units, weights_budget_bytes=int(total * 0.8), activation_bytes=0)
    sizes = dict(units)
    assert plan.resident and plan.streamed
    assert plan.resident_bytes + plan.buffer_bytes <= int(total * 0.8)
    # the largest unit is resident, and no streamed unit is larger than the largest resident one
    assert max(sizes, key=sizes.get) in plan.resident
    assert max(sizes[n] for n in plan.streamed) <= max(sizes[n] for n in plan.resident)


def test_bad_input_gets_one_clear_line():
    with pytest.raises(ValueError, match="ldm/sgm UNetModel"):
        unet_units(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="forwards_per_step"):
        choose_resident([("out", 4)], weights_budget_bytes=8, activation_bytes=0, forwards_per_step=0)
    with pytest.raises(ValueError, match="units"):
        choose_resident([], weights_budget_bytes=8, activation_bytes=0)
    with pytest.raises(ValueError, match="does not have"):
        StreamedUNet(tiny_unet(), ["input_blocks.99"], "cpu")


def test_parts_that_came_back_during_a_streamed_pass_stay_counted_resident(ctx_unet):
    # the real WebUI (docs/webui-acceptance.md, issue 22 run): the idle VAE/text encoders moved off
    # for the pass came back when the next stage woke them, before the pass's stack closed; the
    # streamer's end then set the card's resident to what it was at its start and lost their bytes
    kw = _inputs()
    plan = _plan_holding(ctx_unet, 2 / 3)
    others = 12345678
    card = EmulatedCard(1 << 30, resident=[ctx_unet])
    unet_only = card.resident_bytes
    with torch.no_grad(), card, StreamedUNet(ctx_unet, plan, "cpu"):
        ctx_unet(**kw)
        assert card.resident_bytes == unet_only - plan.streamed_bytes
        card.set_resident(card.resident_bytes + others)  # the idle parts woke up mid-pass
    assert card.resident_bytes == unet_only + others


def test_bench_gpus_streamed_part_refuses_cleanly_without_cuda():
    """``bench gpu``'s ``stream_unet`` part measures the side stream's overlap on a real GPU; on
    a machine without CUDA it builds nothing and says why in one line of the run's ``skipped``."""
    from lib_vram.cli.bench import gpu
    from lib_vram.cli.bench.sampling_stream import gpu_stream

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the part runs (bench gpu)")
    skipped: list[str] = []
    assert gpu.gpu_stream(torch.device("cpu"), gpu._Clock(60.0), skipped) == []
    assert skipped == ["stream_unet: needs CUDA (side-stream copy/compute overlap from pinned memory)"]
    assert gpu_stream("cpu") == []


def test_more_streamed_frees_the_need_with_the_fewest_bytes():
    from lib_vram.sampling import more_streamed

    units = [("a", 100), ("b", 40), ("c", 40), ("d", 10), ("e", 10), ("f", 10), ("g", 300)]
    resident = ["a", "b", "c", "d", "e", "f"]  # ("g" streams already)
    assert more_streamed(units, resident, 0) == ((), 0, 0)
    # 25 short: the three 10s free 30 - 20 (their buffer) = 10, not enough; b, c, d free 90 - 80 = 10;
    # b, c, d, e free 100 - 80 = 20; b..f: 110 - 80 = 30 >= 25 (110 bytes); a + b + c: 180 - 140
    names, nbytes, buffer = more_streamed(units, resident, 25)
    assert names == ("b", "c", "d", "e", "f") and nbytes == 110 and buffer == 80
    assert nbytes - buffer >= 25
    # what no choice frees: every resident unit, 210 - 140 = 70
    assert more_streamed(units, resident, 70)[1:] == (210, 140)
    assert more_streamed(units, resident, 71) is None
    # only resident units are ever chosen, in the units' order
    assert set(more_streamed(units, resident, 60)[0]) <= set(resident)
