"""Forge adapter: ``patcher.model_options`` wrappers around a real ldm-layout VAE.

The VAE object and its patcher are host-state fakes shaped like Forge's ``backend.patcher.vae.VAE``
(``decode``/``encode`` consult the wrapper slots exactly as Forge does: ``wrapper(inner, x)``); the
encoder/decoder inside are the real ldm classes (Forge's ``IntegratedAutoencoderKL`` has that
layout).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from tolerances import VAE_EXACT
from webui_fakes import FakeHost, FakeP, tiny_decoder, tiny_encoder

from lib_vram.core.hooks import HookRegistry
from lib_vram.webui import ScriptJobs, Session
from lib_vram.webui.forge import DECODE_SLOT, ENCODE_SLOT
from lib_vram.webui.job import HOOK_NAME
from lib_vram.webui.options import VRAMGuardOptions


class FakeForgeVAE:
    """Forge's VAE contract: decode(latent BCHW) -> BHWC in [0,1]; encode(BHWC [0,1]) -> latent."""

    def __init__(self) -> None:
        torch.manual_seed(2)
        self.first_stage_model = torch.nn.Module()
        self.first_stage_model.decoder = tiny_decoder()
        self.first_stage_model.encoder = tiny_encoder()
        self.first_stage_model.post_quant_conv = torch.nn.Conv2d(4, 4, 1)
        self.first_stage_model.quant_conv = torch.nn.Conv2d(8, 8, 1)
        self.patcher = SimpleNamespace(model_options={})
        self.device = torch.device("cpu")
        self.vae_dtype = torch.float32
        self.output_device = torch.device("cpu")
        self.inner_calls = 0

    def decode_inner(self, z: torch.Tensor) -> torch.Tensor:
        self.inner_calls += 1
        fsm = self.first_stage_model
        x = fsm.decoder(fsm.post_quant_conv(z))
        return torch.clamp((x.float() + 1.0) / 2.0, 0.0, 1.0).movedim(1, -1)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        wrapper = self.patcher.model_options.get(DECODE_SLOT)
        return self.decode_inner(z) if wrapper is None else wrapper(self.decode_inner, z)

    def encode_inner(self, pixels: torch.Tensor) -> torch.Tensor:
        self.inner_calls += 1
        fsm = self.first_stage_model
        h = fsm.quant_conv(fsm.encoder(2.0 * pixels.movedim(-1, 1) - 1.0))
        return torch.chunk(h, 2, dim=1)[0]

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        wrapper = self.patcher.model_options.get(ENCODE_SLOT)
        return self.encode_inner(pixels) if wrapper is None else wrapper(self.encode_inner, pixels)


def forge_model(vae: FakeForgeVAE):
    # Forge: first_stage_model is None; the VAE lives in forge_objects.
    return SimpleNamespace(first_stage_model=None, forge_objects=SimpleNamespace(vae=vae))


Z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(9))
TILED = VRAMGuardOptions(enabled=True, vae_tiling="Always", vae_tile=16, release_between_stages=False)
"""VRAM Guard runs the VAE passes (tiled, exact mode): Forge's own decode_inner is bypassed."""


def test_forge_wrappers_installed_used_and_removed():
    vae = FakeForgeVAE()
    host = FakeHost(forge_model(vae))
    jobs = ScriptJobs(Session(host=host), kind="txt2img")
    with torch.no_grad():
        plain = vae.decode(Z)
    p = FakeP()
    jobs.process(p, TILED)
    opts = vae.patcher.model_options
    assert set(opts) == {DECODE_SLOT, ENCODE_SLOT}
    assert HookRegistry.of(vae.first_stage_model.decoder).names == (HOOK_NAME,)
    vae.inner_calls = 0
    with torch.no_grad():
        out = vae.decode(Z)
        pix = torch.rand(1, 16, 16, 3, generator=torch.Generator().manual_seed(1))
        lat = vae.encode(pix)
    assert vae.inner_calls == 0  # Forge's own decode_inner (its 3-pass OOM fallback) is bypassed
    assert out.shape == plain.shape == (2, 16, 16, 3)
    # exact tiles vs Forge's untiled decode_inner: the engine's bound (on the decoder's output;
    # (x + 1) / 2 and the clamp only shrink a difference)
    assert (out - plain).abs().max() <= VAE_EXACT
    assert lat.shape == (1, 4, 8, 8) and torch.isfinite(lat).all()
    assert host.loaded == [vae, vae]  # the VAE was put on its device through Forge's manager
    jobs.postprocess(p)
    assert vae.patcher.model_options == {}
    assert "forward" not in vae.first_stage_model.decoder.__dict__


