"""One learning store for both engines: out-of-memory retries and finished plans go into a
:class:`~lib_vram.planning.planner.PlanMemory`, and the next automatic choice for the same key uses them.

Real models (ldm ``Decoder``, a spandrel Compact saved and loaded), OOM raised by a forward
pre-hook above a size, CPU, tiny channel counts.
"""

from __future__ import annotations

import pytest
import torch
from conftest import image_like, learned_keys
from tolerances import UPSCALE_LSB, VAE_EXACT, lsb
from vae_models import ldm_decoder, smooth_latent

from lib_vram.core.tracker import StageRecord, StageTracker
from lib_vram.planning import planner
from lib_vram.upscale import UpscaleConfig, UpscaleReport, upscale_tensor
from lib_vram.vae import TiledVAEConfig, VAEReport, tiled_decode

EXACT_TOL = VAE_EXACT


class _OOMAbove:
    """Forward pre-hook raising the allocator's error for inputs above ``limit`` (N x H x W)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.raised = 0

    def __call__(self, module, args):
        n, _, h, w = args[0].shape
        if n * h * w > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


# -- VAE ----------------------------------------------------------------------------------------------

# ldm decoder with ch_mult (1, 2): conv_out runs at 2x the latent. A 32x32 latent at tile 32 (one
# tile, 64x64 px at conv_out) is above the limit; at tile 24 (cores of 16 + halo: <= 46x46 px) not.
VAE_LIMIT = 3000


def _decode(dec, z, memory, **cfg):
    rep = VAEReport()
    config = TiledVAEConfig(**{"mode": "exact", "budget_bytes": 2**40, **cfg})
    out = tiled_decode(dec, z, config=config, report=rep, memory=memory)
    return out, rep


def test_vae_oom_is_recorded_and_the_next_call_starts_at_the_tile_that_worked():
    dec = ldm_decoder()
    z = smooth_latent(1, 4, 32, 32, seed=3)
    with torch.no_grad():
        ref = dec(z)
    hook = _OOMAbove(VAE_LIMIT)
    dec.conv_out.register_forward_pre_hook(hook)
    mem = planner.PlanMemory()

    out, rep = _decode(dec, z, mem)
    assert rep.oom_retries == [32] and rep.tile == 24 and hook.raised == 1
    assert (out - ref).abs().max().item() < EXACT_TOL
    (key,) = learned_keys(mem)
    assert key[0] == "vae_decode" and key[2] == (1, 4, 32, 32) and key[3] == "float32" and key[-1] == "exact"
    hist = mem.history(key)
    assert [(o.candidate.tile, o.oom) for o in hist] == [(32, True), (24, False)]
    # Raw estimates are recorded. At this size both are the global stage's peak (equal), so a
    # cap on estimates alone could not tell 24 from 32: the sizes that failed and worked do.
    assert hist[0].predicted_peak_bytes >= hist[1].predicted_peak_bytes > 0

    out2, rep2 = _decode(dec, z, mem)
    assert rep2.oom_retries == [] and rep2.tile == 24 and hook.raised == 1  # no failure first
    assert any("learned from an earlier out-of-memory error" in n for n in rep2.notes)
    assert torch.equal(out2, out)


def test_vae_auto_untiled_oom_is_learned_with_the_host_forward():
    dec = ldm_decoder()
    z = smooth_latent(1, 4, 32, 32, seed=4)
    hook = _OOMAbove(VAE_LIMIT)
    dec.conv_out.register_forward_pre_hook(hook)
    mem = planner.PlanMemory()
    _, rep = _decode(dec, z, mem, mode="auto")
    # the untiled try (the engine at tile = the whole latent) failed, then tiles
    assert rep.oom_retries == [32] and rep.mode == "exact" and rep.tile == 24
    raised = hook.raised
    # Second call with the host's own forward as the untiled path: not even tried now.
    _, rep2 = _decode(dec, z, mem, mode="auto")
    out3 = tiled_decode(
        dec,
        z,
        config=TiledVAEConfig(mode="auto", budget_bytes=2**40),
        original_forward=dec.forward,
        report=(rep3 := VAEReport()),
        memory=mem,
    )
    assert rep2.oom_retries == [] == rep3.oom_retries and rep2.tile == rep3.tile == 24
    assert hook.raised == raised and out3.shape == (1, 3, 64, 64)


def test_vae_learning_does_not_leak_across_shapes_or_models():
    mem = planner.PlanMemory()
    dec = ldm_decoder()
    dec.conv_out.register_forward_pre_hook(_OOMAbove(VAE_LIMIT))
    _, rep = _decode(dec, smooth_latent(1, 4, 32, 32, seed=5), mem)
    assert rep.oom_retries == [32]
    # Another shape (32x28: tile 32 is still one 64x56 px tile) must fail first on its own.
    _, rep_shape = _decode(dec, smooth_latent(1, 4, 28, 32, seed=5), mem)
    assert rep_shape.oom_retries == [32]
    # Another model (8 latent channels) on the first shape too.
    dec8 = ldm_decoder(8)
    dec8.conv_out.register_forward_pre_hook(_OOMAbove(VAE_LIMIT))
    _, rep_model = _decode(dec8, smooth_latent(1, 8, 32, 32, seed=5), mem)
    assert rep_model.oom_retries == [32]
    # Another dtype is another key as well.
    _, rep_dtype = _decode(dec, smooth_latent(1, 4, 32, 32, seed=5), mem, dtype=torch.bfloat16)
    assert rep_dtype.oom_retries == [32]
    assert len(set(learned_keys(mem))) == 4


def test_vae_measured_ratio_above_one_raises_later_estimates():
    dec = ldm_decoder()
    z = smooth_latent(1, 4, 32, 32, seed=6)
    mem = planner.PlanMemory()
    _, probe = _decode(dec, z, mem)
    budget = probe.peak_estimate_bytes  # tile 32 fits exactly
    _, rep = _decode(dec, z, mem, budget_bytes=budget)
    assert rep.tile == 32 and not rep.notes
    (key,) = learned_keys(mem)
    ran = mem.history(key)[-1].candidate
    mem.record(key, planner.Outcome.of(ran, measured_peak_bytes=int(ran.peak_bytes * 1.5)))
    _, rep2 = _decode(dec, z, mem, budget_bytes=budget)
    assert rep2.tile < 32 and rep2.oom_retries == []
    assert any("x1.50 measured/estimated" in n for n in rep2.notes)
    # the report's estimate is the learned one: 1.5x the raw estimate of the tile that ran
    raw = next(o for o in mem.history(key) if o.candidate.tile == rep2.tile).predicted_peak_bytes
    assert rep2.peak_estimate_bytes == pytest.approx(raw * 1.5, rel=1e-6)  # the ratio is a float


def test_engines_learn_into_the_process_memory_by_default():
    dec = ldm_decoder()
    dec.conv_out.register_forward_pre_hook(_OOMAbove(VAE_LIMIT))
    z = smooth_latent(1, 4, 32, 32, seed=7)
    tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", budget_bytes=2**40))
    rep = VAEReport()
    tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", budget_bytes=2**40), report=rep)
    assert rep.oom_retries == [] and rep.tile == 24
    assert len(learned_keys(planner.MEMORY)) == 1


# -- measured peaks --------------------------------------------------------------------------------


def test_learnable_peak_uses_exact_accelerator_records_only():
    # A real CPU record: the resident set, not used (allocator and library state, not the plan).
    tracker = StageTracker("cpu")
    with tracker.stage("vae_decode"):
        torch.ones(1000)
    assert planner.learnable_peak(tracker.last("vae_decode")) is None
    rec = StageRecord("vae_decode", 0, None, start_bytes=100, peak_bytes=1100, measure="allocated")
    assert planner.learnable_peak(rec, input_bytes=50) == 1050
    assert (
        planner.learnable_peak(StageRecord("x", 0, None, 0, peak_bytes=9, measure="allocated", exact=False))
        is None
    )
    assert (
        planner.learnable_peak(StageRecord("x", 0, None, 0, peak_bytes=9, measure="allocated", ok=False))
        is None
    )
    assert planner.learnable_peak(None) is None


# -- upscaling ---------------------------------------------------------------------------------------

# Compact x2, 160x160 input, predicted sizing (calibrate=False: 16 KiB/px, halo 16): this budget
# gives tile 64, batch 1 (batch 2 would need more than the budget by the plan's own peak: the
# batch's blend). Windows of tile 64 (70x70 .. 70x85) are above the limit, tile 32's (<= 64x64)
# are not. (The batch step of the OOM path: tests/test_upscale.py.)
UP_BUDGET = 170_000_000
UP_LIMIT = 5000


def _upscale(model, x, memory, **cfg):
    rep = UpscaleReport()
    config = UpscaleConfig(**{"budget_bytes": UP_BUDGET, "calibrate": False, **cfg})
    out = upscale_tensor(model, x, config=config, report=rep, memory=memory)
    return out, rep


def test_upscale_oom_is_recorded_and_the_next_call_starts_at_the_plan_that_worked(tiny_compact):
    hook = _OOMAbove(UP_LIMIT)
    tiny_compact.model.register_forward_pre_hook(hook)
    x = image_like(160, 160)
    mem = planner.PlanMemory()
    out, rep = _upscale(tiny_compact, x, mem)
    assert rep.events == ["out of memory: tile -> 32"] and rep.ooms == 1
    (key,) = learned_keys(mem)
    assert key[0] == "upscale" and key[2] == (1, 3, 160, 160) and key[3] == "float32"
    hist = mem.history(key)
    assert [(o.candidate.tile, o.candidate.batch, o.oom) for o in hist] == [
        (64, 1, True),
        (32, 1, False),
    ]
    raised = hook.raised
    out2, rep2 = _upscale(tiny_compact, x, mem)
    assert rep2.ooms == 0 and hook.raised == raised
    assert (rep2.tile, rep2.batch) == (32, 1)
    assert rep2.events == ["learned for this model and shape: tiled t32 o16 b1"]
    # t32 from the start vs t64 split into t32 after the OOM: other tile borders, so not the same
    # operations; each is within the upscaler's bound of the untiled model, so within twice that
    assert lsb(out2, out) <= 2 * UPSCALE_LSB


def test_upscale_learning_does_not_leak_across_shapes(tiny_compact):
    tiny_compact.model.register_forward_pre_hook(_OOMAbove(UP_LIMIT))
    mem = planner.PlanMemory()
    _, rep = _upscale(tiny_compact, image_like(160, 160), mem)
    assert rep.ooms == 1
    _, rep_other = _upscale(tiny_compact, image_like(152, 160), mem)
    assert rep_other.ooms > 0 and not any(e.startswith("learned") for e in rep_other.events)
    assert len(learned_keys(mem)) == 2


def test_upscale_measured_ratio_above_one_shrinks_the_next_plan(tiny_compact):
    x = image_like(160, 160)
    mem = planner.PlanMemory()
    _, rep = _upscale(tiny_compact, x, mem)
    assert (rep.tile, rep.batch) == (64, 1)
    (key,) = learned_keys(mem)
    ran = mem.history(key)[-1].candidate
    assert ran.tile == 64 and ran.batch == 1
    mem.record(key, planner.Outcome.of(ran, measured_peak_bytes=2 * ran.peak_bytes))
    _, rep2 = _upscale(tiny_compact, x, mem)
    assert (rep2.tile, rep2.batch) != (64, 1) and rep2.ooms == 0
    chosen = mem.history(key)[-1].candidate
    assert 2 * chosen.peak_bytes <= UP_BUDGET  # the doubled prediction fits the budget


@pytest.mark.parametrize("fixed", [{"tile": 48, "batch": 1}])
def test_upscale_fixed_sizes_are_not_overridden_but_still_recorded(tiny_compact, fixed):
    tiny_compact.model.register_forward_pre_hook(_OOMAbove(UP_LIMIT))
    mem = planner.PlanMemory()
    _, rep = _upscale(tiny_compact, image_like(160, 160), mem, **fixed)
    _, rep2 = _upscale(tiny_compact, image_like(160, 160), mem, **fixed)
    assert rep.ooms == rep2.ooms > 0  # the user's sizes are tried as given, every time
    (key,) = learned_keys(mem)
    assert sum(o.oom for o in mem.history(key)) == 2 * rep.ooms


# -- the quick estimate, against the fake-tensor prediction of the engine ----------------------------


@pytest.mark.parametrize(
    ("kind", "size", "tile", "mode"),
    [
        ("decode", 32, None, "untiled"),
        ("decode", 32, 8, "exact"),
        ("decode", 64, 16, "exact"),
        ("decode", 48, 16, "fast"),
        ("encode", 48, 16, "exact"),
        ("encode", 32, None, "untiled"),
    ],
)
def test_quick_estimate_tracks_the_engines_fake_tensor_prediction(kind, size, tile, mode):
    from vae_models import ldm_encoder

    from lib_vram.cli.stageplan import predict_engine_vae
    from lib_vram.vae import estimate_peak_bytes

    # Two levels of 2 ResNets, 32..64 channels: another width and depth than the SD VAE.
    make = ldm_decoder if kind == "decode" else ldm_encoder
    module = make(ch_mult=(1, 2, 2), num_res_blocks=2)
    shape = (1, 4, size, size) if kind == "decode" else (1, 3, 4 * size, 4 * size)
    est = estimate_peak_bytes(module, shape, torch.float32, tile=tile, mode=mode, backend="cpu")
    pm = "exact" if mode == "untiled" else mode
    pred = predict_engine_vae(module, kind, shape, torch.float32, tile=tile, mode=pm, backend="cpu")
    ref = pred.input_bytes + pred.activation_bytes
    # No fitted factors: every mode within 10 % (tests/test_plan_path.py draws more cases).
    assert abs(est / ref - 1) <= 0.10, (est, ref)
