"""flex_attention for packed documents: one block mask per micro-batch, one compiled kernel.

Every query ``i`` may attend the keys ``lo[i] <= j <= hi[i]`` plus the one key ``extra[i]`` (-1 for
none): `document_intervals` gives, for a query at row position ``p`` of a document whose buffer
segment starts at ``s`` with ``n`` real tokens, ``[s, p]`` when ``p`` is real and ``[s, s + n - 1]`` plus
``p`` itself when ``p`` is alignment padding (a padding row needs one key; its output is zeroed), and
only ``p`` itself when ``p`` is past the last boundary (so nothing there reaches a document). The
same intervals give the mask function flex calls inside partial blocks and the block tables
themselves, so the two cannot disagree:

    count[qb, kb] = number of allowed (query, key) pairs in the 128 x 128 tile (qb, kb)
    full    = count == 128 * 128        (flex skips the mask function there)
    partial = 0 < count < 128 * 128     (flex calls it)

Cost: elementwise work on [T, T / 128] integers and a sort of [T/128, T/128] (T=14,398: 1.6 M and
113 x 113), no host read; ``create_block_mask`` evaluates the mask on all T x T pairs. The tables
equal ``create_block_mask``'s exactly (tested). `Documents.memo` keeps the mask, so it is built by
the first layer of a micro-batch and reused by every layer and the backward pass.

Compilation: ``torch.compile(flex_attention)`` once per device type (`compiled_flex`). The mask
function is a new closure per micro-batch over new [T] tensors; dynamo guards on their shapes, not
their identity, so new boundaries at the same T reuse the compiled graph (tested: one graph over
several micro-batches). A new T: on CUDA (``dynamic=None``) the first change recompiles once with
dynamic shapes, later sizes reuse it (unmeasured here: no GPU); on CPU (``dynamic=False``: torch
2.13's CPU flex template fails to compile dynamic shapes, a C++ error measured here) each new T
compiles once (about 3 s on this 2-core machine, 16 s for the first), up to dynamo's recompile limit.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, cast

import torch

from megapack.attention.documents import Documents, zero_outside

BLOCK = 128
"""flex_attention's default sparse block size."""


def document_intervals(
    positions: torch.Tensor, cu_buffer: torch.Tensor, cu_real: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lo, hi, extra) [N] int64 of queries at row ``positions`` (keys are row positions); a
    position past the last boundary attends only itself.

    Example:
        >>> lo, hi, extra = document_intervals(torch.arange(10), torch.tensor([0, 4, 8]),
        ...                                    torch.tensor([0, 3, 5]))
        >>> lo.tolist(), hi.tolist(), extra.tolist()
        ([0, 0, 0, 0, 4, 4, 4, 4, 8, 9], [0, 1, 2, 2, 4, 5, 5, 5, 8, 9], [-1, -1, -1, 3, -1, -1, 6, 7, -1, -1])
    """
    cu = cu_buffer.to(torch.int64)
    doc = torch.searchsorted(cu[1:], positions, right=True).clamp(max=len(cu) - 2)
    starts = cu[doc]
    lengths = (cu_real[1:] - cu_real[:-1]).to(torch.int64)
    lo, hi, extra = intervals(positions, starts, starts + lengths[doc])
    past = positions >= cu[-1]
    return (torch.where(past, positions, lo), torch.where(past, positions, hi),
            torch.where(past, -1, extra))  # fmt: skip


def intervals(
    positions: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lo, hi, extra) of queries at ``positions`` in documents spanning ``[starts, ends)`` (real part)."""
    real = positions < ends
    hi = torch.where(real, positions, ends - 1)
    extra = torch.where(real, torch.full_like(positions, -1), positions)
    return starts, hi, extra


def interval_block_mask(
    lo: torch.Tensor, hi: torch.Tensor, extra: torch.Tensor, kv_len: int, *, block: int = BLOCK
) -> Any:
    """flex's ``BlockMask`` for queries that attend keys ``[lo, hi]`` and ``extra`` (see the module)."""
    from torch.nn.attention.flex_attention import BlockMask

    q_len = lo.shape[0]
    nq, nk = -(-q_len // block), -(-kv_len // block)
    pad = nq * block - q_len
    if pad:  # whole tiles of queries, allowed nothing; also keeps the mask's indexing in range
        lo = torch.cat([lo, lo.new_ones(pad)])
        hi = torch.cat([hi, hi.new_zeros(pad)])
        extra = torch.cat([extra, extra.new_full((pad,), -1)])
    starts = torch.arange(nk, device=lo.device) * block
    ends = (starts + block).clamp(max=kv_len)  # [nk] exclusive
    inside = (torch.minimum(hi[:, None] + 1, ends) - torch.maximum(lo[:, None], starts)).clamp(
        min=0
    )
    lone = (
        (extra[:, None] >= starts)
        & (extra[:, None] < ends)
        & ((extra < lo) | (extra > hi))[:, None]
    )
    count = (inside + lone).view(nq, block, nk).sum(1)  # [nq, nk] allowed pairs per tile
    full = count == block * block
    partial = (count > 0) & ~full

    def mask_mod(b: Any, h: Any, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        return ((ki >= lo[qi]) & (ki <= hi[qi])) | (ki == extra[qi])

    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )


def document_block_mask(docs: Documents, device: torch.device) -> Any:
    """The block mask of a single row's documents (query i at row position i), once per micro-batch."""
    key = ("flex_mask", device)
    if key not in docs.memo:
        positions = torch.arange(docs.total, device=device)
        lo, hi, extra = document_intervals(
            positions, docs.cu_buffer.to(device), docs.cu_real.to(device)
        )
        docs.memo[key] = interval_block_mask(lo, hi, extra, docs.total)
    return docs.memo[key]


def flex_attention_thd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float, dropout: float
) -> torch.Tensor:
    """Compiled flex_attention of a row's documents with the micro-batch's block mask; zeros,
    output and gradients, where no real token is.

    flex computes whole 128 x 128 tiles and masks scores, not loads: a NaN or inf held by a
    masked key in a tile of real ones would still reach the real queries (0 x NaN), so q, k and v
    are zeroed where no real token is before the kernel (``torch.where``: its backward zeroes the
    gradients there too). Cost: one pass over each of q, k, v forward and their gradients backward.
    """
    keep = docs.kept()[:, None, None]
    q, k, v = (torch.where(keep, x, x.new_zeros(())) for x in (q, k, v))
    out = run_flex(q, k, v, document_block_mask(docs, q.device), scale)
    return zero_outside(out, docs)


def run_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, scale: float
) -> torch.Tensor:
    """``q [Nq, h, d]``, ``k``/``v [Nk, g, d]`` through the compiled flex_attention -> [Nq, h, d]."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        out = compiled_flex(q.device.type)(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            block_mask=block_mask,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    return cast(torch.Tensor, out)[0].transpose(0, 1)


@functools.cache
def compiled_flex(device_type: str) -> Any:
    """``torch.compile(flex_attention)``, once per device type (see the module docstring)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False if device_type == "cpu" else None)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([1, 1, nq] count, [1, 1, nq, nk] kv tile indices, the selected ones first), as flex wants."""
    dense = tiles.to(torch.int32)[None, None]
    order = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(-1).to(torch.int32), order.to(torch.int32)
