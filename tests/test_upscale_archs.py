"""Tiled upscaling equals the untiled model for every spandrel architecture, or falls back visibly.

Every model is a real spandrel architecture with random weights, saved to a file and loaded back
through spandrel (both ESRGAN key formats). Each is tiled at two tile sizes that do not divide the
image, on an image whose sides are not a multiple of any window and one whose sides are, and
compared with spandrel's own untiled call: at most 1 LSB and at least 60 dB (8-bit). Models whose
output depends on the whole image (global pooling, grid attention) must instead run untiled when
they fit and carry a note (``report.exact`` False, plan ``inexact``) when forced to tile.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from conftest import image_like

from lib_vram.cli.bench._archs import build, save_and_load
from lib_vram.planning import planner
from lib_vram.upscale import UpscaleConfig, UpscaleReport, as_spec, measure_context, upscale_tensor
from lib_vram.upscale._calibrate import Context
from lib_vram.upscale._engine import signature

LOCAL = ["compact-x1", "compact-x2", "span", "rrdb-x4", "rrdb-x2", "rrdb-x1", "plksr", "safmn"]
WINDOWED = ["swinir", "ditn"]
GLOBAL = ["hat", "dat", "realcugan"]
"""HAT and DAT have channel attention (AdaptiveAvgPool2d over the whole image), RealCUGAN
squeeze-excitation: no exact tiling exists for them. Swin2SR, DRCT (windowed), OmniSR (global) and
ScuNET take 40-110 s each on a loaded 2-core CPU: they are in ``bench upscale --archs`` (the same
models, docs/benchmarks.md), not in the test suite; ``test_window_models_report_their_grid`` and
``test_model_classification`` still check how the engine sees them."""
CASES = [((75, 58), 24), ((64, 48), 40)]
"""(image size, tile): not a multiple of any window (8, 16), and a multiple of both; tiles that
divide neither."""


def psnr_8bit(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a8, b8 = (a.float() * 255).round(), (b.float() * 255).round()
    mse = float(((a8 - b8) ** 2).mean())
    return (math.inf if mse == 0 else 10 * math.log10(255**2 / mse)), float((a8 - b8).abs().max())


_models: dict[str, object] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    def get(name: str, new_keys: bool = False):
        key = f"{name}{'-new' if new_keys else ''}"
        if key not in _models:
            path = tmp_path_factory.mktemp("m") / f"{key}.safetensors"
            _models[key] = save_and_load(build(name), path, new_keys=new_keys)
        return _models[key]

    yield get
    _models.clear()


def _untiled(model, x):
    with torch.inference_mode():
        return model(x)


def _overlap(spec) -> int:
    g = max(1, spec.grid)
    return -(-16 // g) * g


@pytest.mark.parametrize("name", LOCAL + WINDOWED)
def test_tiled_equals_untiled(models, name):
    model = models(name)
    spec = as_spec(model)
    assert spec.global_stats is None
    for (h, w), tile in CASES:
        x = image_like(h, w, seed=h)
        ref = _untiled(model, x)
        rep = UpscaleReport()
        y = upscale_tensor(model, x, config=UpscaleConfig(tile=tile, batch=4), report=rep)
        assert rep.tiled and rep.tiles_total > 2 and rep.exact, rep
        db, err = psnr_8bit(y, ref)
        assert err <= 1 and db >= 60, (name, h, w, tile, rep.overlap, db, err)


def test_window_models_report_their_grid(models):
    assert as_spec(models("swinir")).grid == 8
    assert as_spec(models("dat")).grid == 8  # split sizes 4 and 8
    assert as_spec(models("compact-x1")).grid == 1


@pytest.mark.parametrize(
    ("name", "grid", "pads", "global_"),
    [("drct", 16, False, False), ("swin2sr", 8, True, False), ("omnisr", 8, True, True)],
)
def test_model_classification(models, name, grid, pads, global_):
    spec = as_spec(models(name))
    assert spec.grid == grid and (spec.pre_pad is not None) == pads and bool(spec.global_stats) == global_


def test_window_model_without_the_grid_alignment_shows_seams(models):
    """The matrix can fail: the same SwinIR tiled on windows off its 8-px grid (overlap 5, grid
    forced to 1) differs visibly from the untiled model."""
    model = models("swinir")
    x = image_like(75, 58, seed=3)
    ref = _untiled(model, x)
    spec = as_spec(model)
    spec.grid, spec.pre_pad = 1, None
    y = upscale_tensor(spec.forward, x, scale=2, config=UpscaleConfig(tile=24, overlap=5, batch=4))
    assert psnr_8bit(y, ref)[1] > 4


def test_esrgan_new_key_format_tiles_like_the_old(models):
    old, new = models("rrdb-x4"), models("rrdb-x4", new_keys=True)
    x = image_like(40, 33)
    torch.testing.assert_close(_untiled(new, x), _untiled(old, x), atol=0, rtol=0)
    y = upscale_tensor(new, x, config=UpscaleConfig(tile=16, overlap=8, batch=4))
    assert psnr_8bit(y, _untiled(old, x))[1] <= 1


@pytest.mark.parametrize("name", GLOBAL)
def test_global_statistics_models_fall_back_visibly(models, name):
    model = models(name)
    spec = as_spec(model)
    assert spec.global_stats, name
    x = image_like(44, 37, seed=1)
    ref = _untiled(model, x)
    # Fits: untiled, exact.
    rep = UpscaleReport()
    y = upscale_tensor(model, x, config=UpscaleConfig(overlap=_overlap(spec)), report=rep)
    assert not rep.tiled and rep.exact and not rep.notes
    assert psnr_8bit(y, ref)[1] <= 1
    # Forced to tile: it runs, and says it may differ.
    rep = UpscaleReport()
    upscale_tensor(model, x, config=UpscaleConfig(tile=16, overlap=_overlap(spec), batch=4), report=rep)
    assert rep.tiled and not rep.exact and rep.plan.endswith("inexact")
    assert rep.notes and spec.name in rep.notes[0] and "whole image" in rep.notes[0]


# -- overlap calibration ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["compact-x1", "rrdb-x1", "swinir"])
def test_calibrated_overlap_gives_exact_tiles_on_hard_edges(models, name):
    """The automatic overlap on an image of hard-edged blocks (the case a smooth probe under-measured)."""
    model = models(name)
    g = torch.Generator().manual_seed(7)
    blocks = torch.rand(1, 3, 12, 10, generator=g).round()
    x = blocks.repeat_interleave(7, -2).repeat_interleave(7, -1)[..., :81, :67].contiguous()
    ref = _untiled(model, x)
    rep = UpscaleReport()
    y = upscale_tensor(model, x, config=UpscaleConfig(tile=24, batch=4), report=rep)
    assert rep.tiled and rep.overlap >= 4
    db, err = psnr_8bit(y, ref)
    assert err <= 1 and db >= 60, (name, rep.overlap, db, err)


class WideBlur(torch.nn.Module):
    """A model whose context (80 px) exceeds every probed margin: a 161-px box blur (separable),
    then x2."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = torch.nn.AvgPool2d((161, 1), stride=1, padding=(80, 0), count_include_pad=False)
        self.cols = torch.nn.AvgPool2d((1, 161), stride=1, padding=(0, 80), count_include_pad=False)
        self.up = torch.nn.Upsample(scale_factor=2, mode="nearest")

    def forward(self, x):
        return self.up(0.5 * x + 0.5 * self.cols(self.rows(x)))


