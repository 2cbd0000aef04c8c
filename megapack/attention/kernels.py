"""The single-row kernels behind `PackedAttention` and `packed_attention` (no context parallelism).

Each kernel attends causally within every buffer segment of `Documents` and gives exact zeros,
output and gradients, at every position that holds no real token: alignment padding and positions
past the last boundary (`megapack.attention.documents.zero_outside` and ``guard_outside`` around
the FlashAttention-based kernels, which leave those rows uninitialised; cuDNN's outputs are
zero-filled; bucketed and sdpa never read or write them). `KERNELS` maps backend names to them
(Transformer Engine lives in `megapack.attention.te`, cuDNN's ragged graphs in
`megapack.attention.cudnn`, the length buckets in `megapack.attention.bucketed`, flex in
`megapack.attention.flex`, torch's varlen_attn forms in `megapack.attention.varlen`); `attend`
runs one and falls back where ``auto`` chose a cuDNN graph that cannot be built.
``sbhd_attention`` serves padded [s, b] batches.

Shapes: q [T, h, d], k/v [T, g, d] -> [T, h, d] (h query heads, g key/value groups, g divides h).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megapack.attention.bucketed import bucketed_attention
from megapack.attention.choice import fallback
from megapack.attention.cudnn import CudnnUnavailable, cudnn_attention
from megapack.attention.documents import Documents, guard_outside, zero_outside
from megapack.attention.flex import flex_attention_thd
from megapack.attention.varlen import call_varlen


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float, dropout: float
) -> torch.Tensor:
    """Reference: one causal scaled_dot_product_attention per document.

    Reads the boundaries on the host once per micro-batch (`Documents.host_bounds`, cached), then
    slices on the host: the only megapack kernel that reads the device.
    """
    starts, ends = docs.host_bounds()
    gqa = q.shape[1] != k.shape[1]
    pieces = []
    for i in range(len(starts) - 1):
        a, n, width = starts[i], ends[i + 1] - ends[i], starts[i + 1] - starts[i]
        # 4-D [1, heads, n, dim]: 3-D inputs fall back to the math kernel on CPU (measured 5x slower)
        o = F.scaled_dot_product_attention(
            q[None, a : a + n].transpose(1, 2),
            k[None, a : a + n].transpose(1, 2),
            v[None, a : a + n].transpose(1, 2),
            is_causal=True,
            scale=scale,
            dropout_p=dropout,
            enable_gqa=gqa,
        )
        pieces.append(o[0].transpose(0, 1))
        if width > n:
            pieces.append(q.new_zeros(width - n, q.shape[1], v.shape[2]))
    if starts[-1] < q.shape[0]:
        pieces.append(q.new_zeros(q.shape[0] - starts[-1], q.shape[1], v.shape[2]))
    return torch.cat(pieces)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float, dropout: float
) -> torch.Tensor:
    """torch's varlen_attn over the buffer segments, causal, in the installed torch's form."""
    cu = docs.cu_buffer.to(torch.int32)
    q, k, v = guard_outside(q, k, v, docs)
    out = call_varlen(q, k, v, cu, cu, docs.max_seqlen, docs.max_seqlen, scale=scale)
    return zero_outside(out, docs)


def flash_attn_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float, dropout: float
) -> torch.Tensor:
    """flash_attn_varlen_func over buffer segments, causal; grouped-query attention is native."""
    from flash_attn import flash_attn_varlen_func

    cu = docs.cu_buffer.to(torch.int32)
    q, k, v = guard_outside(q, k, v, docs)
    out = flash_attn_varlen_func(
        q,
        k,
        v,
        cu,
        cu,
        docs.max_seqlen,
        docs.max_seqlen,
        dropout_p=dropout,
        softmax_scale=scale,
        causal=True,
    )
    return zero_outside(out, docs)


KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "sdpa": sdpa_attention,
    "bucketed": bucketed_attention,
    "cudnn": cudnn_attention,
    "flex": flex_attention_thd,
    "torch_varlen": varlen_attention,
    "flash_attn": flash_attn_attention,
}
"""Single-row kernels by backend name (Transformer Engine: `megapack.attention.te`)."""


def attend(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: Documents,
    scale: float,
    dropout: float,
    *,
    auto: bool,
    training: bool,
) -> tuple[str, torch.Tensor]:
    """(the backend that ran, its output): ``KERNELS[name]``, or, where ``auto`` chose cudnn and
    cuDNN cannot build its graphs here, the next backend ``auto`` prefers (logged once). cuDNN
    refuses before any of its kernels runs (`megapack.attention.cudnn`), so the fallback does the
    whole call, forward and backward. A lasting refusal keeps ``auto`` off cudnn in this process;
    after a transient one (out of memory...) the next call tries cudnn again.

    Raises:
        ValueError: an explicit ``backend="cudnn"`` that cuDNN cannot run, with cuDNN's reason.
        CaptureError: a cuDNN graph not built yet, asked for inside a CUDA-graph capture (no
            fallback: warm up eagerly).
    """
    try:
        return name, KERNELS[name](q, k, v, docs, scale, dropout)
    except CudnnUnavailable as exc:
        if not auto:
            again = "" if exc.lasting else " (a transient failure: the next call tries again)"
            raise ValueError(f"attention backend 'cudnn' cannot run here: {exc}{again}") from exc
        name = fallback("cudnn", str(exc), q.device, q.dtype, training=training, dropout=dropout,
                        planned=docs.buckets is not None, remember=exc.lasting)  # fmt: skip
        return name, KERNELS[name](q, k, v, docs, scale, dropout)


def sbhd_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    dropout: float,
) -> torch.Tensor:
    """Padded batches: causal attention, or megatron's mask (True = masked out) when one is given."""
    s, b = q.shape[0], q.shape[1]
    qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (q, k, v))  # [b, heads, s, hn]
    allowed = None if mask is None else ~mask.to(torch.bool)
    out = F.scaled_dot_product_attention(
        qb,
        kb,
        vb,
        attn_mask=allowed,
        is_causal=mask is None,
        scale=scale,
        dropout_p=dropout,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)
