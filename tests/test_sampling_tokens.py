"""HyperTile and token merging in the sampling estimate, against the real patches on the real UNet.

The real ldm ``UNetModel`` at reduced width (as in ``tests/test_sampling_estimate.py``) runs on fake
tensors under the live-byte counter with the patch applied as the WebUI v1.10.1 applies it:

* token merging: tomesd 0.1.3 (the WebUI's pin, a test requirement), ``tomesd.apply_patch`` with
  the WebUI's arguments (``modules/sd_models.py``: ``use_rand=False``, ``merge_attn=True``, no
  cross-attention or MLP merging, tomesd's default ``max_downsample=1``);
* HyperTile: the WebUI's own module (``extensions-builtin/hypertile/hypertile.py``, imported from
  the WebUI checkout at ``$VRAM_GUARD_WEBUI``, default ``/work/webui``: the acceptance host;
  skipped without it), ``hypertile_hook_model`` with the WebUI's settings.

The predicted activations must be within the estimate's promise for the stock forward, 15 % of
the counted ones (docs/sampling.md, "How it is checked"). HyperTile with a swap size over 1 draws
its tile counts at random: the estimate counts the largest tiles it may draw, so there the count of
every draw must stay at or below the prediction (and within 15 % of it for the largest draw).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from lib_vram.cli.models.unet import attention_applied, build_unet, context_arg, host_forward
from lib_vram.core.livebytes import LiveBytesCounter
from lib_vram.core.predict import fake_call, fake_state, new_fake_mode
from lib_vram.sampling import HyperTile, SelfAttention, TokenMerging, estimate_sampling, unet_spec

TOLERANCE = 0.15
"""The estimate's promise for the stock forward (docs/sampling.md, "How it is checked")."""
TOKENS = 77
CTX = 96
WEBUI = Path(os.environ.get("VRAM_GUARD_WEBUI", "/work/webui"))
HYPERTILE_PY = WEBUI / "extensions-builtin" / "hypertile" / "hypertile.py"


def _fresh(shape: str):
    """A UNet of its own for each case (the patches leave attributes on the modules)."""
    unet = build_unet(shape, 32, context_dim=CTX)
    mode = new_fake_mode()
    return unet, mode, fake_call(unet, fake_state(unet, mode, torch.float32))


def _count(unet, mode, call, shape: str, attention: str, batch: int, hw: tuple[int, int]) -> int:
    with mode:
        x = torch.empty(batch, 4, *hw)
        t = torch.empty(batch)
        c = torch.empty(batch, TOKENS, CTX)
    counter = LiveBytesCounter(None)
    fwd = host_forward(attention, lambda: float(1 << 50) - counter.live_bytes, "cuda", False)
    with attention_applied(unet, fwd), torch.no_grad(), mode, counter:
        out = call(x, t, context_arg(shape, c))
        del out
    return counter.peak_bytes


def _predict(unet, attention: str, batch: int, hw: tuple[int, int], sa: SelfAttention | None) -> int:
    est = estimate_sampling(
        unet_spec(unet), batch=batch, latent_hw=hw, context_tokens=TOKENS, attention=attention,
        dtype=torch.float32, self_attention=sa,
    )  # fmt: skip
    return est.activation_bytes


# -- token merging (tomesd) --------------------------------------------------------------------


def _measure_tome(shape: str, attention: str, batch: int, hw: tuple[int, int], ratio: float) -> tuple:
    import tomesd

    unet, mode, call = _fresh(shape)
    holder = torch.nn.Module()  # tomesd patches "the highest level object" (sd_model.model.diffusion_model)
    holder.model = torch.nn.Module()
    holder.model.diffusion_model = unet
    plain = _count(unet, mode, call, shape, attention, batch, hw)
    tomesd.apply_patch(
        holder, ratio=ratio, use_rand=False, merge_attn=True, merge_crossattn=False, merge_mlp=False
    )
    try:
        assert type(unet.input_blocks[1][1].transformer_blocks[0]).__name__ == "ToMeBlock"
        got = _count(unet, mode, call, shape, attention, batch, hw)
    finally:
        tomesd.remove_patch(holder)
    return plain, got


@pytest.mark.parametrize(
    ("shape", "attention", "batch", "hw", "ratio"),
    [
        ("sd15", "sdp", 2, (40, 40), 0.5),
        ("sd15", "none", 2, (40, 40), 0.5),
        ("sd15", "doggettx", 1, (24, 32), 0.3),
        ("sd2", "sub-quadratic", 2, (48, 40), 0.7),
        ("sd2", "invokeai", 4, (24, 32), 0.9),
        ("sd15", "sdp", 1, (96, 96), 0.5),
    ],
)
def test_token_merging_within_15_percent(shape, attention, batch, hw, ratio):
    plain, got = _measure_tome(shape, attention, batch, hw, ratio)
    unet = build_unet(shape, 32, context_dim=CTX, meta=True)
    want = _predict(unet, attention, batch, hw, SelfAttention(merging=TokenMerging(ratio)))
    assert abs(want - got) <= TOLERANCE * got, (want, got, plain)


