"""IP-Adapter in the sampling estimate, against a decoupled cross-attention run on the real UNet.

The real ldm ``UNetModel`` at reduced width (as in ``tests/test_sampling_tokens.py``) runs on fake
tensors under the live-byte counter with every cross-attention replaced by this test's own
IP-Adapter attention, which does what IP-Adapter does as sd-webui-controlnet v1.1.455 runs it
(``scripts/ipadapter/plugable_ipadapter.py``, read, not copied): the prompt's attention by torch's
SDP whatever the WebUI's optimization, then for each unit the same queries attend to the unit's
image tokens, whose keys and values (``to_k_ip``/``to_v_ip`` of the image embedding, float32) are
made at the first forward and cached per layer for the pass; the result is scaled and added.
Two forwards are counted (the first makes the cache, the second runs with all of it held).

The issue's bar (issue 42): the prediction within 10 % of the measured peak, for 4 image tokens
(ip-adapter) and 16 (ip-adapter-plus), SD1.5- and SDXL-shaped UNets.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from lib_vram.cli.models.unet import attention_applied, build_unet, context_arg, host_forward
from lib_vram.core.livebytes import LiveBytesCounter
from lib_vram.core.predict import fake_call, fake_state, new_fake_mode
from lib_vram.sampling import SelfAttention, estimate_sampling, unet_spec

TOLERANCE = 0.10
"""Issue 42's bar for IP-Adapter: the pass's prediction within 10 % of the measured peak."""
TOKENS = 77
CTX = 96


def _ip_attention(layers: dict, units: list[torch.Tensor], dtype: torch.dtype):
    """The cross-attention ``forward`` of an IP-Adapter with one image embedding per unit in
    ``units`` (``(batch, image tokens, CTX)``, float32); ``layers``: per attention module, each
    unit's (``to_k_ip``, ``to_v_ip``) weights and a cache of their outputs."""

    def heads(t: torch.Tensor, b: int, h: int) -> torch.Tensor:
        return t.view(b, -1, h, t.shape[-1] // h).transpose(1, 2)

    def image_part(attn, q: torch.Tensor, i: int) -> torch.Tensor:  # noqa: ANN001
        b, h = q.shape[0], attn.heads
        entry = layers[id(attn)]
        if i not in entry["cache"]:
            wk, wv = entry["weights"][i]
            entry["cache"][i] = (F.linear(units[i], wk), F.linear(units[i], wv))
        ik, iv = (t.to(dtype) for t in entry["cache"][i])
        out = F.scaled_dot_product_attention(heads(q, b, h), heads(ik, b, h), heads(iv, b, h))
        out = out.transpose(1, 2).reshape(b, -1, q.shape[-1])
        return out * 0.8

    def forward(self, x, context=None, mask=None):  # noqa: ANN001, ANN202
        b, h = x.shape[0], self.heads
        q = self.to_q(x)
        k, v = self.to_k(context), self.to_v(context)
        out = F.scaled_dot_product_attention(heads(q, b, h), heads(k, b, h), heads(v, b, h))
        out = out.transpose(1, 2).reshape(b, -1, q.shape[-1])
        del k, v
        for i in range(len(units)):
            out = out + image_part(self, q, i)
        del q
        return self.to_out(out)

    return forward


def _measure(
    shape: str, attention: str, batch: int, hw: tuple[int, int], image_tokens: tuple[int, ...]
) -> int:
    unet = build_unet(shape, 32, context_dim=CTX)
    mode = new_fake_mode()
    call = fake_call(unet, fake_state(unet, mode, torch.float32))
    attn2 = [m for n, m in unet.named_modules() if n.endswith("attn2")]
    with mode:
        x, t, c = torch.empty(batch, 4, *hw), torch.empty(batch), torch.empty(batch, TOKENS, CTX)
        units = [torch.empty(batch, n, CTX) for n in image_tokens]
        layers = {
            id(m): {"weights": [(torch.empty(m.to_q.out_features, CTX),) * 2 for _ in units], "cache": {}}
            for m in attn2
        }
    counter = LiveBytesCounter(None)
    fwd = host_forward(attention, lambda: float(1 << 50) - counter.live_bytes, "cuda", False)
    ip = _ip_attention(layers, units, torch.float32)
    with attention_applied(unet, fwd), torch.no_grad(), mode, counter:
        for m in attn2:
            m.forward = types.MethodType(ip, m)
        for _ in range(2):  # the first forward makes the cache, the second runs with it held
            out = call(x, t, context_arg(shape, c))
            del out
    assert all(len(e["cache"]) == len(units) for e in layers.values())
    return counter.peak_bytes


def _predict(
    shape: str, attention: str, batch: int, hw: tuple[int, int], image_tokens: tuple[int, ...]
) -> int:
    unet = build_unet(shape, 32, context_dim=CTX, meta=True)
    sa = SelfAttention(image_tokens=image_tokens) if image_tokens else None
    est = estimate_sampling(
        unet_spec(unet), batch=batch, latent_hw=hw, context_tokens=TOKENS, attention=attention,
        dtype=torch.float32, self_attention=sa,
    )  # fmt: skip
    return est.activation_bytes


@pytest.mark.parametrize(
    ("shape", "attention", "batch", "hw", "image_tokens"),
    [
        ("sd15", "sdp", 2, (40, 40), (4,)),
        ("sd15", "sdp", 2, (40, 40), (16,)),
        ("sd15", "doggettx", 2, (32, 48), (16,)),
        ("sd15", "none", 2, (24, 24), (4, 16)),
        ("sdxl", "sdp", 2, (64, 64), (4,)),
        ("sdxl", "sdp", 2, (64, 64), (16,)),
        ("sdxl", "sub-quadratic", 4, (48, 40), (16,)),
    ],
)
def test_ip_adapter_within_10_percent(shape, attention, batch, hw, image_tokens):
    got = _measure(shape, attention, batch, hw, image_tokens)
    want = _predict(shape, attention, batch, hw, image_tokens)
    assert abs(want - got) <= TOLERANCE * got, (want, got)


def test_ip_adapter_changes_the_count():
    """The check can fail: at a small latent with many image tokens the cache and the added
    attention make the peak larger than the stock prediction by more than the bar."""
    got = _measure("sd15", "sdp", 8, (16, 16), (16, 16))
    stock = _predict("sd15", "sdp", 8, (16, 16), ())
    assert stock < (1 - TOLERANCE) * got
    assert abs(_predict("sd15", "sdp", 8, (16, 16), (16, 16)) - got) <= TOLERANCE * got


def test_image_tokens_checked_and_keyed():
    assert SelfAttention(image_tokens=(4,)).active
    assert SelfAttention(image_tokens=(4,)).key() != SelfAttention(image_tokens=(16,)).key()
    assert "IP-Adapter (4 + 16 image tokens)" in SelfAttention(image_tokens=(4, 16)).describe()
    for bad in ((0,), [4], (4.0,), (5000,)):
        with pytest.raises(ValueError, match="image_tokens"):
            SelfAttention(image_tokens=bad)
