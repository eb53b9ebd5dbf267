"""SDXL hires fix stage by stage, and the FP16-overflow comparison, in a real WebUI v1.10.1 (CPU).

Talks to a running WebUI's HTTP API (helpers from ``webui_acceptance.py``). The WebUI runs with the
SDXL checkpoint loaded (``--ckpt .../sdxl-random.safetensors``, ``--no-half`` as always on a CPU)
and two acceptance helpers linked into ``extensions/`` (neither is VRAM Guard, neither changes a
result):

* ``webui_stage_probe/`` with ``VG_STAGE_DUMP=DIR``: every VAE stage's input and output, in call
  order (first-pass decode, hires encode whose input is the hires upscale's output, final decode);
* ``webui_vae_dtype/`` with ``VG_VAE_DTYPE_ROUTE=1``: ``/vg-accept/vae-dtype`` puts the WebUI's VAE
  into FP16 (``devices.dtype_vae`` and the module), the state of a WebUI started without
  ``--no-half``/``--no-half-vae``.

Phases (one WebUI start each):

* ``plain`` — no VRAM Guard in ``extensions/``. Hires fix (``--hires-size`` → ×2, ESRGAN); then at
  ``--fp16-size``: a txt2img whose sampled latent (from the probe) calibrates the overflow VAE
  (``--overflow-cmd LATENT OUT``: FP16 overflows at one place of that latent), the same job with
  that VAE in FP32 (the reference), and in FP16: the WebUI's NaN check must fire, its log must
  show the fallback, ``devices.dtype_vae`` must be FP32 afterwards and the image must equal the
  FP32 one (the whole decode redone in FP32).
* ``extension`` — the same WebUI plus ``extensions/vram-guard``. Hires fix with VRAM Guard off
  (identical to ``plain``, every stage) and on (exact t16 on every VAE stage: >= 80 dB, each
  stage's error); then the overflow job with the WebUI's VAE in FP16 and VRAM Guard on (exact t16,
  VAE precision Auto = the VAE's FP16): its guard's log lines name the recomputed tiles, the
  WebUI's fallback must not fire, the image must be finite and close to the plain FP32 one.

``--seeds 1,2,...`` (default 1234) runs the hires part once per seed: images and the probe's files
are named ``<plain|off|on>-hires-s<seed>`` (``off`` for the first seed only); the extension phase
prints one summary line per seed (final image vs plain, and how many values of the first-pass 8-bit
picture, the hires upscale's input, differ) and writes them to ``OUT/seeds-extension.json``.

usage: webui_sdxl_stages.py plain|extension --url URL --out DIR --stage-dump DIR --log WEBUI_LOG
        [--hires-size 128] [--fp16-size 256x64] [--steps 1] [--upscaler NAME] [--seeds 1234]
        [--overflow-cmd CMD] [--only hires,fp16]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from webui_acceptance import PROMPT, _to_8bit, call, compare_stages, psnr, run  # noqa: E402

VG = "VRAM Guard"
# not "sdxl-random…": v1.10.1's VAE "Automatic" picks any file in models/VAE whose name starts with
# the checkpoint's name ("VAE weights found near the checkpoint"), for every job of every later start
VAE_NAME = "vg-overflow-vae-for-sdxl.safetensors"
FALLBACK = "A tensor with all NaNs was produced in VAE"
RETRY = "Web UI will now convert VAE into 32-bit float and retry"
GUARD = re.compile(r"precision guard: (\w+) tile (\d+) step (\d+) overflowed in (\S+), recomputed in (\S+)")
ON = {"enabled": True, "vae_tiling": "Always", "vae_mode": "exact", "vae_tile": 16,
      "upscale_tiling": False, "precision_vae": "Auto", "unet_fp16": False}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["plain", "extension"])
    ap.add_argument("--url", default="http://127.0.0.1:7946")
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage-dump", required=True, help="the probe's VG_STAGE_DUMP folder")
    ap.add_argument("--log", required=True, help="the WebUI's log file")
    ap.add_argument("--upscaler", default="ESRGAN_x4-tiny-random")
    ap.add_argument("--hires-size", type=int, default=128)
    ap.add_argument("--fp16-size", default="256x64", help="WxH of the FP16 overflow jobs")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--overflow-cmd", default=None, help="builds the overflow VAE: CMD LATENT.pt OUT")
    ap.add_argument("--vae-dir", default="/work/webui/models/VAE")
    ap.add_argument("--only", default="")
    ap.add_argument("--seeds", default=str(PROMPT["seed"]), help="comma-separated seeds of the hires jobs")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, a.only.split(","))) or {"hires", "fp16"}
    fw, fh = (int(v) for v in a.fp16_size.lower().split("x"))
    seeds = [int(v) for v in a.seeds.split(",") if v.strip()]
    hires = dict(PROMPT, steps=a.steps, width=a.hires_size, height=a.hires_size, enable_hr=True, hr_scale=2,
                 hr_upscaler=a.upscaler, hr_second_pass_steps=1, denoising_strength=0.5)  # fmt: skip
    small = dict(PROMPT, steps=a.steps, width=fw, height=fh)
    overflow = dict(small, override_settings={"sd_vae": VAE_NAME}, override_settings_restore_afterwards=True)
    results: list[dict] = []

    def record(check: str, ok: bool, **data) -> None:
        ok = bool(ok)  # numpy comparisons give numpy bools (not JSON)
        results.append({"check": check, "ok": ok, **data})
        print(f"{'PASS' if ok else 'FAIL'} {check} {json.dumps(data)}", flush=True)

    def job(label: str, payload: dict, vg: dict | bool | None) -> tuple[dict, str]:
        """One txt2img; returns (result, the WebUI log written meanwhile). The probe's files of the
        job go to OUT/stages/<label>; the image to OUT/<label>.png."""
        for f in Path(a.stage_dump).glob("*.npy"):
            f.unlink()
        if vg is not None:
            payload = dict(payload, alwayson_scripts={VG: {"args": [vg if isinstance(vg, dict) else False]}})
        off = os.path.getsize(a.log)
        r = run(a.url, label, "/sdapi/v1/txt2img", payload)
        with open(a.log, "rb") as fh_:
            fh_.seek(off)
            text = fh_.read().decode(errors="replace")
        dest = out / "stages" / label
        dest.mkdir(parents=True, exist_ok=True)
        for f in dest.glob("*.npy"):
            f.unlink()
        for f in sorted(Path(a.stage_dump).glob("*.npy")):
            f.replace(dest / f.name)
        Image.fromarray(r["image"]).save(out / f"{label}.png")
        return r, text

    def stage(label: str, idx: int) -> np.ndarray:
        return np.load(sorted((out / "stages" / label).glob("*.npy"))[idx])

    def vg_stages() -> list:
        st, _ = call(a.url, "/vram-guard/v1/status")
        return [
            (s.get("stage"), s.get("plan"), round(s.get("seconds") or 0, 1)) for s in st.get("stages", [])
        ]

    def dtype_state(dtype: str | None = None) -> dict:
        if dtype is None:
            return call(a.url, "/vg-accept/vae-dtype")[0]
        return call(a.url, "/vg-accept/vae-dtype", {"dtype": dtype})[0]

    def flips(tag: str, x: np.ndarray, y: np.ndarray) -> int:
        """How many values of the 8-bit pictures the WebUI makes of two probed stage outputs differ."""
        return int((_to_8bit(tag, x) != _to_8bit(tag, y)).sum())

    def load_png(label: str) -> np.ndarray:
        return np.asarray(Image.open(out / f"{label}.png").convert("RGB"))

    # a latent upscaler has no first-pass decode, upscale or encode: only the final decode's call
    latent_up = a.upscaler.startswith("Latent")
    stage_job = "hires-latent" if latent_up else "hires"  # (compare_stages names the 6 ESRGAN calls)
    if a.phase == "plain":
        for seed in seeds if "hires" in only else []:
            r, _ = job(f"plain-hires-s{seed}", dict(hires, seed=seed), None)
            n = len(list((out / "stages" / f"plain-hires-s{seed}").glob("*.npy")))
            record(f"plain hires fix (no VRAM Guard), {a.upscaler}, seed {seed}", n == (2 if latent_up else 6), seconds=r["seconds"], shape=list(r["image"].shape),
                   std=float(r["image"].std()), probe_files=n)  # fmt: skip
        if "fp16" in only:
            state = dtype_state()
            record("plain WebUI's VAE precision at the start", state["dtype_vae"] == "torch.float32", **state)
            r, _ = job("plain-fp16size-normal-vae", small, None)
            import torch

            latent = torch.from_numpy(stage("plain-fp16size-normal-vae", 0))
            torch.save(latent, out / "latent.pt")
            record("latent of the job", True, seconds=r["seconds"], shape=list(latent.shape))
            made = subprocess.run([*shlex.split(a.overflow_cmd), str(out / "latent.pt"), f"{a.vae_dir}/{VAE_NAME}"],
                                  capture_output=True, text=True, check=True)  # fmt: skip
            info = json.loads(made.stdout.strip().splitlines()[-1])
            (out / "overflow-vae.json").write_text(json.dumps(info, indent=1))
            record("overflow VAE built for the job's latent", True, **info)
            call(a.url, "/sdapi/v1/refresh-vae", {})
            r32, _ = job("plain-overflow-fp32", overflow, None)
            d32 = stage("plain-overflow-fp32", 1)
            record("plain WebUI, overflow VAE in FP32", bool(np.isfinite(d32).all()), seconds=r32["seconds"],
                   std=float(r32["image"].std()))  # fmt: skip
            state = dtype_state("float16")
            record("plain WebUI's VAE put into FP16 (as without --no-half-vae)",
                   state["dtype_vae"] == "torch.float16" and state["vae_parameter_dtypes"] == ["torch.float16"],
                   **state)  # fmt: skip
            r16, text = job("plain-overflow-fp16", overflow, None)
            after = dtype_state()
            d16 = stage("plain-overflow-fp16", 1)
            fell_back = FALLBACK in text and RETRY in text
            same = bool(np.array_equal(r16["image"], r32["image"]))
            record("plain WebUI, overflow VAE in FP16: NaN detected, whole decode redone in FP32",
                   fell_back and after["dtype_vae"] == "torch.float32" and same,
                   seconds=r16["seconds"], seconds_fp32_job=r32["seconds"], fallback_in_log=fell_back,
                   log_lines=[ln for ln in text.splitlines() if "NaN" in ln or "retry" in ln][:4],
                   state_after=after, image_equals_fp32=same, decode_max_abs_vs_fp32=float(np.abs(d16 - d32).max()))  # fmt: skip
            dtype_state("float32")
    else:
        summary: list[dict] = []
        for seed in seeds if "hires" in only else []:
            b, plain_dir = load_png(f"plain-hires-s{seed}"), out / "stages" / f"plain-hires-s{seed}"
            if seed == seeds[0]:  # off = plain is seed-independent; once keeps the run short
                r, text = job(f"off-hires-s{seed}", dict(hires, seed=seed), False)
                st = compare_stages(stage_job, plain_dir, out / "stages" / f"off-hires-s{seed}")
                ok = bool(np.array_equal(r["image"], b)) and all(e.get("max_abs") == 0 for e in st)
                record(f"SDXL hires ({a.upscaler}), seed {seed}, VRAM Guard off = plain (image and every stage)", ok and f"{VG}:" not in r["infotext"],
                       seconds=r["seconds"], psnr=psnr(r["image"], b), stages=st)  # fmt: skip
            r, text = job(f"on-hires-s{seed}", dict(hires, seed=seed), ON)
            st = compare_stages(stage_job, plain_dir, out / "stages" / f"on-hires-s{seed}")
            p = psnr(r["image"], b)
            row = {"seed": seed, "psnr": p, "max_lsb": int(np.abs(r["image"].astype(int) - b).max()),
                   "differing_values": int((r["image"] != b).sum()), "values": int(b.size)}  # fmt: skip
            if not latent_up:  # probe calls 1 and 2: first-pass decode out, hires upscale out (8-bit / 255)
                x, y = stage(f"plain-hires-s{seed}", 1), stage(f"on-hires-s{seed}", 1)
                row["first_pass_8bit_differing"] = flips("decode-out", x, y)
                row["first_pass_values"] = int(x.size)
                row["first_pass_decode_max_abs"] = float(np.abs(x.astype(np.float64) - y).max())
                up = (stage(f"plain-hires-s{seed}", 2), stage(f"on-hires-s{seed}", 2))
                row["upscale_out_8bit_differing"] = flips("encode-in", *up)
            summary.append(row)
            record(f"SDXL hires ({a.upscaler}), seed {seed}, VRAM Guard exact t16 on every VAE stage >= 80 dB vs plain", p >= 80,
                   seconds=r["seconds"], **row, stages=st, infotext=r["infotext"].split("\n")[-1], vg_stages=vg_stages())  # fmt: skip
        if summary:
            (out / "seeds-extension.json").write_text(json.dumps(summary, indent=1))
            print("seed | final on-vs-plain dB | max level | differing values | first-pass 8-bit values differing"
                  " | first-pass decode max abs")  # fmt: skip
            for row in summary:
                print(f"{row['seed']} | {row['psnr']:.1f} | {row['max_lsb']} | {row['differing_values']} of {row['values']} | "
                      f"{row.get('first_pass_8bit_differing', '-')} of {row.get('first_pass_values', '-')} | "
                      f"{row.get('first_pass_decode_max_abs', float('nan')):.1e}", flush=True)  # fmt: skip
        if "fp16" in only:
            call(a.url, "/sdapi/v1/refresh-vae", {})
            state = dtype_state("float16")
            record(
                "WebUI's VAE put into FP16 (as without --no-half-vae)",
                state["dtype_vae"] == "torch.float16",
                **state,
            )
            r, text = job("vg-overflow-fp16", overflow, ON)
            after = dtype_state()
            dtype_state("float32")
            guard = GUARD.findall(text)
            tiles = sorted({int(t) for part, t, *_ in guard if part == "tiles"})  # part: "global" or "tiles"
            ref_img, ref = load_png("plain-overflow-fp32"), stage("plain-overflow-fp32", 1)
            got = stage("vg-overflow-fp16", 1)
            finite = bool(np.isfinite(got).all())
            p = psnr(r["image"], ref_img)
            record("VRAM Guard, overflow VAE in FP16 + guard: finite, close to FP32, no WebUI fallback",
                   finite and bool(guard) and FALLBACK not in text and after["dtype_vae"] == "torch.float16" and p >= 30,
                   seconds=r["seconds"], finite=finite, psnr_vs_plain_fp32=p,
                   max_abs_vs_fp32=float(np.abs(got - ref).max()),
                   max_lsb=int(np.abs(r["image"].astype(int) - ref_img).max()), recomputed_tiles=tiles,
                   guard_lines=[" ".join(g) for g in guard], fallback_in_log=FALLBACK in text,
                   state_after=after, infotext=r["infotext"].split("\n")[-1], vg_stages=vg_stages())  # fmt: skip
    text = Path(a.log).read_text(errors="replace")
    errs = [ln for ln in text.splitlines() if re.search(r"Error|Traceback", ln)]
    record("Error/Traceback lines in the WebUI log (the NaN fallback prints none)", not errs, count=len(errs),
           first=errs[:5])  # fmt: skip
    (out / f"results-{a.phase}.json").write_text(json.dumps(results, indent=1))
    return 0 if all(x["ok"] for x in results) else 1


if __name__ == "__main__":
    sys.exit(main())
