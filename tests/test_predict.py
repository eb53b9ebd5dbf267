from __future__ import annotations

import pytest
import torch
from ldm.modules.diffusionmodules.model import Decoder as LdmDecoder
from ldm.modules.diffusionmodules.model import Encoder as LdmEncoder

from lib_vram.cli import stageplan
from lib_vram.core.predict import (
    LiveBytesCounter,
    count_peak,
    cpu_conv_workspace_bytes,
    new_fake_mode,
    predict_module_peak,
)
from lib_vram.planning import reference

# The SD ddconfig at a quarter of the width (same code path, cheap).
DD = dict(
    double_z=True,
    z_channels=4,
    resolution=256,
    in_channels=3,
    out_ch=3,
    ch=32,
    ch_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_resolutions=[],
    dropout=0.0,
)
ARCH = reference.VAEArch("sd-ch32", z_channels=4, ch=32)


def test_counter_tracks_allocations_and_frees_on_real_tensors():
    with LiveBytesCounter() as c:
        a = torch.ones(1000)  # 4000 B
        b = torch.ones(500)  # 2000 B
        del a
        d = b * 2  # 2000 B; a's 4000 are free again
        b.add_(1)  # in place: nothing new
        e = b.view(-1)  # a view: same storage
    assert c.peak_bytes == 6000
    assert c.live_bytes == 4000
    del b, d, e
    assert c.live_bytes == 0


@pytest.mark.parametrize("inference", [False, True])
def test_cpu_conv_scratch_is_a_transient_peak_at_each_convolution(inference):
    # 3 -> 8 channels at 32x32, then a 8 -> 2 conv: the first conv's scratch (max(in, out) + weight)
    # sits on top of its output and is gone afterwards; a backend without a term adds nothing.
    conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
    conv2 = torch.nn.Conv2d(8, 2, 1, bias=False)

    def net(x):
        with torch.inference_mode(inference):
            return conv2(conv1(x))

    mode = new_fake_mode()
    with mode:
        x = torch.empty(1, 3, 32, 32)
    out1, out2 = 8 * 32 * 32 * 4, 2 * 32 * 32 * 4
    plain, _ = count_peak(net, x, fake_mode=mode)
    assert plain == out1 + out2
    cpu, _ = count_peak(net, x, fake_mode=mode, workspace=cpu_conv_workspace_bytes)
    scratch1 = cpu_conv_workspace_bytes((1, 3, 32, 32), (8, 3, 3, 3), (1, 8, 32, 32), 4)
    scratch2 = cpu_conv_workspace_bytes((1, 8, 32, 32), (2, 8, 1, 1), (1, 2, 32, 32), 4)
    assert scratch1 == out1 + 8 * 3 * 9 * 4
    assert cpu == max(out1 + scratch1, out1 + out2 + scratch2) > plain
    mps = predict_module_peak(conv1, (1, 3, 32, 32), backend="mps")
    assert predict_module_peak(conv1, (1, 3, 32, 32), backend="cpu").raw_activation_bytes == out1 + scratch1
    assert mps.raw_activation_bytes == out1


def test_cpu_conv_scratch_counts_the_copy_of_a_non_contiguous_input():
    conv = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False)
    mode = new_fake_mode()
    with mode:
        big = torch.empty(1, 4, 33, 33)
    crop, weight, n = (1, 4, 32, 32), (4, 4, 3, 3), 4 * 32 * 32 * 4

    def cropped(t):  # a view: not contiguous
        with torch.no_grad():
            return conv(t[:, :, :32, :32])

    def copied(t):  # an explicit contiguous copy first
        with torch.no_grad():
            return conv(t[:, :, :32, :32].contiguous())

    for fn, contiguous in ((cropped, False), (copied, True)):
        without, _ = count_peak(fn, big, fake_mode=mode)
        with_scratch, _ = count_peak(fn, big, fake_mode=mode, workspace=cpu_conv_workspace_bytes)
        assert with_scratch - without == cpu_conv_workspace_bytes(crop, weight, crop, 4, contiguous)
    assert cpu_conv_workspace_bytes(crop, weight, crop, 4, False) == n + cpu_conv_workspace_bytes(
        crop, weight, crop, 4, True
    )


