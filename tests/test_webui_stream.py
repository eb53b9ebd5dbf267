"""The WebUI's last sampling rung (lib_vram.webui.stream): stream the UNet for a pass that does not
fit even at micro-batch 1, on the emulated card, with a real ldm UNetModel (reduced width)."""

from __future__ import annotations

import logging
from contextlib import ExitStack
from types import SimpleNamespace

import pytest
import torch
from webui_fakes import fake_sd_model

from lib_vram.cli.models.unet import build_unet
from lib_vram.core.emulate import EmulatedCard
from lib_vram.planning import planner
from lib_vram.sampling import micro_batched, plan_sampling, unet_spec, unit_bytes
from lib_vram.webui import stream

SIDE = 32


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def unet():
    return build_unet("sd15", 32, context_dim=64, init=True)


def _step(unet):
    g = torch.Generator().manual_seed(1)
    kw = {
        "x": torch.randn(2, 4, SIDE, SIDE, generator=g),
        "timesteps": torch.tensor([10, 700]),
        "context": torch.randn(2, 77, 64, generator=g),
    }
    return kw


def _card_bytes(unet, kw) -> int:
    """Below the whole UNet plus one micro-batch's activations, above the UNet beside the output."""
    card = EmulatedCard(1 << 40, resident=[unet])
    with torch.no_grad(), card:
        unet(**{k: v[:1] for k, v in kw.items()})
    act1 = card.peak_bytes - card.resident_bytes
    total = sum(b for _, b in unit_bytes(unet))
    return int(act1 + 0.6 * total)


def _plans(unet, capacity, sd_model, **extra):
    spec = unet_spec(unet)
    step = dict(
        latent_hw=(SIDE, SIDE), context_tokens=77, attention="none", dtype=torch.float32, backend="cpu"
    )
    sp = plan_sampling(spec, batch=2, budget_bytes=capacity, memory=planner.PlanMemory(), **step)
    return sp, stream.plan_pass(sd_model, unet, spec, sp, budget_bytes=capacity, **step, **extra)


def _bits(unet):
    return {n: t.detach().clone() for n, t in unet.state_dict().items()}


def _same(unet, before):
    return all(
        torch.equal(t.view(torch.int32), before[n].view(torch.int32)) for n, t in unet.state_dict().items()
    )


def test_a_pass_that_does_not_fit_streams_and_gives_the_uncapped_output(unet, caplog):
    caplog.set_level(logging.INFO, logger="lib_vram.webui.stream")
    kw = _step(unet)
    capacity = _card_bytes(unet, kw)
    sd_model = fake_sd_model(unet=unet)
    sp, sp_stream = _plans(unet, capacity, sd_model)
    assert not sp.fits  # the named error's case in issue 21's guard
    assert sp_stream is not None
    assert sp_stream.label.startswith("UNet streamed: ")
    m = sp_stream.plan.micro_batch
    said = "batch 2 in one forward" if m == 2 else "micro-batch 1 of 2"
    assert sp_stream.label.endswith(f" MiB resident, {said}")
    assert "per step" in sp_stream.describe()

    def forward(**k):
        return unet(**k)

    with torch.no_grad():
        ref = micro_batched(forward, sp.micro_batch, memory=planner.PlanMemory())(**kw)
    before = _bits(unet)
    # the plain pass: the whole UNet resident, micro-batch 1: out of memory
    with torch.no_grad(), EmulatedCard(capacity, resident=[unet]), pytest.raises(torch.OutOfMemoryError):
        micro_batched(forward, 1, memory=planner.PlanMemory())(**kw)
    card = EmulatedCard(capacity, resident=[unet])
    with torch.no_grad(), card:
        stack = ExitStack()
        s = sp_stream.enter(stack)
        try:
            outs = [
                micro_batched(forward, sp_stream.plan.micro_batch, memory=planner.PlanMemory())(**kw)
                for _ in range(2)
            ]
        finally:
            stack.close()
    assert all(torch.equal(o, ref) for o in outs)
    assert s.stats.forwards == 2 * sp_stream.plan.forwards_per_step
    # the pass's end logs what the streamer copied (the real-WebUI acceptance reads it)
    mib = s.stats.bytes_in / 2**20
    assert any(
        f"UNet streamed for {s.stats.forwards} forward(s): {mib:.0f} MiB copied" in r.getMessage()
        for r in caplog.records
    )
    assert _same(unet, before)
    assert card.resident_bytes == sp_stream.plan.unet_bytes
    assert card.peak_bytes <= capacity


