"""The sampling estimate against the real ldm ``UNetModel`` on fake tensors.

Real ldm UNets at reduced width (SD1.5-like: conv projections, 8 heads, four levels; SD2-like:
linear projections, fixed head width; SDXL-like: three levels, attention at the lower two with two
transformer blocks, linear projections; see :data:`lib_vram.cli.models.unet.SHAPES`) run on fake
tensors under :class:`lib_vram.core.livebytes.LiveBytesCounter` (the counter behind
:mod:`lib_vram.core.predict`), with each attention installed as the WebUI installs it (a
``CrossAttention.forward`` replaced; test-side forwards that hold what the host's hold, in
:mod:`lib_vram.cli.models.unet`). The predicted activations (peak minus weights and inputs) must
be within 15 % of the counted ones in every case.

The default run covers every attention once per shape, the size and the batch rotating (so each
attention meets every size and every batch across the shapes), and the free-memory-sized slicing
of Doggettx, InvokeAI and sub-quadratic; ``VRAM_GUARD_SLOW=1`` runs the full matrix (3 shapes x
8 attentions x 3 sizes x batch 1/2/4).
SDXL's per-level depth 0/2/10 and its ``adm`` vector need sgm's ``UNetModel`` (not installable
here): the SDXL-like shape has depth 2 at both attention levels and no ``y``; the reference
SDXL spec's closed form (parameters) is checked against the published count instead.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from lib_vram.cli.models.unet import SHAPES, attention_applied, build_unet, context_arg, host_forward
from lib_vram.core.livebytes import LiveBytesCounter
from lib_vram.core.predict import WORKSPACE_TERMS, fake_call, fake_state, new_fake_mode
from lib_vram.sampling import (
    ATTENTIONS,
    attention_of,
    estimate_sampling,
    param_count,
    reference_spec,
    unet_spec,
)

TOLERANCE = 0.15
SIZES = ((16, 16), (24, 32), (40, 40))
BATCHES = (1, 2, 4)
TOKENS = 77
CTX = 96
SLOW = os.environ.get("VRAM_GUARD_SLOW") == "1"

_UNETS: dict = {}


def _unet(shape: str):
    if shape not in _UNETS:
        unet = build_unet(shape, 32, context_dim=CTX)
        mode = new_fake_mode()
        _UNETS[shape] = (unet, mode, fake_call(unet, fake_state(unet, mode, torch.float32)))
    return _UNETS[shape]


def measured(shape, attention, batch, hw, *, free=None, backend="cuda"):
    """Peak bytes the real UNet's forward allocates on fake tensors (its output included)."""
    unet, mode, call = _unet(shape)
    with mode:
        x = torch.empty(batch, 4, *hw)
        t = torch.empty(batch)
        c = torch.empty(batch, TOKENS, CTX)
    counter = LiveBytesCounter(WORKSPACE_TERMS["cpu"] if backend == "cpu" else None)
    total = float(1 << 50) if free is None else free

    def probe() -> float:
        return total - counter.live_bytes

    math_sdp = attention == "sdp-no-mem" and backend != "cpu"
    fwd = host_forward(attention, probe, backend, math_sdp)
    with attention_applied(unet, fwd), torch.no_grad(), mode, counter:
        out = call(x, t, context_arg(shape, c))
        del out
    return counter.peak_bytes


def predicted(shape, attention, batch, hw, *, free=None, backend="cuda"):
    spec = unet_spec(_unet(shape)[0])
    est = estimate_sampling(
        spec,
        batch=batch,
        latent_hw=hw,
        context_tokens=TOKENS,
        attention=attention,
        dtype=torch.float32,
        free_bytes=free,
        backend=backend,
    )
    return est.activation_bytes


def _cases():
    """Default: per shape, each attention once, the size and batch rotating (every size and batch
    met by every attention across the three shapes); ``VRAM_GUARD_SLOW=1``: the full matrix."""
    out = []
    for k, shape in enumerate(SHAPES):
        for i, att in enumerate(ATTENTIONS):
            if SLOW:
                out += [(shape, att, hw, b) for hw in SIZES for b in BATCHES]
            else:
                out.append((shape, att, SIZES[(i + k) % 3], BATCHES[(i + 2 * k) % 3]))
    return out


@pytest.mark.parametrize(("shape", "attention", "hw", "batch"), _cases())
def test_activations_within_15_percent(shape, attention, hw, batch):
    got = measured(shape, attention, batch, hw)
    want = predicted(shape, attention, batch, hw)
    assert abs(want - got) <= TOLERANCE * got, (want, got)


