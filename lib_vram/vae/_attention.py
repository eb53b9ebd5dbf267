"""Memory-efficient self-attention for the VAE mid block.

``torch.nn.functional.scaled_dot_product_attention`` with 4-D ``(batch, heads, tokens, channels)``
tensors whose last dimension is contiguous (with 3-D tensors, or with a transposed view, torch's
kernel selection falls back to the quadratic-memory math kernel).

Where torch's CPU flash kernel is certain to be picked (it is blocked: it never holds more than a
few query x key blocks per thread), the whole attention is one call: it is also the fastest CPU
kernel (measured on a 128² SD latent: 4.6 s against 8.1 s for 32 math-kernel chunks). Everywhere
else queries are processed in chunks so that even the math kernel, if a backend picks it, never
holds more than ``max_bytes`` of attention scores: the N x N matrix is never materialised.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

DEFAULT_SCORE_BYTES = 32 * 2**20
"""Upper bound for one chunk's (queries x keys) score matrix in float32, should a backend use the
math kernel: 32 MiB keeps a 256x256 latent (65,536 tokens) at 128 queries per chunk."""


def query_chunk(batch: int, heads: int, tokens: int, max_bytes: int = DEFAULT_SCORE_BYTES) -> int:
    """Queries per chunk so that ``batch * heads * chunk * tokens`` float32 scores fit ``max_bytes``."""
    if max_bytes < 1:
        raise ValueError(f"`max_bytes` must be >= 1, got {max_bytes}")
    per_query = max(1, batch * heads * tokens * 4)
    return max(1, min(tokens, max_bytes // per_query))


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= (major, minor)
    except (IndexError, ValueError):
        return False


def cpu_flash_kernel(dtype: torch.dtype) -> bool:
    """Whether torch runs CPU attention in ``dtype`` with its blocked flash kernel: a torch that
    has the kernel (2.2 and later), the flash backend not switched off
    (``torch.backends.cuda.enable_flash_sdp(False)`` applies to the CPU kernel too) and a dtype it
    takes (float32, bfloat16, float64; float16 from torch 2.3). The other conditions (4-D, no
    mask, no dropout, last-dim stride 1) hold for every call :func:`attention` makes."""
    dtypes = (torch.float32, torch.bfloat16, torch.float64)
    if _torch_at_least(2, 3):  # half precision joined the CPU flash kernel in torch 2.3
        dtypes += (torch.float16,)
    return (
        dtype in dtypes
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
        and torch.backends.cuda.flash_sdp_enabled()
    )


def cpu_flash_available(q: torch.Tensor) -> bool:
    """:func:`cpu_flash_kernel` for a query tensor on the CPU."""
    return q.device.type == "cpu" and cpu_flash_kernel(q.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    max_bytes: int = DEFAULT_SCORE_BYTES,
    fused: bool | None = None,
) -> torch.Tensor:
    """Softmax attention of ``q`` over ``k``/``v``, all ``(B, heads, tokens, dim)``.

    Returns ``(B, heads, tokens_q, dim)``. Never allocates the full score matrix: one call where
    torch's blocked CPU flash kernel will run it (``fused``: None = :func:`cpu_flash_available`),
    otherwise queries are split into chunks of :func:`query_chunk` rows when the whole matrix
    would exceed ``max_bytes``.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"`q`, `k`, `v` must be 4-D (B, heads, tokens, dim), got {q.dim()}/{k.dim()}/{v.dim()}"
        )
    # last-dim stride 1, or every backend but the math kernel declines the call
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    b, h, n, _ = q.shape
    if fused is None:
        fused = cpu_flash_available(q)
    chunk = query_chunk(b, h, k.shape[2], max_bytes)
    if fused or chunk >= n:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    for i in range(0, n, chunk):
        out[:, :, i : i + chunk] = F.scaled_dot_product_attention(q[:, :, i : i + chunk], k, v, scale=scale)
    return out
