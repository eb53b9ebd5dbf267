"""Tiled upscaling equals the untiled model for every spandrel architecture, or falls back visibly.

Every model is a real spandrel architecture with random weights, saved to a file and loaded back
through spandrel (both ESRGAN key formats). The matrix covers every image-to-image architecture
spandrel 0.3.4 registers (``lib_vram.cli.models.archs``; the ones not built are listed here with
the reason): tiled at most 1 LSB from spandrel's own untiled call while the report says exact, or
flagged inexact with a note - never a crash. Which models are flagged is decided by behaviour (the
reach and batch probes of :mod:`lib_vram.upscale._calibrate`), never by class names: a model whose
output depends on the whole image (DCTLSA's cyclic shift, RealCUGAN's squeeze-excitation) runs
untiled when it fits and carries a note (``report.exact`` False, plan ``inexact``) when forced to
tile; a model that takes one image at a time (DRUNet) runs so and says it in the plan.
"""

from __future__ import annotations

import logging
import math
from unittest import mock

import pytest
import torch
from conftest import image_like

from lib_vram.cli.models.archs import BUILDERS, build, save_and_load
from lib_vram.planning import planner
from lib_vram.upscale import (
    ModelCache,
    UpscaleConfig,
    UpscaleError,
    UpscaleReport,
    as_spec,
    clear_calibration,
    load_model,
    measure_context,
    upscale_tensor,
)
from lib_vram.upscale._calibrate import Context, measure_reach
from lib_vram.upscale._engine import signature
from lib_vram.upscale._types import TileError

LOCAL = ["compact-x1", "compact-x2", "span", "rrdb-x4", "rrdb-x2", "rrdb-x1", "plksr", "safmn"]
WINDOWED = ["swinir", "ditn"]
GLOBAL = ["dctlsa", "realcugan"]
"""Tiles cannot equal the whole image: DCTLSA's Swin blocks shift with an unmasked cyclic
``torch.roll`` (the image's far side wraps onto its border), RealCUGAN averages over the whole image
(squeeze-excitation). Found by the reach probe, whatever the classes are called."""
CASES = [((75, 58), 24), ((64, 48), 40)]
"""(image size, tile): not a multiple of any window (8, 16), and a multiple of both; tiles that
divide neither."""

SPANDREL_ID = {
    n: getattr(b, "arch", "Compact" if n.startswith("compact") else "ESRGAN") for n, b in BUILDERS.items()
}
"""The spandrel architecture id each builder's file loads as."""
NOT_BUILT = {
    "GFPGAN": "face restoration (refused like RestoreFormer): its StyleGAN2 decoder is fixed at 512 px "
    "and 512 style features, too large to build for a test",
    "LaMa": "inpainting (spandrel gives a masked-image descriptor, refused at load): its generator has "
    "fixed widths (27 M parameters), too large to build for a test",
}
"""spandrel 0.3.4 architectures without a builder here, and why."""


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
    ("name", "grid", "pads"), [("drct", 16, False), ("swin2sr", 8, True), ("omnisr", 8, True)]
)
def test_model_grid(models, name, grid, pads):
    spec = as_spec(models(name))
    assert spec.grid == grid and (spec.pre_pad is not None) == pads


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
def test_whole_image_models_fall_back_visibly(models, name):
    model = models(name)
    spec = as_spec(model)
    x = image_like(44, 37, seed=1)
    ref = _untiled(model, x)
    # Fits: untiled, exact.
    rep = UpscaleReport()
    y = upscale_tensor(model, x, config=UpscaleConfig(overlap=_overlap(spec)), report=rep)
    assert not rep.tiled and rep.exact and not rep.notes
    assert psnr_8bit(y, ref)[1] <= 1
    # Forced to tile: it runs, and says why it may differ.
    rep = UpscaleReport()
    upscale_tensor(model, x, config=UpscaleConfig(tile=16, overlap=_overlap(spec), batch=4), report=rep)
    assert rep.tiled and not rep.exact and rep.plan.endswith("inexact")
    assert rep.notes and spec.name in rep.notes[0] and "whole image" in rep.notes[0], rep.notes