@pytest.mark.parametrize("size", [8, 16])
def test_reference_vae_counts_like_the_real_ldm_classes(size):
    mode = new_fake_mode()
    with torch.device("meta"):
        pairs = [
            (LdmDecoder(**DD), reference.Decoder(ARCH, attn="vanilla"), (1, 4, size, size)),
            (LdmEncoder(**DD), reference.Encoder(ARCH, attn="vanilla"), (1, 3, 8 * size, 8 * size)),
        ]
    for ldm_mod, ref_mod, shape in pairs:
        a = predict_module_peak(ldm_mod, shape, fake_mode=mode)
        b = predict_module_peak(ref_mod, shape, fake_mode=mode)
        assert a.raw_activation_bytes == b.raw_activation_bytes > 0
        assert a.weights_bytes == b.weights_bytes


def test_prediction_leaves_a_real_module_untouched():
    torch.manual_seed(0)
    dec = LdmDecoder(**DD).eval()
    before = {k: v.clone() for k, v in dec.state_dict().items()}
    pred = predict_module_peak(dec, (1, 4, 16, 16), torch.float16)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in dec.parameters())
    assert all(torch.equal(before[k], v) for k, v in dec.state_dict().items())
    half = pred.weights_bytes
    assert half == sum(p.numel() for p in dec.parameters()) * 2 + sum(b.numel() * 4 for b in dec.buffers())
    full = predict_module_peak(dec, (1, 4, 16, 16), torch.float32)
    assert full.raw_activation_bytes == 2 * pred.raw_activation_bytes
    with torch.no_grad():
        assert dec(torch.randn(1, 4, 2, 2)).shape == (1, 3, 16, 16)  # still a working module


def test_spandrel_model_loaded_from_file(tmp_path):
    from spandrel import ModelLoader
    from spandrel.architectures.Compact import SRVGGNetCompact

    torch.manual_seed(0)
    net = SRVGGNetCompact(num_feat=16, num_conv=4, upscale=4)
    path = tmp_path / "compact.pth"
    torch.save(net.state_dict(), path)
    desc = ModelLoader().load_from_file(path)
    pred = predict_module_peak(desc.model, (1, 3, 32, 32))
    # The output alone is 3 x 128 x 128 fp32.
    assert pred.raw_activation_bytes >= 3 * 128 * 128 * 4
    assert pred.weights_bytes == sum(p.numel() * 4 for p in desc.model.parameters()) + sum(
        b.numel() * b.element_size() for b in desc.model.buffers()
    )


def test_plan_of_the_reference_vae_tiles_when_the_budget_shrinks():
    """``plan`` plans the reference architectures (meta device, no ldm) with the engine's own
    function: smaller budgets give smaller tiles and smaller predicted peaks (the UNet and text
    encoders off the card, as with the WebUI's --medvram: the whole budget is the VAE's)."""
    peaks = []
    for free in (64 * 2**30, 2**30, 2**29):
        stages = stageplan.plan_job(
            "sd15", 1024, 1024, _preset(), free, free, safety_margin_bytes=0, host_swaps=True
        )
        (dec,) = [p for p in stages if p.stage == "vae_decode"]  # the sampling stage comes first
        peaks.append((dec.tile, dec.predicted_peak_bytes))
    assert peaks[0][0] is None and peaks[1][0] is not None and peaks[2][0] is not None
    assert peaks[0][1] > peaks[1][1] >= peaks[2][1] and peaks[1][0] >= peaks[2][0]


def _preset():
    from lib_vram.planning.presets import PRESETS

    return PRESETS["8GB"]


def test_engines_run_on_fake_tensors_and_tiles_predict_less():
    with torch.device("meta"):
        dec = reference.Decoder(ARCH)
        net = reference.build_upscaler("compact", 4, num_filters=16, num_blocks=4)
    untiled = stageplan.predict_engine_vae(dec, "decode", (1, 4, 32, 32), "fp32", None)
    tiled = stageplan.predict_engine_vae(dec, "decode", (1, 4, 32, 32), "fp32", 16, "exact")
    assert 0 < tiled.activation_bytes < untiled.activation_bytes
    whole, tiles = (
        stageplan.predict_loop(net, stageplan.upscale_loop(t, b, 4), (1, 3, 128, 128), torch.float32, "cpu",
                               new_fake_mode())
        for t, b in ((128, 1), (48, 2))
    )  # fmt: skip
    # Either way the 4x output (3 x 512 x 512 fp32) is allocated.
    assert min(whole.activation_bytes, tiles.activation_bytes) >= 3 * 512 * 512 * 4
    with pytest.raises(ValueError, match="`kind`"):
        stageplan.predict_engine_vae(dec, "both", (1, 4, 8, 8))


