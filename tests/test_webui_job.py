"""The WebUI job lifecycle on real ldm VAE modules, with host *state* faked (webui_fakes)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from webui_fakes import FakeHost, FakeP, fake_sd_model, tiny_decoder

from lib_vram.core.hooks import ATTR, HookRegistry
from lib_vram.webui import ScriptJobs, Session
from lib_vram.webui.job import HOOK_NAME
from lib_vram.webui.options import VRAMGuardOptions

Z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(5))
X = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(6)) * 2 - 1


def opts(**kw) -> VRAMGuardOptions:
    base = {"enabled": True, "vae_tiling": "Off", "release_between_stages": False, "upscale_tiling": False}
    base.update(kw)
    return VRAMGuardOptions(**base)


def untouched(module: torch.nn.Module) -> bool:
    return "forward" not in module.__dict__ and ATTR not in module.__dict__


@pytest.fixture()
def env():
    model = fake_sd_model()
    host = FakeHost(model)
    session = Session(host=host)
    jobs = ScriptJobs(session, kind="txt2img")
    with torch.no_grad():
        plain_dec = model.first_stage_model.decoder(Z)
        plain_enc = model.first_stage_model.encoder(X)
    return model, host, session, jobs, plain_dec, plain_enc


def test_disabled_installs_nothing_and_output_is_bit_identical(env):
    model, host, session, jobs, plain_dec, plain_enc = env
    p = FakeP()
    jobs.setup(p, opts(enabled=False))
    assert jobs.process(p, opts(enabled=False)) is None
    dec, enc = model.first_stage_model.decoder, model.first_stage_model.encoder
    assert untouched(dec) and untouched(enc)
    assert "close" not in p.__dict__ and p.extra_generation_params == {}
    with torch.no_grad():
        assert torch.equal(dec(Z), plain_dec)
        assert torch.equal(enc(X), plain_enc)
    assert session.open_jobs() == []


def test_enabled_job_hooks_records_and_postprocess_restores(env):
    model, host, session, jobs, plain_dec, plain_enc = env
    dec, enc = model.first_stage_model.decoder, model.first_stage_model.encoder
    p = FakeP()
    jobs.setup(p, opts())
    job = jobs.process(p, opts())
    assert job is not None and HookRegistry.of(dec).names == (HOOK_NAME,)
    assert p.extra_generation_params["VRAM Guard"].startswith("preset Auto")
    with torch.no_grad():
        assert torch.equal(dec(Z), plain_dec)  # tiling Off, precision Auto: the original forward
        assert torch.equal(enc(X), plain_enc)
    names = [r.name for r in job.tracker.records]
    assert names == ["decode", "encode"] and job.tracker.records[0].plan == "untiled"
    plan = p.extra_generation_params["VRAM Guard plan"]
    assert callable(plan) and plan(p=p, index=0) == "decode untiled; encode untiled"
    jobs.postprocess(p)
    assert untouched(dec) and untouched(enc) and "close" not in p.__dict__
    assert job.closed and not job.failed
    assert [s["name"] for s in session.last["records"]] == ["decode", "encode"]


def test_exception_path_is_closed_by_the_hosts_closing_p(env):
    """OOM-like failure inside the decode: the WebUI skips postprocess, but ``with closing(p)``
    calls ``p.close()``; that alone must undo every patch."""
    model, host, session, jobs, plain_dec, _ = env
    dec = model.first_stage_model.decoder
    p = FakeP()
    jobs.setup(p, opts())
    job = jobs.process(p, opts())
    with pytest.raises(RuntimeError), torch.no_grad():
        dec(torch.randn(1, 5, 8, 8))  # wrong channel count: the conv raises inside our stage
    assert not untouched(dec)
    p.close()  # the host's finally
    assert p.closed == 1 and "close" not in p.__dict__
    assert untouched(dec) and job.closed and job.failed
    rec = session.last["records"][-1]
    assert rec["name"] == "decode" and rec["ok"] is False
    with torch.no_grad():
        assert torch.equal(dec(Z), plain_dec)


def test_stale_job_is_closed_at_the_next_process(env):
    model, host, session, jobs, plain_dec, _ = env
    dec = model.first_stage_model.decoder
    jobs.process(FakeP(), opts())
    assert not untouched(dec)
    host.token = 2.0  # the next WebUI job, with VRAM Guard now disabled
    jobs.process(FakeP(), opts(enabled=False))
    assert untouched(dec) and session.open_jobs() == []


def test_hook_is_inert_outside_the_job_that_installed_it(env, monkeypatch):
    model, host, session, jobs, plain_dec, _ = env
    dec = model.first_stage_model.decoder
    job = jobs.process(FakeP(), opts())
    calls = []
    monkeypatch.setattr(job, "vae_call", lambda *a, **k: calls.append(a))
    host.token = 99.0  # the WebUI started another job without telling us
    with torch.no_grad():
        assert torch.equal(dec(Z), plain_dec)
    assert calls == []
    host.token = 1.0
    with torch.no_grad():
        dec(Z)
    assert len(calls) == 1


def test_model_swap_mid_job_hooks_the_new_vae_and_close_releases_both(env):
    model, host, session, jobs, _, _ = env
    old = model.first_stage_model.decoder
    p = FakeP(enable_hr=True)
    jobs.process(p, opts())
    new_model = fake_sd_model(decoder=tiny_decoder(seed=7))
    host.model = new_model  # hires checkpoint / refiner
    jobs.before_hr(p)
    new = new_model.first_stage_model.decoder
    assert HookRegistry.of(new).names == (HOOK_NAME,) and HookRegistry.of(old).names == (HOOK_NAME,)
    jobs.postprocess(p)
    assert untouched(old) and untouched(new)


def test_unload_closes_every_open_job(env):
    model, host, session, jobs, _, _ = env
    other = ScriptJobs(session, kind="img2img")
    jobs.process(FakeP(), opts())
    other.process(FakeP(), opts())
    assert len(session.open_jobs()) == 2
    assert session.close_all() == 2
    assert untouched(model.first_stage_model.decoder) and session.open_jobs() == []


def test_stage_names_follow_hires_progress_and_threads(env):
    model, host, session, jobs, _, _ = env
    dec, enc = model.first_stage_model.decoder, model.first_stage_model.encoder
    p = FakeP(enable_hr=True)
    job = jobs.process(p, opts())
    jobs.before_sampling(p)
    with torch.no_grad():
        dec(Z)  # first-pass decode for hires
        p.is_hr_pass = True
        enc(X)  # hires re-encode
        t = threading.Thread(target=lambda: dec(Z))  # a live preview from the HTTP thread
        t.start()
        t.join()
        dec(Z)  # final decode
    jobs.postprocess(p)
    names = [r.name for r in job.tracker.records]
    assert names == ["sampling", "hires_decode", "hires_encode", "preview_decode", "decode"]


def test_release_boundaries_are_recorded(env):
    model, host, session, jobs, _, _ = env
    p = FakeP()
    job = jobs.process(p, opts(release_between_stages=True, preset="4GB"))
    jobs.post_sample(p)
    jobs.postprocess_batch(p)
    jobs.postprocess(p)
    assert [r["at"] for r in job.releases] == ["process", "post_sample", "postprocess_batch", "job_end"]
    assert [r.name for r in job.tracker.records] == ["postprocess"]


def test_flag_disable_patches_nothing(env):
    model, host, session, jobs, _, _ = env
    host.flags["vram_guard_disable"] = True
    assert jobs.process(FakeP(), opts()) is None
    assert untouched(model.first_stage_model.decoder)


def test_closed_job_does_not_keep_the_model_alive():
    host = FakeHost(fake_sd_model())
    jobs = ScriptJobs(Session(host=host), kind="txt2img")
    jobs.process(FakeP(), opts())
    ref = weakref.ref(host.model.first_stage_model.decoder)
    jobs.close()
    host.model = None
    gc.collect()
    assert ref() is None


def test_fp16_revert_by_the_webui_is_reported(env):
    model, host, session, jobs, _, _ = env
    host.dtype = torch.float16
    p = FakeP()
    jobs.process(p, opts())
    host.dtype = torch.float32  # decode_latent_batch's NaN fallback flips devices.dtype_vae
    jobs.postprocess(p)
    assert any("switched its VAE from FP16 to FP32" in n for n in session.notes)
    assert any("FP16" in c for c in host.comments)
    assert any("FP16" in n for n in session.status()["notes"])
