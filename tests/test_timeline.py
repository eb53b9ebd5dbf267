"""The memory timeline (lib_vram.core.timeline): bounded samples that keep the peak, bands, events, the
SVG (valid XML), the status route's ``timeline`` key, and its content for jobs on the real engines
(ldm VAE modules, a spandrel ESRGAN file) — also under an emulated card with a caused OOM."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import make_imagelike_rrdb, rrdb_class
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image
from vae_models import ldm_decoder
from webui_fakes import FakeHost, FakeP, fake_sd_model

from lib_vram.core import emulate
from lib_vram.core import readout as R
from lib_vram.core.timeline import Timeline, render_svg
from lib_vram.core.tracker import StageTracker
from lib_vram.planning import planner
from lib_vram.webui import ScriptJobs, Session, mount_routes
from lib_vram.webui.integration import STATUS_ROUTE
from lib_vram.webui.options import VRAMGuardOptions

GiB = 2**30
SVG = "{http://www.w3.org/2000/svg}"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def svg_of(data: dict) -> ET.Element:
    svg = render_svg(data, label=R.stage_label)
    assert svg
    return ET.fromstring(svg)  # valid XML, or this raises


def titles(root: ET.Element) -> list[str]:
    return [t.text or "" for t in root.iter(f"{SVG}title")]


# -- bounded, peaks kept ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [7, 399, 400, 401, 5_000, 100_000])
def test_points_stay_bounded_and_keep_the_peak(n):
    clock = Clock()
    tl = Timeline(total_bytes=8 * GiB, max_points=64, clock=clock)
    spike = (n * 7) // 11
    for i in range(n):
        clock.t = i * 0.01
        used = 5 * GiB if i == spike else GiB + (i % 97) * 2**20
        tl.add(used, used + 2**20, "tile")
    d = tl.to_dict()
    pts = d["points"]
    assert len(pts["t"]) == len(pts["used"]) == len(pts["reserved"]) <= 64
    assert max(pts["used"]) == 5 * GiB  # the spike survives any amount of decimation
    assert d["peak"]["bytes"] == 5 * GiB and d["peak"]["t"] == pytest.approx(spike * 0.01)
    assert pts["t"][pts["used"].index(5 * GiB)] == pytest.approx(spike * 0.01)
    assert pts["t"] == sorted(pts["t"])
    assert d["samples"] == {"tile": n}
    assert d["stride"] & (d["stride"] - 1) == 0  # a power of two
    assert d["stride"] * 64 >= n / 2
    # each point is the highest of the samples it stands for: never above the true maximum of
    # its neighbourhood, never below it
    assert all(GiB <= u <= 5 * GiB for u in pts["used"])


def test_status_payload_size_is_bounded_for_a_long_job():
    clock = Clock()
    tl = Timeline(total_bytes=8 * GiB, clock=clock)
    for k in range(200):  # more bands and events than the caps, the longest texts
        tl.begin(f"hires_sampling_{k}")
        for i in range(500):
            clock.t += 0.0123457
            tl.add(23 * GiB + i * 1234567, 24 * GiB - 1 + i, "step")
        tl.event("oom", "x" * 1000, at="postprocess_batch", freed_bytes=2**34)
        tl.end(f"hires_sampling_{k}", plan="p" * 500, ok=False, error="e" * 1000, peak_bytes=2**35)
    d = tl.to_dict()
    assert len(d["bands"]) == tl.max_bands and d["dropped"]["bands"] == 200 - tl.max_bands
    assert len(d["events"]) == tl.max_events and d["dropped"]["events"] == 200 - tl.max_events
    assert len(d["points"]["t"]) <= tl.max_points
    payload = R.status_payload(_gpu(), [], job_running=True, timeline=d)
    body = json.dumps(payload)
    # the bound docs/webui.md states (worst case: every cap reached, every text at its cap)
    assert len(json.dumps(payload["timeline"])) < 48_000, len(json.dumps(payload["timeline"]))
    assert len(payload["html"]) < 72_000, len(payload["html"])
    assert len(body) < 128_000
    assert "later stages not drawn" in payload["html"]


def _gpu():
    from lib_vram.core.device import MemoryInfo

    return MemoryInfo(
        device="cuda:0",
        backend="cuda",
        total=8 * GiB,
        free=3 * GiB,
        allocated=4 * GiB,
        reserved=5 * GiB,
        peak_allocated=6 * GiB,
        peak_reserved=6 * GiB,
        process_rss=2 * GiB,
        system_total=32 * GiB,
        system_available=20 * GiB,
    )


def test_invalid_bounds_are_refused_in_one_line():
    with pytest.raises(ValueError, match="max_points"):
        Timeline(max_points=2)
    with pytest.raises(ValueError, match="max_bands"):
        Timeline(max_bands=0)


# -- the SVG ---------------------------------------------------------------------------------------
def _known_job() -> dict:
    clock = Clock()
    tl = Timeline(total_bytes=6 * GiB, measure="allocated", clock=clock)
    for stage, n, base, plan in (("sampling", 20, 2.0, "sdp"), ("vae_decode", 30, 2.5, "exact t64")):
        tl.begin(stage)
        for i in range(n):
            clock.t += 0.1
            tl.add(int((base + 0.1 * (i % 5)) * GiB), int((base + 0.6) * GiB), "step")
        if stage == "vae_decode":
            tl.event("oom", "decoder: out of memory at tile 96: released, retrying at tile 64")
        tl.end(stage, plan=plan, peak_bytes=int((base + 0.5) * GiB))
        tl.event("release", "released memory at post sample: 512 MiB of cache returned", freed_bytes=2**29)
    tl.finish()
    return tl.to_dict()


def test_svg_is_valid_xml_with_labelled_bands_total_peak_events_and_hover_values():
    d = _known_job()
    root = svg_of(d)
    assert root.tag == f"{SVG}svg" and root.get("viewBox")
    text = " ".join("".join(t.itertext()) for t in root.iter(f"{SVG}text"))
    assert "1 Sampling" in text and "2 Decode" in text  # bands numbered, named by the readout's names
    assert "total 6.00 GiB" in text  # the card's total line
    assert "peak 2.90 GiB" in text
    tips = titles(root)
    assert any(t.startswith("Decode:") and "plan: exact t64" in t for t in tips)
    assert any("out of memory" in t and "tile 96" in t for t in tips)
    assert any("released memory" in t for t in tips)
    hover = [t for t in tips if "allocated" in t and "reserved" in t]
    assert 10 <= len(hover) <= 64  # values on hover, per column
    classes = {e.get("class") for e in root.iter()}
    assert {"vram-guard-tl-used", "vram-guard-tl-reserved", "vram-guard-tl-peak"} <= classes
    lines = [
        e for e in root.iter(f"{SVG}line") if e.get("stroke") == "#dc2626" and e.get("y1") == e.get("y2")
    ]
    assert lines, "no total line"


def _near_the_top_job() -> dict:
    """The README's hires job on an emulated 4.15 GiB card: the checkpoint keeps 3.97 GiB resident,
    so every sample lies between 3.97 and 4.10 GiB."""
    clock = Clock()
    total = int(4.15 * GiB)
    tl = Timeline(total_bytes=total, measure="emulated", clock=clock)
    for stage, n in (("sampling", 30), ("vae_decode", 20)):
        tl.begin(stage)
        for i in range(n):
            clock.t += 0.5
            tl.add(int((3.97 + 0.13 * (i % 6) / 5) * GiB), None, "step")
        tl.end(stage, peak_bytes=int(4.10 * GiB))
    tl.finish()
    return tl.to_dict()


def _y_scale(root: ET.Element) -> tuple[list[float], Callable[[float], float]]:
    """The y axis's labelled values (GiB, top to bottom) and the value (GiB) at a height y, read
    from where the labels are drawn (each is 3 px below its grid line)."""
    ticks = []
    for t in root.iter(f"{SVG}text"):
        text = t.text or ""
        if text.endswith(" GiB") and t.get("text-anchor") == "end" and float(t.get("x")) < 50:
            ticks.append((float(text.split()[0]), float(t.get("y")) - 3))
    ticks.sort(key=lambda v: v[1])
    assert len(ticks) >= 3, ticks
    (v0, y0), (v1, y1) = ticks[0], ticks[-1]
    return [v for v, _ in ticks], lambda y: v0 + (v1 - v0) * (y - y0) / (y1 - y0)


def test_y_axis_spans_the_range_used_and_the_total_is_a_labelled_line_near_the_top():
    """A job near the top of the card: the axis starts near its lowest sample, not at 0, so the line
    spreads over the plot instead of lying flat along the top; the card's total is a labelled red
    line above it, inside the plot."""
    from lib_vram.core import timeline as T

    d = _near_the_top_job()
    root = svg_of(d)
    values, value_at = _y_scale(root)
    assert values == sorted(values, reverse=True)
    plot_top, plot_bottom = T._PAD_T, T.H - T._PAD_B
    assert 3.8 <= value_at(plot_bottom) <= 3.97 and 4.15 < value_at(plot_top) <= 4.3
    (used,) = [e for e in root.iter(f"{SVG}polyline") if e.get("class") == "vram-guard-tl-used"]
    ys = [float(xy.split(",")[1]) for xy in used.get("points").split()]
    # the job's 0.13 GiB of movement takes more than half the plot's height
    assert max(ys) - min(ys) > 0.5 * (plot_bottom - plot_top), (min(ys), max(ys))
    assert abs(value_at(max(ys)) - 3.97) < 0.005 and abs(value_at(min(ys)) - 4.10) < 0.005
    (total,) = [g for g in root.iter(f"{SVG}g") if g.get("class") == "vram-guard-tl-total"]
    (line,) = total.iter(f"{SVG}line")
    (label,) = total.iter(f"{SVG}text")
    yt = float(line.get("y1"))
    assert line.get("y2") == line.get("y1") and line.get("stroke") == "#dc2626"
    assert "".join(label.itertext()) == "total 4.15 GiB" and abs(value_at(yt) - 4.15) < 0.005
    assert plot_top < yt < min(ys)
    # its label sits at the line's right end, outside the plot (where no marker is): "total" just
    # above the line, the size just below it; the peak's label stays inside the plot
    assert float(label.get("x")) > float(line.get("x2"))
    word, size = label.iter(f"{SVG}tspan")
    assert yt - 12 < float(label.get("y")) < yt < float(label.get("y")) + float(size.get("dy")) < yt + 12
    assert (word.text, size.text) == ("total ", "4.15 GiB")
    (peak,) = [g for g in root.iter(f"{SVG}g") if g.get("class") == "vram-guard-tl-peak"]
    (peak_label,) = peak.iter(f"{SVG}text")
    right = float(peak_label.get("x")) + T.text_width(peak_label.text, T.FONT + 1)
    assert right <= float(line.get("x2"))
    assert "total" not in T.legend_html(d)  # on the plot, so not in the legend


def _crowded_hires_job() -> dict:
    """A hires-fix job on a card it nearly fills (the issue's picture): long passes and short VAE
    stages, a release event at the start and at every boundary, an out-of-memory event near the
    peak and a plan event at each pass's start."""
    clock = Clock()
    total = int(2.15 * GiB)
    tl = Timeline(total_bytes=total, measure="emulated", clock=clock)
    stages = (
        ("sampling", 33.0, 1.45),
        ("hires_decode", 3.9, 1.75),
        ("hires_upscale", 164.0, 1.47),
        ("hires_encode", 6.4, 1.82),
        ("hires_sampling", 36.0, 1.96),
        ("vae_decode", 13.0, 2.04),
        ("postprocess", 0.01, 1.50),
    )
    tl.add(int(1.4 * GiB), None, "start")
    tl.event("release", "released memory at process: 0 MiB of cache returned", freed_bytes=0)
    for stage, seconds, top in stages:
        tl.begin(stage)
        if stage.endswith("sampling"):
            tl.event("plan", f"{stage}: predicted peak 1704 MiB (batch 2)")
        for i in range(8):
            clock.t += seconds / 8
            tl.add(int((1.4 + (top - 1.4) * (i % 4) / 3) * GiB), None, "step")
            if stage == "vae_decode" and i == 3:
                tl.event("oom", "decoder: out of memory at tile 96: released, retrying at tile 64")
        tl.end(stage, plan="untiled", peak_bytes=int(top * GiB), exact=stage == "vae_decode")
        tl.event("release", f"released memory at {stage}: 0 MiB of cache returned", freed_bytes=0)
    tl.finish()
    return tl.to_dict()


def boxes_overlap(a: tuple, b: tuple) -> bool:
    """Two (x0, y0, x1, y1) boxes share some area."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _boxes(root: ET.Element) -> tuple[list[tuple[str, tuple]], list[tuple[str, tuple]]]:
    """(label text, box) of every label, and (what, box) of every marker: the events' circles and
    dashed lines, the peak's circle. Boxes are (x0, y0, x1, y1), text by the layout's own generous
    width estimate (timeline.text_width) and its font size."""
    from lib_vram.core import timeline as T

    labels, markers = [], []
    inside_markers = set()
    for g in root.iter(f"{SVG}g"):
        cls = g.get("class") or ""
        if cls in ("vram-guard-tl-event", "vram-guard-tl-peak"):
            for c in g.iter(f"{SVG}circle"):
                cx, cy, r = (float(c.get(k)) for k in ("cx", "cy", "r"))
                markers.append((cls, (cx - r, cy - r, cx + r, cy + r)))
            for ln in g.iter(f"{SVG}line"):
                x, y_a, y_b = float(ln.get("x1")), float(ln.get("y1")), float(ln.get("y2"))
                markers.append((cls, (x - 1, y_a, x + 1, y_b)))
            if cls == "vram-guard-tl-event":  # (the glyph inside the marker is the marker)
                inside_markers.update(id(t) for t in g.iter(f"{SVG}text"))
    for t in root.iter(f"{SVG}text"):
        if id(t) in inside_markers:
            continue
        size = float(t.get("font-size") or T.FONT) + (1 if t.get("font-weight") == "bold" else 0)
        x, y = float(t.get("x")), float(t.get("y"))
        spans = list(t.iter(f"{SVG}tspan"))
        lines = [(x, y, t.text or "")] if not spans else []
        for sp in spans:
            y += float(sp.get("dy") or 0)
            lines.append((float(sp.get("x") or x), y, sp.text or ""))
        for lx, ly, text in lines:
            w = T.text_width(text, size)
            left = {"end": lx - w, "middle": lx - w / 2}.get(t.get("text-anchor") or "start", lx)
            labels.append((text, (left, ly - 0.8 * size, left + w, ly + 0.2 * size)))
    return labels, markers


@pytest.mark.parametrize("job", [_known_job, _near_the_top_job, _crowded_hires_job])
def test_no_label_sits_on_a_marker_or_another_label_and_every_stage_is_named(job):
    """Issue 43: the total's label sat under the first event marker, the short stages had no name.
    Now: labels clear of every marker and of each other, the card's total labelled at the line's
    right end, and each stage named, on its band or in the legend."""
    from lib_vram.core import timeline as T

    d = job()
    root = svg_of(d)
    labels, markers = _boxes(root)
    assert labels and markers
    for text, box in labels:
        hit = [what for what, m in markers if boxes_overlap(box, m)]
        assert not hit, (text, box, hit)
    for i, (a, box_a) in enumerate(labels):
        for b, box_b in labels[i + 1 :]:
            assert not boxes_overlap(box_a, box_b), (a, b)
    # nor does a marker sit on another: events close in time share one (the real WebUI's hires job
    # released memory at post sample, postprocess batch and job end within 3 s of 218)
    circles = [m for what, m in markers if what == "vram-guard-tl-event" and m[3] - m[1] < 20]
    for i, a in enumerate(circles):
        assert not any(boxes_overlap(a, b) for b in circles[i + 1 :]), (a, circles)
    events = [g for g in root.iter(f"{SVG}g") if g.get("class") == "vram-guard-tl-event"]
    titles = [g.findtext(f"{SVG}title") for g in events]
    shown = [ev for ev in d["events"] if ev["kind"] != "plan"]
    assert sum(t.count("\n") + 1 for t in titles) == len(shown)  # (each event in one marker's hover)
    # the capacity line: labelled right of the plot, where it ends
    (total,) = [g for g in root.iter(f"{SVG}g") if g.get("class") == "vram-guard-tl-total"]
    (line,) = total.iter(f"{SVG}line")
    (label,) = total.iter(f"{SVG}text")
    assert float(label.get("x")) > float(line.get("x2")) and "".join(label.itertext()).startswith("total ")
    # every stage named: on one of its bands ("3 Hires upscale"), or by its number in the legend
    drawn = [
        "".join(t.itertext())
        for g in root.iter(f"{SVG}g")
        if "vram-guard-tl-band" in (g.get("class") or "")
        for t in g.iter(f"{SVG}text")
    ]
    legend = T.legend_html(d, label=R.stage_label)
    for n, stage in enumerate(dict.fromkeys(b["stage"] for b in d["bands"]), start=1):
        name = R.stage_label(stage)
        assert f"{n} {name}" in drawn or f"{n} {name}" in legend, (n, name, drawn, legend)
    # plan events are the stage table's: no marker says them again
    assert not [g for g in root.iter(f"{SVG}g") if g.get("data-kind") == "plan"]


def test_a_small_job_zooms_onto_its_range_and_the_legend_gives_the_total():
    from lib_vram.core import timeline as T

    clock = Clock()
    tl = Timeline(total_bytes=24 * GiB, clock=clock)
    for i in range(10):
        clock.t += 0.1
        tl.add(int((1.0 + 0.05 * (i % 3)) * GiB), None, "step")
    tl.finish()
    d = tl.to_dict()
    root = svg_of(d)
    _values, value_at = _y_scale(root)
    assert 0.9 <= value_at(T.H - T._PAD_B) < 1.0 and 1.1 < value_at(T._PAD_T) < 1.2
    assert not [g for g in root.iter(f"{SVG}g") if g.get("class") == "vram-guard-tl-total"]
    assert "total 24.00 GiB: far above the plot" in T.legend_html(d)


def test_a_job_that_starts_near_zero_keeps_zero_on_the_axis():
    from lib_vram.core import timeline as T

    clock = Clock()
    tl = Timeline(total_bytes=6 * GiB, clock=clock)
    for i in range(10):
        clock.t += 0.1
        tl.add(int((0.2 + 0.5 * i) * GiB), None, "step")
    tl.finish()
    _values, value_at = _y_scale(svg_of(tl.to_dict()))
    assert abs(value_at(T.H - T._PAD_B)) < 0.01


def test_svg_escapes_names_and_draws_nothing_without_points():
    clock = Clock()
    tl = Timeline(total_bytes=GiB, clock=clock)
    assert render_svg(tl.to_dict()) == ""
    tl.begin('<script>alert("x")</script>')
    clock.t = 1.0
    tl.add(2**20)
    tl.end('<script>alert("x")</script>', plan="a & b <c>")
    svg = render_svg(tl.to_dict())
    assert "<script>" not in svg
    ET.fromstring(svg)


def test_readout_html_embeds_the_plot_and_payload_carries_the_key():
    d = _known_job()
    payload = R.status_payload(_gpu(), [], job_running=False, timeline=d)
    assert payload["timeline"]["bands"][0]["stage"] == "sampling"
    assert '<svg class="vram-guard-timeline"' in payload["html"]
    # the readout's HTML around it stays parseable, the SVG inside is XML
    start = payload["html"].index("<svg")
    end = payload["html"].index("</svg>") + len("</svg>")
    ET.fromstring(payload["html"][start:end])
    assert R.status_payload(_gpu(), [], job_running=False)["timeline"] is None
    assert "<svg" not in R.status_payload(_gpu(), [], job_running=False)["html"]


# -- the real engines ------------------------------------------------------------------------------
def test_tiled_decode_samples_once_per_tile_step_inside_its_band():
    from lib_vram.vae import TiledVAEConfig, VAEReport, tiled_decode

    dec = ldm_decoder()
    z = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(1))
    tl = Timeline(total_bytes=GiB)
    tracker = StageTracker("cpu", timeline=tl)
    ticks: list[int] = []
    rep = VAEReport()
    tiled_decode(
        dec,
        z,
        config=TiledVAEConfig(mode="exact", tile=16),
        tracker=tracker,
        report=rep,
        progress=lambda done, total: ticks.append(done),
    )
    d = tl.to_dict()
    assert rep.tiles == 4 and len(ticks) >= 4
    assert d["samples"]["tile"] == len(ticks)  # one sample per tile step, no more, no fewer
    assert d["samples"]["stage"] == 2  # the band's start and end
    (band,) = d["bands"]
    assert band["stage"] == "vae_decode" and band["plan"].startswith("exact t16")
    assert band["samples"] == len(ticks) + 2 and band["ok"]
    assert band["t0"] <= d["points"]["t"][0] and d["points"]["t"][-1] <= band["t1"]
    assert d["measure"] == "rss" and d["events"] == []


@pytest.fixture(scope="module")
def esrgan_file(tmp_path_factory):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    net = make_imagelike_rrdb(rrdb_class()(in_nc=3, out_nc=3, num_filters=8, num_blocks=1, scale=4))
    path = tmp_path_factory.mktemp("esrgan") / "tiny-esrgan.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return str(path)


def test_upscale_samples_once_per_batch_of_tiles(esrgan_file):
    from lib_vram.upscale import UpscaleConfig, UpscaleReport, load_model, upscale_tensor

    desc = load_model(esrgan_file, device="cpu")
    x = torch.rand(1, 3, 40, 56, generator=torch.Generator().manual_seed(3))
    for batch in (1, 2):
        tl = Timeline(total_bytes=GiB)
        tracker = StageTracker("cpu", timeline=tl)
        rep = UpscaleReport()
        calls: list[int] = []
        upscale_tensor(
            desc,
            x,
            config=UpscaleConfig(tile=16, batch=batch),
            tracker=tracker,
            report=rep,
            progress=lambda done, total, calls=calls: calls.append(done),
            memory=planner.PlanMemory(),
        )
        d = tl.to_dict()
        assert rep.tiles_total == 12 and len(calls) == -(-12 // batch)
        assert d["samples"]["tile"] == len(calls)
        (band,) = d["bands"]
        assert band["stage"] == "upscale" and "16" in band["plan"] and band["samples"] == len(calls) + 2


# -- a WebUI job: bands in pipeline order, one sample per step, release events ---------------------
STEPS = 5


class UpscalerESRGAN:
    """Host-state fake: the WebUI object whose ``do_upscale`` VRAM Guard replaces during a job."""

    def do_upscale(self, img, selected_model):  # pragma: no cover - replaced by the patch
        return img


def _hires_job(
    esrgan_file: str, *, routes: bool = False, card: emulate.EmulatedCard | None = None, upscale: bool = True
):
    """A txt2img job with hires fix as the WebUI runs it (host-api §3): sampling steps (the
    ``on_cfg_denoiser`` callback), the first-pass decode, the hires upscale (ESRGAN file), the
    re-encode, the hires steps, the final decode. Real ldm VAE modules and spandrel model."""
    planner.MEMORY.clear()
    model = fake_sd_model()
    host = FakeHost(model)
    scaler = UpscalerESRGAN()
    host.scalers = [scaler]
    session = Session(host=host)
    client = None
    if routes:
        app = FastAPI()
        mount_routes(app, session)
        client = TestClient(app)
    jobs = ScriptJobs(session, kind="txt2img")
    p = FakeP(enable_hr=True)
    o = VRAMGuardOptions(
        enabled=True,
        release_between_stages=True,
        vae_tiling="Always",
        vae_tile=16,
        upscale_tiling=True,
        upscale_tile=32,
    )
    dec, enc = model.first_stage_model.decoder, model.first_stage_model.encoder
    z1 = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    z2 = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(2))
    seen: dict = {}
    ctx = card if card is not None else _null()
    with ctx, torch.no_grad():
        jobs.setup(p, o)
        job = jobs.process(p, o)
        jobs.before_sampling(p)
        for _ in range(STEPS):
            session.sampling_step()
        if client is not None:
            seen["running"] = client.get(STATUS_ROUTE).json()
        dec(z1)  # the first-pass decode (hires fix decodes before upscaling)
        jobs.before_hr(p)
        img = Image.fromarray(
            (torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(4)) * 255).byte().numpy()
        )
        if upscale:
            img = scaler.do_upscale(img, esrgan_file)
        p.is_hr_pass = True
        x = torch.from_numpy(np.array(img.resize((64, 64)))).permute(2, 0, 1)[None].float() / 127.5 - 1
        enc(x)
        jobs.before_sampling(p)
        for _ in range(STEPS):
            session.sampling_step()
        jobs.post_sample(p)
        dec(z2)
        jobs.postprocess_batch(p)
        jobs.postprocess(p)
        p.close()
    if client is not None:
        seen["done"] = client.get(STATUS_ROUTE).json()
    return session, job, seen


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_hires_job_timeline_has_the_stages_in_order_steps_tiles_and_releases(esrgan_file):
    session, job, seen = _hires_job(esrgan_file, routes=True)
    d = session.last["timeline"]
    assert [b["stage"] for b in d["bands"]] == [
        "sampling",
        "hires_decode",
        "hires_upscale",
        "hires_encode",
        "hires_sampling",
        "decode",
        "postprocess",
    ]
    assert d["samples"]["step"] == 2 * STEPS  # one per sampling step
    assert d["samples"]["start"] == 1
    bands = {b["stage"]: b for b in d["bands"]}
    assert bands["sampling"]["samples"] == STEPS + 2 and bands["hires_sampling"]["samples"] == STEPS + 2
    for name in ("hires_decode", "hires_upscale", "hires_encode", "decode"):
        b = bands[name]
        assert b["plan"] and b["ok"] and b["peak_bytes"] > 0
        assert b["samples"] > 4, b  # several tiles, each sampled (plus the nested engine stage)
    assert bands["decode"]["plan"].startswith("exact t16")
    # bands follow each other in time; the job's end closes the axis
    for a, b in zip(d["bands"], d["bands"][1:]):
        assert a["t1"] <= b["t0"]
    assert d["running"] is False and d["seconds"] >= d["bands"][-1]["t1"]
    # a release event at every boundary the settings release at, in order
    order = ["process", "before_hr", "post_sample", "postprocess_batch", "job_end"]
    want = [b for b in order if b in job.settings.release_at]
    assert want, job.settings.release_at
    assert [e["at"] for e in d["events"] if e["kind"] == "release"] == want
    assert not [e for e in d["events"] if e["kind"] == "oom"]
    # the status route: the key while the job runs (growing), and after it
    running = seen["running"]
    assert running["job_running"] is True and running["timeline"]["running"] is True
    assert running["timeline"]["samples"]["step"] == STEPS
    assert "vram-guard-timeline" in running["html"]
    done = seen["done"]
    assert done["job_running"] is False and done["timeline"]["bands"] == d["bands"]
    assert len(done["timeline"]["points"]["t"]) > len(running["timeline"]["points"]["t"])
    ET.fromstring(done["html"][done["html"].index("<svg") : done["html"].index("</svg>") + 6])


def test_emulated_card_timeline_records_the_caused_oom_inside_its_stage(esrgan_file):
    """The job on an emulated card, the card's out-of-memory error caused in the middle of the final
    decode's allocations: the timeline measures the card, shows its capacity, and marks the OOM."""
    big = 2**34
    ref = emulate.EmulatedCard(big)
    _hires_job(esrgan_file, card=ref, upscale=False)  # a dry run (warms the engines up)
    ref = emulate.EmulatedCard(big)
    counts: dict = {}
    orig = ScriptJobs.post_sample

    def mark(self, p):
        counts["post_sample"] = ref.allocations
        return orig(self, p)

    ScriptJobs.post_sample = mark
    try:
        session, job, _ = _hires_job(esrgan_file, card=ref, upscale=False)
    finally:
        ScriptJobs.post_sample = orig
    first, last = counts["post_sample"] + 1, ref.allocations
    card = emulate.EmulatedCard(big, inject_oom_at=(first + last) // 2)
    session, job, _ = _hires_job(esrgan_file, card=card, upscale=False)
    assert card.injected and card.ooms == 1
    d = session.last["timeline"]
    assert d["measure"] == "emulated" and d["total_bytes"] == big
    ooms = [e for e in d["events"] if e["kind"] == "oom"]
    assert len(ooms) == 1, d["events"]
    decode = next(b for b in d["bands"] if b["stage"] == "decode")
    assert decode["t0"] <= ooms[0]["t"] <= decode["t1"]
    assert "out of memory" in ooms[0]["text"] and decode["ok"] and "after OOM" in decode["plan"]
    tips = titles(svg_of(d))
    assert any("out of memory" in t for t in tips)
    assert max(d["points"]["used"]) <= big


def test_the_documented_library_example_runs():
    """docs/how-it-works.md, *The memory timeline in Python*: its code block, run as written (only
    its device, ``"cuda"``, becomes ``"cpu"``) on a real ldm decoder: a Timeline on a StageTracker
    handed to an engine, then its SVG."""
    import re
    import types
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "how-it-works.md").read_text()
    section = text[text.index("## The memory timeline in Python") :]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    assert 'StageTracker("cuda"' in code, code
    dec = ldm_decoder()
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(5))
    scope = {"vae": types.SimpleNamespace(decoder=dec), "z": z}
    with torch.no_grad():
        exec(compile(code.replace('"cuda"', '"cpu"'), "how-it-works.md", "exec"), scope)  # noqa: S102
    d = scope["tracker"].timeline.to_dict()
    assert [b["stage"] for b in d["bands"]] == ["vae_decode"] and d["bands"][0]["plan"]
    assert scope["out"].shape[:2] == (1, 3) and scope["out"].shape[-1] > z.shape[-1]
    ET.fromstring(scope["svg"])


