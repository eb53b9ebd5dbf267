"""The WebUI's HyperTile and token merging in a guarded pass: predicted, not measured.

The pass is driven as in ``tests/test_webui_sampling.py`` (its helpers: the real tiny ldm UNet,
the emulated card) with the real patch on the UNet, applied with the WebUI's arguments: tomesd
0.1.3 (``sd_models.apply_token_merging``'s call) and the WebUI's own HyperTile module (from the
WebUI checkout, ``hypertile_hook_model`` as its script's ``configure_hypertile`` calls it; skipped
without the checkout). VRAM Guard reads their state off the UNet (:mod:`lib_vram.webui.selfattn`)
and plans the pass from the estimate with them, within its promise (15 % of the measured peak,
docs/sampling.md); a state it cannot read leaves the pass measured, as any extension's change.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_sampling_tokens import HYPERTILE_PY, hypertile  # noqa: F401 (the module fixture)
from test_webui_sampling import BIG, UNET, _need, _sampling, _stage, assert_clean, same_samples

MiB = 1 << 20
TOLERANCE = 0.15


@contextlib.contextmanager
def token_merging(ratio: float, **args: Any) -> Iterator[None]:
    """tomesd on the test's UNet as the WebUI applies it (``args`` override its arguments)."""
    import tomesd

    holder = torch.nn.Module()  # (sd_model: tomesd patches its .model.diffusion_model)
    holder.model = torch.nn.Module()
    holder.model.diffusion_model = UNET
    kw = dict(use_rand=False, merge_attn=True, merge_crossattn=False, merge_mlp=False) | args
    tomesd.apply_patch(holder, ratio=ratio, **kw)
    try:
        yield
    finally:
        tomesd.remove_patch(holder)


@contextlib.contextmanager
def hypertile_on(module: Any, *, swap: int) -> Iterator[None]:
    """The WebUI's HyperTile on the test's UNet (its defaults but ``swap``), undone after."""
    holder = torch.nn.Module()  # (sd_model.model: the layers are named diffusion_model.*)
    holder.diffusion_model = UNET
    module.hypertile_hook_model(holder, 192, 192, enable=True, tile_size_max=256, swap_size=swap, max_depth=3)
    wrapped = [m for m in UNET.modules() if hasattr(m, "__webui_hypertile_params")]
    try:
        assert wrapped
        yield
    finally:
        for m in wrapped:
            m.__dict__.pop("forward", None)
            delattr(m, "__webui_hypertile_params")
        delattr(holder, "__webui_hypertile_layers")


def _predicted(r: Any) -> float:
    plan = _stage(r, "sampling")[0]["plan"]
    m = re.search(r"\(predicted (\d+) MiB\)", plan)
    assert m is not None and "measured" not in plan, plan
    return float(m[1]) * MiB


def test_token_merging_is_predicted_and_runs_the_plain_picture():
    with token_merging(0.5):
        off = _sampling(BIG, guard_sampling=False)
        r = _sampling(BIG)
    stock = _sampling(BIG)
    assert off.error is None and r.error is None, (off.error, r.error)
    assert torch.equal(r.out[0], off.out[0])
    peak = _stage(r, "sampling")[0]["peak_bytes"]
    assert abs(_predicted(r) - peak) <= TOLERANCE * peak + MiB, (_predicted(r), peak)  # (MiB: rounding)
    assert _predicted(stock) > 1.5 * peak  # the stock prediction would not do
    assert not any("measured" in n for n in r.notes), r.notes
    assert_clean(r)


def test_token_merging_that_does_not_fit_whole_micro_batches_as_predicted():
    """Per sample (no random destinations): on a card its whole batch does not fit, the pass
    splits before its first step, as predicted, not after an out-of-memory error."""
    with token_merging(0.5):
        big = _sampling(BIG, guard_sampling=False)
        cap = big.resident_before + int(_need(big) * 0.75)
        r = _sampling(cap)
    assert r.error is None, r.error
    plan = _stage(r, "sampling")[0]["plan"]
    assert plan.startswith("micro-batch ") and "measured" not in plan, plan
    assert not any("ran out of memory" in n for n in r.notes), r.notes
    same_samples(r.out[0], big.out[0])
    assert_clean(r)


def test_token_merging_not_as_the_webui_applies_it_is_measured():
    """Cross-attention merging is not modelled: the pass runs whole on its measured first step."""
    with token_merging(0.5, merge_crossattn=True):
        r = _sampling(BIG)
    assert r.error is None, r.error
    plan = _stage(r, "sampling")[0]["plan"]
    assert "measured, not predicted" in plan and "token merging" in " ".join(r.notes), (plan, r.notes)
    assert_clean(r)


needs_webui = pytest.mark.skipif(
    not HYPERTILE_PY.is_file(), reason=f"the WebUI's HyperTile module is not at {HYPERTILE_PY}"
)


@needs_webui
def test_hypertile_is_predicted_and_its_random_tiles_keep_the_batch_whole(hypertile):  # noqa: F811
    """Swap size 3 (the default): each forward draws its tiles, so a micro-batch would draw other
    tiles than the WebUI's whole batch; the pass is predicted and never split."""
    with hypertile_on(hypertile, swap=3):
        hypertile.set_hypertile_seed(7)
        off = _sampling(BIG, guard_sampling=False)
        hypertile.set_hypertile_seed(7)
        r = _sampling(BIG)
        hypertile.set_hypertile_seed(7)
        tight = _sampling(off.resident_before + int(_need(off) * 0.75))
    assert off.error is None and r.error is None, (off.error, r.error)
    assert torch.equal(r.out[0], off.out[0])
    peak = _stage(r, "sampling")[0]["peak_bytes"]
    assert abs(_predicted(r) - peak) <= TOLERANCE * peak + MiB, (_predicted(r), peak)
    assert tight.error is not None and "HyperTile draws its tiles at random" in str(tight.error), tight.error
    assert "\n" not in str(tight.error)
    assert_clean(r)


@needs_webui
def test_hypertile_without_random_tiles_may_split(hypertile):  # noqa: F811
    with hypertile_on(hypertile, swap=1):
        big = _sampling(BIG, guard_sampling=False)
        r = _sampling(big.resident_before + int(_need(big) * 0.75))
    assert r.error is None, r.error
    plan = _stage(r, "sampling")[0]["plan"]
    assert plan.startswith("micro-batch ") and "measured" not in plan, plan
    same_samples(r.out[0], big.out[0])
    assert_clean(r)
