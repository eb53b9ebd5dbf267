"""Tiled upscaling engine: fidelity on real spandrel models, geometry, precision guard, OOM, PIL."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import image_like
from spandrel import ModelTiling, SizeRequirements
from tolerances import UPSCALE_LSB, levels, reduced_precision, rounding

from lib_vram.upscale import (
    Interrupted,
    UpscaleConfig,
    UpscaleError,
    UpscaleReport,
    as_spec,
    clear_calibration,
    upscale_tensor,
)
from lib_vram.upscale._engine import _axis_weights


def psnr_8bit(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a8, b8 = (a.float() * 255).round(), (b.float() * 255).round()
    mse = float(((a8 - b8) ** 2).mean())
    err = float((a8 - b8).abs().max())
    return (math.inf if mse == 0 else 10 * math.log10(255**2 / mse)), err


class Nearest(torch.nn.Module):
    """A real, context-free upscaler: nearest-neighbour x``s``. Tiled output must equal it exactly."""

    def __init__(self, s: int) -> None:
        super().__init__()
        self.up = torch.nn.Upsample(scale_factor=s, mode="nearest")

    def forward(self, x):
        return self.up(x)


# -- fidelity on real architectures ------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_compact", "tiny_rrdb"])
def test_tiled_matches_untiled_on_spandrel_models(fixture, request):
    model = request.getfixturevalue(fixture)
    x = image_like(45, 38)
    ref = model(x)
    rep = UpscaleReport()
    y = upscale_tensor(model, x, config=UpscaleConfig(tile=16, batch=3), report=rep)
    assert rep.tiled and rep.tiles_total == 9 and rep.overlap > 0
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert float(y.min()) >= 0.0 and float(y.max()) <= 1.0
    db, err = psnr_8bit(y, ref)
    assert db >= 60 and err <= UPSCALE_LSB, (db, err)
    # Each forward got a batch of equal-shaped windows; 9 tiles in batches of <= 3 -> >= 3 calls.
    assert 3 <= rep.forward_calls < 9


def test_untiled_path_is_the_descriptor_output(tiny_rrdb):
    x = image_like(21, 17)
    rep = UpscaleReport()
    y = upscale_tensor(tiny_rrdb, x, config=UpscaleConfig(), report=rep)
    assert not rep.tiled and rep.forward_calls == 1
    # the same network on the same tensor, clamped as spandrel clamps: the same operations
    assert torch.equal(y, tiny_rrdb(x))


def test_too_little_overlap_shows_seams(tiny_rrdb):
    """The fidelity test can fail: without overlap the tiled output visibly differs."""
    x = image_like(48, 48)
    ref = tiny_rrdb(x)
    y0 = upscale_tensor(tiny_rrdb, x, config=UpscaleConfig(tile=16, batch=4, overlap=0))
    y8 = upscale_tensor(tiny_rrdb, x, config=UpscaleConfig(tile=16, batch=4, overlap=8))
    assert psnr_8bit(y0, ref)[0] < psnr_8bit(y8, ref)[0] - 10


@pytest.mark.parametrize(("tile", "overlap"), [(8, 0), (8, 3), (16, 6), (10, 8), (64, 4)])
def test_blend_weights_are_a_partition_of_unity(tile, overlap):
    x = image_like(37, 29)
    model = Nearest(3)
    y = upscale_tensor(model, x, scale=3, config=UpscaleConfig(tile=tile, overlap=overlap, batch=2))
    # a pixel is the sum of <= 4 copies of the same value (<= 1) times weights wy * wx that sum to 1:
    # each weight is 2 roundings per axis off, each product 2 and the sum 3 more
    torch.testing.assert_close(y, model(x), atol=rounding(4 * 2 + 2 + 3), rtol=0)


def test_axis_weights_cross_fade_only_inside_the_overlap():
    lo, hi, w = _axis_weights(10, 20, 40, 2, 4, torch.device("cpu"))
    assert (lo, hi) == (16, 44)  # core [20, 40) in output px, grown by half the 8-px feather
    assert w is not None and float(w[8:-8].min()) == 1.0 and float(w[0]) < 0.2 and float(w[-1]) < 0.2
    _, _, w_next = _axis_weights(20, 30, 40, 2, 4, torch.device("cpu"))
    # each weight is (p - a) / fs in float32 (2 roundings), their sum one more
    torch.testing.assert_close(w[-8:] + w_next[:8], torch.ones(8), atol=rounding(2 + 2 + 1), rtol=0)


# -- size requirements ----------------------------------------------------------------------------


class Checked(torch.nn.Module):
    """Conv + PixelShuffle x2 that refuses inputs violating its size requirements."""

    def __init__(self, req: SizeRequirements) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.conv = torch.nn.Conv2d(3, 12, 3, padding=1)
        self.shuffle = torch.nn.PixelShuffle(2)
        self.size_requirements = req
        self.seen: list[tuple[int, int]] = []

    def forward(self, x):
        h, w = x.shape[-2:]
        self.seen.append((h, w))
        if not self.size_requirements.check(w, h):
            raise AssertionError(f"illegal input {h}x{w}")
        return torch.sigmoid(self.shuffle(self.conv(x)))


@pytest.mark.parametrize(
    "req",
    [
        SizeRequirements(multiple_of=8),
        SizeRequirements(minimum=24),
        SizeRequirements(square=True),
        SizeRequirements(minimum=16, multiple_of=4, square=True),
    ],
)
@pytest.mark.parametrize(("h", "w", "tile"), [(50, 35, 16), (5, 3, 16), (1, 1, 8), (40, 70, 200)])
def test_size_requirements_are_met(req, h, w, tile):
    model = Checked(req)
    x = image_like(h, w)
    y = upscale_tensor(model, x, scale=2, config=UpscaleConfig(tile=tile, overlap=4, batch=2))
    assert y.shape == (1, 3, 2 * h, 2 * w)
    assert model.seen and all(req.check(sw, sh) for sh, sw in model.seen)
    # Away from the padded bottom/right border the result is the model's own.
    from spandrel.__helpers.size_req import pad_tensor

    _, xp = pad_tensor(x, req)
    with torch.no_grad():
        ref = model(xp)[..., : 2 * h, : 2 * w]
    inner = (slice(None), slice(None), slice(0, max(1, 2 * h - 8)), slice(0, max(1, 2 * w - 8)))
    assert psnr_8bit(y[inner], ref[inner])[1] <= UPSCALE_LSB


def test_spandrel_descriptor_with_requirements_and_tiny_images(tiny_compact):
    tiny_compact.size_requirements = SizeRequirements(minimum=8, multiple_of=4)
    for h, w in [(1, 1), (3, 7), (9, 13)]:
        x = image_like(h, w)
        y = upscale_tensor(tiny_compact, x, config=UpscaleConfig())
        assert torch.equal(y, tiny_compact(x))  # untiled: the same padding, network and clamp


def test_internal_tiling_means_one_pass(tiny_compact):
    tiny_compact.tiling = ModelTiling.INTERNAL
    rep = UpscaleReport()
    upscale_tensor(tiny_compact, image_like(40, 40), config=UpscaleConfig(tile=16), report=rep)
    assert not rep.tiled and rep.forward_calls == 1


def test_discouraged_tiling_uses_largest_tile_that_fits(tiny_compact, monkeypatch):
    """Automatic tiles are capped at ``AUTO_TILE_MAX`` except for ``DISCOURAGED`` models. The cap is
    lowered to 32 so that a small image shows it: both runs must tile (a whole-image run would make
    the comparison vacuous), the supported one at the cap, the discouraged one above it."""
    from lib_vram.upscale import _plan

    monkeypatch.setattr(_plan, "AUTO_TILE_MAX", 32)
    x = image_like(192, 192)
    rep_s, rep_d = UpscaleReport(), UpscaleReport()
    budget = 4 * 2**20  # a 192² whole-image pass does not fit; a ~100 px tile does
    # an overlap beyond the model's context: an exact plan (a smaller one is flagged inexact, and an
    # inexact model gets the largest tile like a discouraged one)
    cfg = UpscaleConfig(budget_bytes=budget, overlap=16)
    upscale_tensor(tiny_compact, x, config=cfg, report=rep_s)
    tiny_compact.tiling = ModelTiling.DISCOURAGED
    upscale_tensor(tiny_compact, x, config=cfg, report=rep_d)
    assert rep_s.exact and rep_d.exact, (rep_s.notes, rep_d.notes)
    assert rep_s.tiled and rep_d.tiled, (rep_s.plan, rep_d.plan)
    assert rep_s.tile == 32 and rep_d.tile > 32, (rep_s.plan, rep_d.plan)


# -- memory planning --------------------------------------------------------------------------------


def test_tile_and_batch_follow_the_budget_and_calibration_is_cached(tiny_compact):
    clear_calibration()
    calls = []
    tiny_compact.model.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape))
    x = image_like(96, 96)
    small, big = UpscaleReport(), UpscaleReport()
    upscale_tensor(tiny_compact, x, config=UpscaleConfig(budget_bytes=2**20), report=small)
    probes = len(calls) - small.forward_calls
    assert probes >= 2, small  # bytes/px probe + context probes, measured once
    calls.clear()
    upscale_tensor(tiny_compact, x, config=UpscaleConfig(budget_bytes=60 * 2**20), report=big)
    assert len(calls) == big.forward_calls  # no second calibration
    assert small.tiled and small.bytes_per_px > 0
    win = small.tile + 2 * small.overlap
    assert win * win * small.bytes_per_px * small.batch <= small.budget_bytes
    assert not big.tiled  # everything fits: no tiling at all


# -- precision guard -------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_nonfinite_batch_is_recomputed_in_fp32(tiny_compact, precision):
    x = image_like(40, 40)
    ref = upscale_tensor(tiny_compact, x, config=UpscaleConfig(tile=16, batch=2, overlap=4, precision="fp32"))
    state = {"calls": 0}

    def overflow(module, args, out):
        if out.dtype in (torch.float16, torch.bfloat16):
            state["calls"] += 1
            if state["calls"] == 2:  # the second reduced-precision batch overflows
                return out * torch.tensor(float("inf"), dtype=out.dtype)
        return None

    cfg = UpscaleConfig(tile=16, batch=2, overlap=4, precision=precision)
    upscale_tensor(tiny_compact, x, config=cfg)  # the probes run once per model and dtype (cached)
    tiny_compact.model.body[0].register_forward_hook(overflow)
    rep = UpscaleReport()
    y = upscale_tensor(tiny_compact, x, config=cfg, report=rep)
    assert rep.recomputed_batches == 1 and rep.dtype == ("float16" if precision == "fp16" else "bfloat16")
    assert rep.forward_calls == math.ceil(rep.tiles_total / 2) + 1
    assert bool(torch.isfinite(y).all())
    # reduced-precision rounding only (the output is <= 1)
    assert psnr_8bit(y, ref)[1] <= levels(reduced_precision(getattr(torch, rep.dtype)))
    assert next(tiny_compact.model.parameters()).dtype == torch.float32  # model put back


def test_unsupported_precision_is_an_error(tiny_compact):
    tiny_compact.supports_half = False
    with pytest.raises(ValueError, match="`precision`"):
        upscale_tensor(tiny_compact, image_like(8, 8), config=UpscaleConfig(precision="fp16"))


# -- out of memory ---------------------------------------------------------------------------------


def _oom_above(limit_px: int, after: int = 0):
    """A forward pre-hook raising the allocator's OOM error for inputs above ``limit_px`` pixels
    (batch x height x width), but only after ``after`` successful calls."""
    log: list[tuple[int, int, int, bool]] = []

    def hook(module, args):
        n, _, h, w = args[0].shape
        ok = sum(1 for e in log if e[3])
        fail = ok >= after and n * h * w > limit_px
        log.append((n, h, w, not fail))
        if fail:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    return hook, log


def test_oom_halves_batch_then_tile_and_keeps_finished_tiles(tiny_compact):
    x = image_like(96, 96)
    ref = tiny_compact(x)
    hook, log = _oom_above(limit_px=30 * 30, after=2)
    cfg = UpscaleConfig(tile=32, batch=2, overlap=4)
    upscale_tensor(tiny_compact, x, config=cfg)  # the probes run once per model (cached)
    tiny_compact.model.register_forward_pre_hook(hook)
    rep = UpscaleReport()
    y = upscale_tensor(tiny_compact, x, config=cfg, report=rep)
    fails = [e for e in log if not e[3]]
    assert rep.ooms == len(fails) == 2
    assert rep.events == ["out of memory: batch -> 1", "out of memory: tile -> 16"]
    # The two batches done before memory ran short (4 of the 9 tiles of 32) were not recomputed.
    done_big = [e for e in log if e[3] and e[1] > 24]
    assert len(done_big) == 2 and sum(e[0] for e in done_big) == 4
    # The other 5 tiles were split into 4 tiles of 16 px each and done one at a time.
    assert rep.tiles_done == rep.tiles_total == 4 + 5 * 4
    assert len([e for e in log if e[3]]) == 2 + 20
    assert rep.tile == 16 and rep.batch == 1
    db, err = psnr_8bit(y, ref)
    assert db >= 60 and err <= UPSCALE_LSB


def test_oom_at_the_smallest_tile_is_a_clear_error(tiny_compact):
    hook, _ = _oom_above(limit_px=1)
    tiny_compact.model.register_forward_pre_hook(hook)
    with pytest.raises(UpscaleError, match="out of memory even with one"):
        upscale_tensor(tiny_compact, image_like(40, 40), config=UpscaleConfig(tile=32, batch=1, overlap=4))


def test_other_errors_propagate_unchanged(tiny_compact):
    def boom(module, args):
        raise RuntimeError("shape mismatch in layer 3")

    tiny_compact.model.register_forward_pre_hook(boom)
    rep = UpscaleReport()
    with pytest.raises(RuntimeError, match="shape mismatch"):
        upscale_tensor(tiny_compact, image_like(40, 40), config=UpscaleConfig(tile=16, overlap=4), report=rep)
    assert rep.ooms == 0


# -- interrupt, progress, tracker --------------------------------------------------------------------


def test_interrupt_raises_and_keeps_partial_result(tiny_compact):
    seen = []
    rep = UpscaleReport()
    with pytest.raises(Interrupted):
        upscale_tensor(
            tiny_compact,
            image_like(48, 48),
            config=UpscaleConfig(tile=16, batch=2, overlap=4, precision="bf16"),
            progress=lambda d, t: seen.append((d, t)),
            should_interrupt=lambda: len(seen) >= 2,
            report=rep,
        )
    assert seen == [(2, 9), (4, 9)] and rep.tiles_done == 4
    assert rep.partial is not None and rep.partial.shape == (1, 3, 96, 96)
    assert float(rep.partial[..., :16, :16].mean()) > 0 and float(rep.partial[..., -8:, -8:].abs().max()) == 0
    assert next(tiny_compact.model.parameters()).dtype == torch.float32


def test_tracker_records_the_stage_and_plan(tiny_compact):
    from lib_vram.core.tracker import StageTracker

    tracker = StageTracker("cpu", owns_peak_counters=True)
    cfg = UpscaleConfig(tile=16, overlap=4)
    upscale_tensor(tiny_compact, image_like(32, 32), config=cfg, tracker=tracker)
    rec = tracker.last("upscale")
    assert rec is not None and rec.ok and rec.plan.startswith("tiled t16 o4")


# -- inputs and configuration ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"tile": 4}, "`tile`"),
        ({"batch": 0}, "`batch`"),
        ({"overlap": -1}, "`overlap`"),
        ({"precision": "fp8"}, "`precision`"),
        ({"accumulate_on": "disk"}, "`accumulate_on`"),
        ({"budget_bytes": 0}, "`budget_bytes`"),
    ],
)
def test_config_validation_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        UpscaleConfig(**kwargs)


def test_bad_inputs_are_rejected(tiny_compact):
    with pytest.raises(ValueError, match="`x`"):
        upscale_tensor(tiny_compact, torch.rand(3, 8, 8))
    with pytest.raises(ValueError, match="`x`"):
        upscale_tensor(tiny_compact, torch.rand(1, 4, 8, 8))
    with pytest.raises(ValueError, match="`scale`"):
        upscale_tensor(Nearest(2), torch.rand(1, 3, 8, 8))
    with pytest.raises(UpscaleError, match="expected scale 3"):
        upscale_tensor(Nearest(2), torch.rand(1, 3, 8, 8), scale=3)


def test_runs_under_fake_tensor_mode(tiny_compact):
    """The planner helper predicts peaks by running the engine on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = as_spec(tiny_compact)
    assert spec.scale == 2
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.rand(1, 3, 300, 200))
        cfg = UpscaleConfig(tile=64, batch=4, overlap=8, check_finite=False, calibrate=False)
        y = upscale_tensor(tiny_compact, x, config=cfg)
    assert tuple(y.shape) == (1, 3, 600, 400)
