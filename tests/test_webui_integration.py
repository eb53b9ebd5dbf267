"""Settings table, HTTP routes, conflict detection, preset resolution, upscaler patch semantics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from webui_fakes import FakeHost, FakeP, fake_sd_model, tiny_decoder

from lib_vram.hooks import register_hook, remove_hook
from lib_vram.options import FIELDS, VRAMGuardOptions
from lib_vram.webui import (
    FREE_ROUTE,
    STATUS_ROUTE,
    ScriptJobs,
    Session,
    foreign_vae_wrapper,
    mount_routes,
    resolve,
    settings_options,
)
from lib_vram.webui.host import tiled_vae_extension_installed
from lib_vram.webui.integration import check_conflicts


def test_settings_cover_every_option_with_a_tuple_section_kind():
    keys = dict(settings_options())
    assert {f.settings_key for f in FIELDS} <= set(keys)
    for f in FIELDS:
        spec = keys[f.settings_key]
        assert spec["default"] == f.default and spec["kind"] in ("bool", "choice", "int")
        if spec["kind"] == "choice":
            assert f.default in spec["component_args"]["choices"]
    assert "24GB+" in keys["vram_guard_presets_table"]["label"]


def test_status_and_free_routes_on_the_apps_own_fastapi():
    session = Session(host=FakeHost())
    app = FastAPI()
    mount_routes(app, session)
    mount_routes(app, session)  # idempotent (Reload UI calls on_app_started again)
    assert sum(getattr(r, "path", None) == STATUS_ROUTE for r in app.routes) == 1
    client = TestClient(app)
    status = client.get(STATUS_ROUTE).json()
    assert status["schema"] == 1 and status["cpu_only"] and status["job_running"] is False
    freed = client.post(FREE_ROUTE).json()
    assert "collected_objects" in freed and freed["memory"]["total_bytes"] > 0


def test_status_reports_the_last_jobs_stages():
    host = FakeHost(fake_sd_model())
    session = Session(host=host)
    jobs = ScriptJobs(session, kind="txt2img")
    p = FakeP()
    jobs.process(p, VRAMGuardOptions(enabled=True, vae_tiling="Off", upscale_tiling=False))
    assert session.status()["job_running"] is True
    with torch.no_grad():
        host.model.first_stage_model.decoder(torch.randn(1, 4, 8, 8))
    jobs.postprocess(p)
    status = session.status()
    assert status["job_running"] is False
    assert [s["stage"] for s in status["stages"]] == ["decode"] and status["stages"][0]["plan"] == "untiled"


def test_tiled_vae_extension_is_detected_by_folder_and_by_its_hook(tmp_path):
    other = tmp_path / "some-extension"
    (other / "scripts").mkdir(parents=True)
    assert tiled_vae_extension_installed([str(other)]) is None
    renamed = tmp_path / "my-tiled-vae"
    (renamed / "scripts").mkdir(parents=True)
    (renamed / "scripts" / "tilevae.py").write_text("# marker\n")
    assert tiled_vae_extension_installed([str(other), str(renamed)]) == str(renamed)
    default = tmp_path / "multidiffusion-upscaler-for-automatic1111"
    default.mkdir()
    assert tiled_vae_extension_installed([str(default)]) == str(default)

    host = FakeHost()
    host.tiled_vae_extension_installed = lambda: str(default)
    session = Session(host=host)
    check_conflicts(session, host=host)
    assert any("Tiled VAE" in n for n in session.notes)

    dec = tiny_decoder()
    assert foreign_vae_wrapper(dec) is None
    register_hook(dec, "vram_guard", lambda m, nxt, *a, **k: nxt(*a, **k))
    assert foreign_vae_wrapper(dec) is None  # ours is not foreign
    remove_hook(dec, "vram_guard")
    dec.original_forward = dec.forward  # what the Tiled VAE extension leaves on the decoder
    dec.forward = lambda z: z
    assert "Tiled VAE" in foreign_vae_wrapper(dec)


def test_preset_resolution_flag_custom_and_release():
    caps = SimpleNamespace(backend="cuda", fp16=True, bf16=True)
    o = VRAMGuardOptions(enabled=True)
    s = resolve(o, total_bytes=6 * 1024**3, caps=caps)
    assert s.preset == "Auto (6GB)" and "post_sample" in s.release_at and s.vae_mode == "auto"
    assert resolve(o, total_bytes=6 * 1024**3, caps=caps, preset_override="24gb+").preset == "24GB+"
    with pytest.raises(ValueError, match="preset"):
        resolve(o, total_bytes=1, caps=caps, preset_override="huge")
    custom = resolve(o.replace(preset="Custom", release_between_stages=False), total_bytes=1, caps=caps)
    assert custom.release_at == frozenset({"failure"})
    forced = resolve(
        o.replace(precision_vae="FP16", vae_tiling="Always", vae_mode="fast", vae_tile=64),
        total_bytes=1,
        caps=caps,
    )
    assert forced.vae_dtype == torch.float16 and forced.vae_mode == "fast" and forced.vae_tile == 64


class UpscalerESRGAN:
    """Host-state fake of the WebUI's ESRGAN upscaler object: only ``do_upscale`` matters here."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def do_upscale(self, img, selected_model):
        self.calls.append(selected_model)
        return ("webui", img)


def test_upscaler_patch_falls_back_and_is_undone_keeping_a_later_foreign_patch():
    host = FakeHost(fake_sd_model())
    scaler = UpscalerESRGAN()
    host.scalers = [scaler, SimpleNamespace(do_upscale=lambda img, m: "lanczos")]
    jobs = ScriptJobs(Session(host=host), kind="txt2img")
    p = FakeP()
    jobs.process(p, VRAMGuardOptions(enabled=True, vae_tiling="Off"))
    assert "do_upscale" in scaler.__dict__
    # A URL (model not downloaded yet) is left to the WebUI's own code.
    assert scaler.do_upscale("img", "https://example.invalid/ESRGAN.pth") == ("webui", "img")
    ours = scaler.do_upscale
    scaler.do_upscale = lambda img, m: ("foreign", ours(img, m))
    jobs.postprocess(p)
    assert scaler.do_upscale("img", "x.pth") == ("foreign", ("webui", "img"))
    assert scaler.calls == ["https://example.invalid/ESRGAN.pth", "x.pth"]
    del scaler.do_upscale
    assert "do_upscale" not in scaler.__dict__


def test_upscaler_patch_is_skipped_when_upscale_tiling_is_off():
    host = FakeHost(fake_sd_model())
    scaler = UpscalerESRGAN()
    host.scalers = [scaler]
    jobs = ScriptJobs(Session(host=host), kind="img2img")
    jobs.process(FakeP(), VRAMGuardOptions(enabled=True, upscale_tiling=False, vae_tiling="Off"))
    assert "do_upscale" not in scaler.__dict__
    jobs.close()
