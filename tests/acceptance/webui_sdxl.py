"""SDXL acceptance run of VRAM Guard in a real AUTOMATIC1111 WebUI v1.10.1 (CPU, ``--no-half``).

Talks to the WebUI's HTTP API (helpers from ``webui_acceptance.py``). The WebUI is started with an
SDXL checkpoint loaded (``--ckpt .../sdxl-random.safetensors``). Phases:

* ``baseline`` — a WebUI without the extension (``--disable-extra-extensions``): txt2img and hires
  fix images saved to ``--out``.
* ``extension`` — the same WebUI with ``extensions/vram-guard`` (and, for the FP16 check, the
  ``latent-dump`` helper extension with ``LATENT_DUMP`` set, see ``docs/webui-acceptance.md``):
  VRAM Guard off (must be pixel-identical to the baseline) and on (exact tiles: PSNR >= 80 dB),
  hires fix off/on, then the FP16 overflow check: an overflow VAE is built for the job's own latent
  (``--overflow-cmd``), the plain WebUI decodes it in FP32 (its only CPU VAE precision under
  ``--no-half``, and what its NaN fallback re-decodes in), VRAM Guard decodes it in FP16 with the
  per-tile guard; the guard's log lines give the recomputed tiles.

usage: webui_sdxl.py baseline|extension --url URL --out DIR [--size 256] [--hires-size 128]
        [--log WEBUI_LOG] [--latent FILE] [--overflow-cmd CMD] [--only txt2img,hires,fp16]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from webui_acceptance import PROMPT, call, psnr, run  # noqa: E402

VG = "VRAM Guard"


def jobs(size: int, hires_size: int, steps: int, upscaler: str) -> dict[str, dict]:
    base = dict(PROMPT, steps=steps, width=size, height=size)
    hires = dict(PROMPT, steps=steps, width=hires_size, height=hires_size, enable_hr=True, hr_scale=2,
                 hr_upscaler=upscaler, hr_second_pass_steps=1, denoising_strength=0.5)  # fmt: skip
    return {"txt2img": base, "hires": hires}


def with_vg(payload: dict, args: list) -> dict:
    return dict(payload, alwayson_scripts={VG: {"args": args}})


def log_size(path: str | None) -> int:
    return os.path.getsize(path) if path and os.path.exists(path) else 0


def log_since(path: str | None, offset: int) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read().decode(errors="replace")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["baseline", "extension"])
    ap.add_argument("--url", default="http://127.0.0.1:7860")
    ap.add_argument("--out", default="/tmp/vg-sdxl")
    ap.add_argument("--upscaler", default="ESRGAN_x4-tiny-random")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--hires-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--log", default=None)
    ap.add_argument("--latent", default=None, help="the file LATENT_DUMP names (fp16 check)")
    ap.add_argument("--overflow-cmd", default=None, help="builds the overflow VAE: CMD LATENT OUT")
    ap.add_argument("--vae-dir", default="/work/webui/models/VAE")
    ap.add_argument("--only", default="")
    ap.add_argument(
        "--fp16-whole", action="store_true", help="also FP16 with tiling Off (one tile; slow on a CPU)"
    )
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    reqs = jobs(a.size, a.hires_size, a.steps, a.upscaler)
    only = set(filter(None, a.only.split(",")))
    results: list[dict] = []

    def want(name: str) -> bool:
        return not only or name in only

    def record(check: str, ok: bool, **data) -> None:
        results.append({"check": check, "ok": ok, **data})
        print(f"{'PASS' if ok else 'FAIL'} {check} {json.dumps(data)}", flush=True)

    def save(name: str, img: np.ndarray) -> None:
        Image.fromarray(img).save(f"{a.out}/{name}.png")

    def load(name: str) -> np.ndarray:
        return np.asarray(Image.open(f"{a.out}/{name}.png").convert("RGB"))

    def stages() -> list:
        st, _ = call(a.url, "/vram-guard/v1/status")
        return [(s.get("stage"), s.get("plan"), round((s.get("peak_bytes") or 0) / 2**30, 2), round(s.get("seconds") or 0, 1))
                for s in st.get("stages", [])]  # fmt: skip

    def memory() -> dict:
        m, _ = call(a.url, "/sdapi/v1/memory")
        ram = m.get("ram", {})
        return {"ram_used_gib": round(ram.get("used", 0) / 2**30, 2)}

    if a.phase == "baseline":
        for name, payload in reqs.items():
            if want(name):
                r = run(a.url, name, "/sdapi/v1/txt2img", payload)
                save(f"base-{name}", r["image"])
                record(f"baseline {name}", True, seconds=r["seconds"], shape=list(r["image"].shape),
                       std=float(r["image"].std()), **memory())  # fmt: skip
        with open(f"{a.out}/results-baseline.json", "w") as fh:
            json.dump(results, fh, indent=1)
        return 0

    on_exact = [{"enabled": True, "vae_tiling": "Always", "vae_mode": "exact", "vae_tile": 16,
                 "upscale_tiling": False, "precision_vae": "Auto", "unet_fp16": False}]  # fmt: skip
    if want("txt2img"):
        if a.latent and os.path.exists(a.latent):
            os.unlink(a.latent)
        r = run(a.url, "txt2img", "/sdapi/v1/txt2img", with_vg(reqs["txt2img"], [False]))
        save("off-txt2img", r["image"])
        b = load("base-txt2img")
        record("SDXL txt2img, VRAM Guard off = no extension", bool(np.array_equal(r["image"], b))
               and f"{VG}:" not in r["infotext"], seconds=r["seconds"], psnr=psnr(r["image"], b), **memory())  # fmt: skip
        r = run(a.url, "txt2img", "/sdapi/v1/txt2img", with_vg(reqs["txt2img"], on_exact))
        save("on-txt2img", r["image"])
        p = psnr(r["image"], b)
        record("SDXL txt2img, VRAM Guard exact t16 >= 80 dB vs no extension", p >= 80, seconds=r["seconds"], psnr=p,
               infotext=r["infotext"].split("\n")[-1], stages=stages(), **memory())  # fmt: skip
    if want("fp16"):
        if not (a.latent and os.path.exists(a.latent) and a.overflow_cmd):
            record("fp16 overflow: needs --latent (from the txt2img job) and --overflow-cmd", False)
        else:
            vae_name = "sdxl-random-overflow.safetensors"
            out = subprocess.run([*shlex.split(a.overflow_cmd), a.latent, f"{a.vae_dir}/{vae_name}"],
                                 capture_output=True, text=True, check=True)  # fmt: skip
            made = json.loads(out.stdout.strip().splitlines()[-1])
            record("overflow VAE built for the job's latent", True, **made)
            call(a.url, "/sdapi/v1/refresh-vae", {})
            ov = dict(reqs["txt2img"], override_settings={"sd_vae": vae_name},
                      override_settings_restore_afterwards=True)  # fmt: skip
            r32 = run(a.url, "fp32", "/sdapi/v1/txt2img", with_vg(ov, [False]))
            save("fp16check-plain-fp32", r32["image"])
            record(
                "overflow VAE, plain WebUI (FP32 VAE)",
                True,
                seconds=r32["seconds"],
                std=float(r32["image"].std()),
            )
            for tile in (16,) if not a.fp16_whole else (16, 0):
                args = [dict(on_exact[0], precision_vae="FP16", vae_tile=tile)]
                if tile == 0:
                    args = [dict(on_exact[0], precision_vae="FP16", vae_tiling="Off")]
                off = log_size(a.log)
                t0 = time.time()
                r = run(a.url, "fp16", "/sdapi/v1/txt2img", with_vg(ov, args))
                text = log_since(a.log, off)
                guard = re.findall(
                    r"precision guard: (\w+) tile (\d+) step (\d+) overflowed in (\S+), recomputed in (\S+)",
                    text,
                )
                tiles = sorted({int(t) for kind, t, *_ in guard if kind == "decode"})
                name = f"fp16check-vg-fp16-{'t16' if tile else 'whole'}"
                save(name, r["image"])
                p = psnr(r["image"], r32["image"])
                record(f"overflow VAE, VRAM Guard FP16 + guard ({'exact t16' if tile else 'tiling Off: one tile'})",
                       p >= 30 and bool(guard), seconds=round(time.time() - t0, 1), psnr_vs_fp32=p,
                       recomputed_segments=len(guard), recomputed_tiles=tiles, guard_lines=guard[:12],
                       infotext=r["infotext"].split("\n")[-1], stages=stages())  # fmt: skip
    if want("hires"):
        r = run(a.url, "hires", "/sdapi/v1/txt2img", with_vg(reqs["hires"], [False]))
        b = load("base-hires")
        record("SDXL hires x2, VRAM Guard off = no extension", bool(np.array_equal(r["image"], b)),
               seconds=r["seconds"], psnr=psnr(r["image"], b))  # fmt: skip
        # VAE stages tiled (exact), the WebUI's own upscale: the final image is comparable.
        r = run(a.url, "hires", "/sdapi/v1/txt2img", with_vg(reqs["hires"], on_exact))
        save("on-hires", r["image"])
        p = psnr(r["image"], b)
        record("SDXL hires x2, VRAM Guard exact t16 (all VAE stages), WebUI upscale", p >= 80, seconds=r["seconds"],
               psnr=p, infotext=r["infotext"].split("\n")[-1], stages=stages())  # fmt: skip
    if a.log:
        text = log_since(a.log, 0)
        errs = [ln for ln in text.splitlines() if re.search(r"Error|Traceback", ln)]
        record("no Error/Traceback lines in the WebUI log", not errs, count=len(errs), first=errs[:5])
    with open(f"{a.out}/results-{a.phase}.json", "w") as fh:
        json.dump(results, fh, indent=1)
    return 0 if all(x["ok"] for x in results) else 1


if __name__ == "__main__":
    sys.exit(main())
