"""Tiled VAE engine on the real sgm (SDXL) ``Decoder``/``Encoder`` classes.

sgm is Stability-AI/generative-models (the WebUI v1.10.1 clones it at ``45c443b31673`` into
``repositories/generative-models``). It is on no package registry, so CI cannot install it and
nothing of it is copied here: point ``VRAM_GUARD_SGM_PATH`` at a checkout (the folder that holds
``sgm/``) to run this module; without it the whole module is skipped with one reason.

Only ``sgm/modules/diffusionmodules/model.py`` (and the two sgm modules it imports) are loaded:
``sgm/__init__`` pulls in lightning, kornia and open_clip, so the packages ``sgm``, ``sgm.modules``
and ``sgm.modules.diffusionmodules`` are registered as empty packages whose ``__path__`` points at
the checkout, for the duration of this module (removed again afterwards).

How out-of-memory errors are caused here (as in ``test_vae_engine.py``, plus an emulated card):

* a forward pre-hook on a real sgm conv raises a real ``torch.OutOfMemoryError`` when its input is
  larger than a limit (the untiled pass and too-large tiles fail; small tiles pass);
* an :class:`lib_vram.core.emulate.EmulatedCard` whose capacity lies between the peak of the sgm
  module's own untiled forward and the peak of a tiled pass (both measured on the card first): the
  allocation that crosses it raises ``torch.OutOfMemoryError``, in the sgm forward itself.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from tolerances import VAE_EXACT, reduced_precision
from vae_models import smooth_latent

from lib_vram.core.emulate import EmulatedCard
from lib_vram.vae import (
    TiledVAEConfig,
    VAEOutOfMemory,
    VAEReport,
    decoder_spec,
    encoder_spec,
    estimate_peak_bytes,
    is_supported_decoder,
    is_supported_encoder,
    tiled_decode,
    tiled_encode,
)

SGM_ENV = "VRAM_GUARD_SGM_PATH"
EXACT_TOL = VAE_EXACT
_PACKAGES = ("sgm", "sgm.modules", "sgm.modules.diffusionmodules")


def _sgm_root() -> Path | None:
    root = os.environ.get(SGM_ENV)
    if not root:
        return None
    return Path(root).expanduser()


def _skip_reason() -> str | None:
    root = _sgm_root()
    if root is None:
        return f"sgm not importable: set {SGM_ENV} to a Stability-AI/generative-models checkout"
    if not (root / "sgm" / "modules" / "diffusionmodules" / "model.py").is_file():
        return f"sgm not importable: {SGM_ENV}={root} has no sgm/modules/diffusionmodules/model.py"
    return None


if _skip_reason() is not None:
    pytest.skip(_skip_reason() or "", allow_module_level=True)


def import_sgm_model(root: Path):
    """Register ``sgm``, ``sgm.modules``, ``sgm.modules.diffusionmodules`` as empty packages whose
    ``__path__`` points into the checkout at ``root`` and import
    ``sgm.modules.diffusionmodules.model`` (undo with :func:`forget_sgm`)."""
    pkg = root / "sgm"
    paths = {
        "sgm": pkg,
        "sgm.modules": pkg / "modules",
        "sgm.modules.diffusionmodules": pkg / "modules" / "diffusionmodules",
    }
    for name in _PACKAGES:
        mod = types.ModuleType(name)
        mod.__path__ = [str(paths[name])]
        sys.modules[name] = mod
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # "no module 'xformers'. Processing without..."
            import sgm.modules.diffusionmodules.model as model
    except ImportError:
        forget_sgm()
        raise
    assert Path(model.__file__).resolve() == (paths["sgm.modules.diffusionmodules"] / "model.py").resolve()
    return model


def forget_sgm() -> None:
    for k in [k for k in sys.modules if k == "sgm" or k.startswith("sgm.")]:
        del sys.modules[k]


@pytest.fixture(scope="module")
def sgm_model():
    """``sgm.modules.diffusionmodules.model``, imported without ``sgm/__init__``."""
    root = _sgm_root()
    assert root is not None
    before = sorted(k for k in sys.modules if k == "sgm" or k.startswith("sgm."))
    if before:
        pytest.skip(f"sgm not importable here: another sgm is already imported ({before[0]})")
    try:
        model = import_sgm_model(root)
    except ImportError as exc:
        pytest.skip(f"sgm not importable: {exc}")
    yield model
    forget_sgm()


def _quiet():
    # sgm prints while building ("making attention of type ...", "Working with z of shape ...")
    return contextlib.redirect_stdout(io.StringIO())


def sgm_decoder(model, *, attn_type="vanilla", z_channels=4, ch_mult=(1, 2), num_res_blocks=1, seed=0, **kw):
    with _quiet():
        torch.manual_seed(seed)
        dec = model.Decoder(
            ch=32,
            out_ch=3,
            ch_mult=ch_mult,
            num_res_blocks=num_res_blocks,
            attn_resolutions=[],
            in_channels=3,
            resolution=64,
            z_channels=z_channels,
            attn_type=attn_type,
            **kw,
        )
    return dec.eval()


def sgm_encoder(model, *, attn_type="vanilla", z_channels=4, ch_mult=(1, 2), num_res_blocks=1, seed=0, **kw):
    with _quiet():
        torch.manual_seed(seed)
        enc = model.Encoder(
            ch=32,
            out_ch=3,
            ch_mult=ch_mult,
            num_res_blocks=num_res_blocks,
            attn_resolutions=kw.pop("attn_resolutions", []),
            in_channels=3,
            resolution=64,
            z_channels=z_channels,
            attn_type=attn_type,
            **kw,
        )
    return enc.eval()


def _ref(module, x):
    with torch.no_grad():
        return module(x)


def _image(b, h, w, seed):
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _err(a, b):
    return (a - b).abs().max().item()


# -- what the sgm classes are --------------------------------------------------------------------


def test_the_classes_are_sgms_own(sgm_model):
    """The modules under test come from the checkout, not from ldm (which has the same names)."""
    dec = sgm_decoder(sgm_model)
    assert type(dec).__module__ == "sgm.modules.diffusionmodules.model"
    assert type(dec.mid.attn_1).__module__ == "sgm.modules.diffusionmodules.model"
    # sgm-only API: the factory hooks SDXL/SVD decoders override
    assert callable(dec._make_attn) and callable(dec._make_resblock) and callable(dec._make_conv)
    spec = decoder_spec(dec)
    assert spec.layout == "ldm" and spec.factor == 2 and spec.in_channels == 4


# -- exactness, per attention variant ---------------------------------------------------------


@pytest.mark.parametrize("attn_type", ["vanilla", "none"])
@pytest.mark.parametrize("tile", [4, 7])
def test_decode_exact_matches_the_untiled_sgm_decoder(sgm_model, attn_type, tile):
    dec = sgm_decoder(sgm_model, attn_type=attn_type)
    expected = {"vanilla": "AttnBlock", "none": "Identity"}[attn_type]
    assert type(dec.mid.attn_1).__name__ == expected
    z = smooth_latent(2, 4, 13, 17)
    ref = _ref(dec, z)
    rep = VAEReport()
    out = tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=tile), report=rep)
    assert out.shape == ref.shape and out.dtype == z.dtype
    assert rep.tiles > 1 and rep.mode == "exact" and rep.layout == "ldm"
    assert _err(out, ref) <= EXACT_TOL


def test_decode_exact_sdxl_shaped_three_levels_and_flags(sgm_model):
    """Three resolution levels, two ResNets per level, ``nin_shortcut`` where channels change, and
    the decoder flags ``tanh_out``/``give_pre_end``."""
    for kw in ({}, {"tanh_out": True}, {"give_pre_end": True}):
        dec = sgm_decoder(sgm_model, ch_mult=(1, 2, 2), num_res_blocks=2, seed=1, **kw)
        z = smooth_latent(1, 4, 11, 9, seed=1)
        ref = _ref(dec, z)
        out = tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=4))
        assert out.shape == ref.shape, kw
        assert _err(out, ref) <= EXACT_TOL, kw


def test_decode_vanilla_xformers_block_equals_its_vanilla_twin(sgm_model):
    """``attn_type="vanilla-xformers"`` (what SDXL's config asks for) builds a
    ``MemoryEfficientAttnBlock``: the same q/k/v/proj_out weights, single-head softmax attention
    with scale C^-0.5, computed by ``xformers.ops.memory_efficient_attention``. The engine computes
    the attention itself, so it runs it without xformers; the reference is the block's own forward
    where xformers is installed, else the ``vanilla`` (SDP) decoder with the same weights."""
    xdec = sgm_decoder(sgm_model, attn_type="vanilla-xformers", seed=2)
    assert type(xdec.mid.attn_1).__name__ == "MemoryEfficientAttnBlock"
    vdec = sgm_decoder(sgm_model, attn_type="vanilla", seed=3)
    vdec.load_state_dict(xdec.state_dict())
    z = smooth_latent(1, 4, 12, 10, seed=2)
    if sgm_model.XFORMERS_IS_AVAILABLE:
        ref = _ref(xdec, z)
    else:
        with pytest.raises(NameError, match="xformers"):  # builds, but its forward needs xformers
            _ref(xdec, z)
        ref = _ref(vdec, z)
    assert is_supported_decoder(xdec)
    for mode, tile in (("exact", 4), ("auto", None)):
        out = tiled_decode(xdec, z, config=TiledVAEConfig(mode=mode, tile=tile, budget_bytes=2**40))
        assert _err(out, ref) <= EXACT_TOL, mode


@pytest.mark.parametrize("attn_type", ["vanilla", "vanilla-xformers", "none"])
@pytest.mark.parametrize("tile", [4, 6])
def test_encode_exact_matches_the_untiled_sgm_encoder(sgm_model, attn_type, tile):
    enc = sgm_encoder(sgm_model, attn_type=attn_type, ch_mult=(1, 2, 2))
    x = _image(2, 44, 62, seed=4)
    if attn_type == "vanilla-xformers" and not sgm_model.XFORMERS_IS_AVAILABLE:
        twin = sgm_encoder(sgm_model, attn_type="vanilla", ch_mult=(1, 2, 2), seed=9)
        twin.load_state_dict(enc.state_dict())
        ref = _ref(twin, x)
    else:
        ref = _ref(enc, x)
    rep = VAEReport()
    out = tiled_encode(enc, x, config=TiledVAEConfig(mode="exact", tile=tile), report=rep)
    assert out.shape == ref.shape == (2, 8, 11, 15)  # double_z: mean and logvar
    assert rep.tiles > 1
    assert _err(out, ref) <= EXACT_TOL


def test_linear_attention_variants_are_refused_with_the_reason(sgm_model):
    """sgm's ``"linear"`` and (through ``make_attn``'s ``type ==`` typo) ``"memory-efficient-cross-attn"``
    build a ``LinAttnBlock``: no GroupNorm, no residual, softmax over keys; the engine does not
    compute that, says so, and never runs a wrong decode."""
    for attn_type in ("linear", "memory-efficient-cross-attn"):
        dec = sgm_decoder(sgm_model, attn_type=attn_type)
        enc = sgm_encoder(sgm_model, attn_type=attn_type)
        assert type(dec.mid.attn_1).__name__ == "LinAttnBlock", attn_type
        assert not is_supported_decoder(dec) and not is_supported_encoder(enc)
        with pytest.raises(ValueError, match="mid.attn_1: unknown attention block LinAttnBlock"):
            tiled_decode(dec, smooth_latent(1, 4, 8, 8), config=TiledVAEConfig(mode="exact", tile=4))
        with pytest.raises(ValueError, match="mid.attn_1: unknown attention block LinAttnBlock"):
            tiled_encode(enc, _image(1, 32, 32, seed=5), config=TiledVAEConfig(mode="exact", tile=4))


def test_attention_outside_the_mid_block_is_refused(sgm_model):
    enc = sgm_encoder(sgm_model, attn_resolutions=[64])
    assert len(enc.down[0].attn) == 1
    assert not is_supported_encoder(enc)
    with pytest.raises(ValueError, match="down.0: attention outside the mid block"):
        tiled_encode(enc, _image(1, 32, 32, seed=6), config=TiledVAEConfig(mode="exact", tile=4))


# -- fast mode -----------------------------------------------------------------------------------


def test_fast_decode_exact_with_full_statistics_and_seamless_with_sampled_ones(sgm_model):
    dec = sgm_decoder(sgm_model, ch_mult=(1, 2, 2))
    z = smooth_latent(1, 4, 16, 12, seed=7)
    ref = _ref(dec, z)
    full = tiled_decode(dec, z, config=TiledVAEConfig(mode="fast", tile=8, fast_sample=1))
    assert _err(full, ref) <= EXACT_TOL
    a = tiled_decode(dec, z, config=TiledVAEConfig(mode="fast", tile=6, fast_sample=2))
    b = tiled_decode(dec, z, config=TiledVAEConfig(mode="fast", tile=8, fast_sample=2))
    assert _err(a, b) <= EXACT_TOL  # the tiling does not show
    assert _err(a, ref) > EXACT_TOL  # sampled statistics are an estimate (the test can fail)


def test_fast_encode_close_to_the_untiled_sgm_encoder(sgm_model):
    enc = sgm_encoder(sgm_model, ch_mult=(1, 2, 2))
    x = _image(1, 64, 48, seed=8)
    ref = _ref(enc, x)
    full = tiled_encode(enc, x, config=TiledVAEConfig(mode="fast", tile=4, fast_sample=1))
    assert _err(full, ref) <= EXACT_TOL
    est = tiled_encode(enc, x, config=TiledVAEConfig(mode="fast", tile=4))
    assert est.shape == ref.shape and torch.isfinite(est).all()
    assert _err(est, ref) > EXACT_TOL


# -- precision guard ---------------------------------------------------------------------------


def _blow_up(conv: torch.nn.Conv2d, factor: float = 1e5) -> None:
    """Scale a conv's weights so its output leaves float16's range (65504); the GroupNorm after it
    undoes the scale, so float32 stays finite (like SDXL's VAE, whose activations overflow fp16)."""
    with torch.no_grad():
        conv.weight.mul_(factor)
        conv.bias.mul_(factor)


def test_fp16_overflow_in_the_sgm_decoder_is_recomputed_in_float32(sgm_model):
    dec = sgm_decoder(sgm_model)
    _blow_up(dec.up[0].block[0].conv1)
    z = smooth_latent(1, 4, 10, 10, seed=8)
    ref = _ref(dec, z)
    assert torch.isfinite(ref).all()
    rep = VAEReport()
    cfg = TiledVAEConfig(mode="exact", tile=5, dtype=torch.float16, guard_dtype=torch.float32)
    out = tiled_decode(dec, z, config=cfg, report=rep)
    unguarded = tiled_decode(
        dec, z, config=TiledVAEConfig(mode="exact", tile=5, dtype=torch.float16, guard=False)
    )
    assert not torch.isfinite(unguarded).all()  # the weights really overflow fp16
    assert torch.isfinite(out).all() and out.dtype == torch.float32
    assert _err(out, ref) <= reduced_precision(torch.float16, ref.abs().max().item())
    assert rep.recomputed and len(rep.recomputed) == rep.tiles
    assert all(r.from_dtype == "float16" and r.to_dtype == "float32" for r in rep.recomputed)


def test_fp16_overflow_in_the_sgm_encoder_mid_block_is_recomputed(sgm_model):
    """The encoder's mid block runs on the whole latent (the "global" stage): the guard covers it."""
    enc = sgm_encoder(sgm_model)
    _blow_up(enc.mid.block_1.conv1)
    x = _image(1, 40, 40, seed=9)
    ref = _ref(enc, x)
    assert torch.isfinite(ref).all()
    rep = VAEReport()
    cfg = TiledVAEConfig(mode="exact", tile=5, dtype=torch.float16, guard_dtype=torch.float32)
    out = tiled_encode(enc, x, config=cfg, report=rep)
    assert torch.isfinite(out).all()
    assert _err(out, ref) <= reduced_precision(torch.float16, ref.abs().max().item())
    assert rep.recomputed and {r.stage for r in rep.recomputed} == {"global"}


# -- out of memory -------------------------------------------------------------------------------


class _OOMAbove:
    """Forward pre-hook that raises a real ``torch.OutOfMemoryError`` above an input size."""

    def __init__(self, limit_px: int) -> None:
        self.limit = limit_px
        self.raised = 0

    def __call__(self, module, inputs):
        x = inputs[0]
        if x.shape[-1] * x.shape[-2] > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.numel() * 4} bytes")


