"""Tiled VAE engine against the real ldm and diffusers VAE classes (CPU, tiny channel counts)."""

from __future__ import annotations

import pytest
import torch
from conftest import learned_keys
from tolerances import VAE_EXACT, reduced_precision, rounding
from vae_models import diffusers_vae, ldm_decoder, ldm_encoder, smooth_latent

from lib_vram.core.tracker import StageTracker
from lib_vram.planning import planner
from lib_vram.vae import (
    Interrupted,
    TiledVAEConfig,
    VAEOutOfMemory,
    VAEReport,
    attention,
    estimate_peak_bytes,
    is_supported_decoder,
    is_supported_encoder,
    tiled_decode,
    tiled_encode,
)

EXACT_TOL = VAE_EXACT


def _ref(module, x):
    with torch.no_grad():
        return module(x)


# -- exactness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tile", [4, 7])
def test_ldm_decode_exact_matches_untiled_odd_shape_batch2(tile):
    dec = ldm_decoder()
    z = smooth_latent(2, 4, 13, 17)
    ref = _ref(dec, z)
    rep = VAEReport()
    out = tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=tile), report=rep)
    assert out.shape == ref.shape and out.dtype == z.dtype
    assert rep.tiles > 1 and rep.mode == "exact"
    assert (out - ref).abs().max().item() < EXACT_TOL


def test_ldm_decode_16_channels_two_levels():
    dec = ldm_decoder(16, ch_mult=(1, 2, 2), num_res_blocks=2)
    z = smooth_latent(1, 16, 11, 9, seed=1)
    ref = _ref(dec, z)
    out = tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=4))
    assert (out - ref).abs().max().item() < EXACT_TOL


def test_ldm_decoder_flags_give_pre_end_and_tanh_out():
    for kw in ({"tanh_out": True}, {"give_pre_end": True}):
        dec = ldm_decoder(**kw)
        z = smooth_latent(1, 4, 10, 12, seed=2)
        ref = _ref(dec, z)
        out = tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=4))
        assert out.shape == ref.shape, kw
        assert (out - ref).abs().max().item() < EXACT_TOL, kw


def test_ldm_vanilla_xformers_block_is_tiled_without_xformers():
    """ldm's ``attn_type="vanilla-xformers"`` builds a ``MemoryEfficientAttnBlock`` (what the WebUI
    gets where xformers is installed): the same weights as ``vanilla``; the engine computes the
    attention itself, so its output equals the vanilla twin's forward."""
    xdec = ldm_decoder(attn_type="vanilla-xformers", seed=3)
    assert type(xdec.mid.attn_1).__name__ == "MemoryEfficientAttnBlock"
    vdec = ldm_decoder(attn_type="vanilla", seed=4)
    assert type(vdec.mid.attn_1).__name__ == "AttnBlock"
    vdec.load_state_dict(xdec.state_dict())
    z = smooth_latent(1, 4, 12, 10, seed=24)
    out = tiled_decode(xdec, z, config=TiledVAEConfig(mode="exact", tile=4))
    assert (out - _ref(vdec, z)).abs().max().item() < EXACT_TOL


@pytest.mark.parametrize("latent_channels", [4, 16])
def test_diffusers_decode_exact(latent_channels):
    vae = diffusers_vae(latent_channels)
    z = smooth_latent(2, latent_channels, 9, 14, seed=3)
    ref = _ref(vae.decoder, z)
    out = tiled_decode(vae.decoder, z, config=TiledVAEConfig(mode="exact", tile=4))
    assert (out - ref).abs().max().item() < EXACT_TOL


@pytest.mark.parametrize("tile", [4, 6])
def test_ldm_encode_exact_odd_image(tile):
    enc = ldm_encoder(ch_mult=(1, 2, 2))
    x = torch.rand(2, 3, 44, 62, generator=torch.Generator().manual_seed(4)) * 2 - 1
    ref = _ref(enc, x)
    rep = VAEReport()
    out = tiled_encode(enc, x, config=TiledVAEConfig(mode="exact", tile=tile), report=rep)
    assert out.shape == ref.shape and rep.tiles > 1
    assert (out - ref).abs().max().item() < EXACT_TOL


