"""The WebUI adapter driving the real engines: tiled VAE on real ldm modules, tiled upscaling of a
real spandrel ESRGAN file through the upscaler patch (host state faked as in webui_fakes)."""

from __future__ import annotations

import torch
from conftest import make_imagelike_rrdb, rrdb_class
from PIL import Image
from tolerances import VAE_EXACT
from webui_fakes import FakeHost, FakeP, fake_sd_model

from lib_vram.webui import ScriptJobs, Session
from lib_vram.webui.options import VRAMGuardOptions

Z = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(11))


def opts(**kw) -> VRAMGuardOptions:
    base = {"enabled": True, "release_between_stages": False, "upscale_tiling": False}
    base.update(kw)
    return VRAMGuardOptions(**base)


def setup_job(**kw):
    host = FakeHost(fake_sd_model())
    session = Session(host=host)
    jobs = ScriptJobs(session, kind="txt2img")
    dec = host.model.first_stage_model.decoder
    with torch.no_grad():
        plain = dec(Z)
    p = FakeP()
    job = jobs.process(p, opts(**kw))
    return host, jobs, job, p, dec, plain


def test_always_tiles_the_decode_and_matches_untiled():
    host, jobs, job, p, dec, plain = setup_job(vae_tiling="Always", vae_tile=16)
    with torch.no_grad():
        out = dec(Z)
    jobs.postprocess(p)
    rec = [r for r in job.tracker.records if r.depth == 0][-1]
    assert rec.name == "decode" and rec.plan.startswith("exact t16")
    # the readout says it in words: how many tiles, how big, within how much memory, which picture
    words = [n for n in job.notes if "The VAE decode was done in" in n]
    tiles = int(rec.plan.split(" x")[-1])
    assert words and f"in {tiles} tiles of up to 128x128 px to fit in " in words[0], job.notes
    assert "the same picture as untiled" in words[0]
    assert out.shape == plain.shape
    assert (out - plain).abs().max() <= VAE_EXACT, (out - plain).abs().max()
    assert "forward" not in dec.__dict__


def test_auto_runs_untiled_when_it_fits_bit_identical():
    host, jobs, job, p, dec, plain = setup_job(vae_tiling="Auto")
    with torch.no_grad():
        out = dec(Z)
    jobs.postprocess(p)
    assert torch.equal(out, plain)
    assert [r for r in job.tracker.records if r.depth == 0][-1].plan == "untiled"
    assert not any("was done in" in n for n in job.notes)  # nothing to explain


def test_forced_fp16_overflow_is_recomputed_not_nan():
    """FP16 VAE + a layer that overflows in fp16: the per-tile guard recomputes it wider, so the
    WebUI's NaN check (which would switch the VAE to FP32 for the session) never fires."""
    host, jobs, job, p, dec, plain = setup_job(vae_tiling="Always", vae_tile=16, precision_vae="FP16")

    def overflow(module, inputs, output):
        if output.dtype == torch.float16:
            return output * 1e6  # beyond fp16's range -> inf
        return output

    handle = dec.conv_in.register_forward_hook(overflow)
    try:
        with torch.no_grad():
            out = dec(Z)
    finally:
        handle.remove()
    jobs.postprocess(p)
    assert torch.isfinite(out).all()
    assert any("recomputed" in n for n in job.notes)


def test_esrgan_upscale_goes_through_the_engine_and_the_cache(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    net = make_imagelike_rrdb(rrdb_class()(in_nc=3, out_nc=3, num_filters=8, num_blocks=1, scale=4))
    path = tmp_path / "tiny-esrgan.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))

    class UpscalerESRGAN:  # host-state fake: the WebUI object whose do_upscale gets the path
        def __init__(self):
            self.calls = 0

        def do_upscale(self, img, selected_model):
            self.calls += 1
            return img

    scaler = UpscalerESRGAN()
    host = FakeHost(fake_sd_model())
    host.scalers = [scaler]
    session = Session(host=host)
    jobs = ScriptJobs(session, kind="txt2img")
    p = FakeP(enable_hr=True)
    job = jobs.process(p, opts(upscale_tiling=True, upscale_tile=32, vae_tiling="Off"))
    img = Image.fromarray(
        (torch.rand(40, 48, 3, generator=torch.Generator().manual_seed(2)) * 255).byte().numpy()
    )
    out1 = scaler.do_upscale(img, str(path))
    out2 = scaler.do_upscale(img, str(path))
    jobs.postprocess(p)
    assert scaler.calls == 0  # the WebUI's loader/upscaler never ran
    assert out1.size == (192, 160) and list(out1.getdata()) == list(out2.getdata())
    top = [r for r in job.tracker.records if r.depth == 0]
    assert [r.name for r in top] == ["hires_upscale", "hires_upscale"] and top[0].plan
    assert any(
        n.startswith("VRAM Guard: The hires-fix upscale was done in ") and "of up to 32x32 px" in n
        for n in job.notes
    ), job.notes
    assert [s["name"] for s in session.last["records"]] == ["hires_upscale", "hires_upscale"]
    assert "do_upscale" not in scaler.__dict__
    cache = session.model_cache()
    assert len(cache) >= 1
