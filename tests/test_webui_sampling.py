"""The sampling stage inside the WebUI, and room made for every stage (lib_vram.webui.sampling,
lib_vram.webui.offload, the upscale route).

Real ldm UNet and VAE (the WebUI's classes), a real spandrel upscaler loaded from a file; host
state faked (webui_fakes). The card is the emulated one (``--vram-guard-emulate-vram``): the
checkpoint's weights count as resident, moving idle parts off the card is the card's resident
bytes going down by theirs, and an allocation beyond the card raises the real out-of-memory error.

A sampling pass is driven the way the WebUI drives it: ``process_before_every_sampling`` (the
script's ``before_sampling``), then the UNet called as the sampler calls it (the cond/uncond pair
and the images of the batch in one forward, ``opts.batch_cond_uncond``), one ``on_cfg_denoiser``
per step, then ``post_sample`` and the decode.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from conftest import image_like
from PIL import Image
from webui_fakes import FakeHost, FakeP, fake_sd_model, tiny_unet

from lib_vram.cli.bench._archs import build, save_and_load
from lib_vram.core import emulate
from lib_vram.planning import planner
from lib_vram.webui import ScriptJobs, Session
from lib_vram.webui.emulation import WebUICard
from lib_vram.webui.options import VRAMGuardOptions

BIG = 2**34


class TextEncoder(torch.nn.Module):
    """Stands for ``cond_stage_model`` (its weights are what matters here: idle during sampling
    once the conditioning is computed, and during an upscale)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(512, 64)


MODEL = fake_sd_model(unet=tiny_unet())
MODEL.cond_stage_model = TextEncoder()
UNET = MODEL.model.diffusion_model
UNET_BYTES = emulate.module_bytes([UNET])
TE_BYTES = emulate.module_bytes([MODEL.cond_stage_model])
VAE_BYTES = emulate.module_bytes([MODEL.first_stage_model.decoder, MODEL.first_stage_model.encoder])


class UpscalerESRGAN:
    """Host-state fake of the WebUI's ESRGAN upscaler object (``do_upscale(img, path)``)."""

    def __init__(self) -> None:
        self.calls = 0

    def do_upscale(self, img: Any, selected_model: Any) -> Any:
        self.calls += 1
        return img


@dataclass
class Run:
    out: Any
    error: BaseException | None
    notes: list[str]
    status: dict
    resident_before: int
    resident_after: int
    peak: int
    p: Any


def run_job(
    capacity: int,
    body: Any,
    *,
    kind: str = "txt2img",
    settings: dict | None = None,
    host: FakeHost | None = None,
    p: Any = None,
    inject_oom_at: int | None = None,
    **options: Any,
) -> Run:
    """One job on a card of ``capacity`` bytes with the checkpoint resident; ``body(jobs, p)``
    is what the host does inside it."""
    planner.MEMORY.clear()
    o = VRAMGuardOptions(**{"enabled": True, "release_between_stages": False, "vae_tiling": "Off", **options})
    host = host if host is not None else FakeHost(MODEL)
    session = Session(host=host)
    wc = WebUICard(capacity, host=host)
    wc.install()
    session.emulation = wc
    before = wc.card.resident_bytes
    jobs = ScriptJobs(session, kind=kind)
    host.state.begin()
    p = p if p is not None else FakeP()
    out = error = None
    try:
        jobs.setup(p, o)
        jobs.process(p, o)
        if settings and jobs.job is not None:
            jobs.job.settings = dataclasses.replace(jobs.job.settings, **settings)
        wc.card.inject_oom_at = None if inject_oom_at is None else wc.card.allocations + inject_oom_at
        try:
            with torch.no_grad():
                out = body(jobs, p)
        except Exception as exc:
            error = exc
        peak = wc.card.peak_bytes
        status = session.status()
        notes = list(status["notes"])
        if error is None:
            jobs.postprocess(p)
    finally:
        p.close()
        jobs.close(failed=True)
        host.state.end()
        after = wc.card.resident_bytes
        wc.close()
    return Run(out, error, notes, status, before, after, peak, p)


