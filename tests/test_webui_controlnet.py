"""ControlNet inside the budget (lib_vram.residency.controlnet, the sampling guard, the one owner).

The control model is a ControlNet in cldm's layout made of a real ldm UNet's encoder
(tests/controlnet_model.py); the hook on the UNet does what sd-webui-controlnet's ``UnetHook``
does for memory (every unit's model to the device at each forward, Low VRAM back to the CPU after
it, the residuals added to the UNet's skips). The card is the emulated one: the checkpoint is
resident, a control model VRAM Guard places counts on it while it is on the card, and an
allocation beyond the card raises the real out-of-memory error.

Criterion: where VRAM Guard runs the pass whole it runs the same kernels, so its UNet outputs are
bit-identical to the plain run's; where it micro-batches through ControlNet's wrapper each sample's
output is the whole batch's within the float rounding of another kernel blocking
(``same_samples``: bit-identity is not promised).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from controlnet_model import (
    ControlNet,
    ControlNetScript,
    ControlParams,
    PlugableControlModel,
    Runner,
    UnetHook,
)
from test_webui_sampling import (
    BIG,
    HW,
    IMAGES,
    MODEL,
    NO_MARGIN,
    SIGMAS,
    TE_BYTES,
    UNET,
    VAE_BYTES,
    Step,
    assert_clean,
    run_job,
    same_samples,
    sample_pass,
)
from torch import nn
from webui_fakes import FakeHost

from lib_vram.core import emulate
from lib_vram.sampling import estimate_sampling, reference_control, reference_spec, unet_spec


class CountedModel(PlugableControlModel):
    """Counts the moves that reach the model (ControlNet's, not the owner's)."""

    moves = 0

    def to(self, *args: Any, **kwargs: Any) -> Any:
        CountedModel.moves += 1
        return super().to(*args, **kwargs)


CONTROL = CountedModel(ControlNet(UNET))
CONTROL_BYTES = emulate.module_bytes([CONTROL])
# one control image, broadcast over the batch (as sd-webui-controlnet passes it)
HINT = torch.rand(1, 3, HW[0] * 8, HW[1] * 8, generator=torch.Generator().manual_seed(5))


def _controlnet_run(
    capacity: int, *, hr_option: str = "both", lowvram: bool = False, hires: bool = False, hint=HINT, **kw
):
    """A job whose ControlNet script hooks the UNet before the first pass (as its ``process``
    does), one pass (and a hires pass), the hook restored at the end. The output: each pass's UNet
    outputs, the card's resident bytes seen at each UNet forward, each pass's plan and the calls
    of ControlNet's forward wrapper."""
    seen: list[int] = []

    class Seen(Step):
        def __call__(self, x_in: Any, t: Any, ctx: Any) -> Any:
            out = super().__call__(x_in, t, ctx)
            seen.append(emulate.installed().resident_bytes)
            return out

    def body(jobs: Any, p: Any) -> Any:
        hook = UnetHook(lowvram=lowvram)
        p.scripts = Runner(object(), ControlNetScript(hook))
        hook.hook(UNET, [ControlParams(CONTROL, hint, hr_option=hr_option)])
        try:
            outs = [sample_pass(jobs, p, step=Seen())[0]]
            if hires:
                hook.hires = True
                outs.append(sample_pass(jobs, p, step=Seen(), hr=True)[0])
            guard = getattr(jobs.job, "sampling", None)
            return outs, seen, [x.plan for x in guard.passes] if guard else [], hook.calls
        finally:
            hook.restore()

    return run_job(capacity, body, settings={**NO_MARGIN, **kw.pop("settings", {})}, **kw)


@functools.lru_cache(maxsize=1)
def _plain() -> Any:
    r = _controlnet_run(BIG, guard_sampling=False)
    assert r.error is None, r.error
    return r


def _peak(r: Any, m: int) -> int:
    """The first pass's predicted peak at micro-batch ``m`` with everything where it was."""
    return next(c.peak_bytes for c in r.out[2][0].candidates if c.batch == m)


def test_the_control_matters():
    """Without the control the UNet's outputs differ (a test of placement that a no-op control
    would pass proves nothing)."""
    ref = _plain()
    without = run_job(BIG, lambda jobs, p: sample_pass(jobs, p)[0], settings=NO_MARGIN, guard_sampling=False)
    assert not torch.equal(without.out, ref.out[0][0])


