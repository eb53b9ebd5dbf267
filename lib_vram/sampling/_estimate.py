"""Closed-form memory of one UNet forward (the sampling stage's step).

The walk follows ldm's ``UNetModel.forward`` (openaimodel layout; sgm's is the same) and counts each
tensor as the forward holds it at each moment: the timestep embedding; every input block's output
(the skip connections, held until the up path pops them); inside a block, its input (held by the
caller) and its temporaries (a ResBlock's normalised copy, SiLU, convolutions, the embedding sum and
the skip branch; a SpatialTransformer's normalised copy, projections and contiguous copies; each
BasicTransformerBlock's LayerNorm outputs, residual sums and the GEGLU feed-forward's 8x/4x/4x
temporaries; the attention as :mod:`._attention` models it); on the up path the concatenation
with the popped skip; upsampling's 2x copy. No fitted factors.

Not counted: tensors of a few bytes per sample (the embedding's temporaries, LayerNorm/GroupNorm
statistics), framework workspaces besides the convolution term of
:data:`lib_vram.core.predict.WORKSPACE_TERMS`, allocator rounding. In half precision ldm's
``GroupNorm32`` normalises a float32 copy (counted); autocast's float32 outputs of LayerNorm and
softmax are not (the model is counted at its own dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lib_vram.core.livebytes import itemsize
from lib_vram.core.predict import WORKSPACE_TERMS

from ._attention import ATTENTIONS, Walk, attend, attend_ip
from ._spec import HINT_BLOCK, UNetSpec
from ._tokens import SelfAttention

MAX_BATCH = 64
"""The largest UNet batch estimated or planned (the WebUI's batch size x batch count bound is 8 x
2 for cond/uncond... a larger value is certainly a mistake)."""
MAX_LATENT_SIDE = 2048
"""The largest latent side (16384 px, the CLI's largest image side) estimated."""
MAX_CONTEXT_TOKENS = 77 * 64


@dataclass(frozen=True)
class SamplingEstimate:
    """The predicted memory of one UNet forward, in bytes."""

    weights_bytes: int
    """The UNet's parameters at the compute dtype (resident before the stage)."""
    activation_bytes: int
    """Peak of what the forward allocates above the weights and its inputs (output included)."""
    peak_bytes: int
    """``weights_bytes + input_bytes + activation_bytes``."""
    input_bytes: int = 0
    """The forward's inputs: the latent batch, the timesteps, the context (and ``y``)."""
    refused: str | None = None
    """Set when the host's attention would refuse at this size (Doggettx: over 64 slices)."""


def _check(batch: int, latent_hw: tuple[int, int], context_tokens: int, attention: str) -> tuple[int, int]:
    if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"`batch` must be an integer in 1..{MAX_BATCH}, got {batch!r}")
    try:
        h, w = (int(v) for v in latent_hw)
    except (TypeError, ValueError):
        raise ValueError(f"`latent_hw` must be (height, width) in latent pixels, got {latent_hw!r}") from None
    if not (1 <= h <= MAX_LATENT_SIDE and 1 <= w <= MAX_LATENT_SIDE):
        raise ValueError(f"`latent_hw` sides must be in 1..{MAX_LATENT_SIDE}, got {latent_hw!r}")
    if not isinstance(context_tokens, int) or not 1 <= context_tokens <= MAX_CONTEXT_TOKENS:
        raise ValueError(
            f"`context_tokens` must be an integer in 1..{MAX_CONTEXT_TOKENS}, got {context_tokens!r}"
        )
    if attention not in ATTENTIONS:
        raise ValueError(f"`attention` must be one of {ATTENTIONS}, got {attention!r}")
    return h, w


