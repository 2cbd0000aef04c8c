"""The ``bucketed`` backend: a micro-batch's documents in a few dense batches, one SDPA call each.

torch's ``scaled_dot_product_attention`` on dense [n, h, L, d] batches reaches the fastest dense
kernels there are (cuDNN's Hopper kernels on an H100/H200, which run ~2x torch varlen's
FlashAttention 2 per FLOP there; the flash CPU kernel here), with native grouped-query attention
(``enable_gqa``). A packed row is not dense, so the documents are gathered by length class into
right-padded batches (`megapack.core.buckets`: at most 6 shapes from one fixed set, < 1/8 padding
a document), attended causally (exact: padding follows every real token), and scattered back:

    q [T, h, d] --gather--> [n_b, h, L_b, d] per bucket --SDPA--> --scatter--> out [T, h, d]

The plan comes with the batch (declare ``fields=megapack.BUCKET_FIELDS``: the TP source plans it
from the lengths it holds, every rank knows its shapes from the frame's header) so a GPU never
syncs; without it the plan is made here from the boundaries' host copy (one read per micro-batch,
free on a CPU). Alignment padding, zero-length documents and positions past the last boundary are
in no bucket: their outputs and gradients are exactly 0, and nothing of theirs is read (a padding
slot reads its own document's first token), so the real positions' results do not depend on what
those positions hold.

Cost beyond the kernels: one gather of q, k and v and one scatter of the output (each [T, ., d]),
and the padding of each document to its class (< 1/8 of its length, < 27% of its attention).
Not capturable in a CUDA graph (the bucket shapes change with every micro-batch): refused there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megapack.attention.documents import Documents
from megapack.core.buckets import plan_buckets
from megapack.core.capture import refuse_under_capture


def bucketed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float, dropout: float
) -> torch.Tensor:
    """Causal attention within every document through dense SDPA calls, one per length bucket."""
    refuse_under_capture(
        "attention backend 'bucketed'",
        "its bucket shapes change with every micro-batch",
        "capture with backend 'cudnn' and a megapack.StaticShape",
    )
    total, heads, dim_v = q.shape[0], q.shape[1], v.shape[2]
    gather, scatter = _plan(docs, total, q.device)
    gqa = heads != k.shape[1]
    outs = []
    for index in gather:
        n, length = index.shape
        flat = index.reshape(-1)
        qb, kb, vb = (
            x.index_select(0, flat).view(n, length, x.shape[1], x.shape[2]).transpose(1, 2)
            for x in (q, k, v)
        )
        o = F.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=gqa
        )
        outs.append(o.transpose(1, 2).reshape(n * length, heads, dim_v))
    outs.append(q.new_zeros(1, heads, dim_v))  # what positions in no bucket read
    return torch.cat(outs).index_select(0, scatter)


def _plan(
    docs: Documents, total: int, device: torch.device
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """([index [n, L] of every bucket, each padding slot reading its row's first token],
    scatter [T]), once per micro-batch.

    A slot is real when its index is below the last boundary ``cu_buffer[-1]`` (compared on the
    device: no host read), so a padding slot is found whatever sentinel its plan used (T, or a
    trainer's plan marked with the last boundary). A padding slot reads its document's first
    token, a real one: a real query never sees it (it follows the query's real keys, causally
    masked) and its own output is never read, so its gradient is exactly zero, and no position
    outside the documents is read. ``scatter[t]`` is the row of the concatenated bucket outputs
    position t reads, or the final zero row: a real slot's target is its position, a padding
    slot's a position past T unique to it, so the scatter writes no index twice.

    Worked example: T = 12, boundaries ``[0, 3, 8]`` (positions 8..11 past them), one bucket
    ``[[0, 1, 2, 12, ...], [3, 4, 5, 6, 7, 12, ...]]``: gather ``[[0, 1, 2, 0, ...], [3, ..., 7,
    3, ...]]``; positions 8..11 read the zero row.
    """
    key = ("bucketed", total, device)
    hit = docs.memo.get(key)
    if hit is not None:
        return hit
    buckets = docs.buckets
    if buckets is None:  # no plan delivered: make it from the boundaries' host copy
        buffer, real = docs.host_bounds()
        planned = plan_buckets(buffer, real if docs.padded else None, total=total)
        buckets = tuple(torch.from_numpy(b) for b in planned)
    end = docs.cu_buffer[-1:].to(device=device, dtype=torch.int64, non_blocking=True)
    gather, targets = [], []
    slots = 0
    for bucket in buckets:
        index = bucket.to(device=device, dtype=torch.int64, non_blocking=True)
        token = (index < end) & (index < total)  # a real slot; else padding
        gather.append(torch.where(token, index, index[:, :1]).clamp(max=max(total - 1, 0)))
        flat = index.reshape(-1)
        unique = torch.arange(slots, slots + flat.numel(), device=device) + total
        targets.append(torch.where(token.reshape(-1), flat, unique))
        slots += flat.numel()
    scatter = torch.full((total + slots,), slots, dtype=torch.int64, device=device)
    if slots:
        scatter.scatter_(0, torch.cat(targets), torch.arange(slots, device=device))
    docs.memo[key] = plan = (gather, scatter[:total])
    return plan


def bucket_shapes(docs: Documents) -> list[tuple[int, int]] | None:
    """The delivered plan's (documents, length) per bucket, or None without one (for reports)."""
    buckets: Any = docs.buckets
    return None if buckets is None else [tuple(b.shape) for b in buckets]
