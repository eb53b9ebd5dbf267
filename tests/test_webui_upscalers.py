"""The WebUI upscaler route: the WebUI's channel order, every spandrel upscaler class, the Extras
result cache, and models built while the host has torch.nn's constructors patched."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from conftest import image_like
from PIL import Image
from tolerances import UPSCALE_LSB
from webui_fakes import FakeHost, FakeP, fake_sd_model

from lib_vram.cli.models.archs import build, save_and_load
from lib_vram.upscale import ModelCache, UpscaleError
from lib_vram.upscale._models import patched_construction
from lib_vram.webui import ScriptJobs, Session
from lib_vram.webui.options import VRAMGuardOptions
from lib_vram.webui.upscalers import FAMILY


def _webui_reference(model, img: Image.Image) -> np.ndarray:
    """What v1.10.1's ``upscale_pil_patch`` computes (modules/upscaler_utils.py): RGB, flipped to
    BGR, the model, clamped, x255 rounded, flipped back."""
    arr = np.array(img.convert("RGB"))[:, :, ::-1]
    t = torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)) / 255).float()[None]
    with torch.inference_mode():
        out = model(t)[0].clamp(0, 1).numpy()
    return (255.0 * np.moveaxis(out, 0, 2)).round().astype(np.uint8)[:, :, ::-1]


class UpscalerESRGAN:
    """Host-state fake of the WebUI's ESRGAN upscaler object (``do_upscale(img, path)``)."""

    def __init__(self) -> None:
        self.calls = 0

    def do_upscale(self, img, selected_model):
        self.calls += 1
        return img


class UpscalerSwinIR(UpscalerESRGAN):
    pass


