"""The accordion in a real browser: headless Chromium, DevTools protocol, live readout updates.

Serves the accordion (gradio 3.41 Blocks + javascript/vram_guard.js + style.css) with a fake
status route (tests/ui_demo_server.py), then checks in Chromium that the JS fills the readout from
the route, polls while a job runs, fetches once after it ends, stays quiet when idle, sets the
tooltips, shows the memory timeline's SVG and lets it grow while the job runs, and that "Free
memory now" goes through gradio to the server and back. Takes screenshots into the test's temporary
folder (the pictures in docs/ come from the real WebUI: tests/acceptance/webui_screenshots.py).

Needs Debian's ``chromium`` (``apt-get install -y chromium``); skipped only when it is absent.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
GiB = 1024**3
ENCODE_WORDS = "4 tiles of 512 px, exact mode"
"""The demo hires encode's plan (``exact t64 x4``) as the readout says it."""

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None, reason="Chromium not installed (apt-get update && apt-get install -y chromium)"
    ),
]


class CDP:
    """A minimal Chrome DevTools Protocol client over one page's websocket."""

    def __init__(self, ws):
        self.ws = ws
        self.ids = itertools.count(1)

    async def call(self, method: str, **params):
        msg_id = next(self.ids)
        await self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(await asyncio.wait_for(self.ws.recv(), timeout=60))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def js(self, expression: str):
        res = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in res:
            raise RuntimeError(f"JS error in {expression!r}: {res['exceptionDetails']}")
        return res["result"].get("value")

    async def wait_for(self, expression: str, *, timeout: float = 30.0, what: str = ""):
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = await self.js(expression)
            if value:
                return value
            await asyncio.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what or expression}; last value {value!r}")


def launch_chromium(user_dir: Path) -> tuple[subprocess.Popen, int]:
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-quic",
        "--disable-dev-shm-usage",
        f"--user-data-dir={user_dir}",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0",
        "--remote-allow-origins=*",
        "--window-size=1280,1000",
        "about:blank",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port_file = user_dir / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip():
            return proc, int(port_file.read_text().split()[0])
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("chromium did not open its DevTools port")


