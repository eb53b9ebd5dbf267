"""Time one whole SDXL VAE decode in FP32 and in FP16 on this machine (to choose the FP16 check's size).

The full-size SDXL decoder (sgm ``Decoder`` from the WebUI's ``repositories/generative-models``,
built without ``sgm/__init__``) with the checkpoint's weights, on a random latent of each given
size; FP16 = the module and the latent cast with ``half()`` (what a WebUI VAE in FP16 runs).

usage: sdxl_fp16_decode_time.py LATENT_SIDE [LATENT_SIDE ...] [--ckpt FILE] [--sgm DIR]  (webui venv)
Prints one JSON line per size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from sdxl_stage_check import DD, host_vae  # noqa: F401  (DD documents the layout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sides", nargs="+", type=int, help="latent sides (image side = 8x)")
    ap.add_argument("--ckpt", default="/work/webui/models/Stable-diffusion/sdxl-random.safetensors")
    ap.add_argument("--sgm", default="/work/webui/repositories/generative-models/sgm")
    a = ap.parse_args()
    _, dec, _, _ = host_vae(a.ckpt, a.sgm)
    for side in a.sides:
        z = torch.randn(1, 4, side, side, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            t = time.time()
            ref = dec.float()(z)
            t32 = time.time() - t
            t = time.time()
            got = dec.half()(z.half())
            t16 = time.time() - t
        dec.float()
        print(json.dumps({"image": side * 8, "threads": torch.get_num_threads(), "fp32_s": round(t32, 2),
                          "fp16_s": round(t16, 2), "fp16_finite": bool(torch.isfinite(got).all()),
                          "fp16_max_abs_vs_fp32": float((got.float() - ref).abs().max())}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
