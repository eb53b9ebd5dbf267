"""'Profile the next job' in the WebUI: real ldm VAE modules and the real engine, host state faked
(webui_fakes); the profiler runs for real on the CPU."""

from __future__ import annotations

import html
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from webui_fakes import FakeHost, FakeP, fake_sd_model

from lib_vram.core.profiling import profiler_running
from lib_vram.core.readout import PROFILE_ARMED_NOTE as ARMED_NOTE
from lib_vram.core.readout import file_url
from lib_vram.webui import ScriptJobs, Session
from lib_vram.webui.options import VRAMGuardOptions
from lib_vram.webui.profiling import FOLDER

Z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(5))


def opts(**kw) -> VRAMGuardOptions:
    base = {
        "enabled": True,
        "vae_tiling": "Always",
        "release_between_stages": False,
        "upscale_tiling": False,
    }
    base.update(kw)
    return VRAMGuardOptions(**base)


class OutputsHost(FakeHost):
    """The fake host with an outputs folder and the page's file registry."""

    def __init__(self, model, outputs: Path) -> None:
        super().__init__(model)
        self.outputs = outputs
        self.registered: list[str] = []

    def profiles_dir(self) -> Path:
        return self.outputs / FOLDER

    def register_file(self, path: str) -> None:
        self.registered.append(path)


@pytest.fixture()
def env(tmp_path):
    model = fake_sd_model()
    host = OutputsHost(model, tmp_path / "outputs")
    session = Session(host=host)
    jobs = ScriptJobs(session, kind="txt2img")
    yield model, host, session, jobs
    assert not profiler_running()


def _decode(model):
    with torch.no_grad():
        return model.first_stage_model.decoder(Z)


def test_armed_job_profiles_its_stages_writes_links_and_switches_off(env):
    model, host, session, jobs = env
    assert session.toggle_profile() is True
    status = session.status()
    assert status["profile"]["armed"] is True and html.escape(ARMED_NOTE) in status["html"]
    p = FakeP()
    jobs.setup(p, opts())
    job = jobs.process(p, opts())
    assert job.profiler is not None and session.status()["profile"]["armed"] is False  # taken
    out = _decode(model)
    jobs.postprocess(p)
    assert job.closed and torch.isfinite(out).all()
    last = session.status()["profile"]["last"]
    [stage] = last["stages"]
    assert stage["stage"] == "decode" and stage["ok"]
    assert stage["top"][0]["name"] == "aten::conv2d" and stage["top"][0]["alloc_bytes"] > 0
    assert stage["peak_bytes"] > 0
    files = {k: Path(v) for k, v in stage["files"].items()}
    assert set(files) == {"trace", "summary"}  # no snapshot on the CPU (a note says so)
    assert all(f.parent == host.outputs / FOLDER and f.is_file() for f in files.values())
    assert json.loads(files["summary"].read_text())["ops"][0]["name"] == "aten::conv2d"
    assert sorted(host.registered) == sorted(str(f) for f in files.values())
    page = session.status()["html"]
    assert f'href="{file_url(str(files["trace"]))}"' in page and "conv2d" in page
    assert file_url(str(files["trace"])).startswith("file=/")
    # the next job is not profiled: the switch turned itself off
    p2 = FakeP()
    host.token = 2.0
    job2 = jobs.process(p2, opts())
    _decode(model)
    jobs.postprocess(p2)
    assert job2.profiler is None and session.status()["profile"]["last"] == last


def test_toggle_twice_cancels(env):
    _model, _host, session, jobs = env
    assert session.toggle_profile() is True
    assert session.toggle_profile() is False
    p = FakeP()
    job = jobs.process(p, opts())
    assert job.profiler is None
    jobs.postprocess(p)
    assert html.escape(ARMED_NOTE) not in session.status()["html"]


def test_failed_stage_stops_the_profiler_and_keeps_its_trace(env):
    model, host, session, jobs = env
    session.toggle_profile()
    p = FakeP()
    jobs.process(p, opts())
    with pytest.raises(ValueError), torch.no_grad():
        model.first_stage_model.decoder(torch.randn(1, 5, 8, 8))  # wrong channels: the engine refuses
    assert not profiler_running()
    p.close()  # the host's finally closes the job
    [stage] = session.status()["profile"]["last"]["stages"]
    assert stage["ok"] is False and "channels" in stage["error"]
    assert Path(stage["files"]["trace"]).is_file()


def test_interrupt_inside_a_conv_stops_the_profiler(env):
    model, host, session, jobs = env
    session.toggle_profile()
    p = FakeP()
    job = jobs.process(p, opts())
    conv = model.first_stage_model.decoder.conv_out

    def stop(*_):
        raise KeyboardInterrupt

    handle = conv.register_forward_pre_hook(stop)
    try:
        with pytest.raises(KeyboardInterrupt):
            _decode(model)
    finally:
        handle.remove()
    assert not profiler_running()
    p.close()
    assert job.closed
    [stage] = session.status()["profile"]["last"]["stages"]
    assert stage["ok"] is False and stage["error"].startswith("KeyboardInterrupt")


def test_unwritable_outputs_folder_is_a_note_not_a_failure(env, tmp_path):
    model, host, session, jobs = env
    host.outputs = tmp_path / "a-file"
    host.outputs.write_text("not a folder")
    session.toggle_profile()
    p = FakeP()
    jobs.process(p, opts())
    out = _decode(model)
    jobs.postprocess(p)
    assert torch.isfinite(out).all()
    last = session.status()["profile"]["last"]
    assert last["stages"][0]["files"] == {} and "could not write" in last["notes"][0]