def test_cyclic_shift_shows_only_at_the_border(models):
    """DCTLSA's unmasked roll: the interior is unaffected by far content, the border is not; with
    the reach probe switched off the tiled output is off by many LSB while the report says exact
    (the silent error the probe exists for)."""
    model = models("dctlsa")
    spec = as_spec(model)
    cpu = torch.device("cpu")
    with spec.placed(cpu, torch.float32):
        why = measure_reach(spec, cpu, torch.float32, _overlap(spec))
    assert why is not None and "border" in why, why
    x = image_like(75, 58, seed=3)
    ref = _untiled(model, x)
    cfg = UpscaleConfig(tile=24, overlap=_overlap(spec), batch=4)
    # Both behaviour probes off (the reach probe, and the margin check a user-set overlap gets):
    # what the engine would have claimed without them.
    with (
        mock.patch("lib_vram.upscale._calibrate.measure_reach", return_value=None),
        mock.patch("lib_vram.upscale._calibrate.measure_margin", return_value=None),
    ):
        clear_calibration()
        rep = UpscaleReport()
        y = upscale_tensor(model, x, config=cfg, report=rep)
    clear_calibration()
    assert rep.exact and psnr_8bit(y, ref)[1] > 4
    # With them, the same call is flagged: not exact, and a note that says why.
    rep = UpscaleReport()
    upscale_tensor(model, x, config=cfg, report=rep)
    clear_calibration()
    assert not rep.exact and rep.notes, rep


def test_one_image_at_a_time_model_tiles_and_says_so(models):
    """DRUNet's spandrel wrapper adds a noise map of batch 1: a batch of 2 raises. Found by the
    batch probe; probes and tiles then run one image at a time, and the plan says so."""
    model = models("drunet")
    x = image_like(75, 58, seed=2)
    ref = _untiled(model, x)
    rep = UpscaleReport()
    y = upscale_tensor(model, x, config=UpscaleConfig(tile=24, batch=4), report=rep)
    assert rep.tiled and rep.batch == 1 and "b1 (model takes one image at a time)" in rep.plan, rep.plan
    assert rep.exact and psnr_8bit(y, ref)[1] <= 1
    # Two images at once (colour and alpha): also one per call, untiled.
    x2 = torch.cat([x, image_like(75, 58, seed=9)])
    rep = UpscaleReport()
    y2 = upscale_tensor(model, x2, config=UpscaleConfig(), report=rep)
    assert not rep.tiled and rep.forward_calls == 2
    assert psnr_8bit(y2[1:], _untiled(model, x2[1:]))[1] <= 1


def test_one_image_at_a_time_is_learned_from_a_failing_batch_without_calibration(models):
    model = models("drunet")
    x = image_like(64, 48, seed=2)
    rep = UpscaleReport()
    y = upscale_tensor(
        model, x, config=UpscaleConfig(tile=16, batch=4, overlap=16, calibrate=False), report=rep
    )
    assert (
        rep.batch == 1 and "one image at a time" in rep.plan and any("a batch of 4" in e for e in rep.events)
    )
    assert psnr_8bit(y, _untiled(model, x))[1] <= 1


class SmallTilesFail(torch.nn.Module):
    """A model that refuses inputs under 40 px (an undeclared size requirement), else x2 nearest."""

    def forward(self, x):
        if min(x.shape[-2:]) < 40:
            raise RuntimeError(f"input {tuple(x.shape[-2:])} smaller than the model's patch")
        return torch.nn.functional.interpolate(x, scale_factor=2, mode="nearest")