def test_oom_in_the_sgm_forward_then_tiles_retry_smaller_exactly(sgm_model):
    dec = sgm_decoder(sgm_model)
    # conv_out at 64x64 px fails, and so do tiles of 24 and 16 latent px (their conv_out inputs
    # exceed 20x20 px); 8-px tiles pass. (On a 16x16 latent the first tiled try is already t8: a
    # 16-px tile is the whole latent, which the untiled failure rules out.)
    z = smooth_latent(1, 4, 32, 32, seed=10)
    ref = _ref(dec, z)
    hook = _OOMAbove(limit_px=20 * 20)
    handle = dec.conv_out.register_forward_pre_hook(hook)
    try:
        rep = VAEReport()
        out = tiled_decode(
            dec,
            z,
            config=TiledVAEConfig(mode="auto", budget_bytes=2**40),
            original_forward=dec.forward,  # the sgm module's own untiled forward fails first
            report=rep,
        )
    finally:
        handle.remove()
    assert hook.raised >= 2
    assert rep.oom_retries[0] == 0 and len(rep.oom_retries) >= 2  # untiled, then too-large tiles
    assert rep.mode == "exact" and rep.tile is not None and rep.tile < 16
    assert _err(out, ref) <= EXACT_TOL


def test_oom_on_an_emulated_card_in_the_sgm_forward_then_tiles_fit(sgm_model):
    dec = sgm_decoder(sgm_model, ch_mult=(1, 2, 2))
    z = smooth_latent(1, 4, 16, 16, seed=11)
    ref = _ref(dec, z)

    def peak(fn) -> int:
        with EmulatedCard(2**40) as card, torch.no_grad():
            fn()
        return card.peak_bytes

    untiled = peak(lambda: dec(z))
    tiled = peak(lambda: tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=8)))
    assert tiled < untiled * 0.8, (tiled, untiled)  # precondition: a card size in between exists
    capacity = (tiled + untiled) // 2
    rep = VAEReport()
    with EmulatedCard(capacity) as card:
        out = tiled_decode(
            dec,
            z,
            config=TiledVAEConfig(mode="auto", budget_bytes=2**40),  # the plan thinks all fits
            original_forward=dec.forward,
            report=rep,
        )
    assert card.ooms >= 1 and "CUDA out of memory" in (card.last_oom or "")
    assert rep.oom_retries and rep.oom_retries[0] == 0  # the sgm forward itself hit the card's limit
    assert rep.mode == "exact" and rep.tile is not None
    assert card.peak_bytes <= capacity
    assert _err(out, ref) <= EXACT_TOL


