"""The single-row kernels behind `megapack.attention.PackedAttention` (no context parallelism).

`Documents` turns ``packed_seq_params`` into buffer segments; each kernel attends causally within
every segment and writes zeros at alignment-padding positions. `KERNELS` maps backend names to
them (Transformer Engine is called by `PackedAttention` itself). ``sbhd_attention`` serves padded
[s, b] batches.

Shapes: q [T, np, hn], k/v [T, ng, hn] -> [T, np, hn] (np query heads, ng key/value groups).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.nn.functional as F


class Documents:
    """Document boundaries of a THD buffer: real lengths and buffer offsets (equal without padding)."""

    def __init__(
        self, cu_real: torch.Tensor, cu_buffer: torch.Tensor, max_seqlen: int, total: int
    ) -> None:
        self.cu_real = cu_real
        self.cu_buffer = cu_buffer
        self.max_seqlen = max_seqlen
        self.total = total
        self.padded = cu_buffer is not cu_real

    @classmethod
    def from_params(cls, params: Any, total: int) -> Documents:
        cu_real = params.cu_seqlens_q
        cu_buffer = (
            params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else cu_real
        )
        kv = params.cu_seqlens_kv
        # Identity first: megapack passes one tensor for q and kv, so no device sync happens here.
        if kv is not None and kv is not cu_real and not torch.equal(kv, cu_real):
            raise ValueError(
                "PackedAttention is self-attention: cu_seqlens_kv must equal cu_seqlens_q"
            )
        return cls(cu_real, cu_buffer, int(params.max_seqlen_q), total)

    def segment_ids(self) -> torch.Tensor:
        """[T] index of the document each buffer position belongs to (on device, no host sync)."""
        positions = torch.arange(self.total, device=self.cu_buffer.device)
        return torch.searchsorted(self.cu_buffer[1:].to(torch.int64), positions, right=True)

    def real_positions(self) -> torch.Tensor | None:
        """[T] bool, False on alignment padding; None when nothing is padded."""
        if not self.padded:
            return None
        seg = self.segment_ids().clamp(max=len(self.cu_real) - 2)
        positions = torch.arange(self.total, device=self.cu_buffer.device)
        lengths = (self.cu_real[1:] - self.cu_real[:-1]).to(torch.int64)
        return (positions - self.cu_buffer[seg].to(torch.int64)) < lengths[seg]


def zero_padding(out: torch.Tensor, docs: Documents) -> torch.Tensor:
    real = docs.real_positions()
    return out if real is None else out * real[:, None, None].to(out.dtype)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float, dropout: float
) -> torch.Tensor:
    """Reference: one causal scaled_dot_product_attention per document. One host sync for boundaries."""
    starts, ends = docs.cu_buffer.tolist(), docs.cu_real.tolist()
    gqa = q.shape[1] != k.shape[1]
    pieces = []
    for i in range(len(starts) - 1):
        a, n, width = starts[i], ends[i + 1] - ends[i], starts[i + 1] - starts[i]
        # 4-D [1, heads, n, dim]: 3-D inputs fall back to the math kernel on CPU (measured 5x slower)
        o = F.scaled_dot_product_attention(
            q[None, a : a + n].transpose(1, 2), k[None, a : a + n].transpose(1, 2), v[None, a : a + n].transpose(1, 2),
            is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=gqa,
        )  # fmt: skip
        pieces.append(o[0].transpose(0, 1))
        if width > n:
            pieces.append(q.new_zeros(width - n, q.shape[1], v.shape[2]))
    if starts[-1] < q.shape[0]:
        pieces.append(q.new_zeros(q.shape[0] - starts[-1], q.shape[1], v.shape[2]))
    return torch.cat(pieces)


def flex_attention_thd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float, dropout: float
) -> torch.Tensor:
    """flex_attention with a block mask that is causal and document-local; compiled on CUDA."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seg = docs.segment_ids()
    real = docs.real_positions()

    def document_causal(b: Any, h: Any, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        keep = (seg[qi] == seg[ki]) & (qi >= ki)
        return keep if real is None else keep & (real[ki] | (qi == ki))

    total = q.shape[0]
    mask = create_block_mask(document_causal, None, None, total, total, device=q.device)
    run = compiled_flex() if q.is_cuda else flex_attention
    with (
        warnings.catch_warnings()
    ):  # on CPU the unfused eager path is deliberate (no compiler needed)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = run(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
        )  # fmt: skip
    return zero_padding(out[0].transpose(0, 1), docs)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float, dropout: float
) -> torch.Tensor:
    """torch.nn.attention.varlen.varlen_attn over buffer segments, causal (window (-1, 0))."""
    from torch.nn.attention.varlen import varlen_attn

    cu = docs.cu_buffer.to(torch.int32)
    out = varlen_attn(
        q, k, v, cu, cu, docs.max_seqlen, docs.max_seqlen,
        scale=scale, window_size=(-1, 0), enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip
    return zero_padding(out, docs)  # type: ignore[arg-type]


def flash_attn_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float, dropout: float
) -> torch.Tensor:
    """flash_attn_varlen_func over buffer segments, causal; grouped-query attention is native."""
    from flash_attn import flash_attn_varlen_func

    cu = docs.cu_buffer.to(torch.int32)
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
    return zero_padding(out, docs)


KERNELS = {
    "sdpa": sdpa_attention,
    "flex": flex_attention_thd,
    "torch_varlen": varlen_attention,
    "flash_attn": flash_attn_attention,
}


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
        qb, kb, vb, attn_mask=allowed, is_causal=mask is None, scale=scale, dropout_p=dropout,
        enable_gqa=q.shape[2] != k.shape[2],
    )  # fmt: skip
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)


@functools.cache
def compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)