def test_a_model_that_fails_on_tiles_runs_untiled_when_it_fits():
    model = SmallTilesFail()
    x = image_like(64, 56)
    rep = UpscaleReport()
    y = upscale_tensor(model, x, scale=2, config=UpscaleConfig(tile=16, overlap=4, batch=1), report=rep)
    torch.testing.assert_close(y, model(x))
    assert not rep.tiled and rep.exact
    assert (
        len(rep.notes) == 1 and "SmallTilesFail fails on a" in rep.notes[0] and "ran untiled" in rep.notes[0]
    )
    # Does not fit untiled: one line naming the model and the reason.
    with pytest.raises(
        TileError, match=r"SmallTilesFail fails on a .*smaller than the model's patch.*does not fit"
    ):
        upscale_tensor(
            model, x, scale=2, config=UpscaleConfig(tile=16, overlap=4, batch=1, budget_bytes=4096)
        )


def test_cli_upscales_with_a_one_image_at_a_time_model(tmp_path, capsys):
    """``python -m lib_vram upscale`` with DRUNet on an RGBA image (colour and alpha are one batch of
    2 for the model): it finishes, tiled, and the plan line says one image at a time."""
    import numpy as np
    from PIL import Image

    from lib_vram.cli import main

    save_and_load(build("drunet"), tmp_path / "drunet.safetensors")
    arr = (image_like(40, 36, seed=1)[0].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
    img = Image.fromarray(arr, "RGB").convert("RGBA")
    img.putalpha(128)
    img.save(tmp_path / "in.png")
    argv = ["upscale", tmp_path / "in.png", tmp_path / "out.png", "--model", tmp_path / "drunet.safetensors"]
    assert main([str(a) for a in [*argv, "--tile", "16"]]) == 0
    out = capsys.readouterr().out
    assert "b1 (model takes one image at a time)" in out and Image.open(tmp_path / "out.png").mode == "RGBA"


# -- every architecture spandrel 0.3.4 registers ---------------------------------------------------


def _matrix_image(spec, channels: int) -> torch.Tensor:
    """An image a few tiles large for this model: at least 52 px, and a window of the model's size
    requirement and grid (Uformer: 128) plus 8 px, so that there are tiles to compare."""
    m = math.lcm(max(1, spec.multiple_of), max(1, spec.grid))
    side = max(52, m + 8)
    return image_like(side, side if spec.square else side - 6, channels=channels, seed=5)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_architecture_tiles_exactly_or_says_why(models, name):
    """The promise for every image-to-image architecture: tiled (16-px cores, 32 px of overlap,
    batches of 4) within 1 LSB of spandrel's untiled call while the report says exact, or flagged
    inexact with a note naming the model - never a crash."""
    model = models(name)
    assert model.architecture.id == SPANDREL_ID[name]
    spec = as_spec(model)
    x = _matrix_image(spec, spec.input_channels or 3)
    ref = _untiled(model, x)
    rep = UpscaleReport()
    overlap = -(-32 // spec.grid) * spec.grid  # given: the context calibration is tested above
    y = upscale_tensor(model, x, config=UpscaleConfig(tile=16, batch=4, overlap=overlap), report=rep)
    db, err = psnr_8bit(y, ref)
    assert rep.tiled and rep.tiles_total > 1, rep.plan
    if rep.exact:
        assert err <= 1, (name, rep.plan, db, err)
    else:
        assert rep.plan.endswith("inexact") and rep.notes and spec.name in rep.notes[0], (rep.plan, rep.notes)


def test_the_matrix_covers_every_registered_architecture():
    import spandrel

    registered = {a.architecture.id for a in spandrel.MAIN_REGISTRY.architectures()}
    covered = set(SPANDREL_ID.values()) | {"RestoreFormer"} | set(NOT_BUILT)
    assert registered == covered, (registered - covered, covered - registered)


def test_face_restoration_models_are_refused_in_one_line(tmp_path):
    path = tmp_path / "rf.safetensors"
    descriptor = save_and_load(build("restoreformer"), path)
    with pytest.raises(UpscaleError) as err:
        load_model(path, cache=ModelCache())
    text = str(err.value)
    assert text.startswith("rf.safetensors: a RestoreFormer face restoration model") and "\n" not in text
    assert "not an image-to-image upscaler" in text
    with pytest.raises(ValueError, match="RestoreFormer face restoration model"):
        as_spec(descriptor)


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
