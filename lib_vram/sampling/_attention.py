"""The cross-attention implementations the WebUI v1.10.1 offers, and the memory each allocates.

The WebUI replaces ldm's/sgm's ``CrossAttention.forward`` by one of its optimizations
(``modules/sd_hijack_optimizations.py``). What each allocates differs by orders of magnitude at
hires sizes: SDP (flash / memory-efficient kernels) and xformers hold the output and a
log-sum-exp row per query; the sliced ones (Doggettx, InvokeAI, split v1, sub-quadratic) hold the
scores of one slice, sized from the free memory (Doggettx, InvokeAI on CUDA, sub-quadratic's
chunk threshold) or fixed (split v1: two heads at a time; InvokeAI on the CPU: 32 MiB slices); ldm's
own einsum (``none``) holds the whole score matrix twice, in float32 (``ATTN_PRECISION=fp32``,
ldm's default, also for a half-precision model).

Each model below counts the tensors the host's forward holds at each moment (inputs of the
attention, q/k/v and their rearranged copies, the scores of a slice and their softmax, the result
and its rearranged copy, the output projection), on :class:`Walk` — no fitted factors.
"""

from __future__ import annotations

import math

ATTENTIONS = ("sdp", "sdp-no-mem", "xformers", "sub-quadratic", "doggettx", "invokeai", "split-v1", "none")
"""The attention implementations modelled (the WebUI's cross-attention optimizations, and
``none``: ldm's own ``CrossAttention.forward``)."""

_HOST_NAMES = {
    "xformers": "xformers",
    "sdp-no-mem": "sdp-no-mem",
    "scaled dot product without memory efficient attention": "sdp-no-mem",
    "sdp": "sdp",
    "scaled dot product": "sdp",
    "sub-quadratic": "sub-quadratic",
    "v1": "split-v1",
    "original v1": "split-v1",
    "split-v1": "split-v1",
    "invokeai": "invokeai",
    "doggettx": "doggettx",
    "none": "none",
}

ATTENTION_WORDS = {
    "sdp": "scaled dot product",
    "doggettx": "Doggettx",
    "invokeai": "InvokeAI",
    "split-v1": "V1",
}
"""An id of :data:`ATTENTIONS` as the WebUI's "Cross attention optimization" setting names it
(``none``: ldm's own); the other ids are the setting's own names."""

SUB_QUAD_Q_CHUNK = 1024
"""The WebUI's ``--sub-quad-q-chunk-size`` default."""
INVOKEAI_CPU_MB = 32
"""InvokeAI's slice limit off CUDA (MiB of scores per slice)."""
MiB = 1 << 20


def attention_of(host_name: str, *, backend: str = "cuda", xformers: bool = False) -> str:
    """One of :data:`ATTENTIONS` for the WebUI's optimization name (its ``name`` or ``label``,
    or the ``cross_attention_optimization`` setting's value).

    ``"Automatic"`` resolves as the WebUI v1.10.1 does with no command-line flag: the available
    optimization of highest priority, xformers (100, only with ``--xformers`` and the package:
    ``xformers=True``) then Doggettx (90) on CUDA; InvokeAI (1000 when CUDA is not available) on a
    CPU (``backend="cpu"``); sub-quadratic (1000) on MPS."""
    if not isinstance(host_name, str):
        raise ValueError(f"`host_name` must be a string, got {host_name!r}")
    key = host_name.strip().lower()
    if key in ("automatic", "auto", ""):
        if backend == "mps":
            return "sub-quadratic"
        if backend in ("cuda", "rocm"):
            return "xformers" if xformers else "doggettx"
        return "invokeai"
    if key in _HOST_NAMES:
        return _HOST_NAMES[key]
    raise ValueError(
        f"unknown attention {host_name!r}: expected one of {ATTENTIONS} or a WebUI optimization name"
    )


class Walk:
    """Bytes alive at each moment of a forward, and their high-water mark.

    ``hold(n)``: a tensor of ``n`` bytes is allocated and stays; ``drop(n)``: it is freed;
    ``moment(n)``: ``n`` bytes are allocated and freed within one operator (scratch)."""

    def __init__(self, free_bytes: int | None = None) -> None:
        self.live = 0
        self.peak = 0
        self.free_bytes = free_bytes
        self.refused: str | None = None

    def hold(self, n: int) -> int:
        self.live += int(n)
        self.peak = max(self.peak, self.live)
        return int(n)

    def drop(self, *ns: int) -> None:
        for n in ns:
            self.live -= int(n)

    def moment(self, n: int) -> None:
        self.peak = max(self.peak, self.live + int(n))

    def free_now(self) -> float:
        """What the host's probe would report now (the free memory before the forward minus what
        the forward holds), or infinity when the free memory is not given."""
        if self.free_bytes is None:
            return math.inf
        return max(0, self.free_bytes - self.live)


