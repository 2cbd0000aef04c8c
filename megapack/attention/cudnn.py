"""The ``cudnn`` backend: cuDNN's fused attention over ragged THD tensors, through cudnn-frontend.

cuDNN runs attention on Hopper with its own sm90 kernels (``sdpa_sm90_flash_fprop/bprop_wgmma``),
about 2x torch varlen's FlashAttention 2 per FLOP on an H200 (the kernels padded SDPA gets there).
Transformer Engine's fused attention reaches them for THD batches the same way this module does:
a cuDNN graph whose q, k, v and o are *ragged* (one [B, H, S, D] tensor whose rows start at
per-document offsets) with a padding mask of per-document lengths. The frontend is the pip
package ``nvidia-cudnn-frontend`` (``pip install megapack[cudnn]``, pinned `FRONTEND_PIN`: the
newest release with no required dependencies); cuDNN itself comes with torch.

A graph's dimensions are (documents B, longest document S, heads, head dims, tokens T); they are
quantised into shape classes so that few graphs are built and each is built once, then cached:

    B  documents (segments) rounded up to a power of two; the extra ones have length 0
    S  ``max_seqlen`` up to `megapack.core.buckets.length_class` (>= 64; < 1/8 above it)
    T  the buffer's token count, rounded up to a multiple of 64 (``max_total_seq_len``, which
       sizes backward's dQ accumulator: `megapack.attention.cudnn_graph.max_tokens_class`)

A `megapack.StaticShape` is one class, so a captured step replays one graph pair. Per micro-batch,
everything the graphs read is derived on the device from the boundaries (kept in the
micro-batch's `megapack.attention.documents.Documents`, rebuilt inside a CUDA-graph capture):

    ragged offsets  cu_seqlens_padded (else cu_seqlens) x (heads x head dim), int64, [B + 1]
    lengths         real lengths (cu_seqlens diffs), int32, [B], zero for the extra documents;
                    two tensors, seq_len_q and seq_len_kv

No host read, so no sync; padding and zero-length documents cost nothing (cuDNN skips tiles past
a document's length). cuDNN writes only the rows of each document's real tokens, so the output
and dQ/dK/dV are allocated zero-filled, as Transformer Engine's THD path does (a memset each:
write-only, 2.5 x T x H x D x 2 bytes in all for 16 / 4 heads; unmeasured on a GPU): alignment
padding and positions past the last boundary get exact zeros, whatever they hold. Softmax
statistics are kept dense ([B, H, S, 1] float32, what backward reads: 8 MB a layer at B=32,
H=16, S=4,096). Grouped-query attention is native (K/V heads are not repeated).

Worked example: documents of 3 and 5 tokens (buffer ``[0, 3, 8]``), 4 heads of 64: B class 2,
S class 64, T class 64, q offsets ``[0, 768, 2048]`` (x 256 elements a token), lengths ``[3, 5]``.

Before any kernel runs, the forward graph and, when the call will backpropagate, the backward
graph are built (or found built): a refusal of either comes before any work, so ``auto`` falls back
(`megapack.attention.kernels.attend`) and an explicit ``backend="cudnn"`` raises. What cannot run
here (no frontend, cuDNN < 9.6, a GPU older than sm90, a dtype, head dim or shape cuDNN refuses, a
failed build) is a `CudnnUnavailable` saying why; whether a refusal is remembered or tried again,
and why no graph is built inside a CUDA-graph capture: `megapack.attention.cudnn_graph`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from megapack.attention.cudnn_graph import (
    CudnnUnavailable,
    Graphs,
    GraphShape,
    graphs,
    max_tokens_class,
)
from megapack.attention.documents import Documents
from megapack.core.buckets import length_class

__all__ = ["CudnnUnavailable", "GraphShape", "cudnn_attention", "offsets_of", "shape_of"]

FRONTEND_PIN = "1.28.0"
"""The nvidia-cudnn-frontend release megapack is built against (``megapack[cudnn]``)."""


def batch_class(n: int) -> int:
    """The power of two >= n (>= 1): the documents a graph is built for.

    Example:
        >>> [batch_class(n) for n in (1, 2, 3, 9, 82)]
        [1, 2, 4, 16, 128]
    """
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def seqlen_class(longest: int) -> int:
    """The S a graph is built for: ``length_class(longest)``, at least 64.

    Example:
        >>> [seqlen_class(n) for n in (5, 100, 4096, 14398)]
        [64, 112, 4096, 15360]
    """
    return max(64, length_class(longest))


def shape_of(
    docs: Documents, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> GraphShape:
    """The `GraphShape` of a micro-batch (host values only: the boundaries' size, ``max_seqlen``)."""
    device = q.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return GraphShape(
        batch=batch_class(docs.cu_buffer.shape[0] - 1),
        seqlen=seqlen_class(docs.max_seqlen),
        heads=q.shape[1],
        groups=k.shape[1],
        dim=q.shape[2],
        dim_v=v.shape[2],
        max_tokens=max_tokens_class(q.shape[0]),
        dtype=q.dtype,
        scale=float(scale),
        device=device,
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )


@dataclass(frozen=True, slots=True)
class Offsets:
    """The per-micro-batch device tensors a graph reads besides q, k, v (module docstring)."""

    q: torch.Tensor
    """[B + 1, 1, 1, 1] int64: token offsets x H x D (also o's when D == dim_v)."""
    kv: torch.Tensor
    """[B + 1, 1, 1, 1] int64: x G x D (also v's when D == dim_v)."""
    v: torch.Tensor
    o: torch.Tensor
    lengths_q: torch.Tensor
    """[B, 1, 1, 1] int32 real lengths of the queries (``seq_len_q``)."""
    lengths_kv: torch.Tensor
    """[B, 1, 1, 1] int32 real lengths of the keys (``seq_len_kv``; the same values, its own
    tensor)."""


def offsets_of(docs: Documents, shape: GraphShape) -> Offsets:
    """`Offsets` for ``shape``, once per micro-batch (kept in ``docs.memo``; no host read).

    Example:
        >>> docs = Documents(torch.tensor([0, 3, 8]), torch.tensor([0, 3, 8]), 5, 8)
        >>> shape = GraphShape(batch=2, seqlen=64, heads=4, groups=4, dim=64, dim_v=64,
        ...     max_tokens=64, dtype=torch.bfloat16, scale=0.125, device=torch.device("cuda", 0),
        ...     deterministic=False)
        >>> off = offsets_of(docs, shape)
        >>> off.q.flatten().tolist(), off.lengths_q.flatten().tolist()
        ([0, 768, 2048], [3, 5])
    """
    key = ("cudnn", shape.batch, shape.heads, shape.groups, shape.dim, shape.dim_v)
    hit = docs.memo.get(key)
    if hit is not None:
        return hit
    extra = shape.batch - (docs.cu_buffer.shape[0] - 1)
    cu = docs.cu_buffer.to(torch.int64)
    real = (docs.cu_real[1:] - docs.cu_real[:-1]).to(torch.int32)
    if extra:
        cu = torch.cat([cu, cu[-1:].expand(extra)])
        real = torch.cat([real, real.new_zeros(extra)])
    per = (shape.heads * shape.dim, shape.groups * shape.dim, shape.groups * shape.dim_v)
    q, kv, v = ((cu * n).view(-1, 1, 1, 1) for n in per)
    o = q if shape.dim_v == shape.dim else (cu * (shape.heads * shape.dim_v)).view(-1, 1, 1, 1)
    docs.memo[key] = out = Offsets(q=q, kv=kv, v=kv if shape.dim_v == shape.dim else v, o=o,
                                   lengths_q=real.view(-1, 1, 1, 1),
                                   lengths_kv=real.clone().view(-1, 1, 1, 1))  # fmt: skip
    return out


def unavailable(
    device: torch.device, dtype: torch.dtype, head_dim: int | None = None
) -> str | None:
    """Why the cudnn backend cannot run here (None: it can): `megapack.attention.choice`'s rule
    for it (CUDA, the frontend, sm90+, cuDNN >= 9.6, float16/bfloat16), and the head dims cuDNN's
    fused attention takes. Cheap; checked before any graph is built."""
    from megapack.attention.choice import installed_here, refusal

    why = refusal(
        "cudnn", device.type, dtype, training=True, dropout=0.0, installed=installed_here()
    )
    if why is None and head_dim is not None and (head_dim % 8 or head_dim > 256):
        why = f"cuDNN's fused attention needs a head dim that is a multiple of 8 and <= 256, got {head_dim}"
    return why


def cudnn_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float, dropout: float
) -> torch.Tensor:
    """Causal attention within every document of ``docs`` through cuDNN's ragged graphs; exact
    zeros, output and gradients, where no real token is.

    Both graphs the call needs are built before the forward kernel runs (module docstring).

    Raises:
        CudnnUnavailable: cuDNN cannot take these inputs (the reason); ``auto`` falls back.
        CaptureError: a graph not built yet, asked for inside a CUDA-graph capture.
    """
    why = unavailable(q.device, q.dtype, q.shape[2])
    if why is not None:
        raise CudnnUnavailable(why)
    if dropout > 0.0:
        raise CudnnUnavailable("the cudnn backend has no attention dropout")
    shape = shape_of(docs, q, k, v, scale)
    if docs.max_seqlen > shape.seqlen or docs.cu_buffer.shape[0] - 1 > shape.batch:
        raise AssertionError("shape classes hold every micro-batch")  # internal invariant
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    built = graphs(shape, backward=needs_grad)
    offsets = offsets_of(docs, shape)
    return _CudnnAttention.apply(q, k, v, offsets, shape, built)


