"""``scripts/vram_guard.py`` against the minimal fake ``modules`` package in tests/fake_host/.

The fake holds host *state* only (Script base class, callback registrars, opts/cmd_opts/state,
devices); the VAE is a real ldm decoder and the UI a real gradio 3.41 Blocks.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from webui_fakes import FakeP, fake_sd_model

from lib_vram.core.hooks import ATTR
from lib_vram.webui.options import API_ARG_ORDER, EXTRAS_FIELDS, VRAMGuardOptions

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "fake_host"


@pytest.fixture()
def script(tmp_path, monkeypatch):
    """Import the script file the way the WebUI does (by path), with the fake host first."""
    monkeypatch.syspath_prepend(str(FAKE))
    for name in [m for m in sys.modules if m == "modules" or m.startswith("modules.")]:
        monkeypatch.delitem(sys.modules, name)
    import modules.shared as shared

    shared.sd_model = fake_sd_model()
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("vram_guard.py", ROOT / "scripts" / "vram_guard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    module.SESSION.close_all()
    for name in [m for m in sys.modules if m == "modules" or m.startswith("modules.")]:
        del sys.modules[name]


def test_import_only_registers_callbacks(script, tmp_path):
    from modules import script_callbacks, shared

    kinds = sorted(kind for kind, _ in script_callbacks.registered)
    assert kinds == [
        "app_started", "cfg_denoiser", "list_unets", "model_loaded", "script_unloaded", "ui_settings"
    ]  # fmt: skip
    assert os.listdir(tmp_path) == []  # no files written
    dec = shared.sd_model.first_stage_model.decoder
    assert "forward" not in dec.__dict__ and ATTR not in dec.__dict__  # nothing patched
    assert script.SESSION.open_jobs() == []
    # exactly one Script and one ScriptPostprocessing subclass, none of the base classes imported
    from modules import scripts, scripts_postprocessing

    found = [v for v in vars(script).values() if isinstance(v, type)]
    assert [c for c in found if issubclass(c, scripts.Script)] == [script.VRAMGuardScript]
    assert [c for c in found if issubclass(c, scripts_postprocessing.ScriptPostprocessing)] == [
        script.VRAMGuardExtras
    ]


def test_ui_returns_one_input_per_option(script):
    import gradio as gr

    s = script.VRAMGuardScript()
    assert s.title() == "VRAM Guard" and s.section == "accordions"
    with gr.Blocks():
        inputs = s.ui(False)
    assert len(inputs) == len(API_ARG_ORDER)
    assert len(s.infotext_fields) == len(API_ARG_ORDER)
    with gr.Blocks():
        extras = script.VRAMGuardExtras().ui()
    assert list(extras) == list(EXTRAS_FIELDS)


def test_process_disabled_returns_at_once_and_installs_nothing(script):
    from modules import shared

    s = script.VRAMGuardScript()
    p = FakeP()
    args = VRAMGuardOptions(enabled=False).args()
    s.setup(p, *args)
    assert s.process(p, *args) is None
    dec = shared.sd_model.first_stage_model.decoder
    assert "forward" not in dec.__dict__ and ATTR not in dec.__dict__
    assert p.extra_generation_params == {} and "close" not in p.__dict__
    assert script.SESSION.open_jobs() == []


def test_process_enabled_name_keyed_api_args_then_postprocess(script):
    from modules import shared

    s = script.VRAMGuardScript()
    p = FakeP()
    args = [{"vae_tiling": "Off", "release_between_stages": False, "upscale_tiling": False}]
    s.setup(p, *args)
    s.process(p, *args)
    dec = shared.sd_model.first_stage_model.decoder
    assert "forward" in dec.__dict__
    assert p.extra_generation_params["VRAM Guard"].startswith("preset Auto, VAE off")
    with torch.no_grad():
        dec(torch.randn(1, 4, 8, 8))
    s.postprocess(p, None, *args)
    assert "forward" not in dec.__dict__ and script.SESSION.last["records"][0]["name"] == "decode"


def test_the_list_unets_callback_places_nothing_while_the_option_is_off(script):
    """The checkpoint placement's early hook (before the WebUI's model-loading thread starts):
    with neither the setting nor --vram-guard-place-checkpoint it patches nothing."""
    from modules import script_callbacks

    early = [cb for kind, cb in script_callbacks.registered if kind == "list_unets"][0]
    early([])
    assert script.SESSION.placement is None


def test_unload_callback_closes_jobs(script):
    from modules import script_callbacks, shared

    s = script.VRAMGuardScript()
    args = [{"vae_tiling": "Off", "upscale_tiling": False}]
    s.process(FakeP(), *args)
    unload = [cb for kind, cb in script_callbacks.registered if kind == "script_unloaded"][0]
    unload()
    assert "forward" not in shared.sd_model.first_stage_model.decoder.__dict__


def test_extras_none_args_mean_settings_defaults(script):
    from modules import scripts_postprocessing, shared

    shared.opts.vram_guard_enabled = True
    shared.opts.vram_guard_upscale_tile = 64
    e = script.VRAMGuardExtras()
    pp = scripts_postprocessing.PostprocessedImage(None)
    e.process_firstpass(pp, **{k: None for k in EXTRAS_FIELDS})
    job = e.jobs.job
    assert job is not None and job.settings.upscale_tile == 64 and job.settings.upscale_tiling
    assert pp.info["VRAM Guard"].startswith("preset Auto")
    del pp  # the end of this image's Extras run
    import gc

    gc.collect()
    assert job.closed


def test_settings_registered_in_one_section_the_settings_page_can_read(script):
    from modules import script_callbacks, shared

    register = [cb for kind, cb in script_callbacks.registered if kind == "ui_settings"][0]
    register()
    labels = shared.opts.data_labels
    assert {f"vram_guard_{n}" for n in API_ARG_ORDER} <= set(labels)
    for info in labels.values():
        # The settings page does `elem_id, text = item.section`: exactly two items.
        assert info.section == ("vram_guard", "VRAM Guard") and info.category_id == "system"


def test_fp16_unet_through_the_script_and_the_real_host_adapter(script, monkeypatch):
    """API arg ``unet_fp16`` → ``modules.devices`` state and the UNet cast; the cfg_denoiser
    callback keeps it; postprocess restores both (host.py's own functions on the fake host state)."""
    from modules import devices, script_callbacks, shared
    from webui_fakes import tiny_unet

    from lib_vram.webui import unet as unet_mod

    monkeypatch.setattr(unet_mod, "ALLOW_CPU", True)  # the fake host computes on the CPU
    unet = tiny_unet()
    shared.sd_model = fake_sd_model(unet=unet)
    before = {n: p.detach().clone() for n, p in unet.named_parameters()}
    s = script.VRAMGuardScript()
    p = FakeP()
    args = [{"vae_tiling": "Off", "upscale_tiling": False, "unet_fp16": True}]
    s.setup(p, *args)
    s.process(p, *args)
    assert devices.dtype_unet == torch.float16 and devices.unet_needs_upcast is True
    assert unet.time_embed[0].weight.dtype == torch.float16 and unet.dtype == torch.float16
    step = [cb for kind, cb in script_callbacks.registered if kind == "cfg_denoiser"][0]
    devices.dtype_unet, devices.unet_needs_upcast = torch.float32, False  # a model load reset it
    step(None)
    assert devices.dtype_unet == torch.float16 and devices.unet_needs_upcast is True
    s.postprocess(p, None, *args)
    assert devices.dtype_unet == torch.float32 and devices.unet_needs_upcast is False
    for name, param in unet.named_parameters():
        assert param.dtype == torch.float32 and torch.equal(param.detach(), before[name]), name


def test_fp16_unet_on_the_cpu_is_skipped_with_a_comment(script):
    from modules import devices, shared
    from webui_fakes import tiny_unet

    unet = tiny_unet()
    shared.sd_model = fake_sd_model(unet=unet)
    s = script.VRAMGuardScript()
    p = FakeP()
    args = [{"vae_tiling": "Off", "upscale_tiling": False, "unet_fp16": True}]
    s.process(p, *args)
    assert devices.dtype_unet == torch.float32 and unet.time_embed[0].weight.dtype == torch.float32
    assert any("'FP16 UNet' not applied" in c and "CPU" in c for c in p.comments)
    s.postprocess(p, None, *args)


def test_bad_api_option_is_reported_once_where_an_api_client_sees_it(script):
    """``{"vae_tile": 17}`` in ``alwayson_scripts``: the job runs without VRAM Guard (the WebUI
    cannot fail the request from a script hook), and says so once: ``info`` and the infotext
    (``extra_generation_params``), a comment under the result, one ERROR log line."""
    import logging

    from modules import shared

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.ERROR)
            self.records = []

        def emit(self, record):
            self.records.append(record)

    s = script.VRAMGuardScript()
    logger = logging.getLogger("lib_vram")  # its own handler (other tests may stop propagation)
    for bad, word in (({"vae_tile": 17}, "vae_tile"), ({"no_such_key": 1}, "no_such_key")):
        p = FakeP()
        keep = Keep()
        logger.addHandler(keep)
        try:
            s.setup(p, bad)
            s.process(p, bad)
            s.postprocess(p, None, bad)
        finally:
            logger.removeHandler(keep)
        errors = keep.records
        assert len(errors) == 1 and word in errors[0].getMessage()
        assert word in p.extra_generation_params["VRAM Guard error"]
        assert len(p.comments) == 1 and "VRAM Guard is off for this job" in p.comments[0]
        assert "forward" not in shared.sd_model.first_stage_model.decoder.__dict__
        assert script.SESSION.open_jobs() == []