class _UNetWalk:
    def __init__(
        self, spec: UNetSpec, b: int, m: int, attention: str, s: int, backend: str, w: Walk,
        sa: SelfAttention | None = None,
    ) -> None:  # fmt: skip
        self.spec, self.b, self.m, self.attention = spec, b, m, attention
        self.s, self.backend, self.w = s, backend, w
        self.ws_term = WORKSPACE_TERMS.get(backend)
        self.sa = sa if sa is not None and sa.active else None
        self.hw0 = (1, 1)

    def conv(self, cin: int, cout: int, k: int, hw_in: tuple[int, int], hw_out: tuple[int, int]) -> int:
        b, s = self.b, self.s
        out = self.w.hold(b * cout * hw_out[0] * hw_out[1] * s)
        if self.ws_term is not None:
            ws = self.ws_term(
                (b, cin, hw_in[0], hw_in[1]), (cout, cin, k, k), (b, cout, hw_out[0], hw_out[1]), s, True
            )
            self.w.moment(ws)
        return out

    def groupnorm(self, c: int, px: int) -> int:
        """ldm's GroupNorm32: ``group_norm(x.float()).type(x.dtype)``."""
        w, u = self.w, self.b * px
        if self.s == 4:
            return w.hold(c * u * 4)
        f = w.hold(c * u * 4)
        o = w.hold(c * u * 4)
        w.drop(f)
        t = w.hold(c * u * self.s)
        w.drop(o)
        return t

    def resblock(self, cin: int, cout: int, hw: tuple[int, int]) -> int:
        w, u, s = self.w, self.b * hw[0] * hw[1], self.s
        n1 = self.groupnorm(cin, hw[0] * hw[1])
        a1 = w.hold(cin * u * s)
        w.drop(n1)
        c1 = self.conv(cin, cout, 3, hw, hw)
        w.drop(a1)
        h2 = w.hold(cout * u * s)  # h + emb_out
        w.drop(c1)
        n2 = self.groupnorm(cout, hw[0] * hw[1])
        a2 = w.hold(cout * u * s)
        w.drop(n2)
        c2 = self.conv(cout, cout, 3, hw, hw)
        w.drop(a2, h2)
        sk = self.conv(cin, cout, 1, hw, hw) if cin != cout else 0
        out = w.hold(cout * u * s)
        w.drop(sk, c2)
        return out

    def transformer(
        self, c: int, depth: int, heads: int, hw: tuple[int, int], site: tuple[str, int] | None = None
    ) -> int:
        """A SpatialTransformer (``site``: the UNet block it is in, for HyperTile and token
        merging; None: a ControlNet's, which neither patches)."""
        if depth == 0:
            return 0
        w, s, px = self.w, self.s, hw[0] * hw[1]
        u = self.b * px
        n = self.groupnorm(c, px)
        if self.spec.use_linear:
            cc = w.hold(c * u * s)  # b c h w -> b (h w) c, contiguous
            w.drop(n)
            x = w.hold(c * u * s)  # proj_in
            w.drop(cc)
        else:
            p = self.conv(c, c, 1, hw, hw)
            w.drop(n)
            x = w.hold(c * u * s)
            w.drop(p)
        for j in range(depth):
            x2 = self.block(c, heads, px, x, None if site is None else (site, j))
            w.drop(x)
            x = x2
        if self.spec.use_linear:
            o = w.hold(c * u * s)
            w.drop(x)
            r = w.hold(c * u * s)
            w.drop(o)
        else:
            cc = w.hold(c * u * s)
            w.drop(x)
            r = self.conv(c, c, 1, hw, hw)
            w.drop(cc)
        out = w.hold(c * u * s)  # x + x_in
        w.drop(r)
        return out

    def block(self, d: int, heads: int, n: int, x0: int, where: tuple | None = None) -> int:
        """One BasicTransformerBlock on tokens of width ``d`` (its input ``x0`` is held by the
        caller throughout; ``where``: its site and index, see :meth:`self_attention`). Returns its
        output's bytes (held)."""
        w, s, u = self.w, self.s, self.b * n
        t = d * u * s
        kw = dict(batch=self.b, tokens=n, query_dim=d, heads=heads, s=s, backend=self.backend)
        if self.sa is not None and where is not None:
            a1, kept = self.self_attention(d, heads, n, where)
        else:
            n1 = w.hold(t)
            a1 = attend(w, self.attention, ctx_tokens=n, ctx_dim=d, self_attn=True, **kw)
            w.drop(n1)
            kept = 0
        x1 = w.hold(t)
        w.drop(a1)
        n2 = w.hold(t)
        if self.sa is not None and self.sa.image_tokens and where is not None:
            ip = dict(image_tokens=self.sa.image_tokens, cache_itemsize=self.sa.cache_itemsize)
            a2 = attend_ip(w, ctx_tokens=self.m, **ip, **kw)
        else:
            a2 = attend(
                w, self.attention, ctx_tokens=self.m, ctx_dim=self.spec.context_dim, self_attn=False, **kw
            )
        w.drop(n2)
        x2 = w.hold(t)
        w.drop(a2, x1)
        n3 = w.hold(t)
        p = w.hold(8 * t)  # GEGLU's projection (value and gate)
        g = w.hold(4 * t)  # gelu(gate)
        o = w.hold(4 * t)  # value * gelu(gate)
        w.drop(p, g)
        f = w.hold(t)
        w.drop(o, n3)
        x3 = w.hold(t)
        w.drop(f, x2, kept)
        del x0
        return x3

    def self_attention(self, d: int, heads: int, n: int, where: tuple) -> tuple[int, int]:
        """``attn1(norm1(x))`` of a block at ``where`` (``((kind, index), block)``: ``input_blocks``,
        ``output_blocks`` or the middle) as HyperTile and token merging run it (:mod:`._tokens`).
        Returns the bytes of its output (held; the norm dropped) and of what stays until the block
        returns (token merging's index tensors).

        Token merging (tomesd, on the block's input): its cosine-normalised copy, the copy split into
        source and destination tokens, their similarity matrix, its row maxima and their order;
        kept: the source/destination order and the merge's indices. Then the norm's output is split
        and merged (the unmerged and merged rows, the destinations' scatter-reduced copy, their
        concatenation), the attention runs on the ``N - r`` tokens, and its output is scattered back
        into a new ``N``-token tensor. HyperTile: the attention's input rearranged into the tiles'
        batch (a copy unless the tiles are whole rows) and its output back (a copy likewise)."""
        w, s, b = self.w, self.s, self.b
        t = b * n * d * s
        (site, j), sa = where, self.sa
        r, dst = sa.merging.merged(self.hw0, n) if sa.merging is not None else (0, 0)
        src = n - dst
        kept = 0
        if r:
            kept = w.hold(n * 8)  # the dst|src order of the token grid (int64, one image)
            w.moment(2 * n * 8)  # the index buffer and its transposed copy it was sorted from
            metric = w.hold(t)
            halves = w.hold(b * src * d * s) + w.hold(b * dst * d * s)
            scores = w.hold(b * src * dst * s)
            best = w.hold(b * src * s) + w.hold(b * src * 8)  # row maxima and their columns
            w.moment(b * src * s)  # argsort's sorted values
            kept += w.hold(b * src * 8) + w.hold(b * r * 8)  # edge order, destination of each merged
            w.drop(metric, halves, scores, best)
        n1 = w.hold(t)
        inp, tokens = n1, n
        if r:
            sp, dp = w.hold(b * src * d * s), w.hold(b * dst * d * s)  # the norm's output split
            unm = w.hold(b * (src - r) * d * s)
            moved = w.hold(b * r * d * s)
            w.drop(sp)
            reduced = w.hold(b * dst * d * s)  # scatter_reduce: a new tensor
            w.drop(dp)
            inp, tokens = w.hold(b * (n - r) * d * s), n - r
            w.drop(unm, moved, reduced, n1)
        out = self._tiled_attn1(d, heads, tokens, inp, site, j)
        w.drop(inp)
        if r:
            back = w.hold(b * r * d * s)
            full = w.hold(t)
            w.moment(b * max(src - r, r) * 8)  # the scatter's index
            w.drop(back, out)
            out = full
        return out, kept

    def _tiled_attn1(self, d: int, heads: int, tokens: int, inp: int, site: tuple, j: int) -> int:
        w, ht = self.w, self.sa.hypertile
        tiles, copies = 1, False
        depth = ht.depth_of(site, j) if ht is not None else None
        if depth is not None:
            h0, w0 = self.hw0
            tiles, copies = ht.split(depth, tokens, (w0 * 8, h0 * 8))
        kw = dict(query_dim=d, heads=heads, s=self.s, backend=self.backend, ctx_dim=d, self_attn=True)
        b, n = self.b * tiles, tokens // tiles
        xr = w.hold(inp) if copies else 0
        out = attend(w, self.attention, batch=b, tokens=n, ctx_tokens=n, **kw)
        if copies:
            back = w.hold(out)
            w.drop(out, xr)
            out = back
        return out

    def res_attn(
        self, cin: int, cout: int, depth: int, heads: int, hw: tuple[int, int], site: tuple | None = None
    ) -> int:
        """A ResBlock and (where the level has one) its SpatialTransformer: the output's bytes."""
        r = self.resblock(cin, cout, hw)
        t = self.transformer(cout, depth, heads, hw, site)
        if t:
            self.w.drop(r)
            r = t
        return r

    def ip_cache(self) -> int:
        """IP-Adapter's cache: each unit's image keys and values at every cross-attention of the
        UNet, made at the pass's first forward and kept through its last (0: no IP-Adapter)."""
        sa = self.sa
        if sa is None or not sa.image_tokens:
            return 0
        return 2 * self.b * sum(sa.image_tokens) * self.spec.cross_width * sa.cache_itemsize

    def forward(self, hw: tuple[int, int]) -> None:
        spec, w, b, s = self.spec, self.w, self.b, self.s
        mc = spec.model_channels
        cache = w.hold(self.ip_cache())
        emb = w.hold(b * 4 * mc * s)
        h0, w0 = hw
        cur = self.hw0 = (h0, w0)
        skips: list[tuple[int, int]] = []  # (bytes, channels)
        hcur = self.conv(spec.in_channels, mc, 3, cur, cur)
        skips.append((hcur, mc))
        ch = mc
        for lv in range(spec.levels):
            for _ in range(spec.num_res_blocks[lv]):
                site = ("input", len(skips))
                r = self.res_attn(ch, spec.channels(lv), spec.depth[lv], spec.heads[lv], cur, site)
                ch = spec.channels(lv)
                skips.append((r, ch))
            if lv != spec.levels - 1:
                nxt = ((cur[0] + 1) // 2, (cur[1] + 1) // 2)
                d = self.conv(ch, ch, 3, cur, nxt)
                cur = nxt
                skips.append((d, ch))
        # middle block: its input is the last skip (held)
        r1 = self.res_attn(ch, ch, spec.depth_middle, spec.heads_middle, cur, ("middle", 0))
        r2 = self.resblock(ch, ch, cur)
        w.drop(r1)
        h = r2
        out_index = 0
        for lv in reversed(range(spec.levels)):
            for i in range(spec.num_res_blocks[lv] + 1):
                sk, skc = skips.pop()
                cat = w.hold(b * (ch + skc) * cur[0] * cur[1] * s)
                w.drop(h, sk)
                site = ("output", out_index)
                out_index += 1
                r = self.res_attn(ch + skc, spec.channels(lv), spec.depth[lv], spec.heads[lv], cur, site)
                ch = spec.channels(lv)
                if lv and i == spec.num_res_blocks[lv]:
                    up = (cur[0] * 2, cur[1] * 2)
                    x2 = w.hold(b * ch * up[0] * up[1] * s)  # nearest 2x
                    c = self.conv(ch, ch, 3, up, up)
                    w.drop(x2, r)
                    cur = up
                    r = c
                w.drop(cat)
                h = r
        n = self.groupnorm(mc, cur[0] * cur[1])
        a = w.hold(b * mc * cur[0] * cur[1] * s)
        w.drop(n)
        out = self.conv(mc, spec.out_channels, 3, cur, cur)
        w.drop(a, h, emb, cache)
        del out

    def control(self, hw: tuple[int, int]) -> int:
        """cldm ``ControlNet.forward``: the hint block on the control image (8x the latent; one
        image, which the first block's output broadcasts over the rows, as sd-webui-controlnet
        passes it), the down path (a block's output leaves after the next block; each zero
        convolution's output is held for the UNet), the middle block and its zero convolution.
        Returns the bytes of the outputs (the residuals, held at the end)."""
        spec, w, b, s = self.spec, self.w, self.b, self.s
        mc = spec.model_channels
        emb = w.hold(b * 4 * mc * s)
        self.b = 1  # (the hint block's batch: one control image)
        cur, cin, prev = (hw[0] * 8, hw[1] * 8), spec.hint_channels, 0
        for cout, stride in HINT_BLOCK:
            nxt = cur if stride == 1 else ((cur[0] + 1) // 2, (cur[1] + 1) // 2)
            c = self.conv(cin, cout, 3, cur, nxt)
            w.drop(prev)
            prev = w.hold(cout * nxt[0] * nxt[1] * s)  # SiLU (one image)
            w.drop(c)
            cin, cur = cout, nxt
        guided = self.conv(cin, mc, 3, cur, cur)
        w.drop(prev)
        self.b, cur = b, hw
        h = self.conv(spec.in_channels, mc, 3, cur, cur)
        w.drop(guided)  # (added in place)
        outs = [self.conv(mc, mc, 1, cur, cur)]
        ch = mc
        for lv in range(spec.levels):
            for _ in range(spec.num_res_blocks[lv]):
                r = self.res_attn(ch, spec.channels(lv), spec.depth[lv], spec.heads[lv], cur)
                ch = spec.channels(lv)
                w.drop(h)
                h = r
                outs.append(self.conv(ch, ch, 1, cur, cur))
            if lv != spec.levels - 1:
                nxt = ((cur[0] + 1) // 2, (cur[1] + 1) // 2)
                d = self.conv(ch, ch, 3, cur, nxt)
                w.drop(h)
                h, cur = d, nxt
                outs.append(self.conv(ch, ch, 1, cur, cur))
        r1 = self.res_attn(ch, ch, spec.depth_middle, spec.heads_middle, cur)
        r2 = self.resblock(ch, ch, cur)
        w.drop(r1, h)
        outs.append(self.conv(ch, ch, 1, cur, cur))
        w.drop(r2, emb)
        return sum(outs)


def weights_bytes(spec: UNetSpec, dtype: torch.dtype) -> int:
    return spec.params * itemsize(dtype)


def input_bytes(
    spec: UNetSpec, batch: int, latent_hw: tuple[int, int], context_tokens: int, dtype: torch.dtype
) -> int:
    s = itemsize(dtype)
    h, w = latent_hw
    if spec.is_control:  # the control image (its latent, context and timesteps are the UNet's)
        return batch * spec.hint_channels * h * w * 64 * s
    x = batch * spec.in_channels * h * w * s
    ctx = batch * context_tokens * spec.context_dim * s
    return x + ctx + batch * 4 + batch * spec.adm_in_channels * s


def estimate_sampling(
    spec: UNetSpec,
    *,
    batch: int,
    latent_hw: tuple[int, int],
    context_tokens: int,
    attention: str,
    dtype: torch.dtype,
    free_bytes: int | None = None,
    backend: str = "cuda",
    self_attention: SelfAttention | None = None,
) -> SamplingEstimate:
    """The memory of one UNet forward of ``batch`` samples (the WebUI batches cond and uncond and
    the images into one forward: ``batch = 2 x images`` by default) on a ``latent_hw`` latent with
    ``context_tokens`` context tokens (77 per prompt chunk), at ``dtype``, with ``attention`` as the
    WebUI applies it (see :data:`ATTENTIONS`).

    ``free_bytes``: the free memory when the forward starts (weights resident), which Doggettx,
    InvokeAI (CUDA) and sub-quadratic size their slices from (``None``: unlimited, one slice).
    ``backend``: ``"cuda"`` (default: the WebUI's target; no convolution scratch counted, SDP on
    flash/memory-efficient kernels, see :func:`._attention.flash_kernel`) or ``"cpu"`` (oneDNN's
    convolution scratch, InvokeAI's fixed 32 MiB slices). ``self_attention``: the WebUI's HyperTile
    and token merging as the pass runs them (:class:`~._tokens.SelfAttention`; None: neither, the
    stock forward)."""
    h, w = _check(batch, latent_hw, context_tokens, attention)
    walk = Walk(free_bytes)
    unet = _UNetWalk(spec, batch, context_tokens, attention, itemsize(dtype), backend, walk, self_attention)
    (unet.control if spec.is_control else unet.forward)((h, w))
    wb = weights_bytes(spec, dtype)
    ib = input_bytes(spec, batch, latent_hw, context_tokens, dtype)
    return SamplingEstimate(wb, walk.peak, wb + ib + walk.peak, ib, walk.refused)


def residual_bytes(spec: UNetSpec, batch: int, latent_hw: tuple[int, int], dtype: torch.dtype) -> int:
    """One set of a ControlNet's outputs (the residuals it hands the UNet: one per input block,
    the sizes of the UNet's skips, and one for the middle)."""
    h, w = latent_hw
    total, ch = spec.model_channels * h * w, spec.model_channels
    for lv in range(spec.levels):
        total += spec.num_res_blocks[lv] * spec.channels(lv) * h * w
        ch = spec.channels(lv)
        if lv != spec.levels - 1:
            h, w = (h + 1) // 2, (w + 1) // 2
            total += ch * h * w
    return (total + ch * h * w) * batch * itemsize(dtype)


@dataclass(frozen=True)
class Step:
    """One sampling step as the estimate, the plan and the streamed plan size it: the UNet, the
    host's batch (the sampler holds all of it), the latent, the context tokens, the attention, the
    dtype and the backend (see :func:`estimate_sampling`), and the ControlNets of the pass
    (``controls``: their specs, :func:`~._spec.reference_control` or :func:`~._spec.unet_spec` of a
    live one). ``whole``: the forward cannot split its batch (a ControlNet unit with a control image
    per sample, see :func:`lib_vram.residency.controlnet.whole_batch`)."""

    spec: UNetSpec
    batch: int
    latent_hw: tuple[int, int]
    context_tokens: int
    attention: str
    dtype: torch.dtype
    backend: str = "cuda"
    controls: tuple[UNetSpec, ...] = ()
    whole: bool = False
    self_attention: SelfAttention | None = None
    """HyperTile and token merging on the UNet (:class:`~._tokens.SelfAttention`; None: off)."""

    @property
    def weights_bytes(self) -> int:
        return weights_bytes(self.spec, self.dtype)

    @property
    def control_bytes(self) -> int:
        """The ControlNets' weights (on the card for the pass)."""
        return sum(weights_bytes(c, self.dtype) for c in self.controls)

    @property
    def input_bytes(self) -> int:
        """The inputs of the whole batch and each unit's control image (one, broadcast over the
        batch as sd-webui-controlnet's hook adds it; per sample when the step runs whole)."""
        n = self.batch if self.whole else 1
        hint = sum(input_bytes(c, n, self.latent_hw, 1, self.dtype) for c in self.controls)
        return input_bytes(self.spec, self.batch, self.latent_hw, self.context_tokens, self.dtype) + hint

    @property
    def micro_batches(self) -> range:
        """The micro-batches a plan may choose (only the whole batch when ``whole``). Through
        ControlNet's forward wrapper a micro-batch runs the control models on its own rows: the
        control image is one image broadcast over the rows, so each row's residuals are the ones
        of the whole batch."""
        return range(self.batch, self.batch - 1 if self.whole else 0, -1)

    def outputs(self, m: int) -> int:
        """The micro-batches' outputs held while the last one runs, or during their concatenation
        (none when one forward runs the whole batch)."""
        if m >= self.batch:
            return 0
        one = self.spec.out_channels * self.latent_hw[0] * self.latent_hw[1] * itemsize(self.dtype)
        return max((self.batch - m) * one, 2 * self.batch * one)

    def activation(self, m: int, free_bytes: int | None) -> tuple[int, SamplingEstimate]:
        """The activations at micro-batch ``m`` (its forward's and the chunks' outputs) and the
        forward's estimate, with ``free_bytes`` free when it starts. With ControlNets (as
        sd-webui-controlnet's hook runs them): each control model's forward, while the running
        total of the residuals and the previous unit's scaled outputs are held, then the UNet's
        forward with both held and one skip-sized sum at each of its concatenations."""
        kw = dict(
            latent_hw=self.latent_hw, context_tokens=self.context_tokens, attention=self.attention,
            dtype=self.dtype, free_bytes=free_bytes, backend=self.backend,
        )  # fmt: skip
        est = estimate_sampling(self.spec, batch=m, self_attention=self.self_attention, **kw)
        act = est.activation_bytes + self.outputs(m)
        if not self.controls:
            return act, est
        h, w = self.latent_hw
        sets = [residual_bytes(c, m, self.latent_hw, self.dtype) for c in self.controls]
        peaks = [act + 2 * max(sets) + m * self.spec.model_channels * h * w * itemsize(self.dtype)]
        for i, c in enumerate(self.controls):
            held = 2 * max(sets[:i]) if i else 0
            peaks.append(estimate_sampling(c, batch=m, **kw).activation_bytes + held)
            peaks.append((3 if i else 2) * sets[i])
        return max(peaks), est