def _image(h: int = 72, w: int = 60) -> Image.Image:
    x = image_like(h, w, seed=4)
    x[:, 0] *= 0.3  # unequal channels: RGB and BGR give different pictures
    return Image.fromarray((x[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8), "RGB")


@pytest.mark.parametrize(("cls", "arch"), [(UpscalerESRGAN, "rrdb-x2"), (UpscalerSwinIR, "swinir")])
def test_routed_upscale_is_the_webuis_picture_in_bgr(tmp_path, cls, arch):
    path = tmp_path / f"{arch}.safetensors"
    model = save_and_load(build(arch), path)
    host = FakeHost(fake_sd_model())
    scaler = cls()
    host.scalers = [scaler]
    jobs = ScriptJobs(Session(host=host), kind="txt2img")
    p = FakeP()
    jobs.process(p, VRAMGuardOptions(enabled=True, vae_tiling="Off", upscale_tile=32))
    img = _image()
    out = scaler.do_upscale(img, str(path))
    jobs.postprocess(p)
    assert scaler.calls == 0 and out.mode == "RGB"
    ref = _webui_reference(model, img)
    got = np.asarray(out).astype(int)
    assert np.abs(got - ref).max() <= UPSCALE_LSB
    # The fidelity check can fail: the same model on RGB gives another picture.
    rgb = _webui_reference(model, Image.merge("RGB", img.split()[::-1]))[:, :, ::-1]
    assert np.abs(rgb.astype(int) - ref).max() > 8


def test_every_spandrel_upscaler_of_the_webui_is_routed():
    assert set(FAMILY) == {
        "UpscalerESRGAN",
        "UpscalerRealESRGAN",
        "UpscalerHAT",
        "UpscalerDAT",
        "UpscalerSwinIR",
        "UpscalerScuNET",
    }


def test_extras_route_change_empties_the_webuis_upscale_cache():
    host = FakeHost(fake_sd_model())
    cleared: list[int] = []
    host.clear_upscale_cache = lambda: cleared.append(1)
    jobs = ScriptJobs(Session(host=host), kind="extras")
    on = VRAMGuardOptions(enabled=True, vae_tiling="Off")
    off = VRAMGuardOptions(enabled=False)
    pp = FakeP()
    jobs.extras(pp, off)
    assert len(cleared) == 1  # first Extras run: whatever the cache holds came from elsewhere
    jobs.extras(pp, off)
    assert len(cleared) == 1
    jobs.extras(pp, on)
    assert len(cleared) == 2  # off -> on
    jobs.extras(FakeP(), on)
    assert len(cleared) == 2
    jobs.extras(pp, VRAMGuardOptions(enabled=True, vae_tiling="Off", upscale_tile=64))
    assert len(cleared) == 3  # another tile size


# -- models built while the host builds its own on the meta device -------------------------------


class _OnMeta:
    """What WebUI v1.10.1's ``InitializeOnMeta`` does process-wide while it builds a checkpoint:
    ``Linear``/``Conv2d`` created on the meta device, ``Module.to`` a no-op."""

    def __enter__(self):
        self.saved = [(c, a, c.__dict__[a]) for c, a in _HOOKED]
        conv_init, lin_init = torch.nn.Conv2d.__init__, torch.nn.Linear.__init__
        torch.nn.Conv2d.__init__ = lambda *a, **k: conv_init(*a, **{**k, "device": "meta"})
        torch.nn.Linear.__init__ = lambda *a, **k: lin_init(*a, **{**k, "device": "meta"})
        torch.nn.Module.to = lambda *a, **k: None
        return self

    def __exit__(self, *exc):
        for c, a, f in self.saved:
            setattr(c, a, f)


_HOOKED = [(torch.nn.Conv2d, "__init__"), (torch.nn.Linear, "__init__"), (torch.nn.Module, "to")]


@pytest.mark.filterwarnings("ignore:for .* copying from a non-meta parameter")
def test_a_model_built_on_the_meta_device_is_refused_and_not_cached(tmp_path):
    path = tmp_path / "m.safetensors"
    save_and_load(build("compact-x2"), path)
    cache = ModelCache(construction_wait_s=0)
    with _OnMeta():
        assert patched_construction() == ["Module.to", "Linear.__init__", "Conv2d.__init__"]
        with pytest.raises(UpscaleError, match="meta device"):
            cache.get(path, torch.device("cpu"))
    assert len(cache) == 0 and patched_construction() == []
    model = cache.get(path, torch.device("cpu"))
    assert not any(t.is_meta for t in model.model.parameters())


def test_a_load_waits_for_the_hosts_meta_construction_to_end(tmp_path):
    """The first Extras request of a fresh WebUI arrives while its startup thread builds the
    checkpoint under ``InitializeOnMeta``: the load waits for it, then builds a real model."""
    path = tmp_path / "m.safetensors"
    ref = save_and_load(build("compact-x2"), path)
    cache = ModelCache(construction_wait_s=30)
    entered, done = threading.Event(), threading.Event()

    def host_loads_its_checkpoint():
        with _OnMeta():
            entered.set()
            time.sleep(0.5)
        done.set()

    t = threading.Thread(target=host_loads_its_checkpoint)
    t.start()
    entered.wait()
    model = cache.get(path, torch.device("cpu"))
    assert done.is_set()
    t.join()
    x = image_like(12, 10)
    assert torch.equal(model(x), ref(x))  # the same weights, network and input: the same operations


def test_the_webuis_permanent_lora_patches_do_not_make_a_load_wait(tmp_path, monkeypatch):
    """The built-in Lora extension replaces ``Linear``/``Conv2d._load_from_state_dict`` for good:
    those are not a construction in progress."""
    path = tmp_path / "m.safetensors"
    save_and_load(build("compact-x2"), path)
    orig = torch.nn.Module._load_from_state_dict
    monkeypatch.setattr(torch.nn.Conv2d, "_load_from_state_dict", lambda self, *a, **k: orig(self, *a, **k))
    assert patched_construction() == []
    t0 = time.monotonic()
    ModelCache(construction_wait_s=30).get(path, torch.device("cpu"))
    assert time.monotonic() - t0 < 10


def test_forge_memory_preparation_runs_before_the_routed_upscale(tmp_path):
    """Forge's ESRGAN ``do_upscale`` frees its minimum inference memory before upscaling; the route
    replaces that ``do_upscale``, so it asks the host for the same step (once per upscale, before
    the engine runs). A host without the step (A1111) is left alone."""
    path = tmp_path / "rrdb-x2.safetensors"
    save_and_load(build("rrdb-x2"), path)
    events: list[str] = []
    host = FakeHost(fake_sd_model())
    host.prepare_upscale_memory = lambda: events.append("prepare")
    scaler = UpscalerESRGAN()
    host.scalers = [scaler]
    jobs = ScriptJobs(Session(host=host), kind="extras")
    p = FakeP()
    jobs.process(p, VRAMGuardOptions(enabled=True, vae_tiling="Off", upscale_tile=32))
    stage = jobs.job.stage

    def staged(name):
        events.append(f"stage {name}")
        return stage(name)

    jobs.job.stage = staged
    scaler.do_upscale(_image(), str(path))
    jobs.postprocess(p)
    assert events[:2] == ["prepare", "stage upscale"] and events.count("prepare") == 1
    assert scaler.calls == 0


def test_host_prepare_upscale_memory_is_a_no_op_without_forge(monkeypatch):
    import sys

    from lib_vram.webui import host as real_host

    monkeypatch.setitem(sys.modules, "modules_forge", None)  # "import modules_forge" -> ImportError
    real_host.prepare_upscale_memory()  # A1111: nothing to do, no error


# -- the global generator after a routed upscale (Forge hires fix, issue 14) ---------------------


def _reloading_host_class(name: str):
    """A host upscaler class as WebUI v1.10.1 / Forge write ESRGAN, HAT, ScuNET: ``do_upscale``
    builds the model from its file at every call (``modelloader.load_spandrel_model`` ->
    ``spandrel.ModelLoader(device=None).load_from_file``), then runs it."""
    import spandrel

    def do_upscale(self, img, selected_model):
        self.calls += 1
        model = spandrel.ModelLoader(device=None).load_from_file(str(selected_model))
        return Image.fromarray(_webui_reference(model.model.eval(), img))

    return type(name, (UpscalerESRGAN,), {"do_upscale": do_upscale})


def _route(host, scaler, img, path, notes=None):
    jobs = ScriptJobs(Session(host=host), kind="txt2img")
    p = FakeP()
    jobs.process(p, VRAMGuardOptions(enabled=True, vae_tiling="Off", upscale_tile=32))
    try:
        return scaler.do_upscale(img, str(path))
    finally:
        if notes is not None:
            notes.extend(jobs.job.notes)
        jobs.postprocess(p)


@pytest.mark.parametrize("cls_name", ["UpscalerESRGAN", "UpscalerScuNET"])
def test_routed_upscale_leaves_the_global_generator_where_the_hosts_own_upscale_does(tmp_path, cls_name):
    """The hires re-encode after the upscale samples the latent posterior from torch's global
    generator (``torch.randn`` in ``DiagonalGaussianDistribution.sample``). The host's own upscale
    builds the model at every call (its random init draws); with VRAM Guard's cached model the
    generator was elsewhere and the hires fix on Forge came out 14.2 dB from Forge's own. Both the
    first routed upscale (our cache loads the file) and a later one (cache hit) must leave the
    generator, and so the encode's noise, exactly where the host's own upscale leaves it."""
    from lib_vram.webui import host as real_host

    path = tmp_path / "rrdb-x2.safetensors"
    save_and_load(build("rrdb-x2"), path)
    cls = _reloading_host_class(cls_name)
    own = cls()
    host = FakeHost(fake_sd_model())
    # (None before the fix: the route then had no replay and the check below fails at the cache hit)
    host.replay_upscaler_load = getattr(real_host, "replay_upscaler_load", None)
    routed = cls()
    host.scalers = [routed]
    img = _image()
    for call in ("cache miss", "cache hit"):
        torch.manual_seed(1234)
        start = torch.get_rng_state()
        ref = np.asarray(own.do_upscale(img, str(path)))
        ref_noise = torch.randn(4, 16, 16)  # the encode's posterior noise after the host's upscale
        torch.set_rng_state(start)
        out = np.asarray(_route(host, routed, img, path))
        noise = torch.randn(4, 16, 16)
        assert routed.calls == 0  # it was routed
        assert np.abs(out.astype(int) - ref).max() <= UPSCALE_LSB, call
        assert torch.equal(noise, ref_noise), f"{call}: the encode would draw other noise"
    # The check can fail: without the host's build the generator is elsewhere.
    torch.set_rng_state(start)
    torch.randn(4, 16, 16)
    assert not torch.equal(torch.randn(4, 16, 16), ref_noise)


def test_swinir_keeps_its_model_so_its_loads_are_not_replayed(tmp_path):
    """``UpscalerSwinIR`` caches its model in the host as we do: no replay, our load as it was."""
    path = tmp_path / "swinir.safetensors"
    save_and_load(build("swinir"), path)
    replays: list[str] = []
    host = FakeHost(fake_sd_model())
    host.replay_upscaler_load = replays.append
    scaler = UpscalerSwinIR()
    host.scalers = [scaler]
    _route(host, scaler, _image(), path)
    assert scaler.calls == 0 and replays == []


def test_a_failed_replay_keeps_the_upscaled_picture_and_says_so(tmp_path):
    path = tmp_path / "rrdb-x2.safetensors"
    model = save_and_load(build("rrdb-x2"), path)
    host = FakeHost(fake_sd_model())

    def replay(p):
        raise OSError(f"{p}: read error")

    host.replay_upscaler_load = replay
    scaler = UpscalerESRGAN()
    host.scalers = [scaler]
    img = _image()
    notes: list[str] = []
    out = _route(host, scaler, img, path, notes)
    assert scaler.calls == 0
    assert np.abs(np.asarray(out).astype(int) - _webui_reference(model, img)).max() <= UPSCALE_LSB
    assert any("could not rebuild rrdb-x2.safetensors" in n for n in notes)


def test_a_model_that_takes_one_image_at_a_time_is_upscaled_by_the_route(tmp_path):
    """DRUNet (spandrel's wrapper adds a noise map of batch 1: a batch raises) through the route,
    tiled at 32 px: one image per call, the WebUI's picture, no fallback to the WebUI's upscaler."""
    path = tmp_path / "drunet.safetensors"
    model = save_and_load(build("drunet"), path)
    host = FakeHost(fake_sd_model())
    scaler = UpscalerESRGAN()
    host.scalers = [scaler]
    img = _image()
    out = _route(host, scaler, img, path)
    assert scaler.calls == 0
    assert np.abs(np.asarray(out).astype(int) - _webui_reference(model, img)).max() <= 1
