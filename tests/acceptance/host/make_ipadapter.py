"""Random-weight IP-Adapter models for the offline host (run with the host venv).

  models/ControlNet/ip-adapter_sd15_random.safetensors       ip-adapter_sd15's layout: the image
      projection (a linear map of ViT-H's 1024-wide image embedding to 4 tokens of 768, a norm)
  models/ControlNet/ip-adapter-plus_sd15_random.safetensors  ip-adapter-plus_sd15's: a 4-layer
      resampler (16 queries of 768, 12 heads of 64) over ViT-H's 1280-wide hidden states

  models/ControlNet/ip-adapter_sdxl_random.safetensors       ip-adapter_sdxl's: ViT-bigG's
      1280-wide image embedding to 4 tokens of 2048
  models/ControlNet/ip-adapter-plus_sdxl_vit-h_random.safetensors  ip-adapter-plus_sdxl_vit-h's:
      a resampler of width 1280 (20 heads) over ViT-H's hidden states, 16 tokens of 2048
  models/ControlNet/ip-adapter-faceid_sd15_random.safetensors  ip-adapter-faceid_sd15's: an MLP
      of insightface's 512-wide face embedding to 4 tokens of 768 (its LoRA is a separate file)

Each carries a key and a value projection of the image tokens (768 or 2048 -> the layer's width)
for each of the UNet's cross-attentions (SD1.5: 16, SDXL: 70), keyed
``ip_adapter.{2n+1}.to_k_ip.weight`` with ``n`` in the order sd-webui-controlnet v1.1.455
numbers them (its ``StableDiffusionVersion.transformer_ids``, input blocks, output blocks, then
the middle; SD1: input 1, 2, 4, 5, 7, 8, output 3-11; SDXL: input 4, 5 (2 transformers of 640
each), 7, 8 (10 of 1280), output 0-2 (10 of 1280), 3-5 (2 of 640), middle 10 of 1280), in the flat
``image_proj.`` / ``ip_adapter.`` safetensors layout its loader takes. Weights N(0, 0.02) from a
fixed seed (reproducible), saved in FP16 as the published files are. The plus layout's names and
shapes are those of the extension's own ``Resampler`` (imported from the extension checkout to
get them; nothing of it is copied here). No CLIP vision model is needed: the acceptance client
passes the encoder's output through the API's ``ipadapter_input``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

WIDTHS = {
    "sd15": [320, 320, 640, 640, 1280, 1280] + [1280] * 3 + [640] * 3 + [320] * 3 + [1280],
    "sdxl": [640] * 4 + [1280] * 20 + [1280] * 30 + [640] * 6 + [1280] * 10,
}
"""The cross-attention widths in sd-webui-controlnet's order (see the docstring)."""
CTX = {"sd15": 768, "sdxl": 2048}
EMBED = {"sd15": 1024, "sdxl": 1280}  # the image embedding: ViT-H's, ViT-bigG's
FILES = {
    "ip-adapter_sd15_random.safetensors": ("plain", 11, "sd15"),
    "ip-adapter-plus_sd15_random.safetensors": ("plus", 12, "sd15"),
    "ip-adapter_sdxl_random.safetensors": ("plain", 13, "sdxl"),
    "ip-adapter-plus_sdxl_vit-h_random.safetensors": ("plus", 14, "sdxl"),
    "ip-adapter-faceid_sd15_random.safetensors": ("faceid", 15, "sd15"),
}


def _resampler_shapes(webui: Path, arch: str) -> dict[str, tuple[int, ...]]:
    path = webui / "extensions/sd-webui-controlnet/scripts/ipadapter/image_proj_models.py"
    spec = importlib.util.spec_from_file_location("vg_ip_proj", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dim, heads = (1280, 20) if arch == "sdxl" else (CTX[arch], 12)
    with torch.device("meta"):
        r = mod.Resampler(dim=dim, depth=4, dim_head=64, heads=heads, num_queries=16, embedding_dim=1280,
                          output_dim=CTX[arch], ff_mult=4)  # fmt: skip
    return {k: tuple(v.shape) for k, v in r.state_dict().items()}


def build(kind: str, seed: int, webui: Path, arch: str = "sd15") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ctx = CTX[arch]
    if kind == "plus":
        shapes = {f"image_proj.{k}": s for k, s in _resampler_shapes(webui, arch).items()}
    elif kind == "faceid":  # an MLP of insightface's 512-wide face embedding to 4 tokens
        shapes = {"image_proj.proj.0.weight": (1024, 512), "image_proj.proj.0.bias": (1024,),
                  "image_proj.proj.2.weight": (4 * ctx, 1024), "image_proj.proj.2.bias": (4 * ctx,),
                  "image_proj.norm.weight": (ctx,), "image_proj.norm.bias": (ctx,)}  # fmt: skip
    else:
        shapes = {"image_proj.proj.weight": (4 * ctx, EMBED[arch]), "image_proj.proj.bias": (4 * ctx,),
                  "image_proj.norm.weight": (ctx,), "image_proj.norm.bias": (ctx,)}  # fmt: skip
    for n, width in enumerate(WIDTHS[arch]):
        for kv in ("k", "v"):
            shapes[f"ip_adapter.{2 * n + 1}.to_{kv}_ip.weight"] = (width, ctx)
    out = {}
    for key, shape in shapes.items():
        t = torch.randn(shape, generator=g) * 0.02
        if len(shape) == 1 and "norm" in key and key.endswith("weight"):
            t = torch.ones(shape)
        out[key] = t.to(torch.float16).contiguous()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--webui", type=Path, default=Path("/work/webui"))
    ap.add_argument("--force", action="store_true", help="rebuild files that exist")
    a = ap.parse_args()
    from safetensors.torch import save_file

    for name, (kind, seed, arch) in FILES.items():
        path = a.webui / "models" / "ControlNet" / name
        if path.exists() and not a.force:
            print(f"kept {path}")
            continue
        tensors = build(kind, seed, a.webui, arch)
        save_file(tensors, str(path))
        print(f"wrote {path}: {sum(t.numel() for t in tensors.values()):,} values", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