def test_context_beyond_the_largest_probe_is_loud():
    model = WideBlur()
    spec = as_spec(model, 2)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("lib_vram.upscale._calibrate")
    log.addHandler(handler)
    try:
        ctx = measure_context(spec, torch.device("cpu"), torch.float32)
    finally:
        log.removeHandler(handler)
    assert isinstance(ctx, Context) and not ctx.sufficient and ctx.measured == 64
    assert any("not local enough" in m for m in seen)
    x = image_like(90, 70)
    rep = UpscaleReport()
    y = upscale_tensor(model, x, scale=2, config=UpscaleConfig(), report=rep)
    assert not rep.tiled and rep.exact  # fits: untiled
    torch.testing.assert_close(y, model(x).clamp(0, 1))
    rep = UpscaleReport()
    upscale_tensor(model, x, scale=2, config=UpscaleConfig(tile=32), report=rep)
    assert rep.tiled and not rep.exact and "exceeds 64 px" in rep.notes[0]


# -- out of memory in an untiled plan --------------------------------------------------------------


def _oom_above(limit_px: int):
    def hook(module, args):
        n, _, h, w = args[0].shape
        if n * h * w > limit_px:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    return hook


@pytest.mark.parametrize("name", ["rrdb-x2", "compact-x1"])
def test_untiled_plan_that_runs_out_of_memory_retries_with_overlap(models, name, tmp_path):
    model = save_and_load(build(name), tmp_path / "m.safetensors")  # own copy: a hook goes on it
    x = image_like(64, 56, seed=5)
    ref = _untiled(model, x)
    # Whole image (64 x 56) and 32-px tiles run out of memory; 16-px tiles fit even with the default
    # overlap (the calibration's probes run out of memory too, so the default is what it gets).
    model.model.register_forward_pre_hook(_oom_above(50 * 50))
    memory = planner.PlanMemory()
    rep = UpscaleReport()
    y = upscale_tensor(model, x, config=UpscaleConfig(budget_bytes=2**34), report=rep, memory=memory)
    assert rep.ooms >= 1 and rep.events[0].startswith("out of memory")
    # The report shows the plan that finished: tiled, with the model's overlap and cross-fade.
    assert rep.tiled and rep.overlap >= 4 and rep.feather == rep.overlap // 2
    assert rep.plan.startswith(f"tiled t{rep.tile} o{rep.overlap} f{rep.feather}")
    db, err = psnr_8bit(y, ref)
    assert err <= 1 and db >= 60, (db, err)
    # What was learned is what ran; the next call starts from it and does not run out of memory.
    key = planner.plan_key("upscale", signature(as_spec(model)), x.shape, torch.float32)
    history = memory.history(key)
    assert history[0].oom and history[0].plan.startswith("whole")
    assert history[-1].plan == f"tiled t{rep.tile} o{rep.overlap} b{rep.batch}" and not history[-1].oom
    rep2 = UpscaleReport()
    y2 = upscale_tensor(model, x, config=UpscaleConfig(budget_bytes=2**34), report=rep2, memory=memory)
    assert rep2.ooms == 0 and rep2.tiled and rep2.overlap == rep.overlap
    assert psnr_8bit(y2, ref)[1] <= 1


def test_bench_archs_table(tmp_path):
    """``bench upscale --archs`` (the docs' per-architecture table) on one cheap architecture."""
    from lib_vram.cli.bench.upscale import ARCH_TILES, arch_rows, arch_table

    rows = arch_rows(["compact-x2"], tmp_path)
    assert [r["tile"] for r in rows] == ["auto", *ARCH_TILES]
    assert rows[0]["plan"].startswith("whole") and all(r["plan"].startswith("tiled") for r in rows[1:])
    assert all(r["max_err_lsb"] <= 1 and r["exact"] and r["kind"] == "local" for r in rows)
    table = arch_table(rows)
    assert table.splitlines()[0].startswith("| arch | spandrel | kind | grid |") and "| compact-x2 |" in table
