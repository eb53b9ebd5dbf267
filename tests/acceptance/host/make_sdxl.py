"""Random-weight SDXL models for the offline AUTOMATIC1111 v1.10.1 host (run with the host venv).

  sdxl        models/Stable-diffusion/sdxl-random.safetensors (seed 1): sgm's DiffusionEngine from
              repositories/generative-models/configs/inference/sd_xl_base.yaml (the config the WebUI
              picks for it), built and saved in FP16 (6.9 GB; 13.2 GB as FP32 with --no-half)
  controlnet  models/ControlNet/control_sdxl_mid_random.safetensors: sd-webui-controlnet's SDXL
              ControlNet layout its loader reads as ``controlnet_sdxl_mid_config`` (label_emb, one
              transformer block at the 1280-channel level and in the middle; 271 M parameters),
              its blocks copied from sdxl-random, the zero convs random

  approx      models/VAE-approx/vaeapprox-sdxl.pt: the WebUI's "Approx NN" live-preview model for
              SDXL (random; the WebUI otherwise downloads it at an SDXL job's start)

Existing files are kept unless --force. Building SDXL holds about 8 GB of host memory: check
``free -g`` and hold the WebUI lock. Needs the offline tokenizer cache (make_tokenizer.py); both text
models are built from configs (no pretrained weights).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_models import (  # noqa: E402
    _default_config,
    _import_controlnet_class,
    _offline_clip_text_model,
    log,
    save_safetensors,
)

CKPT = "sdxl-random.safetensors"
CONTROLNET = "control_sdxl_mid_random.safetensors"
UNET = "model.diffusion_model."


def revive(modules, seed: int) -> int:
    """Zero-initialised weights (sgm's UNet output layers, a ControlNet's zero convs) get random
    values (fan-in scaled, so activations stay in range): a fresh model otherwise adds exactly 0."""
    g = torch.Generator().manual_seed(seed)
    n = 0
    for m in modules:
        w = getattr(m, "weight", None)
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)) and w is not None and not w.any():
            w.copy_(torch.randn(w.shape, generator=g) * (0.5 / w[0].numel() ** 0.5))
            n += 1
    return n


def make_sdxl(webui: Path, force: bool, seed: int = 1) -> None:
    path = webui / "models" / "Stable-diffusion" / CKPT
    if path.exists() and not force:
        log(f"kept {path}")
        return
    import open_clip

    sys.path.insert(0, str(webui / "repositories" / "generative-models"))
    from omegaconf import OmegaConf
    from sgm.util import instantiate_from_config

    _offline_clip_text_model()
    create = open_clip.create_model_and_transforms
    open_clip.create_model_and_transforms = lambda *a, pretrained=None, **k: create(*a, pretrained=None, **k)
    cfg = OmegaConf.load(
        webui / "repositories" / "generative-models" / "configs" / "inference" / "sd_xl_base.yaml"
    )
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.float16)  # built in FP16: half the host memory of FP32
    try:
        model = instantiate_from_config(cfg.model).eval()
    finally:
        torch.set_default_dtype(torch.float32)
        open_clip.create_model_and_transforms = create
    log(f"seed {seed}: {revive(model.model.diffusion_model.modules(), seed + 100)} zero UNet layers revived")
    sd = {k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    del model
    assert "conditioner.embedders.1.model.ln_final.weight" in sd  # the WebUI's SDXL config guess
    save_safetensors(sd, path, {"format": "pt", "vg_host": f"random SDXL base, seed {seed}"})


def make_controlnet(webui: Path, force: bool) -> None:
    path = webui / "models" / "ControlNet" / CONTROLNET
    if path.exists() and not force:
        log(f"kept {path}")
        return
    from safetensors import safe_open

    for name in [m for m in sys.modules if m.split(".")[0] == "scripts"]:
        del sys.modules[name]  # (generative-models' own scripts package, imported with sgm)
    ControlNet = _import_controlnet_class(webui)
    config = _default_config(webui, "controlnet_sdxl_mid_config")
    config.update(hint_channels=3, use_fp16=False)
    torch.manual_seed(31)
    net = ControlNet(**config).eval()
    copied = 0
    with safe_open(str(webui / "models" / "Stable-diffusion" / CKPT), "pt") as f:
        names = set(f.keys())
        for k, v in net.state_dict().items():
            if UNET + k in names and tuple(f.get_slice(UNET + k).get_shape()) == tuple(v.shape):
                v.copy_(f.get_tensor(UNET + k).float())
                copied += 1
    revived = revive(net.modules(), 32)
    sd = {k: v.half() for k, v in net.state_dict().items()}
    params = sum(v.numel() for v in sd.values())
    log(
        f"ControlNet: {len(sd)} tensors ({params / 1e6:.1f} M), {copied} copied from {CKPT}, {revived} revived"
    )
    # the loader's checks (build_model_by_guess): label_emb -> SDXL; a first but no tenth block at
    # input_blocks.8 -> controlnet_sdxl_mid_config
    assert "input_hint_block.0.weight" in sd and "label_emb.0.0.bias" in sd
    assert "input_blocks.8.1.transformer_blocks.0.norm3.weight" in sd
    assert "input_blocks.8.1.transformer_blocks.9.norm3.weight" not in sd
    save_safetensors(sd, path, {"vg_host": "random SDXL ControlNet (mid)"})


# the WebUI's VAEApprox (modules/sd_vae_approx.py): conv1..conv8 (in, out, kernel) for 4 latent channels
APPROX = ((4, 8, 7), (8, 16, 5), (16, 32, 3), (32, 64, 3), (64, 32, 3), (32, 16, 3), (16, 8, 3), (8, 3, 3))


def make_approx(webui: Path, force: bool) -> None:
    from make_esrgan import save_pth, webui_safe_check

    path = webui / "models" / "VAE-approx" / "vaeapprox-sdxl.pt"
    if path.exists() and not force:
        log(f"kept {path}")
        return
    g = torch.Generator().manual_seed(41)
    sd = {}
    for i, (cin, cout, k) in enumerate(APPROX, 1):
        sd[f"conv{i}.weight"] = torch.randn(cout, cin, k, k, generator=g) / (cin * k * k) ** 0.5
        sd[f"conv{i}.bias"] = torch.zeros(cout)
    save_pth(sd, path)  # (without the zip entries the WebUI's torch.load checker rejects)
    webui_safe_check(webui, path)
    log(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--webui", type=Path, default=Path("/work/webui"))
    ap.add_argument("--force", action="store_true", help="rebuild files that exist")
    ap.add_argument("what", nargs="+", choices=["sdxl", "controlnet", "approx"])
    ap.add_argument("--hf-home", default=os.environ.get("HF_HOME", "/work/webui-tools/hf-home"))
    args = ap.parse_args()
    os.environ.update(HF_HOME=args.hf_home, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    torch.set_grad_enabled(False)
    for what in args.what:
        t0 = time.time()
        {"sdxl": make_sdxl, "controlnet": make_controlnet, "approx": make_approx}[what](
            args.webui, args.force
        )
        log(f"{what}: {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
