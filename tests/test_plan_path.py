"""One planning path: what ``plan`` (and the WebUI's Auto) says a stage runs is what the engine's
auto mode runs under the same budget, and its predicted peak matches the engine's own fake-tensor
run of that plan (the validator) within 10 %.

Cases are drawn from a fixed seed over architectures (real ldm decoders/encoders of several widths
and depths, diffusers' AutoencoderKL with 4- and 16-channel latents, spandrel Compact and ESRGAN
models loaded from files), sizes, budgets, dtypes and (VAE) auto and fast modes.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import compact_class, image_like, rrdb_class, save_and_load
from vae_models import diffusers_vae, ldm_decoder, ldm_encoder

from lib_vram.cli.stageplan import predict_engine_vae, predict_loop, upscale_loop
from lib_vram.core.predict import new_fake_mode
from lib_vram.planning import planner
from lib_vram.upscale import UpscaleConfig, UpscaleReport, plan_upscale, upscale_tensor
from lib_vram.vae import TiledVAEConfig, VAEReport, plan_vae, tiled_decode, tiled_encode

TOLERANCE = 0.10
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _vae_cases(n: int, seed: int = 1234) -> list[tuple]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        kind = rng.choice(("decode", "encode"))
        ch_mult = rng.choice(((1, 2), (1, 2, 2), (1, 1, 2)))
        blocks = rng.choice((1, 2))
        side = rng.choice((16, 24, 32, 40)) if kind == "decode" else rng.choice((32, 48, 64, 96))
        other = side + 8 * rng.choice((0, 0, 1, -1))
        frac = rng.uniform(0.15, 1.4)
        cases.append((i, kind, ch_mult, blocks, side, other, frac, rng.choice(DTYPES)))
    return cases


VAE_CASES = _vae_cases(20)


def _vae_plan(i, kind, ch_mult, blocks, h, w, frac, dtype):
    make = ldm_decoder if kind == "decode" else ldm_encoder
    module = make(ch_mult=ch_mult, num_res_blocks=blocks, seed=i)
    shape = (1, 4, h, w) if kind == "decode" else (1, 3, h, w)
    untiled = plan_vae(module, shape, dtype, 2**50).peak_bytes
    budget = max(1, int(untiled * frac))
    plan = plan_vae(module, shape, dtype, budget, backend="cpu", memory=planner.PlanMemory())
    return module, shape, budget, plan


def _auto_mode_ran(module, kind, shape, dtype, budget) -> VAEReport:
    """The engine's auto mode on fake tensors (same budget, dtype, device type): what it ran."""
    rep = VAEReport()
    mode = new_fake_mode()
    with mode:
        x = torch.empty(shape, dtype=dtype)
    run = tiled_decode if kind == "decode" else tiled_encode
    cfg = TiledVAEConfig(mode="auto", budget_bytes=budget, dtype=dtype, guard=False, state_offload="device")
    with mode, torch.no_grad():
        run(module, x, config=cfg, report=rep, memory=planner.PlanMemory())
    return rep


def _assert_same_choice(plan, rep: VAEReport) -> None:
    assert (plan.mode, plan.tile) == (rep.mode, None if rep.mode == "untiled" else rep.tile), plan


def _assert_engines_peak(module, kind, shape, dtype, plan) -> None:
    """The validator: the engine itself on fake tensors, at that plan."""
    pred = predict_engine_vae(module, kind, shape, dtype, tile=plan.tile, mode=plan.mode, backend="cpu")
    ref = pred.input_bytes + pred.activation_bytes
    assert abs(plan.raw_peak_bytes / ref - 1) <= TOLERANCE, (plan.plan, plan.raw_peak_bytes, ref)


@pytest.mark.parametrize(("i", "kind", "ch_mult", "blocks", "h", "w", "frac", "dtype"), VAE_CASES)
def test_vae_plan_is_what_the_engines_auto_mode_runs(i, kind, ch_mult, blocks, h, w, frac, dtype):
    module, shape, budget, plan = _vae_plan(i, kind, ch_mult, blocks, h, w, frac, dtype)
    _assert_same_choice(plan, _auto_mode_ran(module, kind, shape, dtype, budget))
    assert plan.fits == (plan.peak_bytes <= budget)


@pytest.mark.parametrize(("i", "kind", "ch_mult", "blocks", "h", "w", "frac", "dtype"), VAE_CASES)
@pytest.mark.parametrize("mode", ["auto", "fast"])
def test_vae_plans_peak_is_the_engines_fake_tensor_peak(mode, i, kind, ch_mult, blocks, h, w, frac, dtype):
    module, shape, budget, plan = _vae_plan(i, kind, ch_mult, blocks, h, w, frac, dtype)
    if mode == "fast":  # the user's fast mode under the same budget
        plan = plan_vae(module, shape, dtype, budget, mode="fast", backend="cpu", memory=planner.PlanMemory())
    _assert_engines_peak(module, kind, shape, dtype, plan)


