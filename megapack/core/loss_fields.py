"""The loss fields: what a loss needs to weigh a trained token the same however the step was packed.

A training step is many micro-batches on many ranks. A loss that is a mean per micro-batch weighs
each trained token by 1 / (trained tokens of its micro-batch x micro-batches x DP), so moving a
document to another micro-batch (another packing, micro-batch size or DP size) changes the
objective. The modes (`LOSS_MODES`, as practice names them) weigh by the whole step instead:

    token_mean        sum over the step's trained tokens / trained tokens in the step
                      (Megatron's --calculate-per-token-loss, verl "token-mean")
    sequence_mean     each document's trained-token mean, averaged over the step's documents that
                      have a trained token (verl "seq-mean-token-mean")
    sequence_sum      each document's trained-token sum, averaged over those documents
                      (verl "seq-mean-token-sum")
    micro_batch_mean  each micro-batch's mean, averaged over the step's micro-batches: Megatron's
                      default without per-token loss; it depends on the packing

A trained token is a position whose ``loss_mask`` is non-zero; a document none of whose tokens is
trained (every token masked, a 1-token document, padding) is not counted.

A CP rank sees only its share of a micro-batch, and a micro-batch only itself, so two declared
fields (`LOSS_FIELDS`, for the loss's stage, whole on every CP rank) carry what neither can see:

    loss_documents  [n, 2] int64, one row per document segment of the micro-batch (a segment of
                    the buffer boundaries, ``cu_seqlens_padded`` else ``cu_seqlens``, in a packed
                    batch; a row of a plain [b, s] batch): the trained tokens of the segment's
                    document in the whole step, and 1 on the one segment that counts that
                    document in the step (0 on its other pieces and on untrained documents)
    loss_step       [1, 3] int64: trained tokens in the step, documents with a trained token in the
                    step, micro-batches in the step over every DP rank

Which segments form one document: by default each segment is a document of its own (``pieces``).
A producer that knows where documents were cut (`megapack.data.PackedDataset`, a StreamingPacker
consumer) may instead count the pieces of one document that meet in the same step as one document
(``whole``: `SPLIT_READINGS`); pieces that fall in different steps are a document of each step.
A document split over CP ranks, or over the rows of a micro-batch, is always one segment per piece
of the buffer, so it counts once.

Worked example, one step of two micro-batches; micro-batch 0 holds documents A (3 trained tokens)
and the first piece of C (2 trained), micro-batch 1 holds the rest of C (4 trained) and B (none
trained)::

    "whole":   micro-batch 0 loss_documents [[3, 1], [6, 1]]   micro-batch 1 [[6, 0], [0, 0]]
    "pieces":  micro-batch 0 loss_documents [[3, 1], [2, 1]]   micro-batch 1 [[4, 1], [0, 0]]
    loss_step  [[9, 2, 2]] ("whole"), [[9, 3, 2]] ("pieces")

Every function here runs on the host (numpy/torch CPU) except `token_documents`, which runs on
the batch's device without reading a value on the host.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import numpy as np
import torch

from megapack.core.batch import PackedBatch
from megapack.core.cp_share import CpLayout, local_documents
from megapack.core.fields import BatchField
from megapack.core.rows import grid_tensor, merge_rows

LossMode = Literal["token_mean", "sequence_mean", "sequence_sum", "micro_batch_mean"]
LOSS_MODES: tuple[LossMode, ...] = (
    "token_mean",
    "sequence_mean",
    "sequence_sum",
    "micro_batch_mean",
)
SplitReading = Literal["whole", "pieces"]
SPLIT_READINGS: tuple[SplitReading, ...] = ("whole", "pieces")
"""How the pieces of a split document count in a step: as one document, or each as its own."""

LOSS_FIELDS: tuple[BatchField, ...] = (
    BatchField("loss_documents", "ragged", torch.int64, "last"),
    BatchField("loss_step", "ragged", torch.int64, "last"),
)
"""The declarations to pass in ``fields=`` where batches carry the loss fields."""
log = logging.getLogger(__name__)


def check_mode(mode: Any) -> LossMode:
    """``mode`` if it is one of `LOSS_MODES`, else ValueError naming it."""
    if mode not in LOSS_MODES:
        raise ValueError(f"mode={mode!r}; choose one of {LOSS_MODES}")
    return mode


def check_reading(split_documents: Any) -> SplitReading:
    """``split_documents`` if it is one of `SPLIT_READINGS`, else ValueError naming it."""
    if split_documents not in SPLIT_READINGS:
        raise ValueError(
            f"split_documents={split_documents!r}; choose one of {SPLIT_READINGS} (a split "
            "document's pieces in one step count as one document, or each as its own)"
        )
    return split_documents


def segment_trained(cu_buffer: torch.Tensor | None, loss_mask: torch.Tensor) -> np.ndarray:
    """Trained tokens of every document segment of one whole micro-batch (host; int64 [n]).

    Args:
        cu_buffer: a packed batch's buffer boundaries [n + 1] (``cu_seqlens_padded`` else
            ``cu_seqlens``), or None for a plain [b, s] batch, whose rows are its segments.
        loss_mask: [1, T] (packed) or [b, s] (plain).

    Example:
        >>> segment_trained(torch.tensor([0, 3, 5]), torch.tensor([[1.0, 1, 0, 0, 1]])).tolist()
        [2, 1]
    """
    trained = (loss_mask.detach().cpu().numpy() != 0).astype(np.int64)
    if cu_buffer is None:
        return trained.sum(axis=1)
    cu = cu_buffer.detach().cpu().numpy().astype(np.int64)
    segment = np.searchsorted(cu[1:], np.arange(trained.size), side="right")
    return np.bincount(segment, weights=trained.reshape(-1), minlength=len(cu) - 1).astype(np.int64)


def item_segments(item: Any) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(buffer boundaries or None, loss_mask) of what a data iterator yields, as delivered.

    A `PackedBatch` as is; a Megatron SFT-style dict with its rows merged the way the delivery
    merges them (`megapack.core.rows.merge_rows`); a plain dict's [b, s] rows.
    """
    if isinstance(item, PackedBatch):
        batch = item
    elif isinstance(item, Mapping):
        if item.get("cu_seqlens") is None:
            return None, grid_tensor(item, "loss_mask")
        batch = merge_rows(item)
    else:
        raise TypeError(
            f"the data iterator yielded {type(item).__name__}; expected a megapack.PackedBatch or "
            "a Megatron batch dict"
        )
    buffer = batch.cu_seqlens_padded if batch.cu_seqlens_padded is not None else batch.cu_seqlens
    return buffer, batch.loss_mask


