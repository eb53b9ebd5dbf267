"""Random-weight ×4 upscalers for the offline AUTOMATIC1111 v1.10.1 host (run with the host venv).

ESRGAN variants (RealESRGAN_x4plus key names: conv_first, body.N.rdbM.convK, conv_body, conv_up1,
conv_up2, conv_hr, conv_last; 32 grow channels, the only value spandrel 0.3.4 builds), written to
models/ESRGAN/ESRGAN_x4-<variant>-random.pth:

  tiny   16 features, 2 RRDB blocks (2.3 MB): identity centre taps + small random weights, i.e. a
         plain nearest-neighbour ×4 upscale with a little noise (seams of a tiled upscale stay
         small: the effective context is a few pixels)
  wide   the tiny layout with body weights large enough that the receptive field shows at 8 bits
         (for tiling-seam tests: tiled vs untiled differ)
  large  RealESRGAN_x4plus's size: 64 features, 23 blocks (16.7 M values, 63.8 MiB FP32), std 0.002
         so the 23 blocks do not saturate the picture

  swinir a small SwinIR ×4 (classical upsampler) in models/SwinIR/SwinIR_x4-tiny-random.pth

v1.10.1 lists only .pt/.pth upscalers, and its pickle checker (modules/safe.py) rejects the
``.format_version``/``.storage_alignment`` entries torch >= 2.4 writes: the zip is rewritten
without them. ``--check`` loads each file through spandrel (as the WebUI does) and through the
WebUI's own checker, and reports how close the model is to a plain ×4 upscale.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import sys
import types
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

VARIANTS = {
    # name: (features, blocks, identity noise std, body std, seed)
    "tiny": (16, 2, 0.005, 0.02, 1),
    "wide": (16, 2, 0.005, 0.11, 2),
    "large": (64, 23, 0.002, 0.002, 3),
}
GROW = 32
DROP = (".format_version", ".storage_alignment")


def esrgan_state_dict(nf: int, nb: int, id_std: float, body_std: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def conv(out_c: int, in_c: int, std: float, identity: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randn(out_c, in_c, 3, 3, generator=g) * std
        for c in range(identity):
            w[c, c, 1, 1] += 1.0
        return w, torch.zeros(out_c)

    sd: dict[str, torch.Tensor] = {}

    def put(name: str, wb: tuple[torch.Tensor, torch.Tensor]) -> None:
        sd[f"{name}.weight"], sd[f"{name}.bias"] = wb

    put("conv_first", conv(nf, 3, id_std, identity=3))
    for b in range(nb):
        for r in range(1, 4):
            for k in range(1, 6):
                in_c = nf + (k - 1) * GROW
                out_c = GROW if k < 5 else nf
                put(f"body.{b}.rdb{r}.conv{k}", conv(out_c, in_c, body_std))
    # the trunk's last conv sees the whole feature map (the shortcut adds its output to the
    # identity path): it gets the small noise, or it alone takes the picture away from x4; each
    # RRDB returns 0.2 * rdb3(rdb2(rdb1(x))) + x, about 1.2 x with small body weights, so the trunk
    # grows 1.2**nb times (66x for 23 blocks): scale the noise down by that
    put("conv_body", conv(nf, nf, id_std / 1.2**nb))
    put("conv_up1", conv(nf, nf, id_std, identity=nf))
    put("conv_up2", conv(nf, nf, id_std, identity=nf))
    put("conv_hr", conv(nf, nf, id_std, identity=nf))
    put("conv_last", conv(3, nf, id_std, identity=3))
    return sd


def swinir_state_dict(seed: int = 4) -> dict[str, torch.Tensor]:
    """A small SwinIR ×4 (embed 30, 2 stages of depth 2, window 8, classical pixel-shuffle
    upsampler) built with spandrel's own class; conv_last biased toward the input's colours."""
    from spandrel.architectures.SwinIR.arch.SwinIR import SwinIR

    torch.manual_seed(seed)
    net = SwinIR(
        img_size=32,
        patch_size=1,
        in_chans=3,
        embed_dim=30,
        depths=[2, 2],
        num_heads=[3, 3],
        window_size=8,
        mlp_ratio=2.0,
        upscale=4,
        img_range=1.0,
        upsampler="pixelshuffle",
        resi_connection="1conv",
    )
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def save_pth(sd: dict[str, torch.Tensor], path: Path) -> None:
    """torch.save, then the zip rewritten without the entries v1.10.1's checker rejects."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if info.filename.endswith(DROP):
                continue
            dst.writestr(info, src.read(info.filename))
    os.replace(tmp, path)


