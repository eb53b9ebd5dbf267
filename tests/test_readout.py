"""Readout payload (stable keys), its HTML (escaped, CPU-only notice) and the JS's global names."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from lib_vram.core import readout as R
from lib_vram.core.device import MemoryInfo, memory_info
from lib_vram.core.plan_words import plan_words
from lib_vram.core.tracker import StageTracker

ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3

GPU = MemoryInfo(
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


class _Text(HTMLParser):
    def __init__(self):
        super().__init__()
        self.text = []
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def text_of(markup: str) -> tuple[str, list[str]]:
    p = _Text()
    p.feed(markup)
    return " ".join(" ".join(p.text).split()), p.tags


RECORDS = [
    {"name": "sampling", "peak_bytes": 3 * GiB, "seconds": 4.0, "plan": None},
    {"name": "vae_decode", "peak_bytes": int(4.5 * GiB), "seconds": 1.0, "plan": "exact t64", "exact": False},
    {"name": "vae_decode", "peak_bytes": 4 * GiB, "seconds": 1.5, "plan": "exact t96"},
    {"name": "hires_upscale", "peak_bytes": 2 * GiB, "seconds": 2.0, "plan": "t192 b4 fp16"},
    {"name": "extras_upscale", "peak_bytes": GiB, "seconds": 0.5, "plan": "t256"},
    {"name": "hires_decode", "peak_bytes": GiB, "seconds": 0.5, "plan": "exact t64"},
]


def test_payload_keys_are_stable():
    payload = R.status_payload(GPU, RECORDS, job_running=True, notes=["n1"], device_name="RTX 3060")
    assert list(payload) == [
        "schema",
        "device",
        "device_name",
        "backend",
        "cpu_only",
        "memory",
        "emulated",
        "job_running",
        "stages",
        "notes",
        "timeline",
        "html",
    ]
    assert list(payload["memory"]) == [
        "basis",
        "total_bytes",
        "used_bytes",
        "free_bytes",
        "allocated_bytes",
        "reserved_bytes",
        "process_rss_bytes",
        "system_total_bytes",
        "system_available_bytes",
    ]
    assert payload["memory"]["used_bytes"] == 5 * GiB and payload["memory"]["basis"] == "device memory"
    assert payload["cpu_only"] is False and payload["job_running"] is True
    json.dumps(payload)  # serialisable as the route's body
    stages = payload["stages"]
    assert [s["stage"] for s in stages] == [
        "sampling",
        "hires_decode",
        "hires_upscale",
        "decode",
        "extras_upscale",
    ]
    assert stages[1]["label"] == "Hires first decode"
    decode = stages[3]
    assert decode["count"] == 2 and decode["peak_bytes"] == int(4.5 * GiB)
    assert decode["plan"] == "exact t64" and decode["exact"] is False and decode["seconds"] == 2.5
    assert set(decode) == {"stage", "label", "peak_bytes", "plan", "seconds", "count", "ok", "exact", "error"}


def test_html_lists_every_stage_with_peak_and_plan():
    payload = R.status_payload(GPU, RECORDS, job_running=False, device_name="RTX 3060")
    text, _tags = text_of(R.render_readout_html(payload))
    assert "RTX 3060 (cuda:0)" in text
    assert "device memory: used 5.00 GiB of 8.00 GiB, free 3.00 GiB" in text
    for label in ("Sampling", "Hires upscale", "Hires encode", "Decode ×2", "Postprocess", "Extras upscale"):
        assert label in text
    # each plan in words; a plan no phrase knows is shown as it is
    assert "≥ 4.50 GiB tiles of 512 px, exact mode" in text
    assert "2.00 GiB t192 b4 fp16" in text
    # "≥" says why, once, under the table
    assert text.count("≥") == 2 and text.endswith(R.AT_LEAST_NOTE)
    assert "CPU only" not in text


def test_an_extras_job_lists_its_upscale_only():
    """The Extras section's readout after an upscale: the generation stages it never has are not
    listed as skipped rows (the real WebUI's picture showed five rows of dashes above it)."""
    up = [{"name": "upscale", "peak_bytes": GiB, "seconds": 0.5, "plan": "whole b1 float32 acc=cpu"}]
    markup = R.render_readout_html(R.status_payload(GPU, up, job_running=False))
    assert re.findall(r'data-stage="([^"]*)"', markup.split("<table", 1)[1]) == ["upscale"]
    text, _tags = text_of(markup)
    assert "Upscale (Extras) 1.00 GiB whole image at once, FP32, picture assembled in RAM" in text
    # a generation job still lists the stages it skipped
    gen = R.render_readout_html(R.status_payload(GPU, RECORDS[:1], job_running=False))
    assert "vram-guard-skipped" in gen and 'data-stage="hires_upscale"' in gen


def test_cpu_only_says_so_and_shows_ram():
    mem = memory_info("cpu")
    payload = R.status_payload(mem, [], job_running=False)
    assert payload["cpu_only"] is True
    assert payload["memory"]["basis"] == "system RAM"
    assert payload["notes"][0] == R.CPU_ONLY_NOTE
    text, _ = text_of(payload["html"])
    assert "system RAM: used" in text and "CPU only" in text


def test_failed_stage_and_tracker_records():
    tracker = StageTracker("cpu")
    with tracker.stage("sampling"):
        pass
    with pytest.raises(RuntimeError), tracker.stage("decode", plan="exact t32"):
        raise RuntimeError("CUDA out of memory")
    payload = R.status_payload(memory_info("cpu"), tracker.records, job_running=False)
    decode = payload["stages"][1]
    assert decode["ok"] is False and "out of memory" in decode["error"]
    assert 'class="vram-guard-stage vram-guard-failed"' in payload["html"]
    with pytest.raises(ValueError, match="`records`"):
        R.status_payload(GPU, [42], job_running=False)


def test_everything_is_escaped():
    evil = "<img src=x onerror=alert(1)>"
    records = [{"name": evil, "peak_bytes": 1, "plan": evil, "ok": False, "error": evil}]
    payload = R.status_payload(GPU, records, job_running=False, notes=[evil], device_name=evil)
    markup = R.render_readout_html(payload, tab=evil, tooltips={evil: (evil, evil)})
    _text, tags = text_of(markup)
    assert "img" not in tags
    assert "<img" not in markup


def test_tooltips_attribute_round_trips():
    tips = {"vram_guard_txt2img_preset": ("Memory preset", 'Say "hi" & <go>')}
    markup = R.render_readout_html(R.placeholder_payload(), tab="txt2img", tooltips=tips)
    m = re.search(r'data-vram-guard-tooltips="([^"]*)"', markup)
    import html

    assert json.loads(html.unescape(m.group(1))) == {k: list(v) for k, v in tips.items()}


def test_format_bytes():
    assert R.format_bytes(None) == "n/a"
    assert R.format_bytes(512) == "512 B"
    assert R.format_bytes(1536 * 2**20) == "1.50 GiB"
    assert R.format_bytes(3 * 2**40) == "3072.00 GiB"


JS = ROOT / "javascript" / "vram_guard.js"


def test_js_globals_are_prefixed():
    source = JS.read_text()
    top = re.findall(r"^(?:function|var|let|const|class)\s+(\w+)", source, flags=re.M)
    assert top, "no top-level names found: the check would be vacuous"
    assert all(name.startswith("vramGuard") for name in top), top
    assert "./internal/vram-guard/status" in source and R.UI_STATUS_ROUTE == "/internal/vram-guard/status"


def test_js_parses():
    node = shutil.which("node")
    if node is None:
        pytest.skip("node not installed; the browser test runs the script instead")
    subprocess.run([node, "--check", str(JS)], check=True, timeout=60)


def test_css_is_scoped():
    css = (ROOT / "style.css").read_text()
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    selectors = re.findall(r"([^{}]+)\{", css)
    assert selectors
    for group in selectors:
        for sel in group.split(","):
            assert sel.strip().startswith(".vram-guard"), sel


def test_notes_say_what_a_pass_did_in_words():
    """The readout's notes about a pass: the stage by the name a user knows, the tiles in image
    pixels, the memory it fitted in, what happened to the picture; nothing for a plain pass."""
    note = R.vae_pass_note("decode", mode="exact", tiles=6, tile=64, budget_bytes=int(3.2 * 2**30))
    assert note == (
        "The VAE decode was done in 6 tiles of up to 512x512 px to fit in 3.2 GiB (the free memory "
        "less a safety margin); exact tiles: the same picture as untiled."
    )
    assert R.vae_pass_note("decode", mode="untiled", tiles=0, tile=None, budget_bytes=2**30) is None
    assert R.vae_pass_note("decode", mode="exact", tiles=1, tile=512, budget_bytes=2**30) is None
    oom = R.vae_pass_note(
        "hires_encode", mode="fast", tiles=4, tile=16, budget_bytes=300 * 2**20, retries=[0, 32]
    )
    assert oom.startswith(
        "The hires-fix VAE encode ran out of memory untiled and with 256x256-px tiles; then it was "
        "done in 4 tiles of up to 128x128 px to fit in 300 MiB"
    ) and oom.endswith("not exactly the untiled picture.")
    up = R.upscale_pass_note("upscale", tiled=True, tiles=9, tile=192, batch=4, budget_bytes=2**31, ooms=1)
    assert up.startswith("The upscale ran out of memory 1 time; then it was done in 9 tiles of up to 192x192")
    assert "4 at a time" in up and "2.0 GiB" in up
    assert R.upscale_pass_note("upscale", tiled=False, tiles=1, tile=0, batch=1, budget_bytes=1) is None
    inexact = R.upscale_pass_note(
        "hires_upscale", tiled=True, tiles=2, tile=64, batch=1, budget_bytes=1, exact=False
    )
    assert "not exactly the untiled picture" in inexact


PLACED = (
    "checkpoint placed by VRAM Guard: UNet {unet} MiB resident, text encoders and VAE on the CPU until used"
)
"""The placement's label (lib_vram.webui.placed.Placed.label)."""


def test_plans_read_in_words_a_webui_user_knows():
    """The plan strings the engines and the adapter record, as the stage table says them."""
    w = plan_words
    assert w("whole b1 float32 acc=cpu") == "whole image at once, FP32, picture assembled in RAM"
    assert w("tiled t512 o32 f16 b4 float16 acc=cuda") == (
        "tiles of 512 px, 4 at a time, FP16, picture assembled on the card"
    )
    assert w("tiled t192 o16 f8 b1 (model takes one image at a time) bfloat16 acc=cpu inexact after OOM") == (
        "tiles of 192 px, 1 at a time (model takes one image at a time), BF16, picture assembled in RAM, "
        "tiles not exactly the untiled picture, retried after running out of memory"
    )
    assert w("exact t64 x6") == "6 tiles of 512 px, exact mode"
    assert w("fast t32 x1, VAE off the card") == "1 tile of 256 px, fast mode, VAE off the card"
    assert w("untiled") == "untiled" and w(None) == "—"
    assert w("micro-batch 1 of 2 (predicted 1704 MiB)") == (
        "batch of 2 in parts, 1 at a time (predicted 1704 MiB)"
    )
    assert w("UNet streamed: 1234 of 4900 MiB resident, batch 2 in one forward") == (
        "UNet streamed, 1234 of 4900 MiB kept on the card, batch of 2 at once"
    )
    placed = PLACED.format(unet="1474 of 3279")
    plan = f"batch 2, {placed} (predicted 1704 MiB)"
    assert w(plan, said=[placed]) == "batch of 2 at once (predicted 1704 MiB)"
    assert w(placed, said=[placed]) == "—"
    for plan in ("whole b1 float32 acc=cpu", "tiled t512 o32 f16 b4 float16 acc=cuda", f"batch 2, {placed}"):
        assert not re.search(r"\bacc=|\bb\d+\b|float\d+|\bt\d+\b", w(plan, said=[placed])), plan


def test_notes_say_only_what_the_rest_of_the_readout_does_not():
    placed = PLACED.format(unet="1 of 4")
    notes = [
        R.CPU_ONLY_NOTE,
        f"VRAM Guard: {placed}",
        f"VRAM Guard: sampling: predicted peak 4 MiB (UNet 4 MiB) for 2 sample(s): batch 2, {placed}",
        "VRAM Guard: untiled",
        "VRAM Guard: The upscale ran out of memory 1 time. It then ran on the whole image at once.",
        "VRAM Guard: The upscale ran out of memory 1 time. Once more.",
    ]
    out = R.readout_notes(
        notes, said=[placed], tails=["batch 2"], shown=["Decode untiled"], drop=[R.CPU_ONLY_NOTE]
    )
    assert out == [
        "Sampling: predicted peak 4 MiB (UNet 4 MiB) for 2 sample(s)",
        "The upscale ran out of memory 1 time. It then ran on the whole image at once.",
        "Once more.",
    ]