def step_loss_fields(
    trained: Sequence[np.ndarray], keys: Sequence[np.ndarray | None] | None = None
) -> tuple[list[np.ndarray], np.ndarray]:
    """The loss fields of one step's micro-batches, given each segment's trained tokens.

    Args:
        trained: per micro-batch of the step (in the step's global order: every DP rank's), the
            trained tokens of each of its segments (`segment_trained`).
        keys: per micro-batch, the document of each segment (any int64 ids: segments with the
            same id in the step are one document), or None for a micro-batch whose segments are
            each their own document; None: every segment its own ("pieces").

    Returns:
        (``loss_documents`` of each micro-batch, [n_i, 2]; ``loss_step`` [3]): see the module
        docstring. The segment that counts a document is its first one with a trained token.
    """
    if keys is None:
        keys = [None] * len(trained)
    if len(keys) != len(trained):
        raise ValueError(f"keys has {len(keys)} micro-batches but trained has {len(trained)}")
    sizes = [len(t) for t in trained]
    flat_trained = np.concatenate(
        [np.zeros(0, np.int64), *(np.asarray(t, np.int64) for t in trained)]
    )
    fresh = iter(range(-1, -len(flat_trained) - 1, -1))  # ids no caller's key uses (< 0)
    parts = []
    for k, n in zip(keys, sizes, strict=True):
        if k is None:
            parts.append(np.array([next(fresh) for _ in range(n)], dtype=np.int64))
            continue
        k = np.asarray(k, dtype=np.int64)
        if k.shape != (n,):
            raise ValueError(f"a micro-batch has {n} segments but {k.shape[0]} document keys")
        if (k < 0).any():
            raise ValueError(f"document keys must be >= 0, got {int(k.min())}")
        parts.append(k)
    flat_keys = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    _, inverse = np.unique(flat_keys, return_inverse=True)
    per_key = np.bincount(inverse, weights=flat_trained).astype(np.int64)
    counted = np.zeros(len(flat_keys), dtype=np.int64)
    live = np.flatnonzero(flat_trained > 0)  # in global order
    _, first = np.unique(inverse[live], return_index=True)
    counted[live[first]] = 1
    columns = np.stack([per_key[inverse], counted], axis=1)
    bounds = np.cumsum([0, *sizes])
    documents = [columns[bounds[i] : bounds[i + 1]] for i in range(len(sizes))]
    step = np.array([flat_trained.sum(), int((per_key > 0).sum()), len(sizes)], dtype=np.int64)
    return documents, step