def test_diffusers_encode_exact():
    vae = diffusers_vae(16)
    x = torch.rand(1, 3, 36, 44, generator=torch.Generator().manual_seed(5)) * 2 - 1
    ref = _ref(vae.encoder, x)
    out = tiled_encode(vae.encoder, x, config=TiledVAEConfig(mode="exact", tile=10))
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < EXACT_TOL


def test_engine_never_calls_the_module_forward():
    """The WebUI glue installs tiled_decode as `decoder.forward`: the engine must not recurse."""
    dec = ldm_decoder()
    z = smooth_latent(1, 4, 8, 8, seed=6)
    ref = _ref(dec, z)

    def boom(*a, **k):
        raise AssertionError("engine called decoder.forward")

    dec.forward = boom
    for cfg in (TiledVAEConfig(mode="exact", tile=4), TiledVAEConfig(mode="auto")):
        out = tiled_decode(dec, z, config=cfg)
        assert (out - ref).abs().max().item() < EXACT_TOL


# -- fast mode -------------------------------------------------------------------------------------


def test_fast_mode_is_seamless_and_exact_with_full_statistics():
    dec = ldm_decoder(ch_mult=(1, 2, 2))
    z = smooth_latent(1, 4, 16, 12, seed=7)
    ref = _ref(dec, z)
    # Statistics from the whole image: fast mode is then exact.
    full = tiled_decode(dec, z, config=TiledVAEConfig(mode="fast", tile=8, fast_sample=1))
    assert (full - ref).abs().max().item() < EXACT_TOL
    # Sampled statistics: every tile uses the same ones, so the tiling does not show at all --
    # two different tilings give the same image (no seams by construction).
    a = tiled_decode(dec, z, config=TiledVAEConfig(mode="fast", tile=6, fast_sample=2))
    b = tiled_decode(dec, z, config=TiledVAEConfig(mode="fast", tile=8, fast_sample=2))
    assert (a - b).abs().max().item() < EXACT_TOL
    assert (a - ref).abs().max().item() > EXACT_TOL  # it is an estimate (the test can fail)


def test_fast_decoder_runs_first_level_globally_and_estimates_the_rest_from_it():
    dec = ldm_decoder(ch_mult=(1, 2, 2))
    z = smooth_latent(1, 4, 16, 16, seed=3)
    ref = _ref(dec, z)
    steps: list[tuple[int, int]] = []
    exact_rep, fast_rep = VAEReport(), VAEReport()
    tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=8), report=exact_rep)
    fast = tiled_decode(
        dec,
        z,
        config=TiledVAEConfig(mode="fast", tile=8),
        report=fast_rep,
        progress=lambda d, t: steps.append((d, t)),
    )
    crops = tiled_decode(dec, z, config=TiledVAEConfig(mode="fast", tile=8, fast_estimate="crops"))
    # The first level's ResNets left the tiles: a smaller halo (2 convs per ResNet less).
    assert fast_rep.halo == exact_rep.halo - 2 * len(dec.up[-1].block)
    # Subsampling the exact first-level output estimates the statistics better than crops.
    err = ((fast - ref) ** 2).mean().item()
    assert err < ((crops - ref) ** 2).mean().item()
    assert err > 0
    # The progress count covers the extra global ResNets exactly.
    assert steps[-1][0] == steps[-1][1]


# -- precision guard -----------------------------------------------------------------------------


def _overflow_hook(module, inputs, output):
    # Scales activations far beyond float16's range (65504); the next GroupNorm undoes the scale.
    return output * 1e5


def test_fp16_overflow_is_recomputed_in_the_wider_dtype():
    dec = ldm_decoder()
    z = smooth_latent(1, 4, 10, 10, seed=8)
    conv = dec.up[0].block[0].conv1
    handle = conv.register_forward_hook(_overflow_hook)
    try:
        ref = _ref(dec, z)  # fp32 with the same hook
        assert torch.isfinite(ref).all()
        rep = VAEReport()
        cfg = TiledVAEConfig(mode="exact", tile=5, dtype=torch.float16, guard_dtype=torch.float32)
        out = tiled_decode(dec, z, config=cfg, report=rep)
        unguarded = tiled_decode(
            dec, z, config=TiledVAEConfig(mode="exact", tile=5, dtype=torch.float16, guard=False)
        )
    finally:
        handle.remove()
    assert not torch.isfinite(unguarded).all()  # the hook really overflows fp16
    assert torch.isfinite(out).all()
    # fp16 everywhere but the recomputed segment: fp16 rounding of the output's magnitude
    assert (out - ref).abs().max().item() <= reduced_precision(torch.float16, ref.abs().max().item())
    assert rep.recomputed, "the guard did not report a recompute"
    assert {r.step for r in rep.recomputed} == {rep.recomputed[0].step}  # only that segment
    assert len(rep.recomputed) == rep.tiles  # once per tile, nothing else
    assert all(r.from_dtype == "float16" and r.to_dtype == "float32" for r in rep.recomputed)


