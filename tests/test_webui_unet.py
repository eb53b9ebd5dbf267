"""'FP16 UNet' inside a WebUI job, on the real ldm ``UNetModel`` class (tiny), host state faked.

What is checked: the cast (FP16 weights, GroupNorm32 kept FP32, the WebUI's dtype_unet /
unet_needs_upcast / ``diffusion_model.dtype``), that the cast UNet runs when fed the way the
WebUI's hijacked ``apply_model`` feeds it, and that every way a job ends puts back exactly what
was there: the same parameter objects with bit-identical FP32 values, the same host state.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import reduced_precision
from webui_fakes import FakeHost, FakeP, fake_sd_model, tiny_unet

from lib_vram.webui import ScriptJobs, Session
from lib_vram.webui import unet as unet_mod
from lib_vram.webui.host import UNetState
from lib_vram.webui.options import VRAMGuardOptions

FP32_STATE = UNetState(torch.float32, False)
X = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(7))
T = torch.tensor([10.0, 500.0])


def opts(**kw) -> VRAMGuardOptions:
    base = {
        "enabled": True,
        "vae_tiling": "Off",
        "release_between_stages": False,
        "upscale_tiling": False,
        "unet_fp16": True,
    }
    base.update(kw)
    return VRAMGuardOptions(**base)


def snapshot(module: torch.nn.Module) -> dict:
    return {name: (p, p.detach().clone()) for name, p in module.named_parameters()}


def exactly_restored(module: torch.nn.Module, snap: dict) -> bool:
    """Same parameter objects, FP32, bit-identical values."""
    now = dict(module.named_parameters())
    if now.keys() != snap.keys():
        return False
    for name, (param, value) in snap.items():
        cur = now[name]
        if cur is not param or cur.dtype != torch.float32:
            return False
        if not torch.equal(cur.detach().view(torch.int32), value.view(torch.int32)):
            return False
    return True


def is_cast(unet: torch.nn.Module) -> bool:
    """FP16 everywhere except the GroupNorm32 layers (FP32), and ``dtype`` says FP16."""
    for module in unet.modules():
        keep = type(module).__name__ == "GroupNorm32"
        for p in module.parameters(recurse=False):
            if p.dtype != (torch.float32 if keep else torch.float16):
                return False
    return unet.dtype == torch.float16


def webui_apply(
    unet: torch.nn.Module, host: FakeHost, x: torch.Tensor, t: torch.Tensor, monkeypatch
) -> torch.Tensor:
    """Call the UNet the way A1111's hijacked ``apply_model`` does (sd_hijack_unet): inputs cast to
    ``devices.dtype_unet``, the timestep embedding made in that dtype, FP32 output when
    ``unet_needs_upcast``."""
    import ldm.modules.diffusionmodules.openaimodel as openaimodel

    state = host.unet_state()
    original = openaimodel.timestep_embedding
    monkeypatch.setattr(
        openaimodel,
        "timestep_embedding",
        lambda *a, **k: original(*a, **k).to(state.dtype_unet),
    )
    try:
        with torch.no_grad():
            out = unet(x.to(state.dtype_unet), t.to(state.dtype_unet))
    finally:
        monkeypatch.setattr(openaimodel, "timestep_embedding", original)
    return out.float() if state.unet_needs_upcast else out


@pytest.fixture()
def allow_cpu(monkeypatch):
    """The tests run on the CPU, where the option is skipped on purpose; let it cast here."""
    monkeypatch.setattr(unet_mod, "ALLOW_CPU", True)


def make_env(*, fp16_exact: bool = False):
    unet = tiny_unet(fp16_exact=fp16_exact)
    model = fake_sd_model(unet=unet)
    host = FakeHost(model)
    session = Session(host=host)
    jobs = ScriptJobs(session, kind="txt2img")
    return unet, model, host, session, jobs


# -- off / skipped --------------------------------------------------------------------------------
def test_option_off_leaves_the_unet_and_the_host_state_untouched(allow_cpu):
    unet, model, host, session, jobs = make_env()
    snap = snapshot(unet)
    ptrs = {n: p.data_ptr() for n, p in unet.named_parameters()}
    p = FakeP()
    job = jobs.process(p, opts(unet_fp16=False))
    assert job.unet is None
    assert {n: p.data_ptr() for n, p in unet.named_parameters()} == ptrs
    assert host.unet == FP32_STATE and unet.dtype == torch.float32
    assert "unet" not in job.plans
    jobs.postprocess(p)
    assert exactly_restored(unet, snap) and "before_load_weights" not in model.__dict__


def test_cpu_is_skipped_with_a_note_and_nothing_changes():
    unet, model, host, session, jobs = make_env()
    snap = snapshot(unet)
    p = FakeP()
    job = jobs.process(p, opts())
    assert exactly_restored(unet, snap) and host.unet == FP32_STATE
    assert job.plans["unet"] == "skipped (cpu)"
    assert any("not applied" in n and "CPU" in n for n in job.notes)
    assert len([c for c in host.comments if "FP16 UNet" in c]) == 1
    assert "UNet fp16" in p.extra_generation_params["VRAM Guard"]  # the option as chosen
    assert "unet skipped (cpu)" in p.extra_generation_params["VRAM Guard plan"](p=p)  # what ran
    jobs.before_sampling(p)  # a second look: no second comment
    assert len([c for c in host.comments if "FP16 UNet" in c]) == 1
    jobs.postprocess(p)
    assert any("not applied" in n for n in session.status()["notes"])


def test_forge_is_skipped_with_a_note(allow_cpu):
    unet, model, host, session, jobs = make_env()
    model.forge_objects = object()  # Forge's model: its memory manager owns the UNet's dtype
    snap = snapshot(unet)
    job = jobs.process(FakeP(), opts())
    assert exactly_restored(unet, snap) and host.unet == FP32_STATE
    assert job.plans["unet"] == "skipped (forge)" and any("Forge" in n for n in job.notes)


def test_an_fp16_unet_is_left_alone(allow_cpu):
    unet, model, host, session, jobs = make_env()
    unet.half()
    host.unet = UNetState(torch.float16, False)
    job = jobs.process(FakeP(), opts())
    assert job.plans["unet"] == "already fp16" and host.unet == UNetState(torch.float16, False)
    assert all(p.dtype == torch.float16 for p in unet.parameters())


def test_an_fp16_unet_the_webui_partly_upcast_is_left_alone(allow_cpu):
    """--upcast-sampling: the WebUI's hijacks widen GroupNorm32 (and GEGLU on CUDA) to FP32."""
    unet, model, host, session, jobs = make_env()
    unet.half()
    for module in unet.modules():
        if type(module).__name__ == "GroupNorm32":
            module.float()
    host.unet = UNetState(torch.float16, True)
    job = jobs.process(FakeP(), opts())
    assert job.plans["unet"] == "already fp16" and job.unet.casts == []