def test_oom_at_every_tile_size_and_in_the_whole_latent_stage_are_named(sgm_model):
    dec = sgm_decoder(sgm_model)
    z = smooth_latent(1, 4, 8, 8, seed=12)
    handle = dec.conv_out.register_forward_pre_hook(_OOMAbove(limit_px=0))
    try:
        with pytest.raises(VAEOutOfMemory, match="out of memory even with the smallest tile"):
            tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=8))
    finally:
        handle.remove()
    handle = dec.mid.block_1.conv1.register_forward_pre_hook(_OOMAbove(limit_px=4 * 4))
    try:
        with pytest.raises(VAEOutOfMemory, match="whole-latent stage .* on a 1x8x8 latent"):
            tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=4))
    finally:
        handle.remove()
    out = tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=4))  # nothing left behind
    assert _err(out, _ref(dec, z)) <= EXACT_TOL


# -- planning ------------------------------------------------------------------------------------


def test_sgm_and_ldm_layouts_plan_alike(sgm_model):
    """The estimate reads the same spec from sgm as from ldm: same numbers for the same sizes."""
    from vae_models import ldm_decoder, ldm_encoder

    sdec = sgm_decoder(sgm_model, ch_mult=(1, 2, 2))
    ldec = ldm_decoder(ch_mult=(1, 2, 2))
    shape = (1, 4, 64, 64)
    for tile, mode in ((None, "untiled"), (16, "exact"), (16, "fast")):
        assert estimate_peak_bytes(sdec, shape, torch.float16, tile=tile, mode=mode) == estimate_peak_bytes(
            ldec, shape, torch.float16, tile=tile, mode=mode
        )
    senc, lenc = sgm_encoder(sgm_model), ldm_encoder()
    assert encoder_spec(senc).factor == encoder_spec(lenc).factor == 2
    img = (1, 3, 128, 128)
    assert estimate_peak_bytes(senc, img, torch.float32, tile=16, mode="exact") == estimate_peak_bytes(
        lenc, img, torch.float32, tile=16, mode="exact"
    )