def test_fp32_non_finite_output_is_reported_once_not_recomputed():
    """fp32 has nothing wider: no per-segment checks, one check of the output, a note."""
    dec = ldm_decoder()
    z = smooth_latent(1, 4, 10, 10, seed=10)
    conv = dec.up[0].block[0].conv1
    handle = conv.register_forward_hook(lambda m, i, out: out.index_fill(1, torch.tensor([0]), float("nan")))
    try:
        rep = VAEReport()
        out = tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=5), report=rep)
    finally:
        handle.remove()
    assert not torch.isfinite(out).all()
    assert not rep.recomputed
    assert any("non-finite values in the output" in n for n in rep.notes)
    clean = VAEReport()
    tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=5), report=clean)
    assert not any("non-finite" in n for n in clean.notes)


def test_bf16_guard_default_and_bf16_compute():
    dec = ldm_decoder()
    z = smooth_latent(1, 4, 10, 10, seed=9)
    ref = _ref(dec, z)
    out = tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=5, dtype=torch.bfloat16))
    assert out.dtype == torch.float32
    assert (out - ref).abs().max().item() <= reduced_precision(torch.bfloat16, ref.abs().max().item())
    handle = dec.up[0].block[0].conv1.register_forward_hook(_overflow_hook)
    try:
        rep = VAEReport()
        out = tiled_decode(
            dec, z, config=TiledVAEConfig(mode="exact", tile=5, dtype=torch.float16), report=rep
        )
    finally:
        handle.remove()
    assert torch.isfinite(out).all() and rep.recomputed
    assert rep.recomputed[0].to_dtype == "bfloat16"  # bf16 where supported (CPU supports it)


# -- auto mode, out of memory ----------------------------------------------------------------------


class _OOMAbove:
    """Forward pre-hook that raises a real torch.OutOfMemoryError above an input size."""

    def __init__(self, limit_px: int) -> None:
        self.limit = limit_px
        self.raised = 0

    def __call__(self, module, inputs):
        x = inputs[0]
        if x.shape[-1] * x.shape[-2] > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.numel() * 4} bytes")


def test_auto_mode_retries_smaller_after_oom_and_remembers():
    dec = ldm_decoder()
    z = smooth_latent(1, 4, 16, 16, seed=10)
    ref = _ref(dec, z)
    hook = _OOMAbove(limit_px=20 * 20)  # conv_out at full res (32x32) is above, 16x16-core tiles are not
    handle = dec.conv_out.register_forward_pre_hook(hook)
    try:
        rep = VAEReport()
        out = tiled_decode(dec, z, config=TiledVAEConfig(mode="auto", budget_bytes=2**40), report=rep)
        assert hook.raised >= 1
        assert rep.oom_retries and rep.mode == "exact" and rep.tile is not None and rep.tile < 16
        assert (out - ref).abs().max().item() < EXACT_TOL
        learned = [o for k in learned_keys(planner.MEMORY) for o in planner.MEMORY.history(k)]
        # the untiled try (the engine at tile = the whole latent: 16) failed, then the retries
        assert [o.candidate.tile for o in learned if o.oom] == [*rep.oom_retries, None]
        assert [o.candidate.tile for o in learned if not o.oom] == [rep.tile]
        # With the host forward as the untiled path: it OOMs, the engine tiles, using what it learned.
        rep2 = VAEReport()
        out2 = tiled_decode(
            dec,
            z,
            config=TiledVAEConfig(mode="auto", budget_bytes=2**40),
            original_forward=dec.forward,
            report=rep2,
        )
        assert (out2 - ref).abs().max().item() < EXACT_TOL
        assert rep2.tile == rep.tile and not rep2.oom_retries
    finally:
        handle.remove()