def test_forge_wrapper_of_another_extension_is_kept_both_ways():
    vae = FakeForgeVAE()
    host = FakeHost(forge_model(vae))
    jobs = ScriptJobs(Session(host=host), kind="txt2img")
    seen = []

    def before(inner, z):  # set by another extension before our job
        seen.append("before")
        return inner(z)

    vae.patcher.model_options[DECODE_SLOT] = before
    p = FakeP()
    jobs.process(p, TILED)
    ours = vae.patcher.model_options[DECODE_SLOT]

    def after(inner, z):  # set by another extension after ours
        seen.append("after")
        return ours(inner, z)

    vae.patcher.model_options[DECODE_SLOT] = after
    with torch.no_grad():
        vae.decode(Z)
    assert seen == ["after", "before"] and vae.inner_calls == 0
    jobs.postprocess(p)
    assert vae.patcher.model_options[DECODE_SLOT] is after  # theirs survives our removal
    seen.clear()
    with torch.no_grad():
        vae.decode(Z)
    assert seen == ["after", "before"] and vae.inner_calls == 1  # ours is a pass-through now


def test_forge_wrapper_inert_outside_its_job():
    vae = FakeForgeVAE()
    host = FakeHost(forge_model(vae))
    jobs = ScriptJobs(Session(host=host), kind="txt2img")
    jobs.process(FakeP(), TILED)
    host.token = "another job"
    vae.inner_calls = 0
    with torch.no_grad():
        vae.decode(Z)
    assert vae.inner_calls == 1
    jobs.close()
    assert vae.patcher.model_options == {}


def test_forge_own_vae_path_kept_when_vram_guard_leaves_the_vae_alone():
    """VAE tiling Off (no forced precision): Forge's own decode_inner/encode_inner run, with its
    memory manager, its OOM -> tiled fallback and "Never OOM"'s always-tiled VAE; our hooks on the
    decoder/encoder still see the passes (untiled) for the readout."""
    vae = FakeForgeVAE()
    host = FakeHost(forge_model(vae))
    jobs = ScriptJobs(Session(host=host), kind="txt2img")
    with torch.no_grad():
        plain = vae.decode(Z)
    p = FakeP()
    jobs.process(p, VRAMGuardOptions(enabled=True, vae_tiling="Off", release_between_stages=False))
    assert set(vae.patcher.model_options) == {DECODE_SLOT, ENCODE_SLOT}
    vae.inner_calls = 0
    with torch.no_grad():
        out = vae.decode(Z)
        vae.encode(torch.rand(1, 16, 16, 3, generator=torch.Generator().manual_seed(1)))
    assert vae.inner_calls == 2  # Forge's own passes
    assert host.loaded == []  # and its own memory management, not ours
    assert torch.equal(out, plain)
    stages = [r.name for r in jobs.job.tracker.records if r.depth == 0]
    assert stages == ["decode", "encode"]  # still seen by our hooks
    jobs.postprocess(p)
    assert vae.patcher.model_options == {}


def test_forge_forced_vae_precision_with_tiling_off_goes_through_vram_guard():
    vae = FakeForgeVAE()
    host = FakeHost(forge_model(vae))
    jobs = ScriptJobs(Session(host=host), kind="txt2img")
    p = FakeP()
    opts = VRAMGuardOptions(
        enabled=True, vae_tiling="Off", precision_vae="FP32", release_between_stages=False
    )
    jobs.process(p, opts)
    vae.inner_calls = 0
    with torch.no_grad():
        vae.decode(Z)
    assert vae.inner_calls == 0 and host.loaded == [vae]
    jobs.postprocess(p)


class _FixedPosterior(torch.nn.Module):
    """An "encoder" whose output is a fixed FP16 posterior (mean, logvar) for any input."""

    def __init__(self, h: torch.Tensor) -> None:
        super().__init__()
        self.h = h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.h.expand(x.shape[0], -1, -1, -1).to(x.device)


def test_forge_encode_draws_the_posterior_noise_like_forge():
    """Forge's ``DiagonalGaussianDistribution.sample``: ``mean + std * torch.randn(shape).to(device)``
    for the whole batch: float32 noise from the CPU generator, a float32 sum even for an FP16 VAE.
    Our encode must draw the same noise (else img2img/hires differ from Forge by more than
    rounding), also for a batch of two."""
    from lib_vram.webui.forge import _encode

    g = torch.Generator().manual_seed(4)
    h = torch.cat([torch.randn(1, 4, 6, 5, generator=g), torch.rand(1, 4, 6, 5, generator=g) - 3.0], 1)
    h = h.half()
    vae = FakeForgeVAE()
    vae.first_stage_model.encoder = _FixedPosterior(h)
    vae.first_stage_model.quant_conv = None
    vae.vae_dtype = torch.float16
    pixels = torch.rand(2, 48, 40, 3, generator=g)
    torch.manual_seed(21)
    ours = _encode(vae, lambda v: None, pixels)
    # Forge's own arithmetic on the same posterior:
    mean, logvar = torch.chunk(h.expand(2, -1, -1, -1), 2, dim=1)
    std = torch.exp(0.5 * torch.clamp(logvar, -30.0, 20.0))
    torch.manual_seed(21)
    forge = (mean + std * torch.randn(mean.shape).to(device=mean.device)).float()
    assert ours.dtype == torch.float32 and ours.shape == (2, 4, 6, 5)
    assert torch.equal(ours, forge)
