"""VRAM Guard on Forge's real VAE classes: ``backend.nn.vae`` and ``backend.patcher.vae.VAE``.

Forge (lllyasviel/stable-diffusion-webui-forge) is on no package registry and is AGPL: CI cannot
install it and nothing of it is copied here. Point ``VRAM_GUARD_FORGE_PATH`` at a Forge checkout
(the folder holding ``backend/``) and run this module in a Python that has Forge's requirements
(see ``docs/forge-run.md``); without it the module is skipped with one reason.

Forge's ``backend`` reads its command line at import (``backend/args.py``): it is imported with
``sys.argv`` set to ``--always-cpu`` (else it asks CUDA for a device), and every ``backend*``
module is removed from ``sys.modules`` after this module's tests.

What runs for real: Forge's ``IntegratedAutoencoderKL`` (its ``Decoder``/``Encoder``/``AttnBlock``
with Forge's own attention function), Forge's ``VAE`` wrapper (``decode``/``encode`` consulting the
``model_vae_*_wrapper`` slots, its memory manager, its tiled fallback ``decode_tiled_``) and VRAM
Guard's job/adapter (``lib_vram.webui``) around it. Host state the adapter reads (the running job,
the loaded model) comes from ``webui_fakes.FakeHost``.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tolerances import VAE_EXACT

FORGE_ENV = "VRAM_GUARD_FORGE_PATH"
EXACT_TOL = VAE_EXACT


def _forge_root() -> Path | None:
    root = os.environ.get(FORGE_ENV)
    return Path(root).expanduser() if root else None


def _skip_reason() -> str | None:
    root = _forge_root()
    if root is None:
        return f"Forge not importable: set {FORGE_ENV} to a stable-diffusion-webui-forge checkout"
    if not (root / "backend" / "nn" / "vae.py").is_file():
        return f"Forge not importable: {FORGE_ENV}={root} has no backend/nn/vae.py"
    return None


if _skip_reason() is not None:
    pytest.skip(_skip_reason() or "", allow_module_level=True)


def _forget_backend() -> None:
    for k in [k for k in sys.modules if k == "backend" or k.startswith("backend.") or k == "gguf"]:
        del sys.modules[k]
    for k in [k for k in sys.modules if k.startswith("gguf.")]:
        del sys.modules[k]


@pytest.fixture(scope="module")
def forge():
    """Forge's ``backend.nn.vae``, ``backend.patcher.vae`` and ``backend.memory_management``."""
    root = _forge_root()
    assert root is not None
    if any(k == "backend" for k in sys.modules):
        pytest.skip("Forge not importable here: another 'backend' package is already imported")
    paths = [str(root), str(root / "packages_3rdparty")]
    argv = sys.argv
    sys.path[:0] = paths
    sys.argv = [argv[0], "--always-cpu"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # "VAE dtype preferences ...", "Using split ..."
            import backend.memory_management as mm
            import backend.nn.vae as nn_vae
            import backend.patcher.vae as patcher_vae
    except ImportError as exc:
        _forget_backend()
        for p in paths:
            sys.path.remove(p)
        pytest.skip(f"Forge not importable: {exc}")
    finally:
        sys.argv = argv
    assert Path(nn_vae.__file__).resolve() == (root / "backend" / "nn" / "vae.py").resolve()
    yield SimpleNamespace(nn=nn_vae, patcher=patcher_vae, mm=mm)
    _forget_backend()
    for p in paths:
        sys.path.remove(p)


def forge_autoencoder(forge, seed: int = 0):
    """A small random ``IntegratedAutoencoderKL`` (SD1.5's layout: ×4 per level here, 2 levels)."""
    torch.manual_seed(seed)
    m = forge.nn.IntegratedAutoencoderKL(
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=32,
    )
    with torch.no_grad():  # let the attention and the deeper blocks matter (default init is tame)
        for p in m.parameters():
            if p.dim() > 1:
                p.mul_(1.5)
    return m.eval()


def latent(seed: int, h: int = 40, w: int = 36) -> torch.Tensor:
    return torch.randn(1, 4, h, w, generator=torch.Generator().manual_seed(seed))


def test_forge_vae_classes_are_forges_own_and_supported(forge):
    from lib_vram.vae import is_supported_decoder, is_supported_encoder

    ae = forge_autoencoder(forge)
    assert type(ae.decoder).__module__ == "backend.nn.vae"
    assert is_supported_decoder(ae.decoder) and is_supported_encoder(ae.encoder)


@pytest.mark.parametrize("tile", [8, 16, 24])
def test_decode_exact_matches_forges_untiled_decoder(forge, tile):
    from lib_vram.vae import TiledVAEConfig, VAEReport, tiled_decode

    ae = forge_autoencoder(forge)
    z = latent(1)
    with torch.inference_mode():
        ref = ae.decoder(z)
        report = VAEReport()
        out = tiled_decode(ae.decoder, z, config=TiledVAEConfig(mode="exact", tile=tile), report=report)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= EXACT_TOL
    assert report.plan.startswith(f"exact t{tile}")


def test_encode_exact_matches_forges_untiled_encoder(forge):
    from lib_vram.vae import TiledVAEConfig, tiled_encode

    ae = forge_autoencoder(forge)
    x = torch.rand(1, 3, 96, 80, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.inference_mode():
        ref = ae.encoder(x)
        out = tiled_encode(ae.encoder, x, config=TiledVAEConfig(mode="exact", tile=8))
    assert (out - ref).abs().max().item() <= EXACT_TOL


def _job(forge, vae, options):
    from webui_fakes import FakeHost, FakeP

    from lib_vram.webui import ScriptJobs, Session
    from lib_vram.webui import host as real_host

    model = SimpleNamespace(first_stage_model=None, forge_objects=SimpleNamespace(vae=vae))
    host = FakeHost(model)
    loaded = []

    def load(v):  # Forge's own manager, as lib_vram.webui.host.forge_load_vae does it
        loaded.append(v)
        forge.mm.load_model_gpu(v.patcher)

    host.forge_load_vae = load
    assert real_host.forge_load_vae.__doc__  # the real one names the same call
    jobs = ScriptJobs(Session(host=host), kind="txt2img")
    p = FakeP()
    jobs.process(p, options)
    return jobs, p, loaded


def _forge_vae(forge, ae):
    with contextlib.redirect_stdout(io.StringIO()):
        return forge.patcher.VAE(model=ae)


def test_forge_vae_wrapper_runs_vram_guard_exact_and_leaves_no_trace(forge):
    """Forge's real ``VAE.decode``: with VRAM Guard (VAE Always, exact t16) the picture equals
    Forge's own untiled decode within float rounding; Forge's always-tiled path ("Never OOM")
    differs from it by far more; after the job the slots are gone and Forge decodes as before."""
    from lib_vram.webui.forge import DECODE_SLOT
    from lib_vram.webui.options import VRAMGuardOptions

    vae = _forge_vae(forge, forge_autoencoder(forge))
    z = latent(3)
    with torch.inference_mode():
        plain = vae.decode(z)
        forge.mm.VAE_ALWAYS_TILED = True
        try:
            forge_tiled = vae.decode(z)
        finally:
            forge.mm.VAE_ALWAYS_TILED = False
    assert plain.shape == (1, 80, 72, 3)  # B,H,W,C in [0, 1] (this VAE: x2)
    jobs, p, loaded = _job(forge, vae, VRAMGuardOptions(enabled=True, vae_tiling="Always", vae_tile=16))
    with torch.inference_mode():
        ours = vae.decode(z)
        forge.mm.VAE_ALWAYS_TILED = True  # "Never OOM" on as well: VRAM Guard's exact tiles win
        try:
            ours_never_oom = vae.decode(z)
        finally:
            forge.mm.VAE_ALWAYS_TILED = False
    plan = [r.to_dict().get("plan") for r in jobs.job.tracker.records if r.depth == 0]
    jobs.postprocess(p)
    assert loaded == [vae, vae]
    assert all(str(x).startswith("exact t16") for x in plan), plan
    err = (ours - plain).abs().max().item()
    forge_err = (forge_tiled - plain).abs().max().item()
    assert err <= EXACT_TOL < forge_err
    assert torch.equal(ours_never_oom, ours)
    assert DECODE_SLOT not in vae.patcher.model_options
    with torch.inference_mode():
        assert torch.equal(vae.decode(z), plain)


def test_forge_vae_off_keeps_forges_own_decode_and_never_oom(forge):
    from lib_vram.webui.options import VRAMGuardOptions

    vae = _forge_vae(forge, forge_autoencoder(forge))
    z = latent(4)
    with torch.inference_mode():
        forge.mm.VAE_ALWAYS_TILED = True
        try:
            forge_tiled = vae.decode(z)
            jobs, p, loaded = _job(forge, vae, VRAMGuardOptions(enabled=True, vae_tiling="Off"))
            ours = vae.decode(z)
        finally:
            forge.mm.VAE_ALWAYS_TILED = False
    jobs.postprocess(p)
    assert loaded == []
    assert torch.equal(ours, forge_tiled)


def test_forge_vae_encode_samples_like_forge(forge):
    """``VAE.encode`` with VRAM Guard (exact tiles) equals Forge's own encode with the same seed:
    the posterior sample draws its noise the way Forge does (CPU generator, float32)."""
    from lib_vram.webui.options import VRAMGuardOptions

    vae = _forge_vae(forge, forge_autoencoder(forge))
    pixels = torch.rand(1, 96, 80, 3, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        torch.manual_seed(11)
        plain = vae.encode(pixels)
    jobs, p, loaded = _job(forge, vae, VRAMGuardOptions(enabled=True, vae_tiling="Always", vae_tile=16))
    with torch.inference_mode():
        torch.manual_seed(11)
        ours = vae.encode(pixels)
    jobs.postprocess(p)
    assert loaded == [vae]
    assert ours.shape == plain.shape == (1, 4, 48, 40) and ours.dtype == plain.dtype
    assert (ours - plain).abs().max().item() <= EXACT_TOL