def test_oom_at_every_size_raises_a_named_error():
    dec = ldm_decoder()
    z = smooth_latent(1, 4, 8, 8, seed=11)
    handle = dec.conv_out.register_forward_pre_hook(_OOMAbove(limit_px=0))
    try:
        with pytest.raises(VAEOutOfMemory, match="out of memory"):
            tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=8))
    finally:
        handle.remove()


@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_oom_in_the_whole_latent_stage_is_named_and_released(kind, monkeypatch):
    from lib_vram.vae import _api, encoder_spec

    released = []
    monkeypatch.setattr(_api, "release", lambda device: released.append(device))
    module = ldm_decoder() if kind == "decode" else ldm_encoder()
    # the mid block's first conv runs on the whole latent in every mode and at every tile size
    hook = _OOMAbove(limit_px=8 * 8)
    handle = module.mid.block_1.conv1.register_forward_pre_hook(hook)
    run = tiled_decode if kind == "decode" else tiled_encode
    f = 1 if kind == "decode" else encoder_spec(module).factor  # image px per latent px
    big = (
        smooth_latent(1, 4, 12, 12, seed=21) if kind == "decode" else torch.rand(1, 3, 12 * f, 12 * f) * 2 - 1
    )
    small = smooth_latent(1, 4, 8, 8, seed=22) if kind == "decode" else torch.rand(1, 3, 8 * f, 8 * f) * 2 - 1
    try:
        for mode in ("exact", "fast", "auto"):
            rep = VAEReport()
            with pytest.raises(VAEOutOfMemory, match="whole-latent stage") as info:
                run(module, big, config=TiledVAEConfig(mode=mode, tile=4, budget_bytes=2**40), report=rep)
            assert "on a 1x12x12 latent" in str(info.value), info.value
            assert rep.oom_retries == [] and any("whole-latent" in n for n in rep.notes)
        assert hook.raised >= 3 and len(released) >= 3
        # nothing left behind: a latent whose mid block fits runs, exactly
        ref = _ref(module, small)
        out = run(module, small, config=TiledVAEConfig(mode="exact", tile=4))
        assert (out - ref).abs().max().item() < EXACT_TOL
    finally:
        handle.remove()


def test_auto_mode_untiled_when_it_fits_and_tiles_when_not():
    dec = ldm_decoder()
    z = smooth_latent(1, 4, 16, 16, seed=12)
    ref = _ref(dec, z)
    calls = []

    def host_forward(x):
        calls.append(x.shape)
        return ref

    rep = VAEReport()
    out = tiled_decode(
        dec,
        z,
        config=TiledVAEConfig(mode="auto", budget_bytes=2**40),
        original_forward=host_forward,
        report=rep,
    )
    assert calls and rep.mode == "untiled" and out is ref
    untiled = estimate_peak_bytes(dec, tuple(z.shape), torch.float32, tile=None, mode="untiled")
    rep = VAEReport()
    out = tiled_decode(dec, z, config=TiledVAEConfig(mode="auto", budget_bytes=untiled // 3), report=rep)
    assert rep.mode == "exact" and rep.tiles > 1
    assert (out - ref).abs().max().item() < EXACT_TOL


def test_estimate_grows_with_tile_and_exact_tiles_are_smaller_than_untiled():
    dec = ldm_decoder(ch_mult=(1, 2, 2))
    shape = (1, 4, 256, 256)
    ests = [estimate_peak_bytes(dec, shape, torch.float16, tile=t, mode="fast") for t in (16, 32, 64)]
    assert ests == sorted(ests)
    untiled = estimate_peak_bytes(dec, shape, torch.float16, tile=None, mode="untiled")
    assert estimate_peak_bytes(dec, shape, torch.float16, tile=32, mode="fast") < untiled / 3


# -- interrupt, progress, tracker -----------------------------------------------------------------


def test_interrupt_stops_between_tiles():
    dec = ldm_decoder()
    z = smooth_latent(1, 4, 12, 12, seed=13)
    seen = []
    state = {"n": 0}

    def should_interrupt():
        state["n"] += 1
        return state["n"] > 5

    with pytest.raises(Interrupted):
        tiled_decode(
            dec,
            z,
            config=TiledVAEConfig(mode="exact", tile=4),
            should_interrupt=should_interrupt,
            progress=lambda d, t: seen.append((d, t)),
        )
    assert seen and seen[-1][0] < seen[-1][1]  # stopped part-way
    # The module is untouched: a normal decode afterwards is exact.
    out = tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=4))
    assert (out - _ref(dec, z)).abs().max().item() < EXACT_TOL