def test_the_pass_plan_counts_the_control_model_and_it_leaves_the_card_after_the_job():
    ref = _plain()
    r = _controlnet_run(BIG)
    assert r.error is None, r.error
    assert torch.equal(r.out[0][0], ref.out[0][0])  # bit-identical: the same kernels on the same batch
    predicted = [n for n in r.notes if "predicted peak" in n]
    assert predicted and "1 ControlNet unit on the card" in predicted[0], r.notes
    # the control model was on the card for the pass (the owner woke it), and is not after the job
    resident = r.resident_before
    assert set(r.out[1]) == {resident + CONTROL_BYTES}, (r.out[1], resident, CONTROL_BYTES)
    assert not any(m["role"] == "control" for m in r.final["models"])
    moves = [m for m in r.final["moves"] if m.startswith("ControlNet unit 0 (")]
    assert len(moves) == 2 and "to the card" in moves[0] and "to the CPU" in moves[1], moves
    assert "to" not in CONTROL.__dict__ and "disable_memory_management" not in CONTROL.__dict__
    assert_clean(r)


def test_a_card_that_holds_the_control_only_without_the_idle_parts():
    """The pass fits with the control model only when the VAE and the text encoders leave the
    card (even at micro-batch 1): the owner sends them, wakes the control model, and the outputs
    are the plain ones."""
    ref = _plain()
    big = _controlnet_run(BIG)
    assert big.peak <= big.out[2][0].predicted_peak_bytes  # (the plan's prediction holds)
    cap = _peak(big, 1) - (VAE_BYTES + TE_BYTES) + 64 * 1024
    r = _controlnet_run(cap)
    assert r.error is None, r.error
    same_samples(r.out[0][0], ref.out[0][0])
    assert r.peak <= cap and r.status["card"]["ooms"] == 0
    assert any("off the card" in n for n in r.notes), r.notes
    assert_clean(r)


def test_micro_batches_run_through_controlnets_wrapper():
    """The whole batch does not fit beside the control model, two samples do: the pass runs in
    micro-batches through ControlNet's forward wrapper (each computes the control on its own rows,
    the one control image broadcast over them), nothing leaves the card, and each sample's output
    is the whole batch's. The plain WebUI runs out of memory there."""
    ref = _plain()
    big = _controlnet_run(BIG)
    cap = _peak(big, 2) + 64 * 1024
    assert cap < _peak(big, 4)
    plain = _controlnet_run(cap, guard_sampling=False)
    assert plain.error is not None and "out of memory" in str(plain.error).lower(), plain.error
    r = _controlnet_run(cap)
    assert r.error is None, r.error
    same_samples(r.out[0][0], ref.out[0][0])
    assert r.out[2][0].micro_batch == 2 and r.out[3] == 2 * len(SIGMAS), (r.out[2][0], r.out[3])
    assert big.out[3] == len(SIGMAS)  # (one wrapper call per step when the whole batch runs)
    assert not any("off the card" in n for n in r.notes), r.notes
    assert r.peak <= cap and r.status["card"]["ooms"] == 0
    assert_clean(r)


def test_a_unit_with_a_control_image_per_sample_runs_whole_or_stops_with_the_reason():
    """A unit with one control image per sample (a batch of control images): ControlNet's hook
    does not split them with the rows, so the pass runs its whole batch (the idle parts off where
    that fits) and where even that does not fit, the named stop says why it did not micro-batch."""
    per_sample = HINT.expand(2 * IMAGES, -1, -1, -1).contiguous()
    big = _controlnet_run(BIG, hint=per_sample)
    assert big.error is None, big.error
    assert [c.batch for c in big.out[2][0].candidates] == [2 * IMAGES]
    cap = _peak(big, 2 * IMAGES) - (VAE_BYTES + TE_BYTES) - (1 << 20)
    r = _controlnet_run(cap, hint=per_sample)
    assert r.error is not None and "stopped sampling before it ran out of memory" in str(r.error), r.error
    assert "whole batch, as ControlNet unit 0 has a control image per sample (4)" in str(r.error)
    assert r.status["card"]["ooms"] == 0
    assert_clean(r)