def _fake_forward(net: torch.nn.Module, dtype: torch.dtype, h: int, w: int) -> tuple[int, tuple]:
    """``net`` on a fake 3-channel ``h`` x ``w`` input: (peak counted by the live-byte counter,
    output shape)."""
    from lib_vram.core.predict import count_peak, fake_call, fake_state, new_fake_mode

    mode = new_fake_mode()
    call = fake_call(net, fake_state(net, mode, dtype))
    with mode:
        x = torch.empty(1, 3, h, w, dtype=dtype)
    peak, _ = count_peak(call, x, fake_mode=mode)
    with mode:
        out_shape = tuple(call(x).shape)
    return peak, out_shape


@pytest.mark.parametrize(
    ("kind", "scale", "width", "blocks", "dtype"),
    [
        ("rrdb", 4, 16, 2, torch.float32),
        ("rrdb", 2, 8, 1, torch.float16),
        ("rrdb", 1, 8, 1, torch.float32),
        ("compact", 4, 16, 3, torch.float32),
        ("compact", 2, 24, 2, torch.bfloat16),
    ],
)
def test_reference_upscalers_are_spandrels_operator_for_operator(kind, scale, width, blocks, dtype):
    """``plan`` builds its reference upscalers without importing spandrel (seconds of import);
    they must cost what spandrel's classes cost: the same parameter shapes, and the same fake
    peak at several sizes (odd ones included)."""
    from spandrel.architectures.Compact import SRVGGNetCompact
    from spandrel.architectures.ESRGAN import RRDBNet

    with torch.device("meta"):
        ours = reference.build_upscaler(kind, scale, num_filters=width, num_blocks=blocks)
        if kind == "rrdb":
            theirs = RRDBNet(num_filters=width, num_blocks=blocks, scale=scale)
        else:
            theirs = SRVGGNetCompact(num_feat=width, num_conv=blocks, upscale=scale)
    assert [p.shape for p in ours.parameters()] == [p.shape for p in theirs.parameters()]
    for h, w in ((16, 16), (23, 37)):
        peaks = [_fake_forward(net, dtype, h, w) for net in (ours, theirs)]
        assert peaks[0] == peaks[1], (h, w, peaks)
        assert peaks[0][1] == (1, 3, h * scale, w * scale)


@pytest.mark.parametrize(
    ("kind", "scale", "width", "blocks", "dtype"),
    [
        ("rrdb", 4, 64, 23, torch.float32),
        ("rrdb", 4, 16, 1, torch.float16),
        ("rrdb", 2, 32, 2, torch.float32),
        ("rrdb", 3, 24, 2, torch.bfloat16),
        ("rrdb", 1, 64, 3, torch.float32),
        ("rrdb", 2, 8, 0, torch.float32),
        ("compact", 4, 64, 16, torch.float32),
        ("compact", 4, 8, 1, torch.float16),
        ("compact", 2, 16, 2, torch.float32),
        ("compact", 1, 24, 3, torch.bfloat16),
    ],
)
def test_reference_upscalers_own_count_is_the_fake_runs(kind, scale, width, blocks, dtype):
    """``plan`` takes a reference upscaler's forward bytes per pixel from the architecture's own
    count (no fake run: a torch dispatch mode imports ``torch._dynamo``, a second of every plan);
    it must be what the live-byte counter counts on fake tensors, at any size."""
    with torch.device("meta"):
        net = reference.build_upscaler(kind, scale, num_filters=width, num_blocks=blocks)
    per_px = net.peak_bytes_per_px(torch.empty((), dtype=dtype).element_size())
    for h, w in ((16, 16), (23, 37), (64, 40)):
        peak, _ = _fake_forward(net, dtype, h, w)
        assert per_px * h * w == peak, (h, w, per_px * h * w, peak)