class _CudnnAttention(torch.autograd.Function):
    """Forward and backward through the graphs built for one `GraphShape` (``built``)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        offsets: Offsets,
        shape: GraphShape,
        built: Graphs,
    ) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # zero-filled: cuDNN writes only the rows of real tokens (module docstring)
        out = q.new_zeros(q.shape[0], shape.heads, shape.dim_v)
        stats = torch.empty(
            shape.batch, shape.heads, shape.seqlen, 1, dtype=torch.float32, device=q.device
        )
        built.forward.run(
            {"q": q, "k": k, "v": v, "o": out, "stats": stats, **_offset_tensors(offsets)},
            shape.device,
        )
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.offsets, ctx.shape, ctx.built = offsets, shape, built
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, stats = ctx.saved_tensors
        backward = ctx.built.backward
        if backward is None:  # internal invariant: built whenever the inputs required grad
            raise RuntimeError("cudnn attention: no backward graph was built for this call")
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        tensors = {"q": q, "k": k, "v": v, "o": out, "stats": stats, "dO": grad.contiguous(),
                   "dQ": dq, "dK": dk, "dV": dv, **_offset_tensors(ctx.offsets)}  # fmt: skip
        backward.run(tensors, ctx.shape.device)
        return dq, dk, dv, None, None, None


def _offset_tensors(offsets: Offsets) -> dict[str, torch.Tensor]:
    return {
        "q_offsets": offsets.q,
        "k_offsets": offsets.kv,
        "v_offsets": offsets.v,
        "o_offsets": offsets.o,
        "lengths_q": offsets.lengths_q,
        "lengths_kv": offsets.lengths_kv,
    }