def page_ws_url(port: int) -> str:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        targets = json.loads(opener.open(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        pages = [t for t in targets if t.get("type") == "page"]
        if pages:
            return pages[0]["webSocketDebuggerUrl"]
        time.sleep(0.2)
    raise RuntimeError("no page target in chromium")


READOUT = "document.querySelector('#vram_guard_readout_txt2img .vram-guard-readout')"


def readout_text() -> str:
    return f"({READOUT} ? {READOUT}.innerText : '')"


TIMELINE_POINTS = (
    f"(() => {{ const p = {READOUT} &&"
    f" {READOUT}.querySelector('svg.vram-guard-timeline polyline.vram-guard-tl-used');"
    " return p ? p.getAttribute('points').trim().split(' ').length : 0; })()"
)
"""How many points the readout's memory line has (0 without a plot)."""


LAYOUT = """(() => {
  const acc = document.querySelector('#vram_guard_txt2img');
  const adv = document.querySelector('#vram_guard_txt2img_advanced');
  const box = (el) => {
    const r = el.getBoundingClientRect();
    return {top: r.top, bottom: r.bottom, h: r.height};
  };
  const controls = {};
  for (const name of NAMES) {
    const el = document.querySelector('#vram_guard_txt2img_' + name);
    const label = el && el.querySelector('label > span, [data-testid="block-info"]');
    const cs = label ? getComputedStyle(label) : null;
    const lh = cs ? parseFloat(cs.lineHeight) || parseFloat(cs.fontSize) * 1.25 : 1;
    // any text of more than a few words in the control besides its label: a paragraph under it
    const texts = el ? Array.from(el.querySelectorAll('*')).filter((n) => n !== label && Array.from(
      n.childNodes).some((t) => t.nodeType === Node.TEXT_NODE && t.textContent.trim().length > 25)) : [];
    controls[name] = {
      visible: !!el && el.offsetParent !== null,
      text: label ? label.textContent.trim() : null,
      lines: label ? Math.round(label.getBoundingClientRect().height / lh) : 0,
      title: el ? el.title : null,
      paragraphs: texts.map((n) => n.textContent.trim()),
    };
  }
  const head = adv && adv.querySelector(':scope > .label-wrap');
  const accHead = acc.querySelector(':scope > .label-wrap');
  return {controls, advanced: adv ? box(adv) : null, advancedTitle: head ? head.title : null,
          accordionTitle: accHead ? accHead.title : null,
          advancedOpen: adv ? adv.querySelector(':scope > .label-wrap').classList.contains('open') : null,
          readout: box(document.querySelector('#vram_guard_readout_txt2img')),
          accordion: box(acc), viewport: window.innerHeight};
})()"""


async def check_layout_and_hints(cdp: CDP) -> None:
    """Short one-line labels, each control's explanation as its hover hint (``title``), no paragraph
    under a control, the common controls and the readout first, the rest folded under Advanced."""
    from lib_vram.webui import ui
    from lib_vram.webui.options import API_ARG_ORDER, FIELDS_BY_NAME

    names = [n for n in API_ARG_ORDER if n != "enabled"]
    common = [n for row in ui.COMMON for n in row]
    # the hints arrive with the readout's first HTML (the JS sets them within a second)
    await cdp.wait_for(
        "document.querySelector('#vram_guard_txt2img_preset').title.length > 0", what="the hover hints"
    )
    got = await cdp.js(LAYOUT.replace("NAMES", json.dumps(names)))
    for name in common:
        c = got["controls"][name]
        f = FIELDS_BY_NAME[name]
        assert c["visible"] and c["text"] == f.label and c["lines"] == 1, (name, c)
        assert c["title"] == f.tooltip and c["paragraphs"] == [], (name, c)
    for name in names:
        c = got["controls"][name]
        assert c["title"] == FIELDS_BY_NAME[name].tooltip, (name, c)  # hints are there when folded too
        if name not in common:
            assert not c["visible"], (name, "should be folded under Advanced")
    assert got["advancedOpen"] is False and got["advancedTitle"] == ui.ADVANCED_TOOLTIP
    assert got["accordionTitle"] == FIELDS_BY_NAME["enabled"].tooltip  # on its header, not over all
    # inside the WebUI the labels' hints also go to hints.js's titles[] (the page's label -> hint map),
    # never a label that is not ours alone
    titles = await cdp.js("titles")
    assert titles["Memory preset"] == FIELDS_BY_NAME["preset"].tooltip and "Sampling steps" in titles
    assert "Advanced" not in titles and "" not in titles
    assert got["readout"]["bottom"] <= got["advanced"]["top"], got  # the readout above the folded group
    # ... right under the common controls: in view without scrolling past the settings
    assert got["readout"]["top"] - got["accordion"]["top"] < 320, got
    assert got["advanced"]["h"] < 60, got  # folded: its header only

    # Opened, the folded controls show their short labels on one line too.
    await cdp.js("document.querySelector('#vram_guard_txt2img_advanced > .label-wrap').click()")
    await cdp.wait_for(
        "document.querySelector('#vram_guard_txt2img_vae_tile').offsetParent !== null", what="Advanced opens"
    )
    got = await cdp.js(LAYOUT.replace("NAMES", json.dumps(names)))
    for name in names:
        c = got["controls"][name]
        f = FIELDS_BY_NAME[name]
        assert c["visible"] and c["text"] == f.label and c["lines"] == 1, (name, c)
        assert c["paragraphs"] == [], (name, c)
    await cdp.js("document.querySelector('#vram_guard_txt2img_advanced > .label-wrap').click()")
    await cdp.wait_for(
        "document.querySelector('#vram_guard_txt2img_vae_tile').offsetParent === null", what="Advanced folds"
    )


async def scenario(url: str, ws_url: str, server, shot: Path, timeline_shot: Path) -> None:
    import websockets
    from ui_demo_server import demo_timeline

    state = server.state
    async with websockets.connect(ws_url, max_size=None, open_timeout=30) as ws:
        cdp = CDP(ws)
        await cdp.call("Page.enable")
        await cdp.call("Runtime.enable")
        # A page taller than the accordion, so screenshots need no capture beyond the viewport (which
        # re-lays the page out while it shoots: the clip measured before it no longer fits).
        await cdp.call(
            "Emulation.setDeviceMetricsOverride", width=1280, height=2000, deviceScaleFactor=1, mobile=False
        )
        await cdp.call("Page.navigate", url=url)
        await cdp.wait_for(f"!!{READOUT}", timeout=90, what="the accordion's readout")
        # The JS's first fetch replaces the placeholder with the route's payload.
        await cdp.wait_for(f"{readout_text()}.includes('Demo GPU 6GB')", what="first status fetch")
        assert await cdp.js("typeof vramGuardTick === 'function' && typeof vramGuardState === 'object'")
        assert "idle" in await cdp.js(readout_text())
        await check_layout_and_hints(cdp)

        assert await cdp.js(f"{READOUT}.querySelectorAll('svg').length") == 0  # no job yet: no plot

        # A job starts: the readout follows the route about once a second, the timeline grows.
        hits0 = state.hits
        state.update(
            job_running=True,
            used_gib=4.1,
            records=[{"name": "sampling", "peak_bytes": int(3.6 * GiB), "seconds": 6.2, "plan": "sdp"}],
            timeline=demo_timeline(until=4.0),
        )
        await cdp.wait_for(
            f"{readout_text()}.includes('job running') && {readout_text()}.includes('3.60 GiB')",
            timeout=20,
            what="running job in the readout",
        )
        first = await cdp.wait_for(TIMELINE_POINTS, timeout=20, what="the timeline's plot")
        state.update(
            records=[
                *state.records,
                {
                    "name": "hires_upscale",
                    "peak_bytes": int(2.4 * GiB),
                    "seconds": 3.1,
                    "plan": "tiled t192 o16 f8 b4 float16 acc=cuda",
                },
            ],
            timeline=demo_timeline(until=9.0),
        )
        upscale_words = "tiles of 192 px, 4 at a time, FP16"  # (its plan in words)
        await cdp.wait_for(f"{readout_text()}.includes('{upscale_words}')", timeout=20, what="second poll")
        grown = await cdp.wait_for(f"{TIMELINE_POINTS} > {first} && {TIMELINE_POINTS}", what="timeline grows")
        assert grown > first
        assert state.hits - hits0 >= 2

        # The job ends: one more fetch brings the final stages and the idle state.
        state.update(
            job_running=False,
            used_gib=2.3,
            records=[
                *state.records,
                {
                    "name": "hires_encode",
                    "peak_bytes": int(3.0 * GiB),
                    "seconds": 1.4,
                    "plan": "exact t64 x4",
                },
                {"name": "vae_decode", "peak_bytes": int(3.3 * GiB), "seconds": 2.9, "plan": "exact t64"},
                {"name": "postprocess", "peak_bytes": int(2.1 * GiB), "seconds": 0.2, "plan": None},
            ],
            timeline=demo_timeline(),
        )
        await cdp.wait_for(
            f"{readout_text()}.includes('{ENCODE_WORDS}') && {readout_text()}.includes('idle')",
            timeout=20,
            what="final fetch after the job",
        )
        # Idle: no polling every second (only a slow refresh while the readout is visible).
        idle0 = state.hits
        await asyncio.sleep(3.0)
        assert state.hits - idle0 <= 1, f"{state.hits - idle0} fetches in 3 s while idle"

        text = await cdp.js(readout_text())
        for label in ("Sampling", "Hires upscale", "Hires encode", "Decode", "Postprocess"):
            assert label in text, label

        # The finished job's plot: every stage band labelled or titled, the card's total, the peak,
        # the events, hover values; the browser parsed it as SVG (it has a bounding box).
        plot = await cdp.js(
            f"(() => {{ const s = {READOUT}.querySelector('svg.vram-guard-timeline');"
            " const r = s.getBoundingClientRect();"
            " return {ns: s.namespaceURI, w: r.width, h: r.height,"
            " text: Array.from(s.querySelectorAll('text')).map(t => t.textContent).join('|'),"
            " titles: Array.from(s.querySelectorAll('title')).map(t => t.textContent),"
            " events: s.querySelectorAll('.vram-guard-tl-event').length,"
            " legend: s.parentElement.querySelector('.vram-guard-tl-legend').textContent,"
            " state: s.parentElement.getAttribute('data-state')}; })()"
        )
        assert plot["ns"] == "http://www.w3.org/2000/svg" and plot["w"] > 300 and plot["h"] > 80, plot
        assert plot["state"] == "done" and plot["events"] == 2
        for label in ("total 6.00 GiB", "peak 3.60 GiB"):
            assert label in plot["text"], (label, plot["text"])
        # each stage named: on its band where it is wide enough, else by its number in the legend
        for label in ("Sampling", "Hires upscale", "Hires encode", "Decode", "Postprocess"):
            assert label in plot["text"] or label in plot["legend"], (label, plot["text"], plot["legend"])
        assert any(t.startswith("Hires encode:") and ENCODE_WORDS in t for t in plot["titles"])
        assert any("out of memory" in t for t in plot["titles"])
        assert sum("allocated" in t for t in plot["titles"]) >= 20

        # Screenshots: the readout with the plot, then the accordion.
        box = await cdp.js(
            f"(() => {{ const r = {READOUT}.getBoundingClientRect();"
            " return {x: r.x, y: r.y + window.scrollY, width: r.width, height: r.height}; })()"
        )
        plot_shot = await cdp.call(
            "Page.captureScreenshot",
            format="png",
            clip={"x": box["x"], "y": box["y"], "width": box["width"], "height": box["height"], "scale": 1},
        )
        timeline_shot.write_bytes(base64.b64decode(plot_shot["data"]))
        rect = await cdp.js(
            "(() => { const r = document.querySelector('#vram_guard_txt2img').getBoundingClientRect();"
            " return {x: r.x, y: r.y + window.scrollY, width: r.width, height: r.height}; })()"
        )
        assert rect["height"] > 200, rect
        assert rect["y"] + rect["height"] <= await cdp.js("window.innerHeight"), rect
        # the accordion's own element, nothing around it
        shot_data = await cdp.call("Page.captureScreenshot", format="png", clip={**rect, "scale": 1})
        shot.write_bytes(base64.b64decode(shot_data["data"]))

        # "Free memory now": gradio calls the server's callback, whose HTML lands in the readout.
        await cdp.js("document.querySelector('#vram_guard_txt2img_free').click()")
        await cdp.wait_for(f"{readout_text()}.includes('released 0.80 GiB')", timeout=30, what="free button")
        assert state.frees == 1


def test_accordion_renders_and_readout_follows_the_status_route(tmp_path):
    from ui_demo_server import DemoServer

    shot = tmp_path / "vram_guard_accordion.png"
    timeline_shot = tmp_path / "vram_guard_timeline.png"
    with DemoServer() as server:
        proc, port = launch_chromium(tmp_path / "profile")
        try:
            ws_url = page_ws_url(port)
            asyncio.run(scenario(server.url, ws_url, server, shot, timeline_shot))
        finally:
            proc.kill()
            proc.wait(timeout=30)
    for path in (shot, timeline_shot):
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
