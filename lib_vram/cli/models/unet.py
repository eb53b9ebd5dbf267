"""Real ldm ``UNetModel``s at reduced width, and attention forwards that allocate as the WebUI's do.

The forwards are this project's own code, written to hold the same tensors at the same moments as
the host's (``modules/sd_hijack_optimizations.py`` and ``sub_quadratic_attention.py`` of v1.10.1).
``"none"`` keeps ldm's own forward; ``"xformers"`` is emulated by torch's SDP on the same views
(the same tensors are held; xformers itself is not installed here).
"""

from __future__ import annotations

import contextlib
import math
import sys
import types
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F  # noqa: N812

from lib_vram.cli.hostmodels import ldm, quiet

MiB = 1 << 20

SHAPES = ("sd15", "sd2", "sdxl")
"""``sd15``: channel_mult 1,2,4,4, attention at the first three levels, 8 heads, conv projections.
``sd2``: the same levels, fixed head width, linear projections. ``sdxl``: channel_mult 1,2,4,
attention at levels 2 and 3 only, two transformer blocks there (ldm's ``transformer_depth`` is one
number: SDXL's 0/2/10 per level and its ``adm`` vector need sgm, not installable here), linear
projections, fixed head width."""


@contextlib.contextmanager
def _omegaconf_for_ldm() -> Iterator[None]:
    """A placeholder ``omegaconf.listconfig`` while ldm's ``UNetModel.__init__`` runs (it imports
    ``ListConfig`` only to check ``context_dim``; the test environment has no omegaconf)."""
    try:
        import omegaconf.listconfig  # noqa: F401

        yield
        return
    except ImportError:
        pass
    om = types.ModuleType("omegaconf")
    lc = types.ModuleType("omegaconf.listconfig")

    class ListConfig(list):
        pass

    lc.ListConfig = ListConfig
    om.listconfig = lc
    sys.modules["omegaconf"], sys.modules["omegaconf.listconfig"] = om, lc
    try:
        yield
    finally:
        sys.modules.pop("omegaconf", None)
        sys.modules.pop("omegaconf.listconfig", None)


def _config(shape: str, mc: int, context_dim: int) -> dict:
    if shape not in (*SHAPES, "sdxl-d1"):
        raise ValueError(f"`shape` must be one of {SHAPES}, got {shape!r}")
    xl = shape.startswith("sdxl")
    cfg = dict(image_size=32, in_channels=4, out_channels=4, model_channels=mc, num_res_blocks=2,
               use_spatial_transformer=True, legacy=False, context_dim=context_dim,
               attention_resolutions=[4, 2] if xl else [4, 2, 1],
               channel_mult=(1, 2, 4) if xl else (1, 2, 4, 4),
               use_linear_in_transformer=shape != "sd15")  # fmt: skip
    if shape == "sd15":
        cfg["num_heads"] = 8
    else:
        cfg["num_head_channels"] = min(64, mc) if shape == "sdxl-d1" else 16
    if shape == "sdxl":
        cfg.update(transformer_depth=2, context_dim=[context_dim, context_dim])
    return cfg


def build_unet(
    shape: str = "sd15",
    model_channels: int = 32,
    *,
    context_dim: int = 96,
    seed: int = 0,
    init: bool = False,
    meta: bool = False,
):
    """A real ldm ``UNetModel`` of ``shape`` (:data:`SHAPES`; ``"sdxl-d1"``: SDXL's levels at
    transformer depth 1, 64-wide heads) at ``model_channels`` (a multiple of 32: GroupNorm's 32
    groups), random weights, eval mode; ``init``: every weight N(0, 0.05) from ``seed`` (ldm
    zero-initialises its output layers: a UNet that predicts 0); ``meta``: on the meta device."""
    torch.manual_seed(seed)
    meta_ctx = torch.device("meta") if meta else contextlib.nullcontext()
    unet_model = ldm("modules.diffusionmodules.openaimodel").UNetModel
    with _omegaconf_for_ldm(), meta_ctx, quiet():
        net = unet_model(**_config(shape, model_channels, context_dim)).eval()
    if init and not meta:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return net