def test_progress_reaches_total_and_tracker_records_stage():
    dec = ldm_decoder()
    z = smooth_latent(1, 4, 12, 12, seed=14)
    seen = []
    tracker = StageTracker("cpu")
    tiled_decode(
        dec,
        z,
        config=TiledVAEConfig(mode="exact", tile=4),
        progress=lambda d, t: seen.append((d, t)),
        tracker=tracker,
    )
    assert seen[-1][0] == seen[-1][1]
    rec = tracker.last("vae_decode")
    assert rec is not None and rec.ok and rec.plan and rec.plan.startswith("exact t4")


# -- support checks, validation -----------------------------------------------------------------


def test_supported_layouts_and_clear_errors():
    assert is_supported_decoder(ldm_decoder()) and is_supported_encoder(ldm_encoder())
    vae = diffusers_vae()
    assert is_supported_decoder(vae.decoder) and is_supported_encoder(vae.encoder)
    assert not is_supported_decoder(torch.nn.Conv2d(4, 4, 3))
    with pytest.raises(ValueError, match="`decoder`"):
        tiled_decode(torch.nn.Conv2d(4, 4, 3), torch.zeros(1, 4, 8, 8), config=TiledVAEConfig())
    with pytest.raises(ValueError, match="`z`"):
        tiled_decode(ldm_decoder(), torch.zeros(1, 5, 8, 8), config=TiledVAEConfig())
    for bad in (
        {"mode": "fastest"},
        {"tile": 0},
        {"state_offload": "disk"},
        {"budget_bytes": -1},
        {"fast_sample": 0},
    ):
        with pytest.raises(ValueError, match="`" + next(iter(bad)) + "`"):
            TiledVAEConfig(**bad)


def test_blocks_with_parts_the_engine_does_not_compute_are_refused_by_name():
    """A block that does more than its plain parts (later sgm's video decoder: a ResNet with a
    ``time_stack``, a ``conv_out`` with a Conv3d inside, an attention block with a ``time_mix_block``)
    would be run wrongly from those parts: refused, naming the part; the plain module still runs."""
    cases = (
        ("up.0.block.0", "time_stack", lambda d: d.up[0].block[0]),
        ("conv_out", "time_mix_conv", lambda d: d.conv_out),
        ("mid.attn_1", "time_mix_block", lambda d: d.mid.attn_1),
    )
    for where, part, pick in cases:
        dec = ldm_decoder()
        setattr(pick(dec), part, torch.nn.Conv2d(4, 4, 1))
        assert not is_supported_decoder(dec), where
        with pytest.raises(ValueError, match=f"{where}: .* parts the engine does not compute: {part}"):
            tiled_decode(dec, smooth_latent(1, 4, 8, 8), config=TiledVAEConfig(mode="exact", tile=4))
    enc = ldm_encoder()
    enc.down[0].block[0].time_stack = torch.nn.Conv2d(4, 4, 1)
    assert not is_supported_encoder(enc)
    # hooks and instance attributes that are not modules change nothing
    dec = ldm_decoder()
    handle = dec.up[0].block[0].conv1.register_forward_pre_hook(lambda m, i: None)
    dec.mid.attn_1.attention_op = None
    try:
        assert is_supported_decoder(dec)
    finally:
        handle.remove()


def test_resnet_blocks_holding_their_silu_as_swish_forges_layout_run_exactly():
    """Forge's ``backend.nn.vae.ResnetBlock`` holds its activation as a child ``swish =
    nn.SiLU(inplace=True)`` (otherwise ldm's layout): accepted and exact (the real Forge classes:
    ``tests/test_vae_forge.py``); a ``swish`` that is not a SiLU is refused by name."""
    dec, enc = ldm_decoder(), ldm_encoder()
    for m in (*dec.modules(), *enc.modules()):
        if type(m).__name__ == "ResnetBlock":
            m.swish = torch.nn.SiLU(inplace=True)
    assert is_supported_decoder(dec) and is_supported_encoder(enc)
    z = smooth_latent(1, 4, 10, 10, seed=3)
    out = tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=4))
    assert (out - _ref(dec, z)).abs().max().item() < EXACT_TOL
    dec.up[0].block[0].swish = torch.nn.GELU()
    with pytest.raises(ValueError, match="up.0.block.0: activation `swish` is GELU, not SiLU"):
        tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=4))