def test_controlnet_low_vram_moves_are_held_for_the_pass():
    """ControlNet's Low VRAM sends the model to the CPU after each forward (and its own
    ``fullvram`` brings it back): under VRAM Guard none of these reach the model; without it they
    do, twice per step. Both give the same outputs."""
    CountedModel.moves = 0
    plain = _controlnet_run(BIG, lowvram=True, guard_sampling=False)
    plain_moves, CountedModel.moves = CountedModel.moves, 0
    r = _controlnet_run(BIG, lowvram=True)
    assert plain.error is None and r.error is None, (plain.error, r.error)
    assert plain_moves == 2 * len(SIGMAS) and CountedModel.moves == 0, (plain_moves, CountedModel.moves)
    assert torch.equal(r.out[0][0], plain.out[0][0])
    assert_clean(r)


def test_low_res_only_keeps_the_control_model_off_the_card_in_the_hires_pass():
    """The #1850 case: ControlNet on the first pass only; ControlNet's own hook still moves every
    unit's model to the card at each forward of the hires pass. Under VRAM Guard it stays in host
    memory for the hires pass, and the outputs are the plain ones."""
    plain = _controlnet_run(BIG, hr_option=ControlParams.LOW_RES_ONLY, hires=True, guard_sampling=False)
    r = _controlnet_run(BIG, hr_option=ControlParams.LOW_RES_ONLY, hires=True)
    assert plain.error is None and r.error is None, (plain.error, r.error)
    for got, want in zip(r.out[0], plain.out[0]):
        assert torch.equal(got, want)
    first, hires = r.out[1][: len(SIGMAS)], r.out[1][len(SIGMAS) :]
    assert set(first) == {r.resident_before + CONTROL_BYTES}, first
    assert set(hires) == {r.resident_before}, hires
    hires_plan = [n for n in r.notes if "predicted peak" in n and "hires" in n]
    assert hires_plan and "ControlNet" not in hires_plan[0], r.notes
    assert_clean(r)


def test_a_job_without_controlnet_after_one_with_it_finds_the_card_as_before():
    """The #628 case: after a job with ControlNet nothing of it stays on the card."""
    r1 = _controlnet_run(BIG)
    r2 = run_job(BIG, lambda jobs, p: sample_pass(jobs, p)[0], settings=NO_MARGIN)
    assert r1.error is None and r2.error is None
    assert r2.resident_before == r1.resident_before and r2.peak < r1.peak
    assert not any(m["role"] == "control" for m in r2.final["models"])
    assert_clean(r2)


# -- the estimate of a ControlNet's forward against the real modules --------------------------------


@pytest.mark.parametrize("shape", ["sd15", "sdxl"])
def test_control_spec_and_parameter_count(shape):
    from lib_vram.cli.models.unet import build_unet
    from lib_vram.sampling import param_count

    net = ControlNet(build_unet(shape, 32, context_dim=96))
    spec = unet_spec(net)
    assert spec.is_control and spec.params == sum(p.numel() for p in net.parameters())
    assert param_count(spec) == spec.params


def test_reference_controlnets():
    # SD1.5's ControlNet: the UNet's encoder and middle, 13 zero convolutions, the hint block
    sd15 = reference_control("sd15")
    assert 1.40e9 < sd15.params * 4 < 1.50e9  # ~1.45 GB in FP32
    assert 2.4e9 < reference_control("sdxl").params * 2 < 2.6e9  # ~2.5 GB in FP16
    with pytest.raises(ValueError, match="ControlNet"):
        reference_control("sd2")


@pytest.mark.parametrize("attention", ["sdp", "none", "doggettx"])
@pytest.mark.parametrize(("hw", "batch"), [((16, 16), 2), ((24, 32), 4)])
def test_control_forward_activations_within_15_percent(attention, hw, batch):
    """The control model's forward on fake tensors, counted as the sampling estimate's tests count
    the UNet's (tests/test_sampling_estimate.py), against the closed-form walk."""
    from lib_vram.cli.models.unet import attention_applied, build_unet, host_forward
    from lib_vram.core.livebytes import LiveBytesCounter
    from lib_vram.core.predict import fake_call, fake_state, new_fake_mode

    net = _fake_controlnet()
    mode = new_fake_mode()
    call = fake_call(net, fake_state(net, mode, torch.float32))
    with mode:
        x, t = torch.empty(batch, 4, *hw), torch.empty(batch)
        hint, ctx = torch.empty(1, 3, hw[0] * 8, hw[1] * 8), torch.empty(batch, 77, 96)
    counter = LiveBytesCounter(None)
    fwd = host_forward(attention, lambda: float(1 << 50) - counter.live_bytes, "cuda", False)
    with attention_applied(net, fwd), torch.no_grad(), mode, counter:
        del_out = call(x, hint, t, ctx)
        del del_out
    want = estimate_sampling(
        unet_spec(net), batch=batch, latent_hw=hw, context_tokens=77, attention=attention, dtype=torch.float32
    ).activation_bytes
    got = counter.peak_bytes
    assert abs(want - got) <= 0.15 * got, (want, got)
    assert build_unet  # (imported for the net's builder)


