"""`packed_attention`: causal attention within each document of a THD buffer, as a plain function.

The same kernels as `megapack.attention.PackedAttention`, without megatron-core: for benchmarks,
checks and code that holds q, k, v and the boundaries directly. What is derived from the boundaries
(the flex block mask, the SDPA reference's host copy) is cached on the boundary tensor itself, so
repeated calls with the same ``cu_seqlens`` objects (one micro-batch, many layers) build it once.

Shapes: q [T, h, d], k/v [T, g, d] (h query heads, g key/value groups, h divisible by g) -> [T, h, d].
"""

from __future__ import annotations

import math

import torch

from megapack.attention.choice import BACKENDS, resolve_backend
from megapack.attention.documents import Documents
from megapack.attention.kernels import KERNELS
from megapack.attention.te import te_attention


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
    max_seqlen: int,
    backend: str = "auto",
    scale: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention of every query to the keys of its own document at positions <= its own.

    Args:
        q: [T, h, d] queries.
        k: [T, g, d] keys (g divides h: grouped-query attention).
        v: [T, g, d] values.
        cu_seqlens: int32 [n + 1] real document boundaries, ``[0, ..., total real]``.
        cu_seqlens_padded: int32 [n + 1] buffer boundaries when documents are padded (then
            ``cu_seqlens`` holds the real lengths); None when nothing is padded.
        max_seqlen: longest buffer segment (a Python int).
        backend: one of `BACKENDS` or ``"auto"``.
        scale: softmax scale, default 1 / sqrt(d).
        dropout: attention dropout probability.

    Returns:
        [T, h, d]; zeros at alignment-padding positions.

    Example:
        >>> q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
        >>> cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)  # documents [3, 2, 4]
        >>> out = packed_attention(q, k, v, cu_seqlens=cu, max_seqlen=4)
        >>> out.shape, bool(torch.allclose(out[3], v[3].repeat_interleave(2, dim=0)))
        (torch.Size([9, 4, 8]), True)
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {backend!r}; choose one of {BACKENDS} or 'auto'"
        )
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q must be [T, h, d] and k, v [T, g, d] with g dividing h, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    name = resolve_backend(backend, q.device, training=needs_grad, dropout=dropout, dtype=q.dtype)
    docs = Documents.cached(cu_seqlens, cu_seqlens_padded, max_seqlen, q.shape[0])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if name == "te":
        return te_attention(q, k, v, docs, scale=scale, dropout=dropout, training=dropout > 0.0)
    return KERNELS[name](q, k, v, docs, scale, dropout)
