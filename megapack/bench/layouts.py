"""The same documents laid out as packing and as the baselines a practitioner would pick, and what
each layout costs in FLOPs: one module for `megapack bench` and the GPU kit alike.

Modes (`MODES`), each a list of micro-batches over the same documents, ``rows`` rows of ``seq_len``
token slots per packed micro-batch (Megatron's micro-batch size: a packed row takes a sequence's
place):

    packed          BFD rows of seq_len (`megapack.packing.plan`), THD, boundaries per document
    padded_fixed    one document per row padded to seq_len, rows per micro-batch (Megatron SFT)
    grouped         length-grouped padding with a token budget: documents sorted by length inside
                    random mega-batches (HF Trainer's ``group_by_length``), each micro-batch as many
                    documents as fit rows x seq_len slots when padded to its longest
    ceiling         the packed rows' tokens as unbroken documents: one document per row, no
                    boundaries; packing beats it only through fewer attention FLOPs
    padded_longest  a weak baseline, kept by name: rows documents per micro-batch in order, padded
                    to the longest (its micro-batch count is what it mostly measures)

Mega-batches of ``grouped``: HF's ``LengthGroupedSampler`` sorts inside mega-batches of
``min(len(dataset) // (4 * batch_size), 50)`` batches; here a batch is the packed micro-batch's
documents on average, so a mega-batch holds ``min(n_micro // 4, 50)`` packed micro-batches' worth
of documents (at least one), in a seeded random order, then sorted longest first.

FLOPs (`LayoutCost`): ``useful`` counts the documents' own training FLOPs (THD-aware: what the
model must compute); ``executed`` what the kernels run: every token slot through the matmuls, and
causal attention over every attention span (a packed buffer segment, a padded row whole, padding
included). The executed-FLOP ideal of a baseline is its executed FLOPs over packing's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from megapack.core.batch import PackedBatch

if TYPE_CHECKING:
    from megapack.bench.gpu.model import GptShape

MODES = ("packed", "padded_fixed", "grouped", "ceiling", "padded_longest")
LABELS = {
    "packed": "packed",
    "padded_fixed": "padded to seq",
    "grouped": "length-grouped padding, token budget",
    "ceiling": "ceiling: unbroken rows",
    "padded_longest": "weak: documents in order padded to the longest",
}
"""How reports name each mode."""
BASELINES = MODES[1:]
MEGA_BATCH_CAP = 50
"""HF ``LengthGroupedSampler``'s cap on batches per mega-batch."""


def micro_batches(
    mode: str, docs: Sequence[np.ndarray], seq_len: int, rows: int, *, seed: int = 0
) -> list[Any]:
    """The documents laid out for ``mode`` (module docstring): a list of micro-batches.

    Example:
        >>> docs = [np.arange(1, n + 1) for n in (3, 5, 2, 6)]
        >>> [tuple(b["tokens"].shape) for b in micro_batches("grouped", docs, 8, 1)]
        [(2, 3), (1, 6), (1, 5)]
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose one of {MODES}")
    if mode in ("packed", "ceiling"):
        bins = _bins(docs, seq_len)
        filler = (-len(bins)) % rows
        if mode == "ceiling":  # each row's tokens as one document, padded to seq_len
            texts = [np.concatenate([docs[i][a:b] for i, a, b in row]) for row in bins]
            texts += [np.zeros(1, dtype=np.int64)] * filler
            return [_plain(texts[i : i + rows], seq_len) for i in range(0, len(texts), rows)]
        packed = [
            PackedBatch.from_documents([docs[i][a:b] for i, a, b in row], seq_len=seq_len)
            for row in bins
        ]
        packed += [PackedBatch.from_documents([[0]], seq_len=seq_len)] * filler  # zero-loss
        return [PackedBatch.concat(packed[i : i + rows]) for i in range(0, len(packed), rows)]
    if mode == "padded_fixed":
        return [_plain(docs[i : i + rows], seq_len) for i in range(0, len(docs), rows)]
    if mode == "padded_longest":
        groups = [docs[i : i + rows] for i in range(0, len(docs), rows)]
        return [_plain(g, max(len(d) for d in g)) for g in groups]
    return [_plain(g, max(len(d) for d in g)) for g in grouped(docs, seq_len, rows, seed=seed)]


def grouped(
    docs: Sequence[np.ndarray], seq_len: int, rows: int, *, seed: int = 0
) -> list[list[np.ndarray]]:
    """``grouped``'s micro-batches (module docstring): each ``k`` documents with ``k x`` its longest
    at most ``rows * seq_len`` token slots (a document longer than that is a micro-batch alone)."""
    budget = rows * seq_len
    n_micro = max(1, -(-len(_bins(docs, seq_len)) // rows))
    per_mega = max(1, round(len(docs) / n_micro * min(max(n_micro // 4, 1), MEGA_BATCH_CAP)))
    order = np.random.default_rng(seed).permutation(len(docs))
    out: list[list[np.ndarray]] = []
    for start in range(0, len(order), per_mega):
        mega = sorted(order[start : start + per_mega], key=lambda i: -len(docs[i]))
        current: list[np.ndarray] = []
        for i in mega:
            if current and (len(current) + 1) * len(current[0]) > budget:
                out.append(current)
                current = []
            current.append(docs[i])
        out.append(current)
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutCost:
    """What one step of a layout holds and costs."""

    slots: int
    """Token positions the micro-batches hold, padding and filler rows included."""
    spans: list[int]
    """Every attention span: a packed buffer segment, or a padded row whole."""

    def executed_flops(self, shape: GptShape) -> int:
        """Training FLOPs the kernels run: every slot through the matmuls, causal attention over
        every span (`GptShape.training_flops` over the spans)."""
        return shape.training_flops(self.spans)


def layout_cost(batches: Sequence[Any]) -> LayoutCost:
    """The `LayoutCost` of a list of micro-batches (PackedBatch or plain [b, s] dicts)."""
    spans: list[int] = []
    for b in batches:
        if isinstance(b, PackedBatch):
            cu = b.cu_seqlens_padded if b.cu_seqlens_padded is not None else b.cu_seqlens
            spans += torch.diff(cu).tolist()
        else:
            rows, width = (int(n) for n in b["tokens"].shape)
            spans += [width] * rows
    return LayoutCost(slots=sum(spans), spans=spans)


def _bins(docs: Sequence[np.ndarray], seq_len: int) -> list[Any]:
    from megapack.packing import plan

    return list(plan([len(d) for d in docs], seq_len, algorithm="bfd").bins)


def _plain(docs: Sequence[np.ndarray], width: int) -> dict[str, torch.Tensor]:
    rows = [PackedBatch.from_documents([d], seq_len=width) for d in docs]
    out = {k: torch.cat([getattr(r, k) for r in rows]) for k in ("tokens", "labels", "loss_mask")}
    return {**out, "position_ids": torch.arange(width).expand(len(docs), width).contiguous()}