def test_cpu_state_offload_setting_is_exact():
    dec = ldm_decoder()
    z = smooth_latent(1, 4, 10, 10, seed=15)
    out = tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=4, state_offload="cpu"))
    assert (out - _ref(dec, z)).abs().max().item() < EXACT_TOL


def test_parked_state_is_accounted_while_tiles_wait():
    """Parked bytes (what a GPU would hold in CPU memory) are reported and counted while tiles
    wait at a GroupNorm, and nothing stays counted afterwards; device-resident state parks nothing."""
    from lib_vram.vae import parked_bytes

    dec = ldm_decoder()
    z = smooth_latent(1, 4, 12, 12, seed=16)
    seen: list[int] = []
    hook = dec.conv_out.register_forward_hook(lambda *_: seen.append(parked_bytes()))
    try:
        rep = VAEReport()
        tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=4, state_offload="cpu"), report=rep)
        assert rep.state_offload == "cpu"
        assert rep.parked_peak_bytes > 0
        assert max(seen) > 0
        assert parked_bytes() == 0
        seen.clear()
        rep2 = VAEReport()
        tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=4, state_offload="device"), report=rep2)
        assert rep2.parked_peak_bytes == 0 and max(seen) == 0
    finally:
        hook.remove()


def test_runs_under_fake_tensor_mode_without_guard():
    """The planner dry-runs the engine on fake tensors: no data-dependent Python with guard=False."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dec = ldm_decoder()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        z = mode.from_tensor(torch.zeros(1, 4, 12, 12))
        out = tiled_decode(
            dec, z, config=TiledVAEConfig(mode="exact", tile=4, guard=False, budget_bytes=2**30)
        )
        assert tuple(out.shape) == (1, 3, 24, 24)


# -- attention ----------------------------------------------------------------------------------


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))

    def kernels(self) -> int:
        """Attention kernel calls: a fused kernel, or the math kernel's softmax."""
        return sum(
            ("flash_attention" in n or "efficient_attention" in n or "_softmax" in n) for n in self.names
        )


