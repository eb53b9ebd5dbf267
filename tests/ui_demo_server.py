"""A tiny stand-alone page serving the VRAM Guard accordion plus a fake status route.

Used by the browser test; also handy to look at the accordion without a WebUI:
``python tests/ui_demo_server.py`` then open the printed URL.

The page is gradio 3.41 Blocks built with :func:`lib_vram.webui.ui.build_ui`, with
``javascript/vram_guard.js`` and ``style.css`` injected the way the WebUI adds an extension's
front-end files. The status route serves :func:`lib_vram.core.readout.status_payload` of a
:class:`DemoState` the test changes (job running, stage records), and counts requests.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, Response  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lib_vram.core.device import MemoryInfo  # noqa: E402
from lib_vram.core.readout import UI_STATUS_ROUTE, render_readout_html, status_payload  # noqa: E402
from lib_vram.core.timeline import Timeline  # noqa: E402
from lib_vram.webui.options import VRAMGuardOptions  # noqa: E402
from lib_vram.webui.ui import build_ui  # noqa: E402

GiB = 1024**3


def demo_memory(used_gib: float = 2.0) -> MemoryInfo:
    """A simulated 6 GB card (the page is a demo; the numbers are not measured)."""
    total = 6 * GiB
    used = int(used_gib * GiB)
    return MemoryInfo(
        device="cuda:0",
        backend="cuda",
        total=total,
        free=total - used,
        allocated=used,
        reserved=used,
        peak_allocated=used,
        peak_reserved=used,
        process_rss=3 * GiB,
        system_total=32 * GiB,
        system_available=24 * GiB,
    )


DEMO_JOB: tuple[tuple[str, float, int, float, float, str | None], ...] = (
    # stage, seconds, samples, base GiB, swing GiB, plan (a simulated hires job on a 6 GB card)
    ("sampling", 6.2, 20, 2.1, 1.5, "sdp"),
    ("hires_upscale", 3.1, 24, 2.0, 0.4, "tiled t192 o16 f8 b4 float16 acc=cuda"),
    ("hires_encode", 1.4, 12, 2.0, 1.0, "exact t64 x4"),
    ("vae_decode", 2.9, 40, 2.1, 1.2, "exact t64"),
    ("postprocess", 0.2, 2, 2.0, 0.1, None),
)


def demo_timeline(until: float | None = None) -> dict:
    """The memory timeline of :data:`DEMO_JOB` (simulated numbers, fixed: a demo, not a
    measurement) as the status route returns it, cut at ``until`` seconds while it "runs"."""
    import math

    clock = [0.0]
    tl = Timeline(total_bytes=6 * GiB, measure="allocated", clock=lambda: clock[0])
    tl.add(int(1.9 * GiB), int(2.2 * GiB), "start")
    for k, (stage, secs, n, base, swing, plan) in enumerate(DEMO_JOB):
        if until is not None and clock[0] >= until:
            return tl.to_dict()
        tl.begin(stage)
        tl.add(int(base * GiB), int((base + 0.3) * GiB), "stage")
        peak = 0
        for i in range(n):
            clock[0] += secs / n
            if until is not None and clock[0] > until:
                return tl.to_dict()
            used = int((base + swing * (0.5 - 0.5 * math.cos(2 * math.pi * (i + 1) / max(2, n / 3)))) * GiB)
            peak = max(peak, used)
            tl.add(used, used + int(0.4 * GiB), "tile" if k else "step")
            if stage == "hires_upscale" and i == n // 2:
                tl.event("oom", "upscale: out of memory: batch -> 2")
        tl.end(stage, plan=plan, peak_bytes=peak)
        if stage == "sampling":
            tl.event(
                "release", "released memory at post sample: 620 MiB of cache returned", freed_bytes=650 << 20
            )
            tl.add(int(1.9 * GiB), int(2.0 * GiB), "release")
    tl.finish()
    return tl.to_dict()


@dataclass
class DemoState:
    job_running: bool = False
    records: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timeline: dict | None = None
    used_gib: float = 2.0
    hits: int = 0
    frees: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def payload(self) -> dict:
        with self.lock:
            return status_payload(
                demo_memory(self.used_gib),
                list(self.records),
                job_running=self.job_running,
                notes=list(self.notes),
                device_name="Demo GPU 6GB",
                timeline=self.timeline,
            )

    def update(self, **changes) -> None:
        with self.lock:
            for key, value in changes.items():
                setattr(self, key, value)


def build_app(state: DemoState) -> FastAPI:
    js = (ROOT / "javascript" / "vram_guard.js").read_text()
    css = (ROOT / "style.css").read_text()

    def on_free() -> str:
        state.frees += 1
        state.update(used_gib=1.2, notes=["Free memory now: released 0.80 GiB"])
        return render_readout_html(state.payload(), tab="txt2img")

    with gr.Blocks(title="VRAM Guard demo", analytics_enabled=False) as demo:
        gr.Textbox(label="Prompt", value="a lighthouse at dusk", lines=2)
        # txt2img's two columns: the settings (and the accordion) left, the gallery right
        with gr.Row():
            with gr.Column(scale=1):
                gr.Slider(label="Sampling steps", minimum=1, maximum=150, value=20, step=1)
                build_ui(
                    tab="txt2img", defaults=VRAMGuardOptions(enabled=True, preset="6GB"), on_free=on_free
                )
            with gr.Column(scale=1):
                gr.HTML('<div style="min-height: 24em">(the gallery)</div>')

    app = FastAPI()

    @app.get(UI_STATUS_ROUTE)
    def status() -> JSONResponse:
        state.hits += 1
        return JSONResponse(state.payload(), headers={"Cache-Control": "no-store"})

    @app.get("/vram_guard_assets/vram_guard.js")
    def script() -> Response:
        return Response(js, media_type="text/javascript")

    @app.get("/vram_guard_assets/style.css")
    def style() -> Response:
        return Response(css, media_type="text/css")

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status_code=204)

    # the WebUI's hints.js: a global label -> hover text map its front end applies to new elements
    head = b'<script>var titles = {"Sampling steps": "How many times to improve the image"};</script>'
    head += b'<script src="./vram_guard_assets/vram_guard.js"></script>'
    head += b'<link rel="stylesheet" href="./vram_guard_assets/style.css">'

    @app.middleware("http")
    async def inject_assets(request: Request, call_next):
        # The WebUI adds extension scripts and style.css to its page; do the same here.
        response = await call_next(request)
        if request.url.path == "/" and response.headers.get("content-type", "").startswith("text/html"):
            body = b"".join([chunk async for chunk in response.body_iterator])
            body = body.replace(b"</head>", head + b"</head>", 1)
            headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
            return Response(body, status_code=response.status_code, headers=headers, media_type="text/html")
        return response

    return gr.mount_gradio_app(app, demo, path="/")


class DemoServer:
    """Runs :func:`build_app` with uvicorn in a background thread on a free localhost port."""

    def __init__(self, state: DemoState | None = None) -> None:
        self.state = state or DemoState()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(build_app(self.state), log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def __enter__(self) -> DemoServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("demo server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


if __name__ == "__main__":
    with DemoServer() as srv:
        print(f"VRAM Guard demo page: {srv.url}  (Ctrl+C to stop)")
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