def warn_if_untrained(step: np.ndarray, where: str) -> None:
    """Log a warning when a step (its ``loss_step`` totals) has no trained token: its loss and
    gradient are 0 in every mode (the chosen behaviour; no NaN, no error)."""
    if int(step[0]) == 0:
        log.warning(
            "%s has no trained token (every loss_mask is 0): its loss and gradient are 0", where
        )


def attach_loss_fields(item: Any, documents: np.ndarray, step: np.ndarray) -> Any:
    """``item`` (a `PackedBatch` or a Megatron dict) with its loss fields added.

    Raises:
        ValueError: ``documents`` does not have one row per segment of ``item``, or ``item``
            already holds a loss field.
    """
    buffer, mask = item_segments(item)
    segments = int(mask.shape[0]) if buffer is None else int(buffer.numel()) - 1
    if tuple(documents.shape) != (segments, 2):
        raise ValueError(
            f"loss_documents has shape {tuple(documents.shape)} but the batch has {segments} "
            "document segments: one row (trained tokens, counted) per segment"
        )
    values = {
        "loss_documents": torch.from_numpy(np.ascontiguousarray(documents, dtype=np.int64)),
        "loss_step": torch.from_numpy(np.asarray(step, dtype=np.int64).reshape(1, 3).copy()),
    }
    held = item.extras if isinstance(item, PackedBatch) else item
    if clash := sorted(set(held) & set(values)):
        raise ValueError(f"the batch already holds {clash}: the loss fields are computed here")
    if isinstance(item, PackedBatch):
        return replace(item, extras={**item.extras, **values})
    return {**item, **values}


def token_documents(
    batch: Mapping[str, Any], *, cp_size: int = 1, cp_rank: int = 0, layout: CpLayout = "document"
) -> torch.Tensor:
    """The document segment of every token of a delivered batch, as this CP rank holds it.

    Args:
        batch: what `megapack.get_batch_on_this_tp_rank` returned (``loss_mask`` is this rank's
            share; ``cu_seqlens`` / ``cu_seqlens_padded`` the whole row's).
        cp_size, cp_rank, layout: this rank's place in its CP group and the batch's CP layout.

    Returns:
        int64, ``loss_mask``'s shape: the index of each token's segment of the buffer boundaries
        (packed), or its row (plain [b, s]); on the batch's device, with no host read.

    Example:
        >>> batch = {"loss_mask": torch.ones(1, 4), "cu_seqlens": torch.tensor([0, 3, 4]),
        ...          "cu_seqlens_padded": None}
        >>> token_documents(batch).tolist()
        [[0, 0, 0, 1]]
    """
    mask = batch["loss_mask"]
    cu = batch.get("cu_seqlens")
    if cu is None:  # plain rows: a row is a document, on every CP rank (split by row)
        rows = torch.arange(mask.shape[0], device=mask.device)
        return rows[:, None].expand(mask.shape)
    padded = batch.get("cu_seqlens_padded")
    buffer = padded if padded is not None else cu
    local = local_documents(buffer, cp_size, cp_rank, layout=layout, local_total=mask.numel())
    return local.reshape(mask.shape)