@pytest.mark.parametrize("transposed", [False, True])
def test_attention_matches_reference_when_chunked(transposed):
    g = torch.Generator().manual_seed(16)
    q, k, v = (torch.randn(2, 1, 300, 8, generator=g) for _ in range(3))
    ref = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, -1) @ v
    if transposed:  # what the VAE's (B, C, N) projections give: channel dimension not contiguous
        q, k, v = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v))
    with _OpLog() as log:
        out = attention(q, k, v, max_bytes=2 * 300 * 4 * 7, fused=False)  # chunks of 7 queries
    # each output is a softmax-weighted mean of 300 values: summed in any order, the scores (8 terms)
    # and the normalisation (300) and the weighted sum (300) are within that many roundings of |v|
    assert (out - ref).abs().max().item() <= rounding(8 + 2 * 300, v.abs().max().item())
    assert log.kernels() == -(-300 // 7)


def test_attention_runs_the_cpu_flash_kernel_in_one_call_where_torch_has_it():
    from lib_vram.vae._attention import cpu_flash_available

    g = torch.Generator().manual_seed(18)
    # a transposed (B, 1, N, C) view, as the VAE's 1x1-conv projections give it
    q, k, v = (torch.randn(1, 8, 2000, generator=g).transpose(1, 2).unsqueeze(1) for _ in range(3))
    ref = attention(q, k, v, fused=False)
    with _OpLog() as log:
        out = attention(q, k, v, max_bytes=2000 * 4 * 16)  # the math kernel would take 125 chunks
    # flash (blocked, online softmax) vs math: other summation orders over 2000 keys, 8 channels
    assert (out - ref).abs().max().item() <= rounding(8 + 2 * 2000, v.abs().max().item())
    flash = [n for n in log.names if "flash_attention_for_cpu" in n]
    if not cpu_flash_available(q):
        pytest.skip(f"torch {torch.__version__} has no CPU flash attention kernel")
    assert len(flash) == 1 and log.kernels() == 1, log.names
    # switched off by the user: no flash, chunks again (and never an N x N matrix)
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        assert not cpu_flash_available(q)
        with _OpLog() as log:
            attention(q, k, v, max_bytes=2000 * 4 * 16)
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    assert not any("flash_attention_for_cpu" in n for n in log.names)
    assert log.kernels() == 125


def test_channel_stats_match_float64_on_crops_batches_and_constant_channels():
    from lib_vram.vae._engine import channel_stats

    g = torch.Generator().manual_seed(19)
    big = torch.randn(2, 24, 40, 50, generator=g) * 0.7 + 3.0
    big[1, 5] = 2.5  # a constant channel: variance 0, not NaN
    views = [
        big[..., 3:31, 7:44],  # a tile's core inside its window: not contiguous
        big.contiguous(memory_format=torch.channels_last)[..., 2:20, :],
        big[:, ::2, ::3, ::2],
        big[..., 3:31, 7:44].half(),  # the var_mean path, in float32
    ]
    for x in views:
        mean, var = channel_stats(x)
        rv, rm = torch.var_mean(x.double(), dim=(2, 3), correction=0)
        assert mean.dtype == var.dtype == torch.float64 and mean.shape == var.shape == x.shape[:2]
        # a float32 sum of n values in any order is within n roundings of their magnitude (mean: of
        # |x|; variance: of the squared deviations, plus the mean's own error twice)
        n, big = x.shape[-2] * x.shape[-1], x.double().abs().max().item()
        assert (mean - rm).abs().max().item() <= rounding(n, big)
        assert (var - rv).abs().max().item() <= rounding(n, rv.max().item()) + 2 * rounding(n, big) * big
    assert channel_stats(views[0])[1][1, 5].item() == 0.0


def test_channel_stats_fall_back_to_var_mean_without_the_cpu_kernel(monkeypatch):
    from lib_vram.vae import _engine

    def missing(*args):
        raise NotImplementedError(
            "Could not run 'aten::batch_norm_update_stats' with arguments from the 'CPU' backend"
        )

    monkeypatch.setattr(_engine, "_BN_STATS", missing)
    x = torch.randn(2, 8, 9, 11, generator=torch.Generator().manual_seed(23))[..., 1:8, 2:10]
    mean, var = _engine.channel_stats(x)
    rv, rm = torch.var_mean(x.double(), dim=(2, 3), correction=0)
    n, big = x.shape[-2] * x.shape[-1], x.abs().max().item()
    assert (mean - rm).abs().max().item() <= rounding(n, big)
    assert (var - rv).abs().max().item() <= rounding(n, rv.max().item()) + 2 * rounding(n, big) * big
    assert _engine._BN_STATS is None  # asked once, not at every GroupNorm


def test_fast_mode_tiles_compute_no_statistics_of_their_own(monkeypatch):
    from lib_vram.vae import _api, _engine

    calls = {"replay": 0, "outside": 0}
    replaying = [False]
    real_stats, real_replay = _engine.core_stats, _api.replay

    def stats(t, box):
        calls["replay" if replaying[0] else "outside"] += 1
        return real_stats(t, box)

    def replay(*args):
        replaying[0] = True
        try:
            return real_replay(*args)
        finally:
            replaying[0] = False

    monkeypatch.setattr(_engine, "core_stats", stats)
    monkeypatch.setattr(_api, "replay", replay)
    dec = ldm_decoder()
    z = smooth_latent(1, 4, 16, 16, seed=20)
    rep = VAEReport()
    tiled_decode(dec, z, config=TiledVAEConfig(mode="fast", tile=4), report=rep)
    assert rep.tiles == 16 and calls["outside"] > 0  # the statistics pass and the global part
    assert calls["replay"] == 0


def test_attention_at_256_squared_latent_stays_far_below_n_squared():
    n = 256 * 256
    g = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(1, 1, n, 8, generator=g) for _ in range(3))
    tracker = StageTracker("cpu")
    with tracker.stage("attn") as rec:
        out = attention(q, k, v)
    assert out.shape == q.shape and torch.isfinite(out).all()
    n_squared = n * n * 4  # the float32 score matrix: 16 GiB
    assert rec.delta_peak_bytes < n_squared / 50, rec.delta_peak_bytes