def test_token_merging_changes_the_count_both_ways():
    """The check can fail: merging shrinks ldm's own einsum attention by far more than the
    tolerance, and with SDP (no score matrix) its similarity matrix makes the peak larger."""
    unet = build_unet("sd15", 32, context_dim=CTX, meta=True)
    sa = SelfAttention(merging=TokenMerging(0.5))
    plain_none, got_none = _measure_tome("sd15", "none", 2, (40, 40), 0.5)
    assert got_none < (1 - 2 * TOLERANCE) * plain_none
    assert _predict(unet, "none", 2, (40, 40), None) > (1 + TOLERANCE) * got_none
    plain_sdp, got_sdp = _measure_tome("sd15", "sdp", 1, (96, 96), 0.5)
    assert got_sdp > (1 + TOLERANCE) * plain_sdp
    assert _predict(unet, "sdp", 1, (96, 96), None) < (1 - TOLERANCE) * got_sdp
    assert _predict(unet, "sdp", 1, (96, 96), sa) > (1 - TOLERANCE) * got_sdp


def test_token_merging_off_is_the_stock_estimate():
    unet = build_unet("sd15", 32, context_dim=CTX, meta=True)
    stock = _predict(unet, "none", 2, (40, 40), None)
    assert _predict(unet, "none", 2, (40, 40), SelfAttention()) == stock
    assert _predict(unet, "none", 2, (40, 40), SelfAttention(merging=TokenMerging(0.0))) == stock


def test_token_merging_rule():
    """tomesd merges ``int(N x ratio)`` tokens, at most the non-destination ones, at the blocks of
    the full latent resolution only (the WebUI's ``max_downsample=1``)."""
    tm = TokenMerging(0.5)
    assert tm.merged((64, 64), 64 * 64) == (2048, 1024)
    assert tm.merged((64, 64), 32 * 32) == (0, 0)  # level 1: downsampled 2x
    assert TokenMerging(0.9).merged((64, 64), 4096) == (4096 - 1024, 1024)  # capped at the sources
    assert TokenMerging(0.5, max_downsample=2).merged((64, 64), 32 * 32)[0] == 512
    for bad in (-0.1, 1.0, "0.5", True):
        with pytest.raises(ValueError, match="ratio"):
            TokenMerging(bad)


# -- HyperTile (the WebUI's module) ------------------------------------------------------------

needs_webui = pytest.mark.skipif(
    not HYPERTILE_PY.is_file(), reason=f"the WebUI's HyperTile module is not at {HYPERTILE_PY}"
)


@pytest.fixture(scope="module")
def hypertile() -> types.ModuleType:
    """The WebUI v1.10.1's ``hypertile`` module (its code unchanged, imported from the checkout);
    taken out of ``sys.modules`` again afterwards."""
    name = "hypertile"
    saved = sys.modules.get(name)
    spec = importlib.util.spec_from_file_location(name, HYPERTILE_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclass looks its module up)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


def _measure_hypertile(hypertile, shape, attention, batch, hw, ht: HyperTile, seed: int = 0) -> int:
    unet, mode, call = _fresh(shape)
    with mode:
        x = torch.empty(batch, 4, *hw)
        t = torch.empty(batch)
        c = torch.empty(batch, TOKENS, CTX)
    counter = LiveBytesCounter(None)
    fwd = host_forward(attention, lambda: float(1 << 50) - counter.live_bytes, "cuda", False)
    with attention_applied(unet, fwd):
        hypertile.set_hypertile_seed(seed)
        hypertile.hypertile_hook_model(
            unet, hw[1] * 8, hw[0] * 8, enable=True, tile_size_max=ht.max_tile_px, swap_size=ht.swap,
            max_depth=ht.max_depth, is_sdxl=ht.sdxl,
        )  # fmt: skip
        wrapped = [m for m in unet.modules() if hasattr(m, "__webui_hypertile_params")]
        try:
            assert wrapped
            with torch.no_grad(), mode, counter:
                out = call(x, t, context_arg(shape, c))
                del out
        finally:
            for m in wrapped:
                m.forward = getattr(m, "__webui_hypertile_params").forward
                delattr(m, "__webui_hypertile_params")
            delattr(unet, "__webui_hypertile_layers")
    return counter.peak_bytes


