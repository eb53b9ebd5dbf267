"""The readout of a hires-fix job with the checkpoint placed by VRAM Guard (issue 43 item 3): each
thing said once, in words a WebUI user knows.

The job runs the WebUI adapter's real path (lib_vram.webui: the placement at load, the sampling
guard's two passes, the VAE hooks, the hires upscale through the tiled engine with a spandrel
ESRGAN file) on the emulated card of tests/test_webui_placement.py, whose placed checkpoint is
real ldm modules; the readout is the session's own status payload and HTML.
"""

from __future__ import annotations

import dataclasses
import html
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from conftest import make_imagelike_rrdb, rrdb_class
from PIL import Image
from test_timeline import _boxes as plot_boxes
from test_timeline import boxes_overlap
from test_webui_placement import CAP, COND, MODEL, SIGMAS, UNCOND, X, unet_of, world
from webui_fakes import FakeP

from lib_vram.core import readout as R
from lib_vram.webui import ScriptJobs
from lib_vram.webui.options import VRAMGuardOptions


class UpscalerESRGAN:
    """Host-state fake: the WebUI object whose ``do_upscale`` VRAM Guard replaces during a job."""

    def do_upscale(self, img, selected_model):  # pragma: no cover - replaced by the patch
        return img


@pytest.fixture(scope="module")
def esrgan_file(tmp_path_factory):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    net = make_imagelike_rrdb(rrdb_class()(in_nc=3, out_nc=3, num_filters=8, num_blocks=1, scale=2))
    path = tmp_path_factory.mktemp("esrgan") / "tiny-esrgan.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return str(path)


def _pass(jobs: ScriptJobs, p: FakeP) -> None:
    """One sampling pass as the WebUI runs it (cond and uncond in one forward per step); the WebUI
    calls ``post_sample`` only after the hires pass (the first decode is part of its ``sample``)."""
    jobs.before_sampling(p, x=X.clone(), c=[COND[0]], uc=[UNCOND[0]])
    for sigma in SIGMAS:
        jobs.session.sampling_step()
        unet_of(MODEL)(torch.cat([X, X]), sigma, context=torch.cat([COND, UNCOND]))


def placed_hires_status(esrgan_file: str) -> dict:
    """The session's status after a txt2img job with hires fix on the placed checkpoint: first
    pass, first decode, hires upscale (ESRGAN), re-encode, hires pass, final decode."""
    w = world(CAP)
    try:
        w.host.sd_models.load_model(MODEL, w.session)
        assert w.session.placement.placed_for(MODEL) is not None
        scaler = UpscalerESRGAN()
        w.host.scalers = [scaler]
        o = VRAMGuardOptions(
            enabled=True, release_between_stages=True, vae_tiling="Auto", upscale_tiling=True
        )
        jobs = ScriptJobs(w.session, kind="txt2img")
        w.host.state.begin()
        p = FakeP(enable_hr=True)
        fs = MODEL.first_stage_model
        try:
            with torch.no_grad():
                jobs.setup(p, o)
                jobs.process(p, o)
                jobs.job.settings = dataclasses.replace(jobs.job.settings, sampling_margin_bytes=0)
                _pass(jobs, p)
                fs.decoder(X)  # the first-pass decode (hires fix decodes before upscaling)
                jobs.before_hr(p)
                rgb = torch.rand(16, 16, 3, generator=torch.Generator().manual_seed(4))
                img = scaler.do_upscale(Image.fromarray((rgb * 255).byte().numpy()), esrgan_file)
                p.is_hr_pass = True
                x = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].float() / 127.5 - 1
                fs.encoder(x)
                _pass(jobs, p)
                jobs.post_sample(p)
                fs.decoder(X)
                jobs.postprocess_batch(p)
                jobs.postprocess(p)
        finally:
            p.close()
            jobs.close(failed=True)
            w.host.state.end()
        return w.session.status()
    finally:
        w.close()