def webui_safe_check(webui: Path, path: Path) -> None:
    """v1.10.1's modules/safe.py check_pt on the file (modules.errors stubbed)."""
    if "modules.errors" not in sys.modules:
        pkg = sys.modules.setdefault("modules", types.ModuleType("modules"))
        pkg.__path__ = []
        pkg.errors = sys.modules["modules.errors"] = types.ModuleType("modules.errors")
    spec = importlib.util.spec_from_file_location("vg_webui_safe", webui / "modules" / "safe.py")
    safe = importlib.util.module_from_spec(spec)
    torch_load = torch.load
    try:
        spec.loader.exec_module(safe)  # (it replaces torch.load with its own checked load)
    finally:
        torch.load = torch_load
    safe.check_pt(str(path), None)


@torch.no_grad()
def check(webui: Path, path: Path, arch: str) -> None:
    from spandrel import ModelLoader

    with zipfile.ZipFile(path) as z:
        bad = [n for n in z.namelist() if n.endswith(DROP)]
    assert not bad, bad
    webui_safe_check(webui, path)
    desc = ModelLoader().load_from_file(str(path))
    assert desc.architecture.id == arch and desc.scale == 4, (desc.architecture.id, desc.scale)
    model = desc.model.eval()
    g = torch.Generator().manual_seed(0)
    # a smooth test picture: blurred noise
    x = F.interpolate(torch.rand(1, 3, 12, 12, generator=g), size=(48, 48), mode="bicubic").clamp(0, 1)
    y = model(x).clamp(0, 1)
    near = F.interpolate(x, scale_factor=4, mode="nearest")
    mse = float(((y - near) ** 2).mean())
    psnr = 10 * torch.log10(torch.tensor(1.0 / max(mse, 1e-12)))
    # how far one input pixel reaches at 8 bits: change the centre pixel, see which outputs move
    x2 = x.clone()
    x2[..., 24, 24] = 1.0 - x2[..., 24, 24]
    moved = ((model(x2).clamp(0, 1) - y).abs() * 255).amax(1)[0] >= 1.0
    ys, xs = torch.nonzero(moved, as_tuple=True)
    reach = int(max((ys // 4 - 24).abs().max(), (xs // 4 - 24).abs().max())) if len(ys) else 0
    n = sum(v.numel() for v in desc.model.state_dict().values())
    print(
        f"check {path.name}: spandrel {desc.architecture.id} x{desc.scale} {desc.tags}, {n} values; "
        f"WebUI pickle check ok; vs nearest x4 {float(psnr):.1f} dB; one input pixel reaches "
        f"{reach} px (input scale) at 8 bits"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--webui", type=Path, default=Path("/work/webui"))
    ap.add_argument("--variant", choices=[*VARIANTS, "swinir"], action="append", required=True)
    ap.add_argument("--force", action="store_true", help="rebuild files that exist")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    for variant in args.variant:
        if variant == "swinir":
            path = args.webui / "models" / "SwinIR" / "SwinIR_x4-tiny-random.pth"
            arch = "SwinIR"
            make = swinir_state_dict
        else:
            path = args.webui / "models" / "ESRGAN" / f"ESRGAN_x4-{variant}-random.pth"
            arch = "ESRGAN"

            def make(v=variant):
                return esrgan_state_dict(*VARIANTS[v])

        if path.exists() and not args.force:
            print(f"kept {path}")
        else:
            save_pth(make(), path)
            print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
        if args.check:
            check(args.webui, path, arch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
