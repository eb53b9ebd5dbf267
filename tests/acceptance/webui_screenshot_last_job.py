"""A picture of the real WebUI's txt2img accordion and memory timeline after the last job (e.g. a
streamed-UNet job of the acceptance run, docs/webui-acceptance.md), taken without running a job.

Against a running AUTOMATIC1111 WebUI v1.10.1 with this extension (``--api``): opens the page in
headless Chromium (DevTools protocol, the helpers of ``tests/test_ui_browser.py``), opens the
txt2img accordion, refreshes its readout from the status route, waits until the readout shows
``--must-show`` (a word of the last job's stages) and the timeline, and saves the accordion as PNG.

usage: webui_screenshot_last_job.py --url URL --out FILE.png [--must-show "Hires sampling"]
Needs Debian's ``chromium`` and the ``websockets`` package (both in this project's test setup).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_ui_browser import CDP, launch_chromium, page_ws_url  # noqa: E402
from webui_screenshots import small_png  # noqa: E402

ROOT_JS = "gradioApp()"


async def take(url: str, ws_url: str, out: Path, must_show: str) -> None:
    import websockets

    async with websockets.connect(ws_url, max_size=None, open_timeout=30) as ws:
        cdp = CDP(ws)
        await cdp.call("Page.enable")
        await cdp.call("Runtime.enable")
        await cdp.call(
            "Emulation.setDeviceMetricsOverride", width=1280, height=1800, deviceScaleFactor=1, mobile=False
        )
        await cdp.call("Page.navigate", url=url)
        await cdp.wait_for(
            f"typeof gradioApp === 'function' && !!{ROOT_JS}.querySelector('#vram_guard_txt2img .label-wrap')"
            " && typeof vramGuardRefresh === 'function'",
            timeout=180,
            what="the WebUI's page with the accordion",
        )
        await asyncio.sleep(3.0)  # the WebUI's own onUiLoaded scripts
        await cdp.js(
            f"(() => {{ const a = {ROOT_JS}.querySelector('#vram_guard_txt2img');"
            " const w = a.querySelector('.label-wrap'); if (!w.classList.contains('open')) w.click(); })()"
        )
        readout = f"{ROOT_JS}.querySelector('#vram_guard_readout_txt2img .vram-guard-readout')"
        await cdp.wait_for(f"!!{readout} && {readout}.offsetHeight > 0", timeout=60, what="the readout")
        await cdp.js("vramGuardRefresh()")
        await cdp.wait_for(
            f"{readout}.innerText.includes({json.dumps(must_show)}) && !!{readout}.querySelector('svg')",
            timeout=60,
            what="the last job in the readout",
        )
        await asyncio.sleep(1.0)
        box = await cdp.js(
            f"(() => {{ const el = {ROOT_JS}.querySelector('#vram_guard_txt2img');"
            " el.scrollIntoView({block: 'start'}); const r = el.getBoundingClientRect();"
            " return {x: r.x + window.scrollX, y: r.y + window.scrollY, width: r.width, height: r.height}; })()"
        )
        clip = {"x": max(0, box["x"] - 8), "y": max(0, box["y"] - 8), "width": box["width"] + 16,
                "height": box["height"] + 16, "scale": 1}  # fmt: skip
        data = await cdp.call("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)
        out.write_bytes(small_png(base64.b64decode(data["data"])))
        print(f"wrote {out} ({int(box['width'])}x{int(box['height'])} px)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:7860")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--must-show", default="Hires sampling")
    a = ap.parse_args()
    # chromium may still write its profile for a moment after it was told to end
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        proc, port = launch_chromium(Path(tmp))
        try:
            asyncio.run(take(a.url, page_ws_url(port), a.out, a.must_show))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