def _diffusers_cases(n: int, seed: int = 99) -> list[tuple]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        kind = rng.choice(("decode", "encode"))
        latent = rng.choice((4, 16))
        blocks = rng.choice((2, 3))
        side = rng.choice((16, 24, 40)) if kind == "decode" else rng.choice((48, 64, 96))
        other = side + 8 * rng.choice((0, 1, -1))
        cases.append((i, kind, latent, blocks, side, other, rng.uniform(0.15, 1.3), rng.choice(DTYPES)))
    return cases


@pytest.mark.parametrize(("i", "kind", "latent", "blocks", "h", "w", "frac", "dtype"), _diffusers_cases(8))
def test_diffusers_vae_plan_is_the_engines_choice_and_peak(i, kind, latent, blocks, h, w, frac, dtype):
    """Another layout (diffusers' AutoencoderKL, 4- and 16-channel latents, 2-3 levels, a mid
    attention): the same two checks as for the ldm classes."""
    vae = diffusers_vae(latent, seed=i, blocks=blocks)
    module = vae.decoder if kind == "decode" else vae.encoder
    shape = (1, latent, h, w) if kind == "decode" else (1, 3, h, w)
    untiled = plan_vae(module, shape, dtype, 2**50).peak_bytes
    budget = max(1, int(untiled * frac))
    plan = plan_vae(module, shape, dtype, budget, backend="cpu", memory=planner.PlanMemory())
    _assert_same_choice(plan, _auto_mode_ran(module, kind, shape, dtype, budget))
    _assert_engines_peak(module, kind, shape, dtype, plan)


def _upscale_cases(n: int, seed: int = 4321) -> list[tuple]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        arch = rng.choice(("compact", "rrdb"))
        width = rng.choice((8, 16)) if arch == "rrdb" else rng.choice((8, 16, 24))
        side = rng.choice((32, 48, 64, 80))
        other = side + rng.choice((0, 8, -8, 5))
        frac = rng.uniform(0.1, 1.2)
        cases.append((i, arch, width, side, other, frac))
    return cases


@pytest.mark.parametrize(("i", "arch", "width", "h", "w", "frac"), _upscale_cases(10))
def test_upscale_plan_is_the_engines_auto_choice_and_its_peak_is_predicted(
    tmp_path, i, arch, width, h, w, frac
):
    torch.manual_seed(i)
    if arch == "compact":
        net = compact_class()(num_in_ch=3, num_out_ch=3, num_feat=width, num_conv=2, upscale=2)
    else:
        net = rrdb_class()(in_nc=3, out_nc=3, num_filters=width, num_blocks=1, scale=4)
    model = save_and_load(net, tmp_path / f"{arch}{i}.safetensors")
    shape = (1, 3, h, w)
    whole = plan_upscale(model, shape, torch.float32, 2**50).peak_bytes
    budget = max(1, int(whole * frac))
    plan = plan_upscale(model, shape, torch.float32, budget, memory=planner.PlanMemory())

    rep = UpscaleReport()
    cfg = UpscaleConfig(budget_bytes=budget, precision="fp32", device="cpu")
    upscale_tensor(model, image_like(h, w), config=cfg, report=rep, memory=planner.PlanMemory())
    if rep.ooms == 0:
        assert (plan.tile, plan.batch, plan.halo) == (rep.tile, rep.batch, rep.overlap), (plan.plan, rep.plan)
        assert plan.whole == (not rep.tiled)

    # the engine on fake tensors, the plan's tile (whole: the image), batch and halo; backend "cuda":
    # tensors only, what the calibration counts
    loop = upscale_loop(max(h, w) if plan.whole else plan.tile, plan.batch, model.scale, overlap=plan.halo)
    pred = predict_loop(model.model, loop, shape, torch.float32, "cuda", new_fake_mode())
    ref = pred.input_bytes + pred.activation_bytes
    assert abs(plan.raw_peak_bytes / ref - 1) <= TOLERANCE, (plan.plan, plan.raw_peak_bytes, ref)


def test_plan_answers_fast_at_any_size():
    """No fake run over the image: the plan of a 16384² job is numbers only (timed in
    docs/benchmarks.md; here only that it completes and is consistent)."""
    from lib_vram.cli.stageplan import plan_job
    from lib_vram.planning.presets import resolve_preset

    preset = resolve_preset("8GB")
    plans = plan_job("sdxl", 16384, 16384, preset, 8 * 2**30, 8 * 2**30, upscaler="compact")
    assert [p.stage for p in plans] == ["sample", "vae_decode", "upscale"]
    assert plans[2].fits and plans[2].tile is not None
    for p in plans:
        assert (
            p.predicted_peak_bytes == p.weights_bytes + p.resident_bytes + p.input_bytes + p.activation_bytes
        )
