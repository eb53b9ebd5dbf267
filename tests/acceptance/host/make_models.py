"""Random-weight models for the offline AUTOMATIC1111 v1.10.1 host (run with the host venv).

  sd15        models/Stable-diffusion/sd15-random.safetensors (seed 1) and sd15-random-b.safetensors
              (seed 2, for hires-checkpoint / Refiner jobs): ldm's LatentDiffusion from the WebUI's
              configs/v1-inference.yaml, saved in FP16 (2.1 GB; 4.07 GB as FP32 with --no-half)
  lora        models/Lora/vg-lora-attn.safetensors and vg-lora-mix.safetensors: kohya key names
              (lora_unet_*, lora_te_*; lora_down/lora_up/alpha) with the shapes of that checkpoint
  controlnet  models/ControlNet/control_sd15_random.safetensors (and -b, -c: other seeds, for jobs
              with two and three units): sd-webui-controlnet's SD1.5 ControlNet layout (UNet
              input/middle blocks + input_hint_block, zero_convs, middle_block_out), its blocks
              copied from sd15-random, the zero convs random

Existing files are kept unless --force. Needs the offline tokenizer cache (HF_HOME, see
make_tokenizer.py) for ldm's FrozenCLIPEmbedder; the text model is built from the cached config
(no pretrained weights).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
from pathlib import Path

import torch

CKPT_A = "sd15-random.safetensors"
CKPT_B = "sd15-random-b.safetensors"
CONTROLNETS = {"control_sd15_random": 21, "control_sd15_random-b": 31, "control_sd15_random-c": 41}
"""Each ControlNet file and its seed (the random layers: seed + 1)."""


def log(msg: str) -> None:
    print(f"[make_models {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    log(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {len(tensors)} tensors)")


# --------------------------------------------------------------------------------------- SD1.5
def _offline_clip_text_model() -> None:
    """ldm's FrozenCLIPEmbedder calls CLIPTextModel.from_pretrained(hub name): build it from the
    cached config instead (random weights; the checkpoint carries them)."""
    import transformers

    def from_pretrained(name, *args, **kwargs):
        cfg = transformers.CLIPTextConfig.from_pretrained(name)
        return transformers.CLIPTextModel(cfg)

    transformers.CLIPTextModel.from_pretrained = from_pretrained


def build_sd15(webui: Path, seed: int):
    sys.path.insert(0, str(webui / "repositories" / "stable-diffusion-stability-ai"))
    from ldm.util import instantiate_from_config
    from omegaconf import OmegaConf

    _offline_clip_text_model()
    cfg = OmegaConf.load(webui / "configs" / "v1-inference.yaml")
    torch.manual_seed(seed)
    model = instantiate_from_config(cfg.model).eval()
    # ldm zero-initialises the UNet's output layers (each ResBlock's last conv, each transformer's
    # proj_out, the final conv): a fresh UNet predicts exactly 0. Give those weights the default
    # (non-zero) initialisation of their layer type; biases stay 0.
    revived = 0
    for module in model.model.diffusion_model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)) and w is not None and not w.any():
            torch.nn.init.kaiming_uniform_(w, a=5**0.5)
            revived += 1
    log(f"seed {seed}: {revived} zero-initialised UNet layers given random weights")
    return model


@torch.no_grad()
def check_unet(model) -> float:
    unet = model.model.diffusion_model
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 16, 16, generator=g)
    ctx = torch.randn(2, 77, 768, generator=g)
    out = unet(x, torch.tensor([999, 500]), context=ctx)
    std = float(out.std())
    if not torch.isfinite(out).all() or std == 0:
        raise SystemExit(f"UNet output unusable (std {std})")
    return std


def make_sd15(webui: Path, force: bool) -> None:
    out = webui / "models" / "Stable-diffusion"
    for name, seed in ((CKPT_A, 1), (CKPT_B, 2)):
        path = out / name
        if path.exists() and not force:
            log(f"kept {path}")
            continue
        t0 = time.time()
        model = build_sd15(webui, seed)
        log(f"seed {seed}: built in {time.time() - t0:.0f} s; UNet output std {check_unet(model):.3f}")
        # weights in FP16 like a pruned fp16 release; the noise schedule (the top-level buffers:
        # betas, alphas_cumprod, ...) and integer buffers (position_ids) as they are
        sd = {
            k: (v.half() if v.is_floating_point() and "." in k else v) for k, v in model.state_dict().items()
        }
        del model
        save_safetensors(sd, path, {"format": "pt", "vg_host": f"random SD1.5, seed {seed}"})
        del sd


# ---------------------------------------------------------------------------------------- LoRA
def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def _unet_kohya_name(ldm_name: str) -> str | None:
    """ldm UNet module name -> kohya (diffusers-layout) name, for transformer modules."""
    parts = ldm_name.split(".")
    if parts[0] == "input_blocks" and parts[2] == "1":
        n = int(parts[1])
        block, tail = f"down_blocks_{(n - 1) // 3}_attentions_{(n - 1) % 3}", parts[3:]
    elif parts[0] == "middle_block" and parts[1] == "1":
        block, tail = "mid_block_attentions_0", parts[2:]
    elif parts[0] == "output_blocks" and parts[2] == "1":
        n = int(parts[1])
        block, tail = f"up_blocks_{n // 3}_attentions_{n % 3}", parts[3:]
    else:
        return None
    return f"lora_unet_{block}_{'_'.join(tail)}"


def _kohya_to_ldm(kohya: str) -> str:
    """The other way (diffusers block numbering -> ldm's), to check each name round-trips.
    The module part must start with a letter: the WebUI's converter int()s any group that starts
    with a digit and fails on the whole file (ValueError, the LoRA silently not applied)."""
    import re

    m = re.fullmatch(r"lora_unet_(down|mid|up)_blocks?_(?:(\d+)_)?attentions_(\d+)_([a-z].*)", kohya)
    if m is None:
        raise SystemExit(f"bad kohya name {kohya}")
    kind, b, j, rest = m.group(1), int(m.group(2) or 0), int(m.group(3)), m.group(4)
    block = {
        "down": f"input_blocks_{1 + b * 3 + j}_1",
        "mid": "middle_block_1",
        "up": f"output_blocks_{b * 3 + j}_1",
    }
    return f"{block[kind]}_{rest}"


LORAS = {
    # name: (rank, alpha, UNet module suffixes, text-encoder module suffixes, seed)
    "vg-lora-attn": (
        4,
        4.0,
        (
            "attn1.to_q",
            "attn1.to_k",
            "attn1.to_v",
            "attn1.to_out.0",
            "attn2.to_q",
            "attn2.to_k",
            "attn2.to_v",
            "attn2.to_out.0",
        ),
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"),
        11,
    ),
    "vg-lora-mix": (
        8,
        4.0,
        ("proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "attn2.to_k", "attn2.to_v"),
        ("mlp.fc1", "mlp.fc2"),
        12,
    ),
}


def make_loras(webui: Path, force: bool, strength: float = 0.5) -> None:
    from safetensors import safe_open

    ckpt = webui / "models" / "Stable-diffusion" / CKPT_A
    shapes = _checkpoint_shapes(ckpt)
    unet_prefix = "model.diffusion_model."
    te_prefix = "cond_stage_model.transformer.text_model.encoder.layers."
    for name, (rank, alpha, unet_suffixes, te_suffixes, seed) in LORAS.items():
        path = webui / "models" / "Lora" / f"{name}.safetensors"
        if path.exists() and not force:
            log(f"kept {path}")
            continue
        g = torch.Generator().manual_seed(seed)
        targets: list[tuple[str, tuple[int, ...]]] = []
        for key, shape in shapes.items():
            if not key.endswith(".weight"):
                continue
            module = key[: -len(".weight")]
            if key.startswith(unet_prefix) and module.endswith(unet_suffixes):
                kohya = _unet_kohya_name(module[len(unet_prefix) :])
            elif key.startswith(te_prefix) and module.endswith(te_suffixes):
                kohya = "lora_te_text_model_encoder_layers_" + module[len(te_prefix) :].replace(".", "_")
            else:
                continue
            if kohya is None:
                raise SystemExit(f"no kohya name for {module}")
            if kohya.startswith("lora_unet_"):
                back = _kohya_to_ldm(kohya)
                if back != module[len(unet_prefix) :].replace(".", "_"):
                    raise SystemExit(f"kohya name {kohya} does not map back to {module}")
            targets.append((kohya, shape, key))
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(ckpt), "pt") as f:
            w_std = {key: float(f.get_tensor(key).float().std()) for _, _, key in targets}
        for kohya, shape, key in sorted(targets):
            out_f, in_f = shape[0], shape[1]
            tail = tuple(shape[2:])  # (1, 1) for SD1.5's conv proj_in/proj_out
            # delta W = up @ down * alpha / rank with entries of std `strength` times the layer's
            # own weights' std. Relative, not absolute: CLIP's q/k/v weights are ~5x smaller than
            # the UNet's default-initialised ones, and a text-encoder delta of 2.5x its weights
            # made the WebUI's job fail ("A tensor with NaNs was produced in Unet")
            down = torch.randn((rank, in_f) + tail, generator=g) / in_f**0.5
            up = torch.randn((out_f, rank) + tuple(1 for _ in tail), generator=g)
            up *= strength * w_std[key] * in_f**0.5 * rank**0.5 / alpha
            tensors[f"{kohya}.lora_down.weight"] = down.half()
            tensors[f"{kohya}.lora_up.weight"] = up.half()
            tensors[f"{kohya}.alpha"] = torch.tensor(alpha).half()
        n_unet = sum(k.startswith("lora_unet_") for k, _, _ in targets)
        meta = {
            "ss_network_module": "networks.lora",
            "ss_network_dim": str(rank),
            "ss_network_alpha": str(alpha),
            "ss_base_model_version": "sd_v1",
            "ss_output_name": name,
            "vg_host": f"random LoRA: {n_unet} UNet and {len(targets) - n_unet} text-encoder modules",
        }
        save_safetensors(tensors, path, meta)


# ---------------------------------------------------------------------------------- ControlNet
def _import_controlnet_class(webui: Path):
    """sd-webui-controlnet's scripts/cldm.py ControlNet, outside the WebUI (modules.devices stubbed)."""
    ext = webui / "extensions" / "sd-webui-controlnet"
    sys.path.insert(0, str(webui / "repositories" / "stable-diffusion-stability-ai"))
    sys.path.insert(0, str(ext))
    if "modules" not in sys.modules:
        modules = types.ModuleType("modules")
        devices = types.ModuleType("modules.devices")
        devices.dtype_unet = torch.float32
        devices.get_device_for = lambda _name: torch.device("cpu")
        modules.devices = devices
        modules.__path__ = []
        sys.modules["modules"] = modules
        sys.modules["modules.devices"] = devices
    from scripts.cldm import ControlNet  # the extension's class: the layout its loader rebuilds

    return ControlNet


def _default_config(webui: Path, name: str = "controlnet_default_config") -> dict:
    """A config of controlnet_model_guess.py (``controlnet_default_config``: the SD1.5 one its loader
    picks for a state dict with ``input_hint_block`` and no ``label_emb``), read from the source: the
    module itself imports half of the WebUI."""
    import ast

    src = webui / "extensions" / "sd-webui-controlnet" / "scripts" / "controlnet_model_guess.py"
    for node in ast.parse(src.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return dict(ast.literal_eval(node.value))
    raise SystemExit(f"{name} not found in {src}")


def make_controlnet(webui: Path, force: bool) -> None:
    for name, seed in CONTROLNETS.items():
        path = webui / "models" / "ControlNet" / f"{name}.safetensors"
        if path.exists() and not force:
            log(f"kept {path}")
        else:
            _make_controlnet(webui, path, seed)


def _make_controlnet(webui: Path, path: Path, seed: int) -> None:
    ControlNet = _import_controlnet_class(webui)
    from safetensors.torch import load_file

    config = _default_config(webui)
    config.update(hint_channels=3, use_fp16=False)
    torch.manual_seed(seed)
    net = ControlNet(**config).eval()
    # the trained-from-the-UNet blocks: copy sd15-random's, so the control signal is shaped like it
    unet = load_file(str(webui / "models" / "Stable-diffusion" / CKPT_A))
    sd = net.state_dict()
    copied = 0
    for k in sd:
        src = unet.get("model.diffusion_model." + k)
        if src is not None and src.shape == sd[k].shape:
            sd[k] = src.float()
            copied += 1
    del unet
    # zero convs, the hint block's last conv, middle_block_out: zero-initialised; give them
    # random weights so the unit changes the picture
    g = torch.Generator().manual_seed(seed + 1)
    revived = 0
    for k, v in sd.items():
        if k.endswith(".weight") and v.ndim > 1 and not v.any():
            fan_in = v[0].numel()
            sd[k] = torch.randn(v.shape, generator=g) * (0.5 / fan_in**0.5)
            revived += 1
    net.load_state_dict(sd)
    log(
        f"ControlNet: {len(sd)} tensors, {copied} copied from {CKPT_A}, {revived} zero layers given random weights"
    )
    # the loader's checks (build_model_by_guess): input_hint_block -> SD1.5 ControlNet config,
    # hint channels and context dim from these shapes
    assert "input_hint_block.0.weight" in sd and "label_emb.0.0.bias" not in sd
    assert sd["input_blocks.5.1.transformer_blocks.0.attn2.to_k.weight"].shape[1] == 768
    save_safetensors({k: v.half() for k, v in sd.items()}, path, {"vg_host": "random SD1.5 ControlNet"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--webui", type=Path, default=Path("/work/webui"))
    ap.add_argument("--force", action="store_true", help="rebuild files that exist")
    ap.add_argument("what", nargs="+", choices=["sd15", "lora", "controlnet"])
    ap.add_argument(
        "--hf-home",
        default=os.environ.get("HF_HOME", "/work/webui-tools/hf-home"),
        help="the offline cache make_tokenizer.py wrote (default: $HF_HOME or the host's)",
    )
    args = ap.parse_args()
    # before anything imports huggingface_hub: the tokenizer/config from the local cache only
    os.environ.update(HF_HOME=args.hf_home, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    torch.set_grad_enabled(False)
    for what in args.what:
        t0 = time.time()
        {"sd15": make_sd15, "lora": make_loras, "controlnet": make_controlnet}[what](args.webui, args.force)
        log(f"{what}: {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