@pytest.mark.parametrize(
    "model_attrs, settings, why",
    [
        ({"lowvram": True}, None, "--medvram/--lowvram"),
        ({"forge_objects": object()}, None, "Forge"),
        ({}, SimpleNamespace(stream_unet=False), "'Stream the UNet' is off"),
    ],
)
def test_never_with_lowvram_forge_or_when_off(unet, model_attrs, settings, why):
    kw = _step(unet)
    capacity = _card_bytes(unet, kw)
    sd_model = fake_sd_model(unet=unet)
    for k, v in model_attrs.items():
        setattr(sd_model, k, v)
    assert stream.skip_reason(sd_model, settings) == why
    _, sp_stream = _plans(unet, capacity, sd_model, settings=settings)
    assert sp_stream is None


def test_an_error_in_the_pass_restores_the_unet(unet):
    kw = _step(unet)
    capacity = _card_bytes(unet, kw)
    _, sp_stream = _plans(unet, capacity, fake_sd_model(unet=unet))
    before = _bits(unet)
    card = EmulatedCard(capacity, resident=[unet])

    def boom(module, args):
        raise RuntimeError("interrupted")

    h = unet.output_blocks[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="interrupted"), torch.no_grad(), card, ExitStack() as stack:
            sp_stream.enter(stack)
            unet(**{k: v[:1] for k, v in kw.items()})
    finally:
        h.remove()
    assert _same(unet, before)
    assert card.resident_bytes == sp_stream.plan.unet_bytes
    assert not unet._forward_hooks and not unet._forward_pre_hooks


def test_a_move_back_that_cannot_fit_waits_for_the_next_job(unet, caplog):
    kw = _step(unet)
    capacity = _card_bytes(unet, kw)
    _, sp_stream = _plans(unet, capacity, fake_sd_model(unet=unet))
    before = _bits(unet)
    card = EmulatedCard(capacity, resident=[unet])
    with torch.no_grad(), card:
        stack = ExitStack()
        s = sp_stream.enter(stack)
        unet(**{k: v[:1] for k, v in kw.items()})
        card.capacity = card.resident_bytes  # another process took the card meanwhile
        stack.close()  # the job's close: no error out of it, a warning
    assert s.pending
    assert any("could not move back" in r.getMessage() for r in caplog.records)
    assert stream.restore_pending() == 1
    card.capacity = capacity
    assert stream.restore_pending() == 0
    assert not s.pending
    assert card.resident_bytes == sp_stream.plan.unet_bytes
    assert _same(unet, before)


def test_each_micro_batch_of_the_guards_wrapper_is_a_forward_so_prefetch_starts_at_the_second(unet):
    """The sampling guard's wrapper (an instance ``forward`` on the UNet) calls the original
    ``forward`` once per micro-batch, which fires none of the UNet module's hooks: each must still
    be a forward for the streamer, so the first micro-batch learns the order and the second
    prefetches. One host call of batch 2 at micro-batch 1: two forwards, prefetch, and the output
    of the unstreamed wrapper bit for bit (the same ops in the same order; only placement differs)."""
    import dataclasses

    from lib_vram.webui.sampling import PassPlan, SamplingGuard

    kw = _step(unet)
    capacity = _card_bytes(unet, kw)
    sp, sp_stream = _plans(unet, capacity, fake_sd_model(unet=unet))
    assert sp_stream is not None
    at1 = dataclasses.replace(sp, micro_batch=1, key=None)  # (key None: nothing learned globally)

    def guarded(stream_pass):
        guard = SamplingGuard(SimpleNamespace(warn_once=lambda *a, **k: None))
        guard.stack = ExitStack()
        planned = PassPlan("sampling", 2, (SIDE, SIDE), 77, "none", torch.float32, capacity, at1)
        planned.stream = stream_pass
        try:
            s = stream_pass.enter(guard.stack) if stream_pass is not None else None
            guard._install(unet, planned)
            assert "forward" in unet.__dict__  # the WebUI-style wrapper is in place
            return unet(**kw), s
        finally:
            guard.end()

    with torch.no_grad():
        ref, _ = guarded(None)
    before = _bits(unet)
    card = EmulatedCard(capacity, resident=[unet])
    with torch.no_grad(), card:
        out, s = guarded(sp_stream)
    assert s.stats.forwards == 2
    assert s.stats.prefetched > 0
    assert s.stats.most_units_here == 2
    assert torch.equal(out, ref)
    assert card.peak_bytes <= capacity
    assert _same(unet, before) and "forward" not in unet.__dict__


