"""The emulated card (lib_vram.core.emulate) and the library's fault matrix on it.

Real modules (ldm Decoder/Encoder from sdkit, spandrel models loaded from files); the out-of-memory
error is the one the card raises (``torch.OutOfMemoryError``), fired by a capacity or injected at
the first, a middle and the last allocation of a stage.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from tolerances import UPSCALE_LSB, VAE_EXACT, levels, reduced_precision
from vae_models import ldm_decoder, ldm_encoder, smooth_latent

from lib_vram.core import device as dev
from lib_vram.core import emulate
from lib_vram.core.emulate import EmulatedCard, parse_size
from lib_vram.core.tracker import StageTracker
from lib_vram.planning import planner
from lib_vram.vae import TiledVAEConfig, VAEOutOfMemory, VAEReport, tiled_decode, tiled_encode

MiB = 2**20


# -- the card itself -------------------------------------------------------------------------------


def test_allocation_over_capacity_raises_the_cuda_error_type():
    card = EmulatedCard(MiB)
    with card:
        a = torch.zeros(200_000)  # 800 kB
        with pytest.raises(torch.OutOfMemoryError, match="out of memory") as info:
            torch.zeros(100_000)
    assert dev.is_oom_error(info.value)
    assert "emulated" in str(info.value) and "1.00 MiB" in str(info.value)
    assert card.ooms == 1 and card.used_bytes == 800_000
    del a
    assert card.used_bytes == 0 and card.peak_bytes == 800_000


def test_views_inplace_and_frees_are_counted_once():
    card = EmulatedCard("1GB")
    with card:
        a = torch.ones(1000)
        v = a[10:]
        a.add_(1)
        assert card.live_bytes == 4000
        del a
        assert card.live_bytes == 4000  # the view keeps the storage
        del v
        assert card.live_bytes == 0


def test_resident_bytes_count_as_used_and_probes_report_the_card():
    dec = ldm_decoder()
    card = EmulatedCard("64MB", resident=[dec])
    weights = sum(p.numel() * 4 for p in dec.parameters())
    assert card.resident_bytes == weights
    assert emulate.current("cpu") is None
    with card:
        info = dev.memory_info("cpu")
        assert info.emulated == card.label and info.total == 64 * MiB
        assert info.free == 64 * MiB - weights == dev.free_bytes("cpu")
        x = torch.zeros(MiB // 4)
        assert dev.free_bytes("cpu") == 64 * MiB - weights - MiB
        del x
    assert dev.memory_info("cpu").emulated is None
    assert emulate.current() is None


def test_peak_across_a_resident_change_is_a_use_the_card_had():
    # Idle models off the card for a pass (resident down), a pass that uses the room, the models
    # back (resident up): the peak is the highest resident + live at any one time, never the live
    # peak of the pass on top of the restored resident (which would exceed the capacity).
    card = EmulatedCard(10 * MiB, resident=8 * MiB)
    with card:
        keep = torch.zeros(MiB // 4)  # 1 MiB under the full resident: 9 MiB used
        card.set_resident(2 * MiB)
        work = torch.zeros(6 * MiB // 4)  # 6 MiB while only 2 MiB are resident: 9 MiB used
        del work
        card.set_resident(8 * MiB)
        assert card.peak_bytes == 9 * MiB <= card.capacity
        more = torch.zeros(MiB // 8)  # 0.5 MiB with the models back: 9.5 MiB used
    assert card.peak_bytes == 9 * MiB + MiB // 2 and card.ooms == 0
    card.reset_peak()
    assert card.peak_bytes == card.used_bytes == 8 * MiB + MiB + MiB // 2
    del keep, more


def test_installed_card_is_what_probes_see_in_every_thread():
    card = EmulatedCard("6GB")
    assert emulate.install(card) is None
    try:
        seen = []
        t = threading.Thread(target=lambda: seen.append(dev.memory_info().total))
        t.start()
        t.join()
        assert seen == [6 * 2**30] and dev.memory_info().emulated == "emulated 6.00 GiB card"
    finally:
        assert emulate.install(None) is card
    assert dev.memory_info().emulated is None


def test_other_threads_are_not_counted_and_fake_runs_allocate_nothing():
    from lib_vram.core.predict import predict_module_peak

    card = EmulatedCard("1MB")
    with card:
        t = threading.Thread(target=lambda: torch.zeros(10_000_000))  # 40 MB elsewhere
        t.start()
        t.join()
        conv = torch.nn.Conv2d(3, 8, 3)
        pred = predict_module_peak(conv, (1, 3, 512, 512))  # planner's dry run: 16 MB fake
        assert pred.activation_bytes > 10 * MiB
        assert card.ooms == 0 and card.used_bytes < 2048


def test_host_role_tensors_leave_and_rejoin_the_count():
    card = EmulatedCard("1GB")
    with card:
        assert emulate.separate_host("cpu")
        a = torch.zeros(1000)
        emulate.to_host(a)
        assert card.live_bytes == 0
        emulate.to_device(a)
        assert card.live_bytes == 4000
    assert not emulate.separate_host("cpu")


def test_injected_error_fires_once_at_the_nth_allocation():
    card = EmulatedCard("1GB", inject_oom_at=3)
    with card:
        torch.zeros(1)
        torch.zeros(1)
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            torch.zeros(1)
        torch.zeros(1)
    assert card.injected and card.allocations == 4 and card.ooms == 1


def test_tracker_measures_the_card():
    card = EmulatedCard("1GB")
    tracker = StageTracker("cpu", owns_peak_counters=True)
    with card:
        keep = torch.zeros(1000)
        with tracker.stage("s"):
            torch.zeros(250_000)  # 1 MB, freed at once
    rec = tracker.last("s")
    assert rec.measure == "emulated" and rec.exact
    assert rec.start_bytes == 4000 and rec.peak_bytes == 1_004_000
    assert planner.learnable_peak(rec) == 1_000_000
    del keep


@pytest.mark.parametrize(
    ("text", "expected"), [("4GB", 4 * 2**30), ("6GiB", 6 * 2**30), ("512MB", 512 * MiB), ("1.5g", 3 * 2**29)]
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "4TB", "-1GB", "0", "banana", "nan"])
def test_parse_size_rejects_with_the_option_name(text):
    with pytest.raises(ValueError, match="--emulate-vram"):
        parse_size(text)


def test_cuda_card_needs_cuda_or_says_why():
    with pytest.raises(ValueError, match="CPU or a CUDA device"):
        EmulatedCard("4GB", device="mps")


# -- the VAE under the card ------------------------------------------------------------------------

LATENT = (1, 4, 16, 28)


def _vae(kind: str):
    if kind == "decoder":
        mod = ldm_decoder(ch_mult=(1, 2))
        x = smooth_latent(*LATENT, seed=3)
        return mod, x, tiled_decode
    mod = ldm_encoder(ch_mult=(1, 2))
    g = torch.Generator().manual_seed(4)
    x = torch.rand(1, 3, LATENT[2] * 2, LATENT[3] * 2, generator=g) * 2 - 1
    return mod, x, tiled_encode


def _run_vae(fn, mod, x, card, cfg, memory):
    rep = VAEReport()
    with card:
        out = fn(mod, x, config=cfg, report=rep, memory=memory, original_forward=mod.forward)
    return out, rep


@pytest.fixture(scope="module")
def vae_cases():
    """Per (kind, mode): module, input, the uncapped result, a capacity and the stage's allocations."""
    cases = {}
    for kind in ("decoder", "encoder"):
        mod, x, fn = _vae(kind)
        with torch.no_grad():
            plain = mod(x)
        probe = EmulatedCard("64GB", resident=[mod])
        with probe, torch.no_grad():
            mod(x)
        plain_peak = probe.peak_bytes
        for mode in ("auto", "exact", "fast"):
            # auto: a card where the untiled pass fits (the host's forward runs, then fails);
            # exact/fast: half the plain pass's activations (the plain module cannot run on it)
            resident = probe.resident_bytes
            cap = resident + (plain_peak - resident) * (2 if mode == "auto" else 1) // 2
            cfg = TiledVAEConfig(mode=mode)
            card = EmulatedCard(cap, resident=[mod])
            ref, rep = _run_vae(fn, mod, x, card, cfg, planner.PlanMemory())
            assert rep.oom_retries == [], (kind, mode, rep.oom_retries)
            cases[kind, mode] = (mod, x, fn, plain, ref, cap, card.allocations, plain_peak)
    return cases


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_plain_vae_fails_on_a_card_where_the_engine_fits(kind, vae_cases):
    mod, x, fn, plain, ref, cap, n, plain_peak = vae_cases[kind, "exact"]
    card = EmulatedCard(cap, resident=[mod])
    with card, torch.no_grad(), pytest.raises(torch.OutOfMemoryError):
        mod(x)
    assert (ref - plain).abs().max() <= VAE_EXACT
    card2 = EmulatedCard(cap, resident=[mod])
    out, rep = _run_vae(fn, mod, x, card2, TiledVAEConfig(mode="exact"), planner.PlanMemory())
    assert card2.peak_bytes <= cap and card2.ooms == 0


