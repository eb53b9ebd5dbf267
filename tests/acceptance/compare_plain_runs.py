"""Two plain (no VRAM Guard) runs of ``run_webui_sdxl_stages.sh`` (ONLY=hires, ESRGAN) compared seed
by seed: the host's own float noise in the hires chain (docs/webui-acceptance.md, SDXL).

For each seed: the final image (``OUT/plain-hires-s<seed>.png``) of ``--got`` against ``--ref``
(PSNR, max level, differing 8-bit values), and from the stage probe's files
(``OUT/stages/plain-hires-s<seed>/``, call order: first-pass decode in/out, hires encode in/out,
final decode in/out) the first-pass latent's and first-pass decode's max abs difference, the
first-pass 8-bit picture's and the hires upscale output's differing values, and the final latent's
max abs difference. ``--got-label on`` reads ``on-hires-s<seed>`` of ``--got`` instead (the extension
phase's VRAM Guard-on jobs), which gives VRAM Guard's row in the same columns.

usage: compare_plain_runs.py --ref OUT_A --got OUT_B --seeds 1,2 [--got-label plain|on] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from webui_acceptance import _to_8bit, psnr  # noqa: E402

# the probe's calls of an ESRGAN hires job, in order (webui_acceptance.STAGE_NAMES["hires"])
LATENT, DECODE, UPSCALED, FINAL_LATENT = 0, 1, 2, 4


def _stages(out: Path, label: str) -> list[np.ndarray]:
    return [np.load(f) for f in sorted((out / "stages" / label).glob("*.npy"))]


def _max_abs(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.abs(x.astype(np.float64) - y).max())


def compare(ref: Path, got: Path, seed: int, got_label: str = "plain") -> dict:
    ref_label, label = f"plain-hires-s{seed}", f"{got_label}-hires-s{seed}"
    a = np.asarray(Image.open(ref / f"{ref_label}.png").convert("RGB"))
    b = np.asarray(Image.open(got / f"{label}.png").convert("RGB"))
    row = {"seed": seed, "psnr": psnr(b, a), "max_lsb": int(np.abs(b.astype(int) - a).max()),
           "differing_values": int((a != b).sum()), "values": int(a.size)}  # fmt: skip
    sa, sb = _stages(ref, ref_label), _stages(got, label)
    if len(sa) == len(sb) == 6:
        row["first_pass_latent_max_abs"] = _max_abs(sa[LATENT], sb[LATENT])
        row["first_pass_decode_max_abs"] = _max_abs(sa[DECODE], sb[DECODE])
        row["first_pass_8bit_differing"] = int(
            (_to_8bit("decode-out", sa[DECODE]) != _to_8bit("decode-out", sb[DECODE])).sum()
        )
        row["first_pass_values"] = int(sa[DECODE].size)
        row["upscale_out_8bit_differing"] = int(
            (_to_8bit("encode-in", sa[UPSCALED]) != _to_8bit("encode-in", sb[UPSCALED])).sum()
        )
        row["final_latent_max_abs"] = _max_abs(sa[FINAL_LATENT], sb[FINAL_LATENT])
    else:
        row["probe_files"] = [len(sa), len(sb)]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", required=True, type=Path, help="OUT of the reference plain run")
    ap.add_argument("--got", required=True, type=Path, help="OUT of the other plain run")
    ap.add_argument("--seeds", required=True, help="comma-separated seeds")
    ap.add_argument("--got-label", default="plain", help="plain, or on: --got's VRAM Guard-on jobs")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args()
    rows = [compare(a.ref, a.got, int(s), a.got_label) for s in a.seeds.split(",") if s.strip()]
    print("seed | final dB | max level | differing values | first-pass latent max abs | first-pass decode max abs"
          " | first-pass 8-bit differing | upscale out 8-bit differing | final latent max abs")  # fmt: skip
    for r in rows:
        print(f"{r['seed']} | {r['psnr']:.1f} | {r['max_lsb']} | {r['differing_values']} of {r['values']} | "
              f"{r.get('first_pass_latent_max_abs', float('nan')):.1e} | {r.get('first_pass_decode_max_abs', float('nan')):.1e} | "
              f"{r.get('first_pass_8bit_differing', '-')} of {r.get('first_pass_values', '-')} | "
              f"{r.get('upscale_out_8bit_differing', '-')} | {r.get('final_latent_max_abs', float('nan')):.1e}")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