def test_the_planner_dry_run_runs_the_engine_on_sgm_modules(sgm_model):
    """``predict_engine_vae`` runs the engine on fake tensors with the module's weights (what the
    planner does with the WebUI's SDXL VAE): it runs on sgm and predicts what it predicts for ldm."""
    from vae_models import ldm_decoder, ldm_encoder

    from lib_vram.cli.stageplan import predict_engine_vae

    pairs = (
        ("decode", sgm_decoder(sgm_model, ch_mult=(1, 2, 2)), ldm_decoder(ch_mult=(1, 2, 2)), (1, 4, 24, 20)),
        ("encode", sgm_encoder(sgm_model, ch_mult=(1, 2, 2)), ldm_encoder(ch_mult=(1, 2, 2)), (1, 3, 96, 80)),
    )
    for kind, sgm_mod, ldm_mod, shape in pairs:
        for tile in (None, 8):
            s = predict_engine_vae(sgm_mod, kind, shape, torch.float16, tile=tile)
            lp = predict_engine_vae(ldm_mod, kind, shape, torch.float16, tile=tile)
            assert s.raw_activation_bytes > 0, (kind, tile)
            assert s.raw_activation_bytes == lp.raw_activation_bytes, (kind, tile)
            assert s.weights_bytes == lp.weights_bytes


