"""Settings table, HTTP routes, conflict detection, preset resolution, upscaler patch semantics."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from webui_fakes import FakeHost, FakeP, fake_sd_model, tiny_decoder

from lib_vram.core.hooks import register_hook, remove_hook
from lib_vram.webui import ScriptJobs, Session
from lib_vram.webui.host import tiled_vae_extension_installed
from lib_vram.webui.integration import (
    FREE_ROUTE,
    STATUS_ROUTE,
    check_conflicts,
    mount_routes,
    settings_options,
)
from lib_vram.webui.options import FIELDS, VRAMGuardOptions
from lib_vram.webui.patching import foreign_vae_wrapper
from lib_vram.webui.settings import resolve


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


def _webui_like_app(api_auth: str | None) -> FastAPI:
    """A FastAPI app with a ``/sdapi/v1/txt2img`` route protected the way v1.10.1's ``Api``
    protects it under ``--api-auth`` (``Api.add_api_route`` adds ``Depends(self.auth)``)."""
    from lib_vram.webui.integration import basic_auth_dependency

    app = FastAPI()
    deps = [basic_auth_dependency(api_auth)] if api_auth else []
    app.add_api_route("/sdapi/v1/txt2img", lambda: {"ok": True}, methods=["POST"], dependencies=deps)
    return app


@pytest.mark.parametrize("with_api", [True, False])
def test_routes_require_the_api_credentials_under_api_auth(with_api):
    from lib_vram.core.readout import UI_STATUS_ROUTE

    host = FakeHost()
    host.flags["api_auth"] = "user:pass,other:word"
    app = _webui_like_app("user:pass,other:word") if with_api else FastAPI()
    mount_routes(app, Session(host=host))
    client = TestClient(app)
    for method, route in (("get", STATUS_ROUTE), ("post", FREE_ROUTE)):
        call = getattr(client, method)
        assert call(route).status_code == 401
        assert call(route, auth=("user", "wrong")).status_code == 401
        assert call(route, auth=("nobody", "pass")).status_code == 401
        assert call(route, auth=("user", "pass")).status_code == 200
        assert call(route, auth=("other", "word")).status_code == 200
    if with_api:
        assert client.post("/sdapi/v1/txt2img").status_code == 401  # the host's behaviour we copy
    # The page's readout route has no API credentials to send: it follows the page (no login here).
    assert client.get(UI_STATUS_ROUTE).status_code == 200


def test_routes_are_open_without_api_auth():
    host = FakeHost()
    app = _webui_like_app(None)
    mount_routes(app, Session(host=host))
    client = TestClient(app)
    assert client.get(STATUS_ROUTE).status_code == 200 and client.post(FREE_ROUTE).status_code == 200


def test_readout_route_follows_the_pages_gradio_login():
    from lib_vram.core.readout import UI_STATUS_ROUTE

    app = FastAPI()
    app.auth = {"user": "pass"}  # what gradio's App holds with --gradio-auth
    app.tokens = {"tok123": "user"}
    mount_routes(app, Session(host=FakeHost()))
    client = TestClient(app)
    assert client.get(UI_STATUS_ROUTE).status_code == 401
    assert client.get(UI_STATUS_ROUTE, cookies={"access-token": "nope"}).status_code == 401
    assert client.get(UI_STATUS_ROUTE, cookies={"access-token": "tok123"}).status_code == 200


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


def test_tiled_vae_extension_is_detected_by_folder_and_by_its_hook(tmp_path, caplog):
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
    with caplog.at_level(logging.INFO, logger="lib_vram.webui.integration"):
        check_conflicts(session, host=host)
    assert "Tiled VAE" in caplog.text
    assert session.notes == []  # installed only: a log line, not a note on every readout

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


def _decode(host):
    with torch.no_grad():
        host.model.first_stage_model.decoder(torch.randn(1, 4, 8, 8))


def test_interrupted_hires_job_labels_its_final_decode_decode():
    """Interrupted during the first pass, v1.10.1's ``sample_hr_pass`` returns at once and the final
    decode happens after ``post_sample`` with ``is_hr_pass`` False: that is the final decode, not a
    second "Hires first decode"."""
    host = FakeHost(fake_sd_model())
    session = Session(host=host)
    jobs = ScriptJobs(session, kind="txt2img")
    p = FakeP(enable_hr=True)
    jobs.process(p, VRAMGuardOptions(enabled=True, vae_tiling="Off", upscale_tiling=False))
    jobs.before_sampling(p)
    _decode(host)  # first-pass decode for the (ESRGAN) hires upscale
    jobs.post_sample(p)  # sample_hr_pass returned early: interrupted
    _decode(host)  # the final decode in process_images_inner
    jobs.postprocess(p)
    stages = {s["stage"]: s for s in session.status()["stages"]}
    assert stages["hires_decode"]["count"] == 1 and stages["decode"]["count"] == 1
    # The normal hires job: first decode, hires pass, final decode inside the hires pass.
    p = FakeP(enable_hr=True)
    jobs.process(p, VRAMGuardOptions(enabled=True, vae_tiling="Off", upscale_tiling=False))
    jobs.before_sampling(p)
    _decode(host)
    p.is_hr_pass = True
    jobs.before_hr(p)
    jobs.before_sampling(p)
    _decode(host)
    p.is_hr_pass = False
    jobs.post_sample(p)
    jobs.postprocess(p)
    stages = {s["stage"]: s for s in session.status()["stages"]}
    assert stages["hires_decode"]["count"] == 1 and stages["decode"]["count"] == 1
    assert "hires_sampling" in stages


def test_job_failed_outside_our_stages_is_not_shown_as_all_ok():
    host = FakeHost(fake_sd_model())
    session = Session(host=host)
    jobs = ScriptJobs(session, kind="txt2img")
    p = FakeP()
    jobs.process(p, VRAMGuardOptions(enabled=True, vae_tiling="Off", upscale_tiling=False))
    jobs.before_sampling(p)
    # The sampler raises: postprocess never runs; the next job (or unload) closes this one as failed.
    session.close_all(failed=True)
    status = session.status()
    sampling = next(s for s in status["stages"] if s["stage"] == "sampling")
    assert sampling["ok"] is False and "outside VRAM Guard" in sampling["error"]
    # Failed between stages (no span open): a note says so.
    p = FakeP()
    jobs.process(p, VRAMGuardOptions(enabled=True, vae_tiling="Off", upscale_tiling=False))
    _decode(host)
    jobs.post_sample(p)
    session.close_all(failed=True)
    status = session.status()
    assert all(s["ok"] for s in status["stages"])
    assert any("failed outside VRAM Guard" in n for n in status["notes"])
