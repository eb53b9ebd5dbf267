"""Upscaler routes of VRAM Guard in a running WebUI v1.10.1 (``--api``), in every entry order.

Run it against a *fresh* WebUI with the extension (the first request matters: Extras as the first
job of the server)::

    python tests/acceptance/webui_upscale_routes.py --url http://127.0.0.1:7860

Each upscale is requested twice, with VRAM Guard's tiled upscaling on (Settings
``vram_guard_enabled``, tile 32 so the engine really tiles) and off (the WebUI's own code, untiled:
``ESRGAN_tile`` etc. 0), on the same input, and compared: max difference in 8-bit levels, PSNR. Order: Extras first; hires fix;
Extras after hires; hires after Extras; a model switch (SwinIR) and back. The hires-fix upscale
stage is the first pass image through the same ``Upscaler.upscale`` Extras calls (``scale`` 2):
compared on that image, plus the final hires images. Prints one line per check and a JSON summary;
restores the options it changed.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
import urllib.error
import urllib.request

import numpy as np
from PIL import Image

PROMPT = {"prompt": "a red apple on a wooden table", "negative_prompt": "", "cfg_scale": 7,
          "sampler_name": "Euler a", "seed": 1234, "batch_size": 1, "n_iter": 1, "steps": 2}  # fmt: skip
KEYS = ("vram_guard_enabled", "vram_guard_upscale_tiling", "vram_guard_upscale_tile", "vram_guard_vae_tiling")
UNTILED = {"ESRGAN_tile": 0, "DAT_tile": 0, "SWIN_tile": 192, "SCUNET_tile": 256}
"""The WebUI's own upscalers untiled: its reference. With the default ``ESRGAN_tile`` 192, an image
smaller than the tile is cut from a 192-px canvas that ``images.split_grid`` pads with black at the
top/left, so the WebUI's own default output is not the model's output near those edges: 0 turns
tiling off. SwinIR/ScuNET (``upscale_2``) cannot run untiled on a CPU in FP32 in v1.10.1 (tile 0
returns spandrel's inference-mode output, which ``torch_bgr_to_pil_image`` then clamps in place:
"Inplace update to inference tensor outside InferenceMode"); a tile at least the image size is one
tile covering the whole image, i.e. the untiled model."""


def call(url: str, path: str, payload: dict | None = None, timeout: float = 1800) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if payload is None else "POST")  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')[:600]}") from None


def encode(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64.split(",", 1)[-1]))).convert("RGB"))


def test_image(size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    img = np.stack([x * 0.4, y, 0.5 + 0.5 * np.sin(7 * x * y)], -1) * 220 + rng.integers(
        0, 35, (size, size, 3)
    )
    return img.clip(0, 255).astype(np.uint8)


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    if a.shape != b.shape:
        return {"shape": [list(a.shape), list(b.shape)], "max_lsb": None, "psnr": None}
    d = a.astype(np.float64) - b.astype(np.float64)
    mse = float(np.mean(d**2))
    return {
        "max_lsb": int(np.abs(d).max()),
        "psnr": None if mse == 0 else round(10 * np.log10(255.0**2 / mse), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:7860")
    ap.add_argument("--upscaler", default="ESRGAN_x4-tiny-random")
    ap.add_argument("--other", default="SwinIR_x4-tiny-random")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--scale", type=int, default=2, help="Extras upscale factor (the hires stage is x2)")
    ap.add_argument("--forge", action="store_true", help="the server is Forge (hires requests need a field)")
    a = ap.parse_args()
    results: list[dict] = []
    # Forge's API fails a hires request without this field (it defaults to None there).
    hires_extra = {"hr_additional_modules": ["Use same choices"]} if a.forge else {}

    def record(check: str, ok: bool, **data) -> None:
        results.append({"check": check, "ok": ok, **data})
        print(f"{'PASS' if ok else 'FAIL'} {check} {json.dumps(data)}", flush=True)

    before = call(a.url, "/sdapi/v1/options")
    # The options route hands integers back as floats (192.0); restored as such, the WebUI's own
    # ESRGAN path fails ("'float' object cannot be interpreted as an integer").
    saved = {
        k: int(v) if isinstance(v, float) and v.is_integer() else v
        for k, v in before.items()
        if k in (*KEYS, *UNTILED)
    }
    call(a.url, "/sdapi/v1/options", UNTILED)

    def vg(on: bool) -> None:
        call(a.url, "/sdapi/v1/options", {"vram_guard_enabled": on, "vram_guard_upscale_tiling": True,
                                          "vram_guard_upscale_tile": 32, "vram_guard_vae_tiling": "Off"})  # fmt: skip

    def extras(img: np.ndarray, upscaler: str, scale: int) -> np.ndarray:
        body = call(a.url, "/sdapi/v1/extra-single-image",
                    {"image": encode(img), "resize_mode": 0, "upscaling_resize": scale, "upscaler_1": upscaler,
                     "upscaler_2": "None", "extras_upscaler_2_visibility": 0})  # fmt: skip
        return decode(body["image"])

    def status_plans() -> list:
        st = call(a.url, "/vram-guard/v1/status")
        return [(s["stage"], s["plan"]) for s in st.get("stages", [])]

    def extras_pair(name: str, img: np.ndarray, upscaler: str, first_on: bool = True, scale: int = 0) -> None:
        order = (True, False) if first_on else (False, True)
        out: dict[bool, np.ndarray] = {}
        for on in order:
            vg(on)
            t0 = time.time()
            try:
                out[on] = extras(img, upscaler, scale or a.scale)
            except RuntimeError as exc:
                record(f"{name} ({'VRAM Guard' if on else 'WebUI'})", False, error=str(exc)[:300])
                return
            if on:
                plans = status_plans()
                secs = round(time.time() - t0, 1)
        c = compare(out[True], out[False])
        record(name, c["max_lsb"] is not None and c["max_lsb"] <= 1, **c, seconds=secs, stages=plans)

    def hires(on: bool) -> tuple[np.ndarray, list]:
        vg(on)
        body = call(a.url, "/sdapi/v1/txt2img", dict(PROMPT, width=a.size, height=a.size, enable_hr=True, hr_scale=2,
                                                     hr_upscaler=a.upscaler, hr_second_pass_steps=1,
                                                     denoising_strength=0.5, **hires_extra))  # fmt: skip
        return decode(body["images"][0]), status_plans() if on else []

    try:
        # 1. Extras as the very first job of the server (the model loads while the checkpoint does).
        extras_pair("Extras first job", test_image(a.size, 1), a.upscaler)
        # 2. Hires fix: the upscale stage (first pass -> Upscaler.upscale x2) and the final image.
        vg(False)
        first = decode(
            call(a.url, "/sdapi/v1/txt2img", dict(PROMPT, width=a.size, height=a.size))["images"][0]
        )
        extras_pair("hires upscale stage (first pass image, x2)", first, a.upscaler, scale=2)
        h_on, plans = hires(True)
        h_off, _ = hires(False)
        c = compare(h_on, h_off)
        record("hires final image (VRAM Guard upscale vs WebUI's)", True, **c, stages=plans)
        # 3. Extras after hires, hires after Extras, a model switch and back.
        extras_pair("Extras after hires", test_image(a.size + 8, 2), a.upscaler)
        h_on2, plans2 = hires(True)
        record("hires after Extras (same as before)", bool(np.array_equal(h_on2, h_on)), **compare(h_on2, h_on),
               stages=plans2)  # fmt: skip
        extras_pair("Extras model switch", test_image(a.size, 3), a.other)
        extras_pair("Extras switch back", test_image(a.size, 4), a.upscaler, first_on=False)
    finally:
        call(a.url, "/sdapi/v1/options", saved)
    print(json.dumps({"passed": sum(r["ok"] for r in results), "total": len(results)}))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