@pytest.mark.parametrize("point", ["first", "middle", "last"])
@pytest.mark.parametrize("mode", ["auto", "exact", "fast"])
@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_vae_survives_an_oom_at_any_allocation(kind, mode, point, vae_cases):
    mod, x, fn, plain, ref, cap, n, _ = vae_cases[kind, mode]
    at = {"first": 1, "middle": max(1, n // 2), "last": n}[point]
    memory = planner.PlanMemory()
    dtype_before = next(mod.parameters()).dtype
    card = EmulatedCard(cap, resident=[mod], inject_oom_at=at)
    out, rep = _run_vae(fn, mod, x, card, TiledVAEConfig(mode=mode), memory)
    assert card.injected and card.ooms == 1
    # finished, within the stage's bound: exact (and auto) against the plain module, fast against
    # fast mode's own uncapped run with the plan the retry finished with (its estimated statistics
    # depend on the plan: a one-tile plan has exact ones)
    bound_ref = plain
    if mode == "fast":
        same_plan = TiledVAEConfig(mode="fast", tile=rep.tile)
        bound_ref, _ = _run_vae(fn, mod, x, EmulatedCard("64GB"), same_plan, planner.PlanMemory())
    assert (out - bound_ref).abs().max() <= VAE_EXACT, (rep.plan, rep.oom_retries, rep.notes)
    # said what happened
    said = rep.oom_retries or any("out of memory" in note for note in rep.notes)
    assert said, (rep.plan, rep.notes)
    # the second identical call runs without an out-of-memory error
    card2 = EmulatedCard(cap, resident=[mod])
    out2, rep2 = _run_vae(fn, mod, x, card2, TiledVAEConfig(mode=mode), memory)
    assert card2.ooms == 0 and rep2.oom_retries == []
    assert (
        out2 - (plain if mode != "fast" else out if rep2.tile == rep.tile else ref)
    ).abs().max() <= VAE_EXACT
    # nothing left behind
    assert "forward" not in mod.__dict__ and next(mod.parameters()).dtype == dtype_before
    assert emulate.current() is None


@pytest.mark.parametrize("point", ["first", "middle", "last"])
def test_vae_fp16_guard_survives_an_oom(point):
    """FP16 with the guard: a decoder whose mid block overflows in fp16 (recomputed wider) and an
    out-of-memory error at the first, a middle and the last allocation."""
    mod = ldm_decoder(ch_mult=(1, 2))
    # activations far beyond float16's range (65504) in one tiled layer; the next GroupNorm undoes it
    handle = mod.up[0].block[0].conv1.register_forward_hook(lambda m, i, o: o * 1e5)
    x = smooth_latent(*LATENT, seed=3)
    try:
        with torch.no_grad():
            ref32 = mod(x)
        cfg = TiledVAEConfig(mode="exact", dtype=torch.float16, guard_dtype=torch.float32, tile=16)
        probe = EmulatedCard("64GB", resident=[mod])
        ref16, rep0 = _run_vae(tiled_decode, mod, x, probe, cfg, planner.PlanMemory())
        assert rep0.recomputed, "the fp16 overflow must be recomputed"
        n = probe.allocations
        at = {"first": 1, "middle": n // 2, "last": n}[point]
        card = EmulatedCard("64GB", resident=[mod], inject_oom_at=at)
        out, rep = _run_vae(tiled_decode, mod, x, card, cfg, planner.PlanMemory())
    finally:
        handle.remove()
    assert card.injected and torch.isfinite(out).all()
    scale = ref32.abs().max().item()
    # fp16 rounding of another tiling; against fp32: fp16 rounding as well
    assert (out.float() - ref16.float()).abs().max() <= reduced_precision(torch.float16, scale)
    assert (out.float() - ref32).abs().max() <= reduced_precision(torch.float16, scale)
    assert next(mod.parameters()).dtype == torch.float32


def test_whole_latent_stage_that_never_fits_is_named_and_leaves_nothing():
    mod, x, fn = _vae("decoder")
    card = EmulatedCard(EmulatedCard("64GB").capacity, resident=[mod])
    card.capacity = card.resident_bytes + 4096  # nothing but the weights fits
    with card, pytest.raises(VAEOutOfMemory, match="whole-latent stage"):
        tiled_decode(mod, x, config=TiledVAEConfig(mode="exact"))
    assert card.live_bytes == 0 and emulate.current() is None


# -- upscaling under the card ---------------------------------------------------------------------


def _lsb(a: torch.Tensor, b: torch.Tensor) -> int:
    qa = (a.clamp(0, 1) * 255).round().to(torch.int16)
    qb = (b.clamp(0, 1) * 255).round().to(torch.int16)
    return int((qa - qb).abs().max())


@pytest.fixture
def image():
    g = torch.Generator().manual_seed(11)
    coarse = torch.rand(2, 3, 6, 8, generator=g)
    smooth = torch.nn.functional.interpolate(coarse, size=(44, 60), mode="bilinear", align_corners=False)
    return (0.8 * smooth + 0.2 * torch.rand(2, 3, 44, 60, generator=g)).clamp(0, 1)


UPSCALE_CONFIGS = {
    "auto": {},
    "explicit": {"tile": 24, "batch": 4, "overlap": 12},
    "batch1": {"tile": 32, "batch": 1, "overlap": 12},
}


@pytest.mark.parametrize("point", ["first", "middle", "last"])
@pytest.mark.parametrize("plan", sorted(UPSCALE_CONFIGS))
@pytest.mark.parametrize("model", ["tiny_compact", "tiny_rrdb"])
def test_upscale_survives_an_oom_at_any_allocation(model, plan, point, image, request):
    from lib_vram.upscale import UpscaleConfig, UpscaleReport, upscale_tensor

    desc = request.getfixturevalue(model)
    with torch.inference_mode():
        ref = torch.cat([desc(image[i : i + 1]) for i in range(2)]).float()
    cfg = UpscaleConfig(**UPSCALE_CONFIGS[plan])
    upscale_tensor(desc, image, config=cfg, memory=planner.PlanMemory())  # calibrated once, cached
    probe = EmulatedCard("8GB", resident=[desc.model])
    memory = planner.PlanMemory()
    with probe:
        upscale_tensor(desc, image, config=cfg, memory=memory)
    n = probe.allocations
    at = {"first": 1, "middle": n // 2, "last": n}[point]
    memory = planner.PlanMemory()
    rep = UpscaleReport()
    card = EmulatedCard("8GB", resident=[desc.model], inject_oom_at=at)
    with card:
        out = upscale_tensor(desc, image, config=cfg, report=rep, memory=memory)
    assert card.injected
    assert _lsb(out, ref) <= UPSCALE_LSB, (rep.plan, rep.events)
    assert rep.ooms >= 1 and any("out of memory" in e for e in rep.events)
    rep2 = UpscaleReport()
    card2 = EmulatedCard("8GB", resident=[desc.model])
    with card2:
        out2 = upscale_tensor(desc, image, config=cfg, report=rep2, memory=memory)
    assert rep2.ooms == 0 and card2.ooms == 0 and _lsb(out2, ref) <= UPSCALE_LSB
    assert next(desc.model.parameters()).dtype == torch.float32


def test_upscale_plain_fails_where_the_engine_fits(tiny_rrdb):
    from lib_vram.upscale import UpscaleReport, upscale_tensor

    g = torch.Generator().manual_seed(2)
    x = torch.rand(1, 3, 96, 96, generator=g)
    probe = EmulatedCard("8GB", resident=[tiny_rrdb.model])
    with probe, torch.inference_mode():
        ref = tiny_rrdb(x)
    cap = probe.resident_bytes + (probe.peak_bytes - probe.resident_bytes) * 3 // 5
    with (
        EmulatedCard(cap, resident=[tiny_rrdb.model]),
        torch.inference_mode(),
        pytest.raises(torch.OutOfMemoryError),
    ):
        tiny_rrdb(x)
    card = EmulatedCard(cap, resident=[tiny_rrdb.model])
    rep = UpscaleReport()
    with card:
        out = upscale_tensor(tiny_rrdb, x, report=rep, memory=planner.PlanMemory())
    assert rep.tiled and card.peak_bytes <= cap
    assert _lsb(out, ref.float()) <= UPSCALE_LSB, (rep.plan, rep.events)


def test_upscale_fp32_recompute_survives_an_oom(tiny_compact, image):
    from lib_vram.upscale import UpscaleConfig, UpscaleReport, upscale_tensor

    cfg = UpscaleConfig(tile=24, batch=2, overlap=12, precision="bf16")
    state = {"calls": 0}

    def overflow(module, args, out):  # noqa: ANN001
        state["calls"] += 1
        if out.dtype != torch.float32 and state["calls"] % 3 == 2:
            return out * float("inf")
        return None

    with torch.inference_mode():
        ref = torch.cat([tiny_compact(image[i : i + 1]) for i in range(2)]).float()
    # The first call runs the model's behaviour probes (cached per model) on the model as it is;
    # the overflowing layer is for the upscale itself, whose allocations the probe run counts.
    upscale_tensor(tiny_compact, image, config=cfg, memory=planner.PlanMemory())
    handle = tiny_compact.model.register_forward_hook(overflow)
    try:
        probe = EmulatedCard("8GB", resident=[tiny_compact.model])
        with probe:
            upscale_tensor(tiny_compact, image, config=cfg, memory=planner.PlanMemory())
        state["calls"] = 0
        rep = UpscaleReport()
        card = EmulatedCard("8GB", resident=[tiny_compact.model], inject_oom_at=probe.allocations // 2)
        with card:
            out = upscale_tensor(tiny_compact, image, config=cfg, report=rep, memory=planner.PlanMemory())
    finally:
        handle.remove()
    assert card.injected and rep.recomputed_batches >= 1 and rep.ooms >= 1
    assert torch.isfinite(out).all() and _lsb(out, ref) <= levels(reduced_precision(torch.bfloat16))
    assert np.isfinite(out.numpy()).all()