HYPERTILE_CASES = [
    # shape, attention, batch, latent, settings
    ("sd15", "none", 2, (40, 40), HyperTile(swap=1)),
    ("sd15", "sdp", 2, (40, 40), HyperTile(swap=1)),
    ("sd15", "doggettx", 1, (128, 128), HyperTile(max_tile_px=128, swap=1)),
    ("sd15", "none", 1, (48, 80), HyperTile(max_tile_px=128, swap=1)),
    ("sd15", "invokeai", 1, (128, 128), HyperTile(max_tile_px=0, max_depth=1, swap=1)),
    ("sd2", "sub-quadratic", 2, (64, 64), HyperTile(max_tile_px=128, swap=1)),
    ("sdxl", "none", 1, (128, 128), HyperTile(max_tile_px=128, swap=1, sdxl=True)),
    ("sdxl", "split-v1", 2, (64, 96), HyperTile(swap=1, sdxl=True)),
]


@needs_webui
@pytest.mark.parametrize(("shape", "attention", "batch", "hw", "ht"), HYPERTILE_CASES)
def test_hypertile_within_15_percent(hypertile, shape, attention, batch, hw, ht):
    got = _measure_hypertile(hypertile, shape, attention, batch, hw, ht)
    unet = build_unet(shape, 32, context_dim=CTX, meta=True)
    want = _predict(unet, attention, batch, hw, SelfAttention(hypertile=ht))
    assert abs(want - got) <= TOLERANCE * got, (want, got)


@needs_webui
def test_hypertile_random_draws_stay_below_the_prediction(hypertile, monkeypatch):
    """Swap size 3 (the WebUI's default): each seed draws other tile counts; the estimate counts
    the largest tiles, so no draw exceeds it, and a draw that leaves a full-resolution layer whole
    (the largest tile) comes within 15 % of it. The module's own draws are recorded (its function
    still draws them) to see which seed leaves a layer whole."""
    ht = HyperTile(max_tile_px=128)  # 512 px: tiles of 16, 32 or 64 latent px at level 0
    unet = build_unet("sd15", 32, context_dim=CTX, meta=True)
    want = _predict(unet, "none", 1, (64, 64), SelfAttention(hypertile=ht))
    draws: list[tuple[int, int]] = []
    real = hypertile.random_divisor

    def recorded(value: int, least: int, options: int = 1) -> int:
        n = real(value, least, options)
        draws.append((value, n))
        return n

    monkeypatch.setattr(hypertile, "random_divisor", recorded)
    got, whole = [], None
    for seed in range(40):
        draws.clear()
        got.append(_measure_hypertile(hypertile, "sd15", "none", 1, (64, 64), ht, seed))
        level0 = [n for v, n in draws if v == 64]
        if (1, 1) in zip(level0[::2], level0[1::2]):
            whole = got[-1]
            break
    assert whole is not None, "no seed of 40 left a full-resolution layer whole"
    assert all(g <= want * (1 + TOLERANCE) for g in got), (want, got)
    assert abs(want - whole) <= TOLERANCE * whole, (want, whole, got)
    assert min(got) < (1 - TOLERANCE) * whole  # the draws differ: the check sees the swap


@needs_webui
def test_hypertile_shrinks_the_quadratic_attention(hypertile):
    """The check can fail: with ldm's own attention HyperTile's tiles cut the count far below the
    stock prediction."""
    ht = HyperTile(swap=1)
    got = _measure_hypertile(hypertile, "sd15", "none", 2, (40, 40), ht)
    unet = build_unet("sd15", 32, context_dim=CTX, meta=True)
    assert _predict(unet, "none", 2, (40, 40), None) > 2 * got


def test_hypertile_rule():
    """Tile sizes and layers as the WebUI's module chooses them (checked against the module itself
    by the tests above)."""
    ht = HyperTile()  # max tile 256 px, depth 3, swap 3
    # 1024x1024: tile 256 px = 32 latent px; level 0 (128x128 tokens) cut into 128/64 = 2 per side
    # at the largest draw (tiles of 32, 64 or 128 as swap 3 allows: 64 is not the largest)
    assert ht.split(0, 128 * 128, (1024, 1024)) == (1, False)
    assert HyperTile(swap=1).split(0, 128 * 128, (1024, 1024)) == (16, True)
    assert HyperTile(swap=2).split(0, 128 * 128, (1024, 1024)) == (4, True)
    assert HyperTile(swap=1).split(1, 64 * 64, (1024, 1024)) == (1, False)  # tile 64 at depth 1
    assert HyperTile(swap=1, max_depth=0).split(1, 64 * 64, (1024, 1024)) == (1, False)
    assert ht.depth_of(("input", 1), 0) == 0 and ht.depth_of(("output", 3), 0) == 2
    assert ht.depth_of(("input", 1), 1) is None and ht.depth_of(("middle", 0), 0) == 3
    xl = HyperTile(sdxl=True)
    assert xl.depth_of(("input", 4), 1) == 1 and xl.depth_of(("output", 0), 9) == 1
    assert xl.depth_of(("input", 1), 0) is None and xl.depth_of(("middle", 0), 3) == 2
    for bad in (dict(max_tile_px=-1), dict(max_depth=4), dict(swap=65), dict(swap=1.5)):
        with pytest.raises(ValueError, match="HyperTile"):
            HyperTile(**bad)
