"""Smoke test of the offline AUTOMATIC1111 v1.10.1 host: start it, run one job of each kind through
the API, check the pictures, stop it (run with the host venv's Python).

Jobs (seed 1234, Euler a, 128x128, 2 steps, sd15-random): txt2img; the same with each random LoRA
in the prompt; the same with a ControlNet unit (canny preprocessor, control_sd15_random); an Extras
x4 upscale with ESRGAN_x4-tiny-random. Checks: each returns a picture of the right size; each
LoRA and the ControlNet unit change the picture; the Extras picture is the model's (closer to a
nearest-neighbour x4 than to the Lanczos fallback the WebUI uses when a model fails to load);
VRAM Guard's status route answers; the log has no traceback. Writes the pictures and
smoke.json to --out; exit status 0 when every check passed. The server is always stopped.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw


def b64_png(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def from_b64(s: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(s.split(",", 1)[-1]))).convert("RGB")


class Api:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def call(self, path: str, body: dict | None = None, timeout: float = 1800) -> tuple[int, object]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")[:2000]


def test_image(seed: int, size: int) -> Image.Image:
    """Shapes with hard edges (for canny), different for each seed (the Extras cache)."""
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(0, 255, 3)))
    d = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = (int(v) for v in rng.integers(0, size * 3 // 4, 2))
        w, h = (int(v) for v in rng.integers(size // 8, size // 2, 2))
        color = tuple(int(v) for v in rng.integers(0, 255, 3))
        (d.ellipse if rng.random() < 0.5 else d.rectangle)([x0, y0, x0 + w, y0 + h], fill=color)
    return img


def max_diff(a: Image.Image, b: Image.Image) -> int:
    return int(np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).max())


def psnr(a: Image.Image, b: Image.Image) -> float:
    mse = float(((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tools", type=Path, default=Path("/work/webui-tools"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/vg-host-smoke"))
    ap.add_argument("--port", type=int, default=7869)
    ap.add_argument("--ckpt", default="sd15-random.safetensors")
    ap.add_argument("--upscaler", default="ESRGAN_x4-tiny-random")
    ap.add_argument("--url", help="use a WebUI that is already running (not started or stopped)")
    ap.add_argument("launch_args", nargs="*", help="extra WebUI args (after --)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "webui.log"
    env = dict(os.environ, PORT=str(args.port), LOG=str(log_path))
    results: dict = {"checks": {}, "seconds": {}}
    ok = True

    def check(name: str, passed: bool, **info) -> None:
        nonlocal ok
        ok &= bool(passed)
        results["checks"][name] = {"ok": bool(passed), **info}
        print(f"{'PASS' if passed else 'FAIL'} {name} {json.dumps(info)}", flush=True)

    started = False
    try:
        if args.url:
            api = Api(args.url)
        else:
            t0 = time.time()
            subprocess.run([str(args.tools / "launch.sh"), *args.launch_args], env=env, check=True)
            started = True
            results["seconds"]["start"] = round(time.time() - t0, 1)
            api = Api(f"http://127.0.0.1:{args.port}")

        code, status = api.call("/vram-guard/v1/status")
        check("vram_guard_status", code == 200, http=code, body=str(status)[:200])
        _, models = api.call("/sdapi/v1/sd-models")
        _, loras = api.call("/sdapi/v1/loras")
        _, upscalers = api.call("/sdapi/v1/upscalers")
        code, cn_models = api.call("/controlnet/model_list")
        results["host"] = {
            "checkpoints": [m["title"] for m in models],
            "loras": [x["name"] for x in loras],
            "upscalers": [u["name"] for u in upscalers],
            "controlnet_models": cn_models.get("model_list") if isinstance(cn_models, dict) else cn_models,
        }
        print(json.dumps(results["host"], indent=1), flush=True)
        cn_model = next(m for m in results["host"]["controlnet_models"] if "control_sd15_random" in m)

        base = {
            "prompt": "a red apple on a wooden table",
            "negative_prompt": "",
            "seed": 1234,
            "sampler_name": "Euler a",
            "steps": 2,
            "cfg_scale": 7,
            "width": 128,
            "height": 128,
            "override_settings": {"sd_model_checkpoint": args.ckpt},
            "override_settings_restore_afterwards": False,
        }

        def txt2img(name: str, **extra) -> Image.Image | None:
            t0 = time.time()
            code, r = api.call("/sdapi/v1/txt2img", {**base, **extra})
            secs = round(time.time() - t0, 1)
            results["seconds"][name] = secs
            if code != 200:
                check(name, False, http=code, error=str(r)[:500], seconds=secs)
                return None
            img = from_b64(r["images"][0])
            img.save(args.out / f"{name}.png")
            check(name, img.size == (128, 128), size=img.size, seconds=secs)
            return img

        plain = txt2img("txt2img")
        plain2 = txt2img("txt2img_repeat")
        if plain and plain2:
            check("txt2img_repeatable", max_diff(plain, plain2) == 0, max_diff=max_diff(plain, plain2))
        for lora in ("vg-lora-attn", "vg-lora-mix"):
            img = txt2img(f"lora_{lora}", prompt=base["prompt"] + f" <lora:{lora}:1>")
            if img and plain:
                d = max_diff(img, plain)
                check(f"lora_{lora}_changes_picture", d >= 8, max_diff=d, psnr=round(psnr(img, plain), 1))
        hint = test_image(7, 128)
        hint.save(args.out / "controlnet_input.png")
        unit = {
            "enabled": True,
            "module": "canny",
            "model": cn_model,
            "image": b64_png(hint),
            "weight": 1.0,
            "resize_mode": "Crop and Resize",
            "processor_res": 128,
            "threshold_a": 100,
            "threshold_b": 200,
            "control_mode": "Balanced",
            "pixel_perfect": False,
        }
        img = txt2img("controlnet_canny", alwayson_scripts={"controlnet": {"args": [unit]}})
        if img and plain:
            d = max_diff(img, plain)
            check("controlnet_changes_picture", d >= 8, max_diff=d, psnr=round(psnr(img, plain), 1))

        # Extras x4: an input no earlier run used (the Upscale operation caches by image)
        src = test_image(int(time.time()) % 100000, 64)
        src.save(args.out / "extras_input.png")
        t0 = time.time()
        code, r = api.call(
            "/sdapi/v1/extra-single-image",
            {"image": b64_png(src), "upscaling_resize": 4, "upscaler_1": args.upscaler},
        )
        secs = results["seconds"]["extras"] = round(time.time() - t0, 1)
        if code != 200:
            check("extras", False, http=code, error=str(r)[:500])
        else:
            up = from_b64(r["image"])
            up.save(args.out / "extras.png")
            near = src.resize((256, 256), Image.NEAREST)
            lanczos = src.resize((256, 256), Image.LANCZOS)
            p_near, p_lz = psnr(up, near), psnr(up, lanczos)
            check(
                "extras_esrgan",
                up.size == (256, 256) and p_near > p_lz and p_lz < 60,
                size=up.size,
                psnr_vs_nearest=round(p_near, 1),
                psnr_vs_lanczos=round(p_lz, 1),
                seconds=secs,
            )
    except Exception as e:  # report, then stop the server
        check("run", False, error=f"{type(e).__name__}: {e}")
    finally:
        if started:
            subprocess.run([str(args.tools / "stop.sh")], env=env, check=False)
    if log_path.exists():
        text = log_path.read_text(errors="replace")
        # "*** Failed reading extension data from Git repository (NAME)" + its traceback up to
        # "---": the WebUI's own notice for an extension folder that is not a clone with an origin
        # and a branch (e.g. vram-guard linked to a worktree); not an extension error
        bad, notices, in_notice = [], [], False
        for line in text.splitlines():
            if line.startswith("*** Failed reading extension data from Git repository"):
                in_notice = True
                notices.append(line.rsplit("(", 1)[-1].rstrip(")"))
            elif in_notice:
                in_notice = line.strip() != "---"
            elif "Traceback" in line or "Error" in line:
                bad.append(line)
        check("log_clean", not bad, error_lines=bad[:10], git_info_notices=notices)
        for line in text.splitlines():
            if line.startswith(("Startup time:", "Model loaded in")):
                results.setdefault("log", []).append(line)
    results["ok"] = ok
    (args.out / "smoke.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({"ok": ok, "seconds": results["seconds"], "log": results.get("log")}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
