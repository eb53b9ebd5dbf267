"""Memory-efficient self-attention for the VAE mid block.

``torch.nn.functional.scaled_dot_product_attention`` with 4-D ``(batch, heads, tokens, channels)``
tensors (with 3-D tensors a CPU build of torch was seen falling back to the quadratic-memory math
kernel). Queries are processed in chunks so that even that math kernel, if a backend picks it,
never holds more than ``max_bytes`` of attention scores: the N x N matrix is never materialised.
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


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    max_bytes: int = DEFAULT_SCORE_BYTES,
) -> torch.Tensor:
    """Softmax attention of ``q`` over ``k``/``v``, all ``(B, heads, tokens, dim)``.

    Returns ``(B, heads, tokens_q, dim)``. Never allocates the full score matrix: queries are
    split into chunks of :func:`query_chunk` rows when the whole matrix would exceed
    ``max_bytes``.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"`q`, `k`, `v` must be 4-D (B, heads, tokens, dim), got {q.dim()}/{k.dim()}/{v.dim()}"
        )
    b, h, n, _ = q.shape
    chunk = query_chunk(b, h, k.shape[2], max_bytes)
    if chunk >= n:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    for i in range(0, n, chunk):
        out[:, :, i : i + chunk] = F.scaled_dot_product_attention(q[:, :, i : i + chunk], k, v, scale=scale)
    return out
