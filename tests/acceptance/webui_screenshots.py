"""The README's pictures, taken in a real WebUI: the accordion after a hires-fix job, and the Extras
tab's VRAM Guard section after an upscale.

Against a running AUTOMATIC1111 WebUI v1.10.1 with this extension, started with ``--api`` (and, for
the pictures in docs/, ``--vram-guard-emulate-vram 3253MB --vram-guard-place-checkpoint``: a card
the SD1.5 checkpoint does not fit, so VRAM Guard places it). It

1. runs a hires-fix txt2img with VRAM Guard on (defaults) through the API,
2. opens the WebUI's page in headless Chromium (DevTools protocol, as ``tests/test_ui_browser.py``
   does), opens the txt2img accordion, lets its readout fetch the status route and takes the
   accordion (``vram_guard_accordion.png``) and its readout with the memory timeline
   (``vram_guard_timeline.png``),
3. runs an Extras x4 upscale with VRAM Guard's Extras section on (the Extras API follows the
   Settings page, so the Settings default is switched on for that request and put back), then
   opens the Extras tab's section and takes it (``vram_guard_extras.png``).

Each picture is taken only once the readout shows the job's own stages. Prints the stages it saw;
``--record FILE`` also writes the status payloads (without their HTML) and timings as JSON.

usage: webui_screenshots.py [--url URL] [--out DIR] [--upscaler NAME] [--size 128] [--steps 2]
        [--extras-size 320] [--record FILE]
Needs Debian's ``chromium`` and the ``websockets`` package (both in this project's test setup).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_ui_browser import CDP, launch_chromium, page_ws_url  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def api(url: str, path: str, payload: dict | None = None, *, timeout: float = 1800) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(
        url + path,
        data=data,
        headers={"Content-Type": "application/json"},
        method="GET" if data is None else "POST",
    )
    with OPENER.open(req, timeout=timeout) as res:
        return json.loads(res.read() or b"null")


def pick_upscaler(url: str, wanted: str | None) -> str:
    """``wanted``, or the first ESRGAN-family upscaler with a local model file (never one the WebUI
    would download)."""
    names = [(u["name"], u.get("model_path") or "") for u in api(url, "/sdapi/v1/upscalers")]
    if wanted:
        if wanted not in [n for n, _ in names]:
            raise SystemExit(
                f"--upscaler {wanted!r}: not offered by the WebUI; it has {[n for n, _ in names]}"
            )
        return wanted
    for name, path in names:
        if path.endswith((".pth", ".pt", ".safetensors")) and Path(path).exists():
            return name
    raise SystemExit(f"no upscaler with a local model file; the WebUI has {[n for n, _ in names]}")


def test_picture(size: int, seed: int) -> str:
    """An image-like input (smooth shapes and some texture) as base64 PNG."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    img = np.stack([0.5 + 0.4 * np.sin(6 * x + 2 * y), 0.5 + 0.4 * np.cos(5 * y), 0.4 + 0.3 * x * y], -1)
    img = np.clip(img + rng.normal(0, 0.03, img.shape), 0, 1)
    buf = io.BytesIO()
    Image.fromarray((img * 255).astype(np.uint8)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def stages_of(status: dict) -> list[str]:
    return [f"{s['label']}: {s.get('plan')} peak {s.get('peak_bytes')}" for s in status.get("stages", [])]


def without_html(status: dict) -> dict:
    return {k: v for k, v in status.items() if k != "html"}


ROOT_JS = "gradioApp()"
COLORS = 128
"""The pictures are saved with a palette of this many colours (a few markers' and lines' colours
among the page's greys): a third of the browser's PNG, no visible change."""


def small_png(data: bytes) -> bytes:
    """``data`` (a PNG) with a palette of :data:`COLORS` colours, no dithering, optimised."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    out = io.BytesIO()
    img.quantize(COLORS, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        out, "PNG", optimize=True
    )
    return out.getvalue()


async def shot(cdp: CDP, selector: str, path: Path, pad: int = 8) -> None:
    """A PNG of the element ``selector`` (in the WebUI's root), with ``pad`` px around it."""
    box = await cdp.js(
        f"(() => {{ const el = {ROOT_JS}.querySelector({json.dumps(selector)});"
        " el.scrollIntoView({block: 'start'}); const r = el.getBoundingClientRect();"
        " return {x: r.x + window.scrollX, y: r.y + window.scrollY, width: r.width, height: r.height}; })()"
    )
    if box["height"] < 50:
        raise SystemExit(f"{selector}: nothing to take ({box})")
    clip = {
        "x": max(0, box["x"] - pad),
        "y": max(0, box["y"] - pad),
        "width": box["width"] + 2 * pad,
        "height": box["height"] + 2 * pad,
        "scale": 1,
    }
    data = await cdp.call("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)
    path.write_bytes(small_png(base64.b64decode(data["data"])))
    print(f"wrote {path} ({int(box['width'])}x{int(box['height'])} px, {path.stat().st_size // 1024} KiB)")


async def open_section(cdp: CDP, accordion_id: str, readout_id: str, must_show: str) -> None:
    """Open an accordion (InputAccordion: opening it ticks its switch), fetch the status now and
    wait until the readout shows ``must_show`` and the memory timeline."""
    await cdp.js(
        f"(() => {{ const a = {ROOT_JS}.querySelector('#{accordion_id}');"
        " const w = a.querySelector('.label-wrap'); if (!w.classList.contains('open')) w.click(); })()"
    )
    readout = f"{ROOT_JS}.querySelector('#{readout_id} .vram-guard-readout')"
    await cdp.wait_for(f"!!{readout} && {readout}.offsetHeight > 0", timeout=60, what=f"#{readout_id} open")
    await cdp.js("vramGuardRefresh()")
    await cdp.wait_for(
        f"{readout}.innerText.includes({json.dumps(must_show)}) && !!{readout}.querySelector('svg')",
        timeout=60,
        what=f"the job in #{readout_id}",
    )
    await asyncio.sleep(1.0)  # let the layout settle after the HTML swap


async def browse(url: str, ws_url: str, out: Path, jobs: dict) -> None:
    import websockets

    async with websockets.connect(ws_url, max_size=None, open_timeout=30) as ws:
        cdp = CDP(ws)
        await cdp.call("Page.enable")
        await cdp.call("Runtime.enable")
        await cdp.call(
            "Emulation.setDeviceMetricsOverride", width=1280, height=1600, deviceScaleFactor=1, mobile=False
        )
        await cdp.call("Page.navigate", url=url)
        await cdp.wait_for(
            f"typeof gradioApp === 'function' && !!{ROOT_JS}.querySelector('#vram_guard_txt2img .label-wrap')"
            " && typeof vramGuardRefresh === 'function'",
            timeout=180,
            what="the WebUI's page with the accordion",
        )
        await asyncio.sleep(3.0)  # the WebUI's own onUiLoaded scripts (InputAccordion setup)
        await jobs["hires"](cdp)
        await open_section(cdp, "vram_guard_txt2img", "vram_guard_readout_txt2img", "Hires upscale")
        await shot(cdp, "#vram_guard_txt2img", out / "vram_guard_accordion.png")
        await shot(cdp, "#vram_guard_readout_txt2img", out / "vram_guard_timeline.png", pad=4)
        await jobs["extras"](cdp)
        await cdp.js(
            f"Array.from({ROOT_JS}.querySelectorAll('#tabs > .tab-nav > button'))"
            ".find(b => b.innerText.trim() === 'Extras').click()"
        )
        await cdp.wait_for(
            f"{ROOT_JS}.querySelector('#vram_guard_extras').offsetHeight > 0",
            timeout=30,
            what="the Extras tab",
        )
        await open_section(cdp, "vram_guard_extras", "vram_guard_readout_extras", "Upscale")
        await shot(cdp, "#vram_guard_extras", out / "vram_guard_extras.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:7860")
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    ap.add_argument(
        "--upscaler", default=None, help="hires fix and Extras upscaler (default: a local ESRGAN)"
    )
    ap.add_argument("--size", type=int, default=128, help="first-pass size of the hires-fix job (x2)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--extras-size", type=int, default=320, help="Extras input size (x4)")
    ap.add_argument("--record", type=Path, default=None, help="write what the jobs reported here (JSON)")
    args = ap.parse_args(argv)
    for name in ("size", "steps", "extras_size"):
        value = getattr(args, name)
        if not 1 <= value <= 2048:
            raise SystemExit(f"--{name.replace('_', '-')} must be in 1..2048, got {value}")
    url = args.url.rstrip("/")
    args.out.mkdir(parents=True, exist_ok=True)
    upscaler = pick_upscaler(url, args.upscaler)
    record: dict = {"url": url, "upscaler": upscaler}

    async def hires(_cdp: CDP) -> None:
        payload = {
            "prompt": "a lighthouse on a cliff at dusk",
            "seed": 1234,
            "steps": args.steps,
            "width": args.size,
            "height": args.size,
            "enable_hr": True,
            "hr_scale": 2,
            "hr_upscaler": upscaler,
            "hr_second_pass_steps": args.steps,
            "denoising_strength": 0.5,
            "alwayson_scripts": {"VRAM Guard": {"args": [{}]}},
        }
        t0 = time.time()
        res = await asyncio.to_thread(api, url, "/sdapi/v1/txt2img", payload)
        info = json.loads(res.get("info") or "{}")
        status = await asyncio.to_thread(api, url, "/vram-guard/v1/status")
        print(f"hires fix: {time.time() - t0:.0f} s; {info.get('infotexts', [''])[0].splitlines()[-1]}")
        print("  " + "\n  ".join(stages_of(status)))
        if "VRAM Guard error" in json.dumps(info) or not status.get("stages"):
            raise SystemExit(f"the hires-fix job did not run through VRAM Guard: {info}")
        record["hires"] = {"seconds": time.time() - t0, "status": without_html(status)}

    async def extras(_cdp: CDP) -> None:
        opts = await asyncio.to_thread(api, url, "/sdapi/v1/options")
        before = opts.get("vram_guard_enabled", False)
        await asyncio.to_thread(api, url, "/sdapi/v1/options", {"vram_guard_enabled": True})
        try:
            t0 = time.time()
            await asyncio.to_thread(
                api,
                url,
                "/sdapi/v1/extra-single-image",
                {
                    # a new picture every run: the Extras tab caches results by input image
                    "image": test_picture(args.extras_size, seed=int(time.time())),
                    "resize_mode": 0,
                    "upscaling_resize": 4,
                    "upscaler_1": upscaler,
                },
            )
        finally:
            await asyncio.to_thread(api, url, "/sdapi/v1/options", {"vram_guard_enabled": before})
        status = await asyncio.to_thread(api, url, "/vram-guard/v1/status")
        print(f"extras: {time.time() - t0:.0f} s")
        print("  " + "\n  ".join(stages_of(status)))
        if not any(s["stage"] == "upscale" for s in status.get("stages", [])):
            raise SystemExit("the Extras upscale did not run through VRAM Guard")
        record["extras"] = {"seconds": time.time() - t0, "status": without_html(status)}

    with tempfile.TemporaryDirectory() as tmp:
        proc, port = launch_chromium(Path(tmp) / "profile")
        try:
            asyncio.run(browse(url, page_ws_url(port), args.out, {"hires": hires, "extras": extras}))
        finally:
            proc.kill()
            proc.wait(timeout=30)
    if args.record is not None:
        args.record.write_text(json.dumps(record, indent=1, default=str))
        print(f"wrote {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