def test_another_running_profiler_is_left_alone(env):
    model, host, session, jobs = env
    session.toggle_profile()
    p = FakeP()
    jobs.process(p, opts())
    with torch.profiler.profile() as outer:
        _decode(model)
    jobs.postprocess(p)
    assert outer.key_averages()  # the user's profiler kept running and collected the decode
    last = session.status()["profile"]["last"]
    assert last["stages"] == [] and "another PyTorch profiler" in last["notes"][0]


def test_profile_button_arms_the_session_and_is_no_script_input(env):
    from test_ui import build, dependency_for, run_event

    from lib_vram.webui.options import FIELDS_BY_NAME

    _model, _host, session, _jobs = env
    demo, w = build(on_profile=session.toggle_profile_html)
    button = w.profile_button
    assert button.value == "Profile the next job" and button.elem_id == "vram_guard_txt2img_profile"
    assert all(c is not button for c in w.inputs) and all(c is not button for c, _ in w.infotext_fields)
    assert "profile" not in FIELDS_BY_NAME  # not an option: no preset, infotext or API slot
    index, dep = dependency_for(demo, button, "click")
    assert dep["outputs"] == [w.readout._id] and dep["inputs"] == []
    out = run_event(demo, index, [])
    assert session.profile_switch.armed and html.escape(ARMED_NOTE) in out[0]
    out = run_event(demo, index, [])
    assert not session.profile_switch.armed and html.escape(ARMED_NOTE) not in out[0]


FAKE = Path(__file__).resolve().parent / "fake_host"


@pytest.fixture()
def fake_modules(monkeypatch):
    """The fake ``modules`` package (tests/fake_host) first on the path, removed afterwards."""
    monkeypatch.syspath_prepend(str(FAKE))
    for name in [m for m in sys.modules if m == "modules" or m.startswith("modules.")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [m for m in sys.modules if m == "modules" or m.startswith("modules.")]:
        del sys.modules[name]


def test_host_writes_into_the_outputs_folder_and_registers_files_with_the_page(
    fake_modules, monkeypatch, tmp_path
):
    from modules import paths_internal, shared

    from lib_vram.webui import host

    monkeypatch.setattr(paths_internal, "default_output_dir", str(tmp_path / "outputs"))
    monkeypatch.setattr(shared.opts, "outdir_samples", "", raising=False)
    assert host.profiles_dir() == tmp_path / "outputs" / FOLDER  # the WebUI's default outputs
    shared.opts.outdir_samples = str(tmp_path / "mine")
    assert host.profiles_dir() == tmp_path / "mine" / FOLDER  # Settings' "Output directory for images"
    demo = SimpleNamespace(temp_file_sets=[set()])
    monkeypatch.setattr(shared, "demo", demo, raising=False)
    host.register_file(str(tmp_path / "mine" / FOLDER / "x.trace.json"))
    assert demo.temp_file_sets[0] == {str(tmp_path / "mine" / FOLDER / "x.trace.json")}


def test_an_extras_upscale_is_profiled_too(tmp_path):
    """The switch is the session's: whichever job runs next takes it, here an Extras upscale
    through the routed WebUI upscaler (a real spandrel model loaded from a file)."""
    import numpy as np
    from PIL import Image

    from lib_vram.cli.models.archs import build, save_and_load

    class UpscalerESRGAN:  # host-state fake of the WebUI's ESRGAN upscaler object
        def do_upscale(self, img, selected_model):
            return img

    path = tmp_path / "rrdb.safetensors"
    save_and_load(build("rrdb-x2"), path)
    host = OutputsHost(fake_sd_model(), tmp_path / "outputs")
    scaler = UpscalerESRGAN()
    host.scalers = [scaler]
    session = Session(host=host)
    jobs = ScriptJobs(session, kind="extras")
    session.toggle_profile()
    pp = FakeP()
    jobs.extras(pp, VRAMGuardOptions(enabled=True, vae_tiling="Off", upscale_tile=32))
    img = Image.fromarray((np.random.default_rng(0).random((48, 40, 3)) * 255).astype(np.uint8), "RGB")
    out = scaler.do_upscale(img, str(path))
    jobs.close()
    assert out.size == (80, 96)
    last = session.status()["profile"]["last"]
    assert last["kind"] == "extras"
    [stage] = last["stages"]
    assert stage["stage"] == "upscale" and stage["ok"]
    assert "aten::conv2d" in [op["name"] for op in stage["top"][:3]]
    assert Path(stage["files"]["trace"]).name.endswith("-extras-upscale.trace.json")
    assert not profiler_running()


def test_a_failing_profiler_is_a_note_and_the_job_goes_on(env, monkeypatch):
    from lib_vram.core import profiling

    def broken(*args, **kwargs):
        raise RuntimeError("summary exploded")

    monkeypatch.setattr(profiling, "summarize", broken)
    model, host, session, jobs = env
    session.toggle_profile()
    p = FakeP()
    jobs.process(p, opts())
    out = _decode(model)
    jobs.postprocess(p)
    assert torch.isfinite(out).all() and not profiler_running()
    last = session.status()["profile"]["last"]
    assert last["stages"] == [] and "summary exploded" in last["notes"][0]