@functools.lru_cache(maxsize=1)
def _fake_controlnet() -> ControlNet:
    from lib_vram.cli.models.unet import build_unet

    return ControlNet(build_unet("sd15", 32, context_dim=96))


def test_a_pass_with_controlnets_counts_their_weights_and_runs_whole():
    from lib_vram.sampling import plan_sampling

    spec = reference_spec("sd15")
    kw = dict(batch=4, latent_hw=(64, 64), context_tokens=77, attention="sdp", dtype=torch.float16)
    bare = plan_sampling(spec, budget_bytes=1 << 40, **kw)
    one = plan_sampling(spec, budget_bytes=1 << 40, controls=(reference_control("sd15"),), **kw)
    two = plan_sampling(spec, budget_bytes=1 << 40, controls=(reference_control("sd15"),) * 2, **kw)
    cb = reference_control("sd15").params * 2
    assert one.control_bytes == cb and two.control_bytes == 2 * cb
    assert one.predicted_peak_bytes > bare.predicted_peak_bytes + cb
    assert two.predicted_peak_bytes > one.predicted_peak_bytes + cb
    # a budget where the whole batch does not fit: the pass micro-batches, also with ControlNet
    # (its control image is broadcast over the rows); a pass that cannot split stops
    tight = plan_sampling(spec, budget_bytes=bare.predicted_peak_bytes - 1, **kw)
    assert tight.fits and tight.micro_batch < 4
    cn = (reference_control("sd15"),)
    tight_cn = plan_sampling(spec, budget_bytes=one.predicted_peak_bytes - 1, controls=cn, **kw)
    assert tight_cn.fits and tight_cn.micro_batch < 4
    small = {c.batch: c.peak_bytes for c in tight_cn.candidates}
    assert small[1] < small[2] < small[4] == one.predicted_peak_bytes
    whole = plan_sampling(spec, budget_bytes=one.predicted_peak_bytes - 1, controls=cn, whole=True, **kw)
    assert not whole.fits and whole.micro_batch == 4 and [c.batch for c in whole.candidates] == [4]
    assert "ControlNet" in whole.suggestion


# -- the emulated card sees ControlNet's own moves (the plain WebUI with ControlNet fails there) ----


class EmuPlugable(PlugableControlModel):
    """A class of its own: the emulation patches the class of the models ControlNet builds."""


class ControlModel:
    def __init__(self, model: nn.Module) -> None:
        self.model = model


class ScriptWithLoader(ControlNetScript):
    """The ControlNet script's class as the emulation finds it (``build_control_model``)."""

    @staticmethod
    def build_control_model(p: Any, unet: Any, model: str) -> ControlModel:
        return ControlModel(EmuPlugable(ControlNet(UNET)))


def _emulated_run(capacity: int, *, lowvram: bool = False, **kw: Any):
    def body(jobs: Any, p: Any) -> Any:
        hook = UnetHook(lowvram=lowvram)
        script = ScriptWithLoader(hook)
        p.scripts = Runner(script)
        model = type(script).build_control_model(p, UNET, "control_sd15")  # (in ControlNet's process)
        hook.hook(UNET, [ControlParams(model.model, HINT)])
        try:
            return sample_pass(jobs, p)[0], emulate.installed().resident_bytes
        finally:
            hook.restore()

    host = FakeHost(MODEL)
    host.script_runners = lambda: {"txt2img": Runner(ScriptWithLoader(None))}
    return run_job(capacity, body, host=host, settings={**NO_MARGIN, **kw.pop("settings", {})}, **kw)


