"""Random-weight preprocessor (annotator) models for the offline host (run with the host venv).

Under ``ROOT`` (default ``/work/webui/models/annotator``; the WebUI is started with
``--controlnet-annotator-models-path ROOT`` so that sd-webui-controlnet v1.1.455 finds them there
and downloads nothing):

  clip_vision/clip_h.pth                IP-Adapter's image encoder as the ``ip-adapter_clip_sd15``
      preprocessor loads it: transformers' ``CLIPVisionModelWithProjection`` with ViT-H/14's shape
      (hidden 1280, 32 layers, 16 heads, MLP 5120, patch 14 at 224 px, projection 1024: 632 M
      values, 2.5 GB in FP32 once loaded), saved in FP16 (1.3 GB on disk)
  midas/dpt_hybrid-midas-501f0c75.pt    the ``depth_midas`` preprocessor's DPT-Hybrid (ViT-B with a
      ResNet-50 stem at 384 px; 123 M values, 0.5 GB), built with the extension's own class
      (imported from the checkout to get its layout; nothing of it is copied here), FP32

Weights from fixed seeds (reproducible): transformers' / torch's own initialisation after
``torch.manual_seed``; written as ``make_esrgan.py`` writes its files (without the zip entries the
WebUI's pickle check rejects). Existing files are kept unless ``--force``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_esrgan import save_pth  # noqa: E402

VIT_H = dict(
    hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
    image_size=224, patch_size=14, projection_dim=1024, hidden_act="gelu", layer_norm_eps=1e-5,
)  # fmt: skip


def clip_h(seed: int = 11) -> dict[str, torch.Tensor]:
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    model = CLIPVisionModelWithProjection(CLIPVisionConfig(**VIT_H))
    return {k: v.half() for k, v in model.state_dict().items()}


def dpt_hybrid(webui: Path, seed: int = 12) -> dict[str, torch.Tensor]:
    pkg = webui / "extensions/sd-webui-controlnet/annotator/midas/midas"
    spec = importlib.util.spec_from_file_location(
        "vg_midas", pkg / "__init__.py", submodule_search_locations=[str(pkg)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vg_midas"] = mod
    spec.loader.exec_module(mod)
    from vg_midas.dpt_depth import DPTDepthModel

    torch.manual_seed(seed)
    model = DPTDepthModel(path=None, backbone="vitb_rn50_384", non_negative=True)
    return model.state_dict()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--webui", type=Path, default=Path("/work/webui"))
    ap.add_argument("--root", type=Path, default=None, help="default: WEBUI/models/annotator")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()
    root = a.root or a.webui / "models/annotator"
    for rel, build in (
        ("clip_vision/clip_h.pth", clip_h),
        ("midas/dpt_hybrid-midas-501f0c75.pt", lambda: dpt_hybrid(a.webui)),
    ):
        path = root / rel
        if path.exists() and not a.force:
            print(f"kept {path}")
            continue
        sd = build()
        save_pth(sd, path)
        n = sum(t.numel() for t in sd.values())
        print(
            f"wrote {path}: {len(sd)} tensors, {n / 1e6:.1f} M values, {path.stat().st_size / 2**20:.0f} MiB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