def test_mid_block_attention_chunked_and_fused_match_sgms_sdp_attention(sgm_model):
    """sgm's ``AttnBlock`` computes the mid-block attention with ``scaled_dot_product_attention``
    (ldm's with bmm + softmax). A 64x48 latent has 3072 tokens: its float32 score matrix (36 MiB) is
    above the engine's 32 MiB score limit, so without a fused kernel the engine chunks the queries;
    with the CPU flash kernel it makes one fused call. Both equal the sgm module's own output."""
    from lib_vram.vae._attention import cpu_flash_kernel

    dec = sgm_decoder(sgm_model, seed=13)
    z = smooth_latent(1, 4, 64, 48, seed=13)
    ref = _ref(dec, z)
    n = 64 * 48
    seen = {}
    for flash in (False, True):
        torch.backends.cuda.enable_flash_sdp(flash)
        try:
            rep = VAEReport()
            out = tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=32), report=rep)
        finally:
            torch.backends.cuda.enable_flash_sdp(True)
        seen[flash] = rep.attention_chunk
        assert _err(out, ref) <= EXACT_TOL, flash
    assert seen[False] is not None and seen[False] < n  # chunked: the N x N matrix never existed
    if cpu_flash_kernel(torch.float32):
        assert seen[True] == n  # one fused call