def assert_clean(r: Run) -> None:
    """Nothing left moved or patched, the card gone."""
    assert r.resident_after == r.resident_before
    assert "forward" not in UNET.__dict__, UNET.__dict__.get("forward")
    for m in (UNET, MODEL.cond_stage_model, MODEL.first_stage_model.decoder):
        assert all(not mod._forward_pre_hooks for mod in m.modules())
    assert emulate.installed() is None and torch._C._len_torch_dispatch_stack() == 0


# -- the upscale stage: the UNet and text encoders off the card when the upscaler needs the room ---


@pytest.fixture(scope="module")
def rrdb(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "rrdb-x2.safetensors"
    model = save_and_load(build("rrdb-x2"), path)
    return path, model


def _picture(h: int = 40, w: int = 48) -> Image.Image:
    x = image_like(h, w, seed=4)
    return Image.fromarray((x[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8), "RGB")


PICTURE = _picture()
"""The first pass's picture (host memory: made before the job)."""


def _upscale_body(path: Any, scaler: UpscalerESRGAN) -> Any:
    def body(jobs: ScriptJobs, p: Any) -> Any:
        return scaler.do_upscale(PICTURE, str(path))

    return body


def _upscale_run(capacity: int, path: Any, **kw: Any) -> Run:
    host = FakeHost(MODEL)
    scaler = UpscalerESRGAN()
    host.scalers = [scaler]
    return run_job(capacity, _upscale_body(path, scaler), host=host, **kw)


def _tight_upscale_cap(path: Any) -> tuple[Run, int]:
    """The reference upscale (whole image) on a big card, and a card with 64 KiB free beside the
    checkpoint: not even the smallest tile fits there, while the UNet and text encoders (2.8 MiB)
    make room for a tiled upscale."""
    _upscale_run(BIG, path)  # calibrates the model once (cached for the process), as a first job does
    ref = _upscale_run(BIG, path)
    assert ref.error is None
    cap = ref.resident_before + 64 * 1024
    assert ref.peak > cap, "the upscale fits beside the checkpoint: nothing to show here"
    return ref, cap


def _same_picture(got: Any, ref: Any) -> None:
    """The tiled upscale against the whole-image one: the engine's tiles carry the model's whole
    receptive field as overlap, so every output pixel comes from the same inputs and weights; only
    the convolutions' summation order differs (other spatial blocking), a float rounding that can
    flip one 8-bit level."""
    diff = np.abs(np.asarray(got).astype(int) - np.asarray(ref).astype(int))
    assert diff.max() <= 1, diff.max()


def test_an_upscale_that_fits_only_without_the_unet_moves_it_off_and_back(rrdb):
    path, _ = rrdb
    ref, cap = _tight_upscale_cap(path)
    off = _upscale_run(cap, path, settings={"offload_unet": False, "offload_text_encoders": False})
    assert off.error is not None and "out of memory" in str(off.error).lower(), off.error
    r = _upscale_run(cap, path)
    assert r.error is None, r.error
    _same_picture(r.out, ref.out)
    moved = [n for n in r.notes if "off the card" in n]
    assert len(moved) == 1 and "UNet, text encoders" in moved[0] and "smallest plan" in moved[0], r.notes
    plans = [st["plan"] for st in r.status["stages"] if st["stage"] == "hires_upscale"]
    assert plans and plans[-1].endswith("UNet, text encoders off the card"), plans
    assert r.peak <= cap
    assert_clean(r)
    assert_clean(off)


def test_an_upscale_that_runs_out_of_memory_where_no_tile_helps_is_retried_with_them_off(rrdb, monkeypatch):
    """The smallest plan said it fits (here: forced), the upscale ran out of memory even at the
    smallest tile: the same upscale runs again with the idle models off the card."""
    from lib_vram.webui import upscalers

    path, _ = rrdb
    ref, cap = _tight_upscale_cap(path)
    monkeypatch.setattr(upscalers, "smallest_plan_fits", lambda *a, **k: True)
    r = _upscale_run(cap, path)
    assert r.error is None, r.error
    _same_picture(r.out, ref.out)
    assert any("ran out of memory with them there" in n for n in r.notes), r.notes
    assert_clean(r)


def test_an_upscale_that_fits_beside_them_moves_nothing(rrdb):
    path, _ = rrdb
    r = _upscale_run(BIG, path)
    assert r.error is None
    assert not any("off the card" in n for n in r.notes)
    assert_clean(r)