# -- in the job: the guard's last rung (lib_vram.webui.sampling -> lib_vram.webui.stream) ----------


def test_in_a_job_a_pass_the_guard_would_stop_streams_and_gives_the_plain_samples(caplog):
    """A card where the pass does not fit even with the VAE and text encoders off at micro-batch 1
    (the guard's named error with streaming off), but fits with half the UNet streamed: the pass
    runs within its predicted peak, the samples are the plain run's (the micro-batched forward's
    float rounding only: see test_webui_sampling.same_samples; streaming itself changes no bit,
    test_sampling_stream.py), prefetch runs from the second micro-batch on, the readout/infotext
    say how much stayed resident, and everything is back after the job.

    This was a strict xfail ("~1.3 MiB more than planned"). Measured on the emulated card, the
    streamed pass peaked at 7.72 MiB of the 7.96 MiB card, within its plan; the 1.27 MiB that did
    not fit was the *decode after the pass*: the VAE decoder's mid-block attention scores at the
    24x24 latent (576 x 576 x 4 bytes), with the whole checkpoint back on the card and VRAM Guard's
    VAE tiling off. No term of the sampling plan was missing; the decode goes through VRAM Guard's
    VAE engine here (``vae_tiling="Auto"``), as it does by default."""
    import test_webui_sampling as ws

    from lib_vram.webui.passplan import _attention

    caplog.set_level(logging.INFO, logger="lib_vram.webui.stream")
    caplog.set_level(logging.INFO, logger="lib_vram.residency")
    ref = ws._reference()
    spec = unet_spec(ws.UNET)
    attention = _attention(ws.FakeHost(ws.MODEL), "cpu")
    sp = plan_sampling(
        spec, batch=2 * ws.IMAGES, latent_hw=ws.HW, context_tokens=77, attention=attention,
        dtype=torch.float32, budget_bytes=1 << 40, backend="cpu", memory=planner.PlanMemory(),
    )  # fmt: skip
    peak1 = next(c.peak_bytes for c in sp.candidates if c.batch == 1)
    capacity = peak1 - sp.weights_bytes // 2
    assert capacity > ref.resident_before  # the checkpoint fits at load
    before = _bits(ws.UNET)
    off = ws._sampling(capacity)
    assert off.error is not None and "out of memory" in str(off.error)  # streaming off: the named error
    seen = {}

    def body(jobs, p):
        out = ws.sample_pass(jobs, p)
        guard = jobs.job.sampling
        seen["plan"] = guard.passes[-1]
        return out

    r = ws.run_job(
        capacity, body, settings={**ws.NO_MARGIN, "stream_unet": True}, vae_tiling="Auto"
    )  # fmt: skip
    assert r.error is None, r.error
    ws.same_samples(r.out[0], ref.out[0])
    planned = seen["plan"]
    assert planned.stream is not None and planned.plan.micro_batch == planned.stream.plan.micro_batch
    # the sampling stage's measured peak is within the pass's prediction, which is within the card
    st = next(st for st in r.status["stages"] if st["stage"] == "sampling")
    assert st["peak_bytes"] <= planned.plan.predicted_peak_bytes <= capacity, (st, planned.plan)
    assert "UNet streamed: " in str(st.get("plan")), r.status["stages"]
    notes = " ".join(r.notes)
    assert "UNet streamed: " in notes and " MiB resident" in notes and "--lowvram would move" in notes, notes
    stats = planned.stream.streamer.stats
    forwards = 2 * planned.stream.plan.forwards_per_step  # two sampling steps
    assert stats.forwards == forwards and stats.prefetched > 0, stats
    assert any(f"UNet streamed for {forwards} forward(s)" in rec.getMessage() for rec in caplog.records)
    # the owner of the card knows it streamed (the readout's and the status route's models)
    said = [
        rec.getMessage()
        for rec in caplog.records
        if "VRAM Guard: UNet streams for sampling: " in rec.getMessage()
    ]
    assert len(said) == 1 and "the pass does not fit with the whole UNet" in said[0], said
    assert r.peak <= capacity
    import re

    said = [int(m) for m in re.findall(r"predicted peak (\d+) MiB", notes)]
    assert said and max(said) <= capacity / (1 << 20) + 1, (said, capacity)
    ws.assert_clean(r)
    assert _same(ws.UNET, before)
    assert all(not m._forward_hooks for m in ws.UNET.modules())