# -- cast and restore -----------------------------------------------------------------------------
@pytest.mark.parametrize("fp16_exact", [False, True], ids=["fp32-weights", "fp16-checkpoint"])
def test_cast_for_the_job_and_exact_restore_at_postprocess(allow_cpu, fp16_exact):
    unet, model, host, session, jobs = make_env(fp16_exact=fp16_exact)
    snap = snapshot(unet)
    p = FakeP()
    job = jobs.process(p, opts())
    assert is_cast(unet)
    assert host.unet == UNetState(torch.float16, True)
    assert "before_load_weights" in model.__dict__
    (cast,) = job.unet.casts
    assert cast.fp32_bytes > 0
    # FP32 originals are kept only for weights FP16 cannot hold exactly
    assert (cast.backup_bytes == 0) == fp16_exact
    assert job.plans["unet"] == "fp16" and "unet fp16" in p.extra_generation_params["VRAM Guard plan"](p=p)
    assert any("FP16 UNet" in n and "GiB" in n for n in job.notes)
    jobs.postprocess(p)
    assert exactly_restored(unet, snap)
    assert host.unet == FP32_STATE and unet.dtype == torch.float32
    assert "before_load_weights" not in model.__dict__


def test_the_cast_unet_runs_as_the_webui_feeds_it(allow_cpu, monkeypatch):
    unet, model, host, session, jobs = make_env()
    reference = webui_apply(unet, host, X, T, monkeypatch)
    p = FakeP()
    jobs.process(p, opts())
    out = webui_apply(unet, host, X, T, monkeypatch)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    # the FP16 UNet against the FP32 one: FP16 rounding of the output's magnitude
    err, bound = (
        (out - reference).abs().max().item(),
        reduced_precision(torch.float16, reference.abs().max().item()),
    )
    assert err <= bound, (err, bound)
    jobs.postprocess(p)
    assert torch.equal(webui_apply(unet, host, X, T, monkeypatch), reference)