def context_arg(shape: str, context: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
    """What the UNet of ``shape`` takes as ``context`` (ldm's depth-2 transformer takes a list)."""
    return [context, context] if shape == "sdxl" else context


# -- attention forwards that hold what the host's hold ------------------------------------------


def _proj(self, x, context):  # noqa: ANN001, ANN202
    ctx = x if context is None else context
    return self.to_q(x), self.to_k(ctx), self.to_v(ctx)


def _heads_first(t: torch.Tensor, h: int) -> torch.Tensor:
    """``b n (h d) -> (b h) n d``: a copy (the host's rearrange)."""
    b, n, _ = t.shape
    return t.reshape(b, n, h, -1).permute(0, 2, 1, 3).reshape(b * h, n, -1)


def _heads_last(t: torch.Tensor, h: int) -> torch.Tensor:
    """``(b h) n d -> b n (h d)``: a copy."""
    bh, n, d = t.shape
    return t.reshape(bh // h, h, n, d).permute(0, 2, 1, 3).reshape(bh // h, n, h * d)


def _make_sdp(math_kernel: bool = False):  # noqa: ANN202
    """SDP attention on ``b h n d`` views (``math_kernel``: torch's math kernel, what ``sdp-no-mem``
    runs in float32 on CUDA). xformers holds the same tensors (the output, a log-sum-exp per query)."""

    def fwd(self, x, context=None, mask=None):  # noqa: ANN001, ANN202
        b, h = x.shape[0], self.heads
        q, k, v = _proj(self, x, context)
        qh, kh, vh = (t.view(b, -1, h, q.shape[-1] // h).transpose(1, 2) for t in (q, k, v))
        if math_kernel:
            o = torch.ops.aten._scaled_dot_product_attention_math(qh, kh, vh)[0]
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh)
        return self.to_out(o.transpose(1, 2).reshape(b, -1, q.shape[-1]))

    return fwd


def _compvis(q, k, v, scale: float | None = None):  # noqa: ANN001, ANN202
    s = torch.einsum("b i d, b j d -> b i j", q, k)
    if scale is not None:
        s *= scale
    s = s.softmax(dim=-1, dtype=s.dtype)
    return torch.einsum("b i j, b j d -> b i d", s, v)


def _sliced(q, k, v, dim: int, step, scale: float | None = None):  # noqa: ANN001, ANN202
    """Attention of ``(b h) n d`` tensors ``step`` at a time along ``dim`` (0: batch x heads, each
    with its keys; 1: queries, against all keys) into one preallocated output (``step`` callable:
    asked once that is allocated, as Doggettx probes the free memory)."""
    r = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    step = step() if callable(step) else step
    for i in range(0, q.shape[dim], step):
        at = slice(i, i + step) if dim == 0 else (slice(None), slice(i, i + step))
        r[at] = _compvis(q[at], k[at] if dim == 0 else k, v[at] if dim == 0 else v, scale)
    return r


def _heads(attend, *, prescale: bool, keep: bool = False):  # noqa: ANN001, ANN202
    """A forward that runs ``attend(self, q, k, v)`` on the host's ``(b h) n d`` copies (``k``
    scaled first with ``prescale``; ``keep``: q, k, v still held while the output is rearranged)."""

    def fwd(self, x, context=None, mask=None):  # noqa: ANN001, ANN202
        h = self.heads
        q_in, k_in, v_in = _proj(self, x, context)
        if prescale:
            k_in = k_in * self.scale
        q, k, v = (_heads_first(t, h) for t in (q_in, k_in, v_in))
        del q_in, k_in, v_in
        r1 = attend(self, q, k, v)
        if not keep:
            del q, k, v
        r2 = _heads_last(r1, h)
        del r1
        return self.to_out(r2)

    return fwd


_split_v1 = _heads(lambda self, q, k, v: _sliced(q, k, v, 0, 2, self.scale), prescale=False)


def _make_doggettx(free: Callable[[], float]):  # noqa: ANN202
    def attend(self, q, k, v):  # noqa: ANN001, ANN202
        def rows() -> int:
            size = q.shape[0] * q.shape[1] * k.shape[1] * q.element_size()
            need = size * (3 if q.element_size() == 2 else 2.5)
            avail = free()
            steps = 1 if need <= avail else 2 ** math.ceil(math.log2(need / max(avail, 1)))
            if steps > 64:
                raise RuntimeError("Not enough memory, use lower resolution")
            return q.shape[1] // steps if q.shape[1] % steps == 0 else q.shape[1]

        return _sliced(q, k, v, 1, rows)

    return _heads(attend, prescale=True)


def _make_invokeai(free: Callable[[], float], backend: str):  # noqa: ANN202
    def attend(self, q, k, v):  # noqa: ANN001, ANN202
        max_mb = free() / 3.3 / MiB if backend in ("cuda", "rocm") else 32
        size_mb = q.shape[0] * q.shape[1] * k.shape[1] * q.element_size() // MiB
        if size_mb <= max_mb:
            return _compvis(q, k, v)
        div = 1 << int((size_mb - 1) / max_mb).bit_length()
        if div <= q.shape[0]:
            return _sliced(q, k, v, 0, q.shape[0] // div)
        return _sliced(q, k, v, 1, max(q.shape[1] // div, 1))

    return _heads(attend, prescale=True, keep=True)


def _make_sub_quad(free: Callable[[], float], q_chunk: int = 1024):  # noqa: ANN202
    def scores_softmax(q, k, v, scale):  # noqa: ANN001, ANN202
        sc = torch.baddbmm(
            torch.empty(1, 1, 1, dtype=q.dtype, device=q.device), q, k.transpose(1, 2), alpha=scale, beta=0
        )
        p = sc.softmax(dim=-1)
        del sc
        return torch.bmm(p, v)

    def kv_chunked(q, k, v, scale, kv):  # noqa: ANN001, ANN202
        parts = []
        for j in range(0, k.shape[1], kv):
            kc, vc = k[:, j : j + kv], v[:, j : j + kv]
            bias = torch.empty(1, 1, 1, dtype=q.dtype, device=q.device)
            wts = torch.baddbmm(bias, q, kc.transpose(1, 2), alpha=scale, beta=0)
            del bias
            mx, _ = torch.max(wts, -1, keepdim=True)
            ex = torch.exp(wts - mx)
            vals = torch.bmm(ex, vc)
            parts.append((vals, ex.sum(dim=-1), mx.squeeze(-1)))
            del wts, ex
        vals, sums, mxs = (torch.stack(t) for t in zip(*parts))
        del parts
        gmax, _ = torch.max(mxs, 0, keepdim=True)
        diff = torch.exp(mxs - gmax)
        vals *= torch.unsqueeze(diff, -1)
        sums *= diff
        return vals.sum(dim=0) / torch.unsqueeze(sums, -1).sum(dim=0)

    def attention(q, k, v):  # noqa: ANN001, ANN202
        bh, n, d = q.shape
        m = k.shape[1]
        s = q.element_size()
        threshold = int(free() * 0.7)
        kv_min = threshold // (bh * s * 2 * d)
        kv = m if bh * n * m * s <= threshold else None
        kv = max(min(kv or int(math.sqrt(m)), m), kv_min)
        scale = d**-0.5

        def chunk(qc):  # noqa: ANN001, ANN202
            return scores_softmax(qc, k, v, scale) if m <= kv else kv_chunked(qc, k, v, scale, kv)

        if n <= q_chunk:
            return chunk(q)
        res = torch.zeros_like(q)
        for i in range(0, n, q_chunk):
            res[:, i : i + q_chunk] = chunk(q[:, i : i + q_chunk])
        return res

    def fwd(self, x, context=None, mask=None):  # noqa: ANN001, ANN202
        h = self.heads
        q, k, v = _proj(self, x, context)
        q = q.unflatten(-1, (h, -1)).transpose(1, 2).flatten(end_dim=1)
        k = k.unflatten(-1, (h, -1)).transpose(1, 2).flatten(end_dim=1)
        v = v.unflatten(-1, (h, -1)).transpose(1, 2).flatten(end_dim=1)
        out = attention(q, k, v)
        out = out.unflatten(0, (-1, h)).transpose(1, 2).flatten(start_dim=2)
        return self.to_out(out)

    return fwd


def host_forward(attention: str, free: Callable[[], float], backend: str = "cuda", math_sdp: bool = False):
    """The ``CrossAttention.forward`` that ``attention`` installs (None: ldm's own). ``free`` is
    the free-memory probe Doggettx, InvokeAI (CUDA) and sub-quadratic size their slices from;
    ``math_sdp``: ``sdp-no-mem`` on the math kernel (float32 on CUDA)."""
    if attention in ("sdp", "sdp-no-mem", "xformers"):
        return _make_sdp(math_sdp and attention == "sdp-no-mem")
    table = {
        "split-v1": lambda: _split_v1,
        "doggettx": lambda: _make_doggettx(free),
        "invokeai": lambda: _make_invokeai(free, backend),
        "sub-quadratic": lambda: _make_sub_quad(free),
        "none": lambda: None,
    }
    if attention not in table:
        raise ValueError(f"unknown attention {attention!r}")
    return table[attention]()


@contextlib.contextmanager
def attention_applied(unet: torch.nn.Module, fn) -> Iterator[None]:  # noqa: ANN001
    """``fn`` set as ``forward`` on every ``CrossAttention`` instance of ``unet`` (the host sets
    it on the class; an instance attribute keeps other models untouched); removed on exit."""
    mods = [m for m in unet.modules() if type(m).__name__ == "CrossAttention"]
    if fn is not None:
        for m in mods:
            m.forward = types.MethodType(fn, m)
    try:
        yield
    finally:
        for m in mods:
            m.__dict__.pop("forward", None)