def test_the_plain_webui_with_controlnet_fails_where_vram_guard_finishes():
    big = _controlnet_run(BIG)
    cap = big.out[2][0].predicted_peak_bytes - (VAE_BYTES + TE_BYTES) + 64 * 1024
    plain = _emulated_run(BIG, guard_sampling=False)
    assert plain.error is None, plain.error
    # ControlNet's fullvram() put the model on the card: counted there until the job's end (a
    # cached model stays; this one is dropped with the job)
    assert plain.out[1] == plain.resident_before + CONTROL_BYTES
    for lowvram in (False, True):
        failed = _emulated_run(cap, lowvram=lowvram, guard_sampling=False)
        assert failed.error is not None and "out of memory" in str(failed.error).lower(), failed.error
        r = _emulated_run(cap, lowvram=lowvram)
        assert r.error is None, r.error
        same_samples(r.out[0], plain.out[0])
        assert r.peak <= cap
        assert_clean(r)
    assert "fullvram" not in EmuPlugable.__dict__ and "build_control_model" in ScriptWithLoader.__dict__
    assert not getattr(ScriptWithLoader.__dict__["build_control_model"].__func__, "_vram_guard", False)


def test_a_control_model_that_does_not_fit_beside_the_whole_unet_streams_the_unet():
    """Beside the control model the whole UNet does not fit even with the VAE and the text
    encoders off the card: the UNet streams for the pass (the streamed plan counts the control
    model's weights and activations), the control model stays whole on the card, the outputs are
    the plain ones."""
    ref = _plain()
    big = _controlnet_run(BIG)
    cap = _peak(big, 1) - (VAE_BYTES + TE_BYTES) - emulate.module_bytes([UNET]) // 2
    assert _controlnet_run(cap).error is not None  # without streaming: the named stop
    r = _controlnet_run(cap, settings={"stream_unet": True})
    assert r.error is None, r.error
    same_samples(r.out[0][0], ref.out[0][0])
    assert r.peak <= cap
    plans = [st["plan"] for st in r.status["stages"] if st["stage"] == "sampling"]
    assert plans and "UNet streamed" in plans[0] and "ControlNet" in plans[0], plans
    assert_clean(r)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_control_model_whose_move_to_the_card_runs_out_of_memory_stops_the_pass_with_the_line(
    where, monkeypatch
):
    """The owner's move of the control model onto the card fails at its first, a middle or its
    last allocation (issue 42 item 0): no traceback from VRAM Guard's hook, the pass stops at its
    first forward with one line, nothing left half-moved."""
    from lib_vram.residency.controlnet import Controls
    from lib_vram.webui.sampling import SamplingOutOfMemory

    tensors = len(list(CONTROL.parameters())) + len(list(CONTROL.buffers()))
    n = {"first": 1, "middle": tensors // 2, "last": tensors}[where]
    start_pass = Controls.start_pass

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        card = emulate.installed()
        card.inject_oom_at = card.allocations + n
        return start_pass(self, *args, **kwargs)

    monkeypatch.setattr(Controls, "start_pass", failing)
    r = _controlnet_run(BIG)
    assert isinstance(r.error, SamplingOutOfMemory), r.error
    text = str(r.error)
    assert "\n" not in text and "moving its models onto the card" in text, text
    assert r.status["card"]["ooms"] == 1
    assert not any(m["role"] == "control" and m["where"] == "card" for m in r.status.get("models", []))
    assert "to" not in CONTROL.__dict__ and "disable_memory_management" not in CONTROL.__dict__
    assert_clean(r)


def test_a_controlnets_units_are_what_its_forward_calls_in_order_and_hold_every_weight_once():
    """Issue 42: a control model streams by the UNet's units (lib_vram.sampling.unet_units knows
    the cldm layout); the streamer's prefetch follows the order the first forward called them."""
    from lib_vram.sampling import unet_units

    net = CONTROL.control_model
    top = [n for n, _ in unet_units(net, 1)]
    assert top[:4] == ["time_embed", "input_hint_block", "input_blocks.0", "zero_convs.0"]
    assert top[-1] == "middle_block_out" and not any(n.startswith(("output_blocks", "out")) for n in top)
    units = unet_units(net)  # (split into children where large)
    names = [n for n, _ in units]
    called: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda *_, n=n: called.append(n)) for n, m in units]
    try:
        with torch.no_grad():
            net(
                x=torch.rand(1, 4, *HW),
                hint=HINT,
                timesteps=torch.full((1,), 500.0),
                context=torch.rand(1, 77, 48),
            )
    finally:
        for h in hooks:
            h.remove()
    assert sorted(called) == sorted(names)  # (a transformer block calls its children interleaved)
    held = [id(t) for _, m in units for t in (*m.parameters(), *m.buffers())]
    assert len(held) == len(set(held)) and set(held) == {id(t) for t in (*net.parameters(), *net.buffers())}