def test_exception_path_is_restored_by_the_hosts_closing_p(allow_cpu, monkeypatch):
    """The job raises (OOM...): the WebUI skips postprocess, but ``with closing(p)`` calls close."""
    unet, model, host, session, jobs = make_env()
    snap = snapshot(unet)
    p = FakeP()
    job = jobs.process(p, opts())
    assert is_cast(unet)
    with pytest.raises(RuntimeError):
        webui_apply(unet, host, torch.randn(1, 5, 8, 8), T[:1], monkeypatch)  # wrong channels
    p.close()
    assert job.closed and job.failed
    assert exactly_restored(unet, snap) and host.unet == FP32_STATE
    assert "before_load_weights" not in model.__dict__


def test_same_job_processing_twice_casts_once(allow_cpu):
    """A selectable script (X/Y/Z) runs process() several times in one WebUI job."""
    unet, model, host, session, jobs = make_env()
    snap = snapshot(unet)
    p = FakeP()
    job = jobs.process(p, opts())
    assert jobs.process(p, opts()) is job
    assert len(job.unet.casts) == 1
    jobs.postprocess(p)
    assert exactly_restored(unet, snap)  # a second cast would have lost the FP32 originals


def test_next_process_without_postprocess_restores_then_casts_again(allow_cpu):
    unet, model, host, session, jobs = make_env()
    snap = snapshot(unet)
    first = jobs.process(FakeP(), opts())  # this run raised: no postprocess, no p.close
    host.token = 2.0
    p = FakeP()
    second = jobs.process(p, opts())
    assert first.closed and first.failed and second is not first
    assert is_cast(unet) and host.unet == UNetState(torch.float16, True)
    jobs.postprocess(p)
    assert exactly_restored(unet, snap) and host.unet == FP32_STATE


def test_next_process_with_the_option_off_restores(allow_cpu):
    unet, model, host, session, jobs = make_env()
    snap = snapshot(unet)
    jobs.process(FakeP(), opts())
    host.token = 2.0
    jobs.process(FakeP(), opts(unet_fp16=False))
    assert exactly_restored(unet, snap) and host.unet == FP32_STATE


def test_script_unload_restores(allow_cpu):
    unet, model, host, session, jobs = make_env()
    snap = snapshot(unet)
    jobs.process(FakeP(), opts())
    assert session.close_all() == 1
    assert exactly_restored(unet, snap) and host.unet == FP32_STATE


# -- models changing mid-job ----------------------------------------------------------------------
def test_weights_loaded_into_the_same_model_mid_job(allow_cpu):
    """Hires checkpoint / Refiner with one checkpoint in memory: ``load_model_weights`` calls
    ``model.before_load_weights(sd)``, loads the new weights into the same objects, sets the
    host's FP32 state and calls ``on_model_loaded``."""
    unet, model, host, session, jobs = make_env()
    params_before = dict(unet.named_parameters())
    p = FakeP()
    job = jobs.process(p, opts())
    new_weights = tiny_unet(seed=9).state_dict()
    model.before_load_weights(new_weights)  # what the WebUI does first
    assert all(q.dtype == torch.float32 for q in unet.parameters()) and unet.dtype == torch.float32
    unet.load_state_dict(new_weights)  # FP32 model: the new weights go in unrounded
    host.unet = FP32_STATE  # what load_model_weights sets for a --no-half model
    snap_new = snapshot(unet)
    session.model_changed(model)
    assert is_cast(unet) and host.unet == UNetState(torch.float16, True)
    assert len(job.unet.casts) == 2 and job.unet.casts[0].restored
    jobs.postprocess(p)
    assert exactly_restored(unet, snap_new)
    assert dict(unet.named_parameters()) == params_before  # same parameter objects throughout
    assert host.unet == FP32_STATE and "before_load_weights" not in model.__dict__


def test_cached_model_switched_in_without_callback_is_caught_at_the_next_step(allow_cpu):
    """A Refiner already in memory (sd_checkpoints_limit > 1) becomes current mid-sampling without
    ``on_model_loaded``; ``on_cfg_denoiser`` runs before its first UNet call."""
    unet, model, host, session, jobs = make_env()
    other_unet = tiny_unet(seed=11)
    other = fake_sd_model(unet=other_unet)
    snap, snap_other = snapshot(unet), snapshot(other_unet)
    p = FakeP()
    jobs.process(p, opts())
    host.model = other
    session.sampling_step()
    assert is_cast(other_unet) and is_cast(unet)
    jobs.postprocess(p)
    assert exactly_restored(unet, snap) and exactly_restored(other_unet, snap_other)
    assert host.unet == FP32_STATE