def flash_kernel(attention: str, dtype_bytes: int, backend: str) -> bool:
    """Whether an SDP attention runs a kernel that never holds the score matrix.

    CUDA: ``sdp`` lets torch pick flash (fp16/bf16) or memory-efficient (any dtype) attention;
    ``sdp-no-mem`` switches memory-efficient off, so float32 falls back to the math kernel
    (assumed: a GPU where flash attention is available for half precision, sm80+ or sm75 with
    torch's own kernels). CPU (torch >= 2.3): the blocked flash kernel takes float32, bfloat16 and
    float16 for both (the ``sdp_kernel`` switch leaves flash on)."""
    if attention == "sdp-no-mem" and backend != "cpu":
        return dtype_bytes == 2
    return True


def attend(
    w: Walk,
    attention: str,
    *,
    batch: int,
    tokens: int,
    ctx_tokens: int,
    query_dim: int,
    ctx_dim: int,
    heads: int,
    s: int,
    backend: str,
    self_attn: bool,
) -> int:
    """One ``CrossAttention.forward`` as ``attention`` runs it, on ``w``: its input (and the
    context) are held by the caller. Returns the bytes of its output (held on ``w``)."""
    b, n, m, h = batch, tokens, ctx_tokens, heads
    inner = query_dim  # heads x head dim: the query width in every SD UNet
    dh = inner // h
    bh = b * h
    q_b = b * n * inner * s
    kv_b = b * m * inner * s
    out_b = b * n * query_dim * s
    del self_attn, ctx_dim  # the context's own bytes are the caller's

    def scores(rows: int, elem: int = s, per: int = bh) -> int:
        return per * rows * m * elem

    if attention in ("sdp", "xformers") or (
        attention == "sdp-no-mem" and flash_kernel(attention, s, backend)
    ):
        q, k, v = w.hold(q_b), w.hold(kv_b), w.hold(kv_b)
        o = w.hold(q_b)  # (B, N, h, d) laid out: the transposed reshape is a view
        w.moment(bh * n * 4)  # the log-sum-exp rows (float32), freed on return
        out = w.hold(out_b)
        w.drop(o, q, k, v)
        return out
    if attention == "sdp-no-mem":
        # torch's math kernel: q and k scaled (copies in the input's layout), made contiguous for
        # the batched matmul, the scores and their softmax, then the output and its contiguous copy
        q, k, v = w.hold(q_b), w.hold(kv_b), w.hold(kv_b)
        qs, ks = w.hold(q_b), w.hold(kv_b)
        qc, kc = w.hold(q_b), w.hold(kv_b)
        sc = w.hold(scores(n))
        w.drop(qc, kc)
        p = w.hold(scores(n))
        w.drop(sc)
        vc = w.hold(kv_b)
        o = w.hold(q_b)
        w.drop(vc, p, qs, ks)
        r = w.hold(q_b)  # transpose(1, 2).reshape: a copy
        w.drop(o)
        out = w.hold(out_b)
        w.drop(r, q, k, v)
        return out
    if attention == "none":
        # ldm: q/k/v, their (b h) n d copies; float32 scores (ATTN_PRECISION=fp32), scaled (a
        # second tensor), softmax; the result and its copy back
        q, k, v = w.hold(q_b), w.hold(kv_b), w.hold(kv_b)
        qh, kh, vh = w.hold(q_b), w.hold(kv_b), w.hold(kv_b)
        w.drop(q, k, v)
        qf = kf = 0
        if s != 4:
            qf, kf = w.hold(q_b * 4 // s), w.hold(kv_b * 4 // s)
            w.drop(qh, kh)
            qh = kh = 0
        e = w.hold(scores(n, 4))
        sim = w.hold(scores(n, 4))
        w.drop(e)
        w.drop(qh, kh, qf, kf)
        p = w.hold(scores(n, 4))
        w.drop(sim)
        cast = w.hold(scores(n)) if s != 4 else 0  # autocast's half copy for the second einsum
        o = w.hold(q_b)
        w.drop(cast, p, vh)
        r = w.hold(q_b)
        w.drop(o)
        out = w.hold(out_b)
        w.drop(r)
        return out
    if attention in ("doggettx", "invokeai", "split-v1"):
        q, k, v = w.hold(q_b), w.hold(kv_b), w.hold(kv_b)
        if attention != "split-v1":
            ks = w.hold(kv_b)  # k * scale
            w.drop(k)
            k = ks
        qh, kh, vh = w.hold(q_b), w.hold(kv_b), w.hold(kv_b)
        w.drop(q, k, v)
        if attention == "doggettx":
            r1 = w.hold(q_b)
            free = w.free_now()
            need = scores(n) * (3 if s == 2 else 2.5)
            steps = 1
            if need > free:
                steps = 2 ** math.ceil(math.log2(need / max(free, 1)))
            if steps > 64:
                w.refused = "Doggettx attention refuses (needs more than 64 slices)"
                steps = 64
            rows = n // steps if n % steps == 0 else n
            _slice(w, scores(rows), bh * rows * dh * s)
            w.drop(qh, kh, vh)
            res = r1
        elif attention == "invokeai":
            if backend in ("cuda", "rocm"):
                max_mb = w.free_now() / 3.3 / MiB
            else:
                max_mb = INVOKEAI_CPU_MB
            size_mb = scores(n) // MiB
            if size_mb <= max_mb:
                sc = w.hold(scores(n))
                p = w.hold(scores(n))
                w.drop(sc)
                res = w.hold(q_b)
                w.drop(p)
            else:
                # no free memory at all (the weights took it): the smallest slices, not a division by 0
                div = 1 << int((size_mb - 1) / max(max_mb, 1 / MiB)).bit_length()
                res = w.hold(q_b)
                if div <= bh:
                    per = bh // div
                    _slice(w, per * n * m * s, per * n * dh * s)
                else:
                    rows = max(n // div, 1)
                    _slice(w, scores(rows), bh * rows * dh * s)
            r = w.hold(q_b)
            out = w.hold(out_b)
            w.drop(r, res, qh, kh, vh)
            return out
        else:  # split-v1: two (batch x head) rows at a time
            r1 = w.hold(q_b)
            per = min(2, bh)
            _slice(w, per * n * m * s, per * n * dh * s)
            w.drop(qh, kh, vh)
            res = r1
        r2 = w.hold(q_b)
        w.drop(res)
        out = w.hold(out_b)
        w.drop(r2)
        return out
    if attention == "sub-quadratic":
        q, k, v = w.hold(q_b), w.hold(kv_b), w.hold(kv_b)
        qh = w.hold(q_b)
        w.drop(q)
        kh = w.hold(kv_b)
        w.drop(k)
        vh = w.hold(kv_b)
        w.drop(v)
        free = w.free_now()
        threshold = free * 0.7
        kv_min = None if math.isinf(threshold) else int(threshold) // (bh * s * 2 * dh)
        kv_chunk = m if scores(n) <= threshold else None
        kv_chunk = min(kv_chunk or int(math.sqrt(m)), m)
        if kv_min is not None:
            kv_chunk = max(kv_chunk, kv_min)
        rows = min(SUB_QUAD_Q_CHUNK, n)
        res = w.hold(q_b) if n > SUB_QUAD_Q_CHUNK else 0
        if m <= kv_chunk:
            sc = w.hold(scores(rows))
            p = w.hold(scores(rows))
            w.drop(sc)
            o = w.hold(bh * rows * dh * s)
            w.drop(p)
            if res:
                w.drop(o)
            else:
                res = o
        else:
            # key/value chunks: each chunk's weights, their shifted copy and its exp; the chunks'
            # values, sums and maxima kept, then stacked
            chunks = math.ceil(m / kv_chunk)
            kept_one = bh * rows * (dh + 2) * s
            wts = bh * rows * kv_chunk * s
            w.moment(kept_one * (chunks - 1) + 3 * wts + bh * rows * dh * s)
            kept = w.hold(kept_one * chunks)
            stacked = w.hold(kept_one * chunks)
            w.drop(kept)
            o = w.hold(bh * rows * dh * s)
            w.moment(bh * rows * dh * s * chunks)
            w.drop(stacked)
            if res:
                w.drop(o)
            else:
                res = o
        x = w.hold(q_b)  # unflatten/transpose/flatten back: a copy
        w.drop(res)
        out = w.hold(out_b)
        w.drop(x, qh, kh, vh)
        return out
    raise ValueError(f"`attention` must be one of {ATTENTIONS}, got {attention!r}")


def attend_ip(
    w: Walk, *, batch: int, tokens: int, ctx_tokens: int, image_tokens: tuple[int, ...], query_dim: int,
    heads: int, s: int, cache_itemsize: int, **_: object,
) -> int:  # fmt: skip
    """A cross-attention as IP-Adapter (sd-webui-controlnet v1.1.455) replaces its ``forward``,
    whatever the WebUI's optimization: torch's SDP (flash or memory-efficient kernels) on the
    prompt's keys and values, which go; then for each unit an SDP of the same queries on its
    ``image_tokens`` keys/values (held in its cache, see :meth:`._estimate._UNetWalk.forward`;
    copied to the model's dtype where the cache's differs), scaled (a new tensor) and added to
    the output (a new tensor); the output projection last. Returns the output's bytes (held)."""
    b, n, d = batch, tokens, query_dim
    q_b = b * n * d * s
    q, k, v = w.hold(q_b), w.hold(b * ctx_tokens * d * s), w.hold(b * ctx_tokens * d * s)
    o = w.hold(q_b)
    w.moment(b * heads * n * 4)  # the log-sum-exp rows
    w.drop(k, v)
    for t in image_tokens:
        cast = w.hold(2 * b * t * d * s) if cache_itemsize != s else 0
        ip = w.hold(q_b)
        w.moment(b * heads * n * 4)
        scaled = w.hold(q_b)
        w.drop(ip, cast)
        total = w.hold(q_b)
        w.drop(o, scaled)
        o = total
    w.drop(q)
    out = w.hold(q_b)
    w.drop(o)
    return out


def _slice(w: Walk, score_bytes: int, out_bytes: int) -> None:
    """One slice of a sliced attention: its scores, their softmax (both alive), then the slice's
    result next to the softmax (copied into the preallocated result)."""
    sc = w.hold(score_bytes)
    p = w.hold(score_bytes)
    w.drop(sc)
    o = w.hold(out_bytes)
    w.drop(o, p)
