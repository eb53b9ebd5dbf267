"""Random-weight AnimateDiff motion modules for the offline host (run with the host venv).

Built from sd-webui-animatediff's own ``motion_module.py`` (``MotionWrapper``, the class its loader
instantiates), so the key names, shapes and the layout its ``MotionModuleType.get_mm_type`` guesses
are the extension's own, not a copy:

  mm_vg_random_v2.safetensors  AnimateDiff V2 layout (a mid block, 32 positions): injected into the
                               UNet's input, middle and output blocks
  mm_vg_random_v1.safetensors  AnimateDiff V1 layout (no mid block, 24 positions): the extension
                               also replaces ldm's ``GroupNorm32.forward`` with one that folds the
                               batch as ``(b f) c h w -> b c f h w`` with ``b=2`` (cond + uncond)

written into the extension's model folder (``<animatediff>/model``, what it lists and loads from by
default). Every weight is PyTorch's default initialisation from a fixed seed, except the temporal
transformers' ``proj_out``, which AnimateDiff zero-initialises (a motion module that changes
nothing): it gets N(0, 0.02) values, so the frames really are coupled (each frame's output depends
on the other frames of its batch). Stored in FP16 (the extension loads it into FP32 modules under
``--no-half``). Existing files are kept unless ``--force``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def build(animatediff: Path, webui: Path, layout: str, seed: int) -> dict[str, torch.Tensor]:
    # motion_module imports ldm (the WebUI's stable-diffusion-stability-ai repository)
    for p in (webui / "repositories" / "stable-diffusion-stability-ai", webui, animatediff):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    from motion_module import MotionModuleType, MotionWrapper

    mm_type = {"v2": MotionModuleType.AnimateDiffV2, "v1": MotionModuleType.AnimateDiffV1}[layout]
    torch.manual_seed(seed)
    mm = MotionWrapper(mm_name=f"mm_vg_random_{layout}.safetensors", mm_hash="", mm_type=mm_type)
    g = torch.Generator().manual_seed(seed + 100)
    n_out = 0
    with torch.no_grad():
        for name, mod in mm.named_modules():
            if name.endswith("temporal_transformer.proj_out"):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * 0.02)
                mod.bias.zero_()
                n_out += 1
    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in mm.state_dict().items()}
    got = MotionModuleType.get_mm_type(sd)
    if got != mm_type:
        raise SystemExit(f"{layout}: AnimateDiff guesses {got}, not {mm_type}")
    n = sum(v.numel() for v in sd.values())
    print(f"{layout}: {len(sd)} tensors, {n / 1e6:.1f} M values, {n_out} proj_out layers given N(0, 0.02); "
          f"AnimateDiff guesses {got.name}")  # fmt: skip
    return sd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--webui", default="/work/webui")
    ap.add_argument("--animatediff", default="/work/webui-ext/sd-webui-animatediff")
    ap.add_argument("--layout", action="append", choices=["v2", "v1"], help="default: both")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()
    from safetensors.torch import save_file

    ad = Path(a.animatediff)
    out_dir = ad / "model"
    out_dir.mkdir(parents=True, exist_ok=True)
    for layout in a.layout or ["v2", "v1"]:
        out = out_dir / f"mm_vg_random_{layout}.safetensors"
        if out.exists() and not a.force:
            print(f"{out}: kept (--force rebuilds)")
            continue
        sd = build(ad, Path(a.webui), layout, seed={"v2": 11, "v1": 12}[layout])
        save_file(sd, str(out))
        print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