def test_a_current_model_that_cannot_be_cast_gets_the_hosts_state_back(allow_cpu):
    unet, model, host, session, jobs = make_env()
    p = FakeP()
    job = jobs.process(p, opts())
    host.model = fake_sd_model(unet=tiny_unet(seed=3).to(torch.bfloat16))  # storage we do not cast
    session.sampling_step()
    assert host.unet == FP32_STATE  # an uncast UNet must not get FP16 inputs
    assert any("not FP32" in n for n in job.notes)
    host.model = model
    session.sampling_step()
    assert host.unet == UNetState(torch.float16, True)
    jobs.postprocess(p)
    assert host.unet == FP32_STATE


# -- others' changes and failures -----------------------------------------------------------------
def test_weights_changed_during_the_job_are_kept(allow_cpu):
    """A LoRA merges into the weights in place (``weight.copy_(...)``) while the UNet is FP16:
    that weight is kept (widened), every other one restored exactly."""
    unet, model, host, session, jobs = make_env()
    snap = snapshot(unet)
    p = FakeP()
    job = jobs.process(p, opts())
    weight = unet.out[2].weight
    with torch.no_grad():
        weight.add_(0.25)
    merged = weight.detach().float().clone()
    jobs.postprocess(p)
    assert weight.dtype == torch.float32 and torch.equal(weight.detach(), merged)
    rest = {k: v for k, v in snap.items() if k != "out.2.weight"}
    assert exactly_restored(unet, {**rest, "out.2.weight": (weight, merged)})
    assert any("changed during the job" in n for n in job.notes)


def test_lora_backup_taken_during_the_job_is_widened_to_the_fp32_original(allow_cpu):
    """The built-in Lora extension's first merge in this job: it copies the (FP16) weight to the CPU
    as its backup, then merges in place. After the job its un-merge must give the FP32 original."""
    unet, model, host, session, jobs = make_env()
    layer = unet.out[2]
    original = layer.weight.detach().clone()
    p = FakeP()
    jobs.process(p, opts())
    with torch.no_grad():
        layer.network_weights_backup = layer.weight.to("cpu", copy=True)  # what Lora stores
        layer.weight.copy_(layer.weight + 0.125)  # ... and merges
    jobs.postprocess(p)
    assert layer.network_weights_backup.dtype == torch.float32
    assert torch.equal(layer.network_weights_backup.view(torch.int32), original.view(torch.int32))
    with torch.no_grad():
        layer.weight.copy_(layer.network_weights_backup)  # Lora's un-merge at the next change
    assert torch.equal(layer.weight.detach().view(torch.int32), original.view(torch.int32))


def test_weight_beyond_fp16_range_aborts_the_cast_and_restores_what_was_cast(allow_cpu):
    unet, model, host, session, jobs = make_env()
    with torch.no_grad():
        unet.out[2].bias[0] = 1e6  # the last parameter: everything before it was already cast
    snap = snapshot(unet)
    p = FakeP()
    job = jobs.process(p, opts())
    assert exactly_restored(unet, snap) and host.unet == FP32_STATE and unet.dtype == torch.float32
    assert job.plans["unet"] == "skipped (fp16 range)" and job.unet.casts == []
    assert any("FP16 range" in c for c in host.comments)


def test_trashed_model_is_skipped_at_restore(allow_cpu):
    """The WebUI moves a model it drops to the meta device; nothing to restore there."""
    unet, model, host, session, jobs = make_env()
    p = FakeP()
    jobs.process(p, opts())
    unet.to("meta")
    jobs.postprocess(p)
    assert host.unet == FP32_STATE


def test_groupnorm32_fp32_weights_are_what_makes_the_cast_unet_run(allow_cpu):
    """Guards the KEEP_FP32 choice: ldm's GroupNorm32 normalises ``x.float()``, which fails with
    FP16 weights."""
    norm = tiny_unet().input_blocks[1][0].in_layers[0]
    assert type(norm).__name__ == "GroupNorm32"
    x = torch.randn(1, norm.num_channels, 4, 4, dtype=torch.float16)
    assert norm(x).dtype == torch.float16
    with pytest.raises(RuntimeError):
        F.group_norm(x.float(), norm.num_groups, norm.weight.half(), norm.bias.half())