@pytest.mark.parametrize(
    ("argv", "message"), [(["--device", "banana"], "not a device name"), (["--reps", "0"], "--reps")]
)
def test_bench_timeline_refuses_bad_arguments_in_one_line(capsys, argv, message):
    from lib_vram.cli import main

    try:
        rc = main(["bench", "timeline", *argv])
    except SystemExit as exc:  # argparse's own checks (type=)
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "error: " in err and message in err and err.count("\n") == 1


def test_extras_job_has_its_upscale_band_and_the_extras_readout_draws_it(esrgan_file):
    """Extras: the job that routes the Upscale operation's upscaler records the same timeline, and
    the Extras section's readout (the same payload) shows the plot."""

    class PostprocessedImage:  # Extras' scripts_postprocessing.PostprocessedImage (host state)
        def __init__(self, image):
            self.image = image
            self.info: dict = {}

    planner.MEMORY.clear()
    host = FakeHost(fake_sd_model())
    scaler = UpscalerESRGAN()
    host.scalers = [scaler]
    session = Session(host=host)
    jobs = ScriptJobs(session, kind="extras")
    img = Image.fromarray(
        (torch.rand(40, 48, 3, generator=torch.Generator().manual_seed(6)) * 255).byte().numpy()
    )
    pp = PostprocessedImage(img)
    jobs.extras(pp, VRAMGuardOptions(enabled=True, upscale_tiling=True, upscale_tile=32, upscale_batch=1))
    out = scaler.do_upscale(img, esrgan_file)
    jobs.close()
    assert out.size == (192, 160)
    d = session.last["timeline"]
    (band,) = d["bands"]
    assert band["stage"] == "upscale" and band["plan"] and band["ok"]
    assert d["samples"]["tile"] == 4  # 40x48 in 32 px tiles, one per batch of 1
    html = R.render_readout_html(session.status(), tab="extras")
    assert "vram-guard-timeline" in html and "Upscale (Extras)" in html
