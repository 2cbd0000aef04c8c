"""Test data for the tiny GPT: the same documents laid out packed (THD) and padded (Megatron SFT).

The model itself (`TinyGPT`, `init_weights`, `forward_step`) lives in `megapack.harness.gpt`, the loss
in `megapack.megatron.loss`; it is re-exported here so tests and examples can import everything from one place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megapack.core.batch import PackedBatch
from megapack.harness.gpt import TinyGPT, forward_step, init_weights
from megapack.megatron.loss import masked_mean_loss

__all__ = [
    "TinyGPT",
    "forward_step",
    "init_weights",
    "masked_mean_loss",
    "packed_micro_batch",
    "padded_micro_batch",
]


def packed_micro_batch(
    rows: Sequence[Sequence[Sequence[int]]], seq_len: int, *, pad_to_multiple_of: int = 1
) -> dict[str, torch.Tensor]:
    """Megatron SFT-style packed micro-batch: one row of ``seq_len`` per entry of ``rows``.

    Each row's documents are packed with `PackedBatch.from_documents`; ``cu_seqlens`` rows are
    padded with -1, as Megatron's SFT datasets do. With ``pad_to_multiple_of > 1`` every document
    is padded to that multiple (context parallelism's "document" layout) and the batch also
    carries ``cu_seqlens_padded`` rows.
    """
    packed = [
        PackedBatch.from_documents(
            list(docs), seq_len=seq_len, pad_to_multiple_of=pad_to_multiple_of
        )
        for docs in rows
    ]
    out = {
        k: torch.cat([getattr(p, k) for p in packed])
        for k in ("tokens", "labels", "loss_mask", "position_ids")
    }
    out["cu_seqlens"] = _cu_rows([p.cu_seqlens for p in packed])
    if pad_to_multiple_of > 1:
        out["cu_seqlens_padded"] = _cu_rows([p.cu_seqlens_padded for p in packed])  # type: ignore[misc]
    return out


def _cu_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """[b, max n + 1] int32, each row's boundaries then -1."""
    cu = torch.full((len(rows), max(len(r) for r in rows)), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        cu[i, : len(r)] = r
    return cu


def padded_micro_batch(docs: Sequence[Sequence[int]], seq_len: int) -> dict[str, torch.Tensor]:
    """Plain [len(docs), seq_len] micro-batch: one document per row, padded at the end (Megatron SFT)."""
    rows = [PackedBatch.from_documents([doc], seq_len=seq_len) for doc in docs]
    return {
        k: torch.cat([getattr(r, k) for r in rows])
        for k in ("tokens", "labels", "loss_mask", "position_ids")
    }