def test_api_requests_without_our_args_follow_the_settings_at_request_time(script):
    """v1.10.1's Api captures every script's UI defaults once at startup and fills them into each
    request: after the app starts, our slots follow the Settings value of the moment instead."""
    from types import SimpleNamespace

    import gradio as gr
    from fastapi import FastAPI
    from modules import script_callbacks, scripts, shared

    s = script.VRAMGuardScript()
    s.alwayson = True
    shared.opts.vram_guard_enabled = True  # the Settings when the WebUI built its API defaults
    with gr.Blocks():
        ui_defaults = [c.value for c in s.ui(False)]
    s.args_from, s.args_to = 1, 1 + len(ui_defaults)

    class Api:  # the attributes of modules.api.api.Api that are read
        def __init__(self):
            self.default_script_arg_txt2img = [0, *ui_defaults]
            self.default_script_arg_img2img = [0, *ui_defaults]

        def text2imgapi(self):
            return {}

    api = Api()
    app = FastAPI()
    app.add_api_route("/sdapi/v1/txt2img", api.text2imgapi, methods=["POST"])
    monkey = SimpleNamespace(scripts=[s])
    scripts.scripts_txt2img = scripts.scripts_img2img = monkey
    try:
        started = [cb for kind, cb in script_callbacks.registered if kind == "app_started"][0]
        started(None, app)
        assert api.default_script_arg_txt2img[1:] == [None] * len(ui_defaults)

        def request_opens_a_job() -> bool:
            p = FakeP()
            args = api.default_script_arg_txt2img[s.args_from : s.args_to]
            s.setup(p, *args)
            s.process(p, *args)
            opened = bool(script.SESSION.open_jobs())
            s.postprocess(p, None, *args)
            return opened

        shared.opts.vram_guard_enabled = False
        assert not request_opens_a_job()  # captured True would have opened one
        shared.opts.vram_guard_enabled = True
        assert request_opens_a_job()
        unload = [cb for kind, cb in script_callbacks.registered if kind == "script_unloaded"][0]
        unload()
        assert api.default_script_arg_txt2img[1:] == ui_defaults  # undone
    finally:
        scripts.scripts_txt2img = scripts.scripts_img2img = None