class _Blocks(HTMLParser):
    """The readout's visible text by block: each table cell, list item and ``div`` on its own, the
    plot's hover texts (``<title>``) apart, the plot's labels apart."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list[tuple[str, str]] = []  # (tag, text)
        self.stack: list[str] = []
        self.text: list[str] = []

    def _flush(self) -> None:
        text = " ".join("".join(self.text).split())
        if text:
            self.blocks.append((self.where(), text))
        self.text = []

    def where(self) -> str:
        if "title" in self.stack:
            return "hover"
        if "svg" in self.stack:
            return "plot"
        return next((t for t in reversed(self.stack) if t in ("td", "th", "li", "div")), "")

    def handle_starttag(self, tag, attrs):
        self._flush()
        self.stack.append(tag)

    def handle_endtag(self, tag):
        self._flush()
        while self.stack and self.stack.pop() != tag:
            pass

    def handle_data(self, data):
        self.text.append(data)


def blocks(markup: str) -> list[tuple[str, str]]:
    parser = _Blocks()
    parser.feed(markup)
    parser.close()
    return parser.blocks


def sentences(text: str) -> list[str]:
    return [s.strip(" .;") for s in re.split(r"(?<=[.;])\s+", text) if s.strip(" .;")]


ABBREVIATIONS = re.compile(r"acc=|\bb\d+\b|\bt\d+\b|\bx\d+\b|float(?:16|32)|\bOOM\b")
"""The engines' plan shorthand (``whole b1 float32 acc=cpu``, ``exact t64 x6``, ``after OOM``)."""


def test_the_readout_of_a_placed_hires_job_says_each_thing_once(esrgan_file):
    status = placed_hires_status(esrgan_file)
    placed = status["placement"]
    assert placed.startswith("checkpoint placed by VRAM Guard: UNet ")
    # (the payload still carries what the adapter said, for the status route's readers)
    assert any(placed in str(st.get("plan")) for st in status["stages"])
    assert any(placed in n for n in status["notes"])
    markup = status["html"]
    parts = blocks(markup)
    shown = [t for where, t in parts if where not in ("hover", "plot")]
    text = " ".join(shown)
    stages = {st["stage"] for st in status["stages"]}
    assert {"sampling", "hires_decode", "hires_upscale", "hires_encode", "hires_sampling", "decode"} <= stages

    # the placement, once: in the "Models now" line
    assert "checkpoint placed" not in text and text.count("placed by VRAM Guard") == 1, text
    (models,) = [t for t in shown if t.startswith("Models now")]
    assert "placed by VRAM Guard" in models and "UNet: streamed, " in models and "CPU until used" in models

    # no sentence twice: in the prose (head, legend, footnote, notes) and between a note and a row
    prose = [t for where, t in parts if where in ("div", "li")]
    said = [s.lower() for t in prose for s in sentences(t)]
    assert len(said) == len(set(said)), [s for s in said if said.count(s) > 1]
    rows = dict(re.findall(r'<tr class="vram-guard-stage[^"]*" data-stage="([^"]*)">(.*?)</tr>', markup))
    plans = {
        stage: html.unescape(re.search(r'class="vram-guard-plan">(.*?)</td>', tr).group(1))
        for stage, tr in rows.items()
        if "<td>—</td>" not in tr
    }
    assert all(p != "—" for stage, p in plans.items() if stage != "postprocess"), plans
    notes = [t for where, t in parts if where == "li"]
    for note in notes:
        assert not any(p in note for p in plans.values() if p != "—"), (note, plans)
        assert not note.startswith("VRAM Guard: ")

    # each plan in words: no shorthand anywhere, not even in the plot's hover texts
    everything = " ".join(t for _where, t in parts)
    assert not ABBREVIATIONS.search(everything), ABBREVIATIONS.search(everything)
    assert plans["hires_upscale"] == "whole image at once, FP32, picture assembled in RAM", plans
    # the pass's predicted peak once: in its note, with what it is made of (the real WebUI's readout
    # said it in the plan and again in the note)
    assert plans["sampling"] == "batch of 2 at once", plans
    predicted = re.findall(r"predicted (?:peak )?(\d+) MiB", text)
    assert len(predicted) == 2, predicted  # (one per pass: sampling, hires sampling)
    assert any(n.startswith("Sampling: predicted peak ") and " attention" in n for n in notes), notes

    # "≥" says why, once
    if "≥" in " ".join(t for where, t in parts if where == "td"):
        assert [t for t in shown if t.startswith("≥ at least:")] == [R.AT_LEAST_NOTE]

    # the plot: no label on a marker or another label; every stage named on its band or in the legend
    svg = markup[markup.index("<svg") : markup.index("</svg>") + len("</svg>")]
    labels, markers = plot_boxes(ET.fromstring(svg))
    for name, box in labels:
        assert not [w for w, m in markers if boxes_overlap(box, m)], name
    legend = [t for t in shown if t.startswith("solid: ")][0]
    drawn = " | ".join(t for where, t in parts if where == "plot")
    for n, stage in enumerate(dict.fromkeys(b["stage"] for b in status["timeline"]["bands"]), start=1):
        assert f"{n} {R.stage_label(stage)}" in drawn or f"{n} {R.stage_label(stage)}" in legend, (
            n,
            stage,
            drawn,
            legend,
        )
