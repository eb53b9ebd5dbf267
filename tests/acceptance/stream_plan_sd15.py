"""VRAM Guard's streamed plan for the WebUI's SD1.5 UNet (FP32, as ``--no-half`` runs it) on a few
card sizes: what stays resident, bytes moved host<->card per sampling step, and its model of
``--lowvram``'s bytes per step on the same units (``lowvram_bytes_per_forward``), for the acceptance
record of issue 22 (docs/webui-acceptance.md). A plan, not a run: the UNet is ldm's ``UNetModel``
with the WebUI's v1-inference parameters built on the meta device (real module tree and sizes, no
memory).

usage: stream_plan_sd15.py [--size 128] [--attention invokeai] [--fractions 0.5,0.67,0.8]
"""

from __future__ import annotations

import argparse

import torch

from lib_vram import sampling
from lib_vram.sampling._stream import plan_stream

MiB = 2**20


def sd15_unet() -> torch.nn.Module:
    import sys
    import types

    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    # the constructor imports omegaconf's ListConfig for a type check of context_dim only; the
    # test env lacks omegaconf: a placeholder for the call, removed after it
    added = []
    if "omegaconf" not in sys.modules:
        om, lc = types.ModuleType("omegaconf"), types.ModuleType("omegaconf.listconfig")
        lc.ListConfig = type("ListConfig", (list,), {})
        om.listconfig = lc
        for name, mod in (("omegaconf", om), ("omegaconf.listconfig", lc)):
            sys.modules[name] = mod
            added.append(name)
    try:
        with torch.device("meta"):
            return _build(UNetModel)
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _build(UNetModel):  # noqa: ANN001, ANN202, N803
    return UNetModel(image_size=32, in_channels=4, out_channels=4, model_channels=320,
                         attention_resolutions=[4, 2, 1], num_res_blocks=2, channel_mult=[1, 2, 4, 4],
                         num_heads=8, use_spatial_transformer=True, transformer_depth=1, context_dim=768,
                         use_checkpoint=False, legacy=False)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--attention", default="invokeai")
    ap.add_argument(
        "--fractions", default="0.5,0.67,0.8", help="the share of the UNet the card's budget holds"
    )
    a = ap.parse_args()
    unet = sd15_unet()
    spec = sampling.unet_spec(unet)
    unet_bytes = sum(p.numel() * p.element_size() for p in unet.parameters())
    hw = (a.size // 8, a.size // 8)
    kw = dict(
        batch=2, latent_hw=hw, context_tokens=77, attention=a.attention, dtype=torch.float32, backend="cpu"
    )
    whole = sampling.plan_sampling(spec, budget_bytes=1 << 40, **kw)
    print(f"SD1.5 UNet FP32 {unet_bytes / MiB:.0f} MiB; {a.size}x{a.size} px, batch 2, {a.attention}: "
          f"activations {whole.activation_bytes / MiB:.0f} MiB")  # fmt: skip
    print("| budget (MiB) | share of UNet | resident MiB | streamed units | VRAM Guard MiB/step | --lowvram MiB/step (model) | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for f in (float(x) for x in a.fractions.split(",")):
        budget = int(f * unet_bytes + 2 * whole.activation_bytes)
        p = plan_stream(unet, spec, budget_bytes=budget, **kw)
        print(f"| {budget / MiB:.0f} | {f:.2f} | {p.resident_bytes / MiB:.0f} ({100 * p.resident_bytes / unet_bytes:.0f} %) | "
              f"{len(p.streamed)} of {len(p.streamed) + len(p.resident)} | {p.bytes_moved_per_step / MiB:.0f} | "
              f"{p.lowvram_bytes_per_step / MiB:.0f} | {p.bytes_moved_per_step / max(1, p.lowvram_bytes_per_step):.3f} |"
              + ("" if p.fits else " (does not fit)"))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
