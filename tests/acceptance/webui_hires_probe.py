"""Hires fix stage by stage, VRAM Guard on vs the host's own (acceptance tool, never run by CI).

Needs a WebUI (A1111 or Forge) with VRAM Guard and the stage probe
(``tests/acceptance/webui_stage_probe``, linked into ``extensions/``) started with
``VG_STAGE_DUMP=<dump> VG_STAGE_DETAIL=1``. Runs the named jobs in order (each a hires fix or
img2img request with VRAM Guard's arguments), moves what the probe wrote for each into
``<out>/<job>/``, then compares every job's stages with the first job's (the reference, normally
``off``) and prints JSON::

    python tests/acceptance/webui_hires_probe.py --url URL --dump DUMP --out OUT [--forge] \\
        [--jobs off,on,vae-only,upscale-only,off2] [--kind hires|img2img|sdupscale]

Per stage: the max abs difference of the float tensor, PSNR in 8 bits for pictures, and whether
torch's global generator state was the same at that point (the encode samples from it).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from webui_acceptance import FORGE_HIRES, PROMPT, call, init_image, psnr  # noqa: E402

JOBS = {
    "off": [False],
    "off2": [False],
    "on": [{"vae_tiling": "Always", "vae_tile": 16, "upscale_tile": 32}],
    "on2": [{"vae_tiling": "Always", "vae_tile": 16, "upscale_tile": 32}],
    "vae-only": [{"vae_tiling": "Always", "vae_tile": 16, "upscale_tiling": False}],
    "upscale-only": [{"vae_tiling": "Off", "upscale_tile": 32}],
    "upscale-only2": [{"vae_tiling": "Off", "upscale_tile": 32}],
    "auto": [{"vae_tiling": "Auto"}],
}


def payload(kind: str, forge: bool, upscaler: str, size: int) -> tuple[str, dict]:
    base = dict(PROMPT, steps=2, width=size, height=size)
    if kind == "img2img":
        return "/sdapi/v1/img2img", dict(base, init_images=[init_image(size)], denoising_strength=0.6)
    if kind == "sdupscale":  # the "SD upscale" script: upscale x2, then img2img over 2*size tiles
        return "/sdapi/v1/img2img", dict(base, width=2 * size, height=2 * size, init_images=[init_image(size)],
                                         denoising_strength=0.3, script_name="sd upscale",
                                         script_args=["", 64, upscaler, 2.0])  # fmt: skip
    hires = dict(base, enable_hr=True, hr_scale=2, hr_upscaler=upscaler, hr_second_pass_steps=1,
                 denoising_strength=0.5)  # fmt: skip
    if forge:
        hires.update(FORGE_HIRES)
    return "/sdapi/v1/txt2img", hires


def files(d: Path) -> list[Path]:
    return sorted(p for p in d.glob("*.npy"))


def compare(ref: Path, got: Path) -> list[dict]:
    out = []
    for sub in ("", "detail"):
        rf, gf = files(ref / sub), files(got / sub)
        for i, r in enumerate(rf):
            tag = r.stem.split("-", 1)[1]
            e: dict = {"call": f"{sub + '/' if sub else ''}{tag}"}
            if i >= len(gf) or gf[i].stem.split("-", 1)[1] != tag:
                e["different_call"] = gf[i].stem if i < len(gf) else None
                out.append(e)
                continue
            x, y = np.load(r), np.load(gf[i])
            if x.shape != y.shape:
                e["shapes"] = [list(x.shape), list(y.shape)]
            elif tag.endswith("-rng"):
                e["same_generator_state"] = bool(np.array_equal(x, y))
            else:
                d = np.abs(x.astype(np.float64) - y)
                e["max_abs"] = float(d.max())
                e["mean_abs"] = float(d.mean())
                if tag == "resize-out":
                    e["psnr_8bit"] = psnr(x.astype(np.uint8), y.astype(np.uint8))
                elif tag == "decode-out":
                    x8 = (np.clip((x + 1) / 2, 0, 1) * 255).astype(np.uint8)
                    y8 = (np.clip((y + 1) / 2, 0, 1) * 255).astype(np.uint8)
                    e["psnr_8bit"] = psnr(x8, y8)
            out.append(e)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--dump", required=True, type=Path, help="the probe's VG_STAGE_DUMP folder")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--forge", action="store_true")
    ap.add_argument("--jobs", default="off,on,vae-only,upscale-only,off2")
    ap.add_argument("--kind", default="hires", choices=["hires", "img2img", "sdupscale"])
    ap.add_argument("--upscaler", default="ESRGAN_x4-tiny-random")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--prime", action="store_true",
                    help="run the first job once, unrecorded, before the compared ones: the host's img2img "
                         "encode samples from torch's global generator before the job seeds it, so its "
                         "picture depends on the previous job; after a job with the same seed every "
                         "compared job starts from the same generator state")  # fmt: skip
    ap.add_argument("--esrgan-tile", type=int, default=0,
                    help="the host's ESRGAN tile for every job (0 = untiled: the model's own picture; put back after)")  # fmt: skip
    a = ap.parse_args()
    opts, _ = call(a.url, "/sdapi/v1/options")
    call(a.url, "/sdapi/v1/options", {"ESRGAN_tile": a.esrgan_tile})
    try:
        return run(a)
    finally:
        call(a.url, "/sdapi/v1/options", {"ESRGAN_tile": int(opts.get("ESRGAN_tile", 192))})


def run(a: argparse.Namespace) -> int:
    path, body = payload(a.kind, a.forge, a.upscaler, a.size)
    results: dict = {"kind": a.kind, "esrgan_tile": a.esrgan_tile, "jobs": {}}
    images = {}
    if a.prime:
        args = JOBS[a.jobs.split(",")[0]]
        call(a.url, path, dict(body, alwayson_scripts={"VRAM Guard": {"args": args}}))
        for f in [*files(a.dump), *files(a.dump / "detail")]:
            f.unlink()
    for job in a.jobs.split(","):
        args = JOBS[job]
        t0 = time.time()
        r, _ = call(a.url, path, dict(body, alwayson_scripts={"VRAM Guard": {"args": args}}))
        dest = a.out / job
        if dest.exists():
            shutil.rmtree(dest)
        (dest / "detail").mkdir(parents=True)
        for f in files(a.dump):
            shutil.move(str(f), dest / f.name)
        for f in files(a.dump / "detail"):
            shutil.move(str(f), dest / "detail" / f.name)
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(r["images"][0]))).convert("RGB"))
        Image.fromarray(img).save(dest / "image.png")
        images[job] = img
        info = json.loads(r["info"])
        st, _ = call(a.url, "/vram-guard/v1/status")
        results["jobs"][job] = {
            "args": args,
            "seconds": round(time.time() - t0, 1),
            "infotext": info.get("infotexts", [""])[0].split("\n")[-1],
            "stages": [(s["stage"], s.get("plan")) for s in st.get("stages", [])]
            if args != [False]
            else None,
        }
    first = a.jobs.split(",")[0]
    for job in list(images)[1:]:
        results["jobs"][job]["final_psnr_vs_" + first] = psnr(images[job], images[first])
        results["jobs"][job]["final_identical"] = bool(np.array_equal(images[job], images[first]))
        results["jobs"][job]["stages_vs_" + first] = compare(a.out / first, a.out / job)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