def test_decoders_built_through_sgms_factory_hooks(sgm_model):
    """sgm's ``Decoder`` builds its blocks through ``_make_resblock``/``_make_conv``/``_make_attn``
    (later sgm overrides them for a video decoder whose ResNets carry a ``time_stack``). A subclass
    whose blocks compute more than their plain parts is refused, naming the part; one that returns
    the plain classes through the hooks is tiled exactly."""

    class TimeStackResBlock(sgm_model.ResnetBlock):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.time_stack = torch.nn.Conv2d(self.out_channels, self.out_channels, 1)

        def forward(self, x, temb, **kwargs):
            h = super().forward(x, temb)
            return h + self.time_stack(h)

    class TimeDecoder(sgm_model.Decoder):
        def _make_resblock(self):
            return TimeStackResBlock

    class PlainHooksDecoder(sgm_model.Decoder):
        def _make_resblock(self):
            return sgm_model.ResnetBlock

        def _make_conv(self):
            return torch.nn.Conv2d

    kw = dict(ch=32, out_ch=3, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=[], in_channels=3)
    with _quiet():
        torch.manual_seed(14)
        timed = TimeDecoder(resolution=64, z_channels=4, **kw).eval()
        torch.manual_seed(14)
        plain = PlainHooksDecoder(resolution=64, z_channels=4, **kw).eval()
    z = smooth_latent(1, 4, 10, 12, seed=14)
    assert not is_supported_decoder(timed)
    with pytest.raises(ValueError, match="mid.block_1: TimeStackResBlock has parts .*: time_stack"):
        tiled_decode(timed, z, config=TiledVAEConfig(mode="exact", tile=4))
    out = tiled_decode(plain, z, config=TiledVAEConfig(mode="exact", tile=4))
    assert _err(out, _ref(plain, z)) <= EXACT_TOL