@pytest.mark.parametrize(
    ("shape", "attention"),
    [("sd15", "doggettx"), ("sd2", "invokeai"), ("sd15", "sub-quadratic"), ("sdxl", "doggettx")],
)
def test_slices_sized_from_the_free_memory(shape, attention):
    """With 24 MiB free Doggettx cuts the queries into 2^k slices and InvokeAI slices by its 3.3
    safety factor (on the SD1.5/SD2 shapes at 40x40 their scores are far above it); the estimate
    follows the same probe (free memory minus what the forward holds at that moment).
    Sub-quadratic's key/value chunking needs far less free memory at this size (its minimum chunk
    is 70 % of the free memory over the key and value rows: below ~2 MiB free here), so it runs
    its query chunks only, as without a limit."""
    free = 24 << 20
    hw, batch = (40, 40), 4
    got = measured(shape, attention, batch, hw, free=free)
    want = predicted(shape, attention, batch, hw, free=free)
    assert abs(want - got) <= TOLERANCE * got, (want, got)
    if shape != "sdxl" and attention != "sub-quadratic":
        assert got < 0.5 * predicted(shape, attention, batch, hw)  # the slicing did act


@pytest.mark.parametrize("attention", ("none", "invokeai"))
def test_cpu_backend_with_convolution_scratch(attention):
    """On the CPU backend: oneDNN's convolution scratch (the predictor's term) and InvokeAI's
    fixed 32 MiB slices."""
    got = measured("sd15", attention, 2, (40, 40), backend="cpu")
    want = predicted("sd15", attention, 2, (40, 40), backend="cpu")
    assert abs(want - got) <= TOLERANCE * got, (want, got)


def test_the_check_can_fail():
    """The attention matters: predicting SDP's memory for ldm's own einsum attention (or the
    reverse) is far outside the tolerance at 40x40."""
    got_none = measured("sd15", "none", 2, (40, 40))
    assert predicted("sd15", "sdp", 2, (40, 40)) < (1 - TOLERANCE) * got_none
    got_sdp = measured("sd15", "sdp", 2, (40, 40))
    assert predicted("sd15", "none", 2, (40, 40)) > (1 + TOLERANCE) * got_sdp


@pytest.mark.parametrize("shape", SHAPES)
def test_spec_and_parameter_count_of_the_real_unet(shape):
    unet = _unet(shape)[0]
    spec = unet_spec(unet)
    assert spec.params == sum(p.numel() for p in unet.parameters())
    assert param_count(spec) == spec.params


def test_reference_specs_match_published_parameter_counts():
    # SD1.5 859.52 M, SD2.x 865.91 M, SDXL base 2567.46 M parameters
    assert reference_spec("sd15").params == 859_520_964
    assert reference_spec("sd2").params == 865_910_724
    assert reference_spec("sdxl").params == 2_567_463_684


def test_quadratic_attentions_grow_by_orders_of_magnitude():
    spec = reference_spec("sd15")
    kw = dict(batch=2, context_tokens=77, dtype=torch.float16)

    def act(hw, attention):
        return estimate_sampling(spec, latent_hw=hw, attention=attention, **kw).activation_bytes

    small = {a: act((64, 64), a) for a in ATTENTIONS}
    big = {a: act((192, 192), a) for a in ATTENTIONS}
    # 9x the pixels: linear attentions grow ~9x, ldm's einsum ~81x
    assert big["sdp"] < 10 * small["sdp"]
    assert big["none"] > 50 * small["none"]
    assert big["none"] > 20 * big["sdp"]


@pytest.mark.parametrize(
    ("name", "backend", "want"),
    [
        ("Automatic", "cuda", "doggettx"),
        ("Automatic", "cpu", "invokeai"),
        ("Automatic", "mps", "sub-quadratic"),
        ("sdp-no-mem", "cuda", "sdp-no-mem"),
        ("scaled dot product", "cuda", "sdp"),
        ("V1", "cuda", "split-v1"),
        ("InvokeAI", "cuda", "invokeai"),
        ("Doggettx", "cuda", "doggettx"),
        ("None", "cuda", "none"),
    ],
)
def test_attention_of_host_names(name, backend, want):
    assert attention_of(name, backend=backend) == want


def test_bad_input_is_named():
    spec = reference_spec("sd15")
    kw = dict(latent_hw=(64, 64), context_tokens=77, attention="sdp", dtype=torch.float16)
    with pytest.raises(ValueError, match="`batch`"):
        estimate_sampling(spec, batch=0, **kw)
    with pytest.raises(ValueError, match="`batch`"):
        estimate_sampling(spec, batch=10_000, **kw)
    with pytest.raises(ValueError, match="`latent_hw`"):
        estimate_sampling(spec, batch=1, **{**kw, "latent_hw": (64, 100_000)})
    with pytest.raises(ValueError, match="`attention`"):
        estimate_sampling(spec, batch=1, **{**kw, "attention": "flash"})
    with pytest.raises(ValueError, match="unknown attention"):
        attention_of("flash")
    with pytest.raises(ValueError, match="`arch`"):
        reference_spec("sd3")
    assert math.isfinite(estimate_sampling(spec, batch=1, **kw).peak_bytes)
