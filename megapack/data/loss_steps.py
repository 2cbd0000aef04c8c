"""The loss fields for batches megapack did not plan, and for a StreamingPacker's global batches.

`megapack.megatron.normalized_loss` weighs a token by its optimizer step (`megapack.core.loss_fields`),
so each micro-batch must carry its step's denominators. Who computes them:

    PackedDataset(..., loss_fields=True)   from the plan, on every rank alike: no collective
    step_batches(bins, ...)                from one StreamingPacker global batch: no collective
    with_loss_fields(iterator, ...)        any iterator (Megatron's dataset dicts, PackedBatches,
                                           a generator): reads one step ahead on each DP rank and
                                           all-gathers 4 integers over the DP group: one
                                           collective per step

`with_loss_fields` sees only its own rank's micro-batches, so each document segment is a document
of its own (nothing says where a document was cut); Megatron's own datasets do not cut documents.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megapack.core.batch import PackedBatch, has_padding_segment
from megapack.core.checks import check_int
from megapack.core.errors import RemoteRankError
from megapack.core.loss_fields import (
    attach_loss_fields,
    check_reading,
    item_segments,
    segment_trained,
    step_loss_fields,
    warn_if_untrained,
)
from megapack.distributed import comm
from megapack.distributed.groups import control_group

_DATA_PARALLEL: Any = object()
"""``group``'s default: megatron-core's data-parallel group (None when there is none)."""


def with_loss_fields(
    data_iterator: Iterable[Any],
    *,
    micro_batches: int,
    group: Any = _DATA_PARALLEL,
    timeout: float | None = None,
) -> Iterator[Any]:
    """``data_iterator``'s items with the loss fields of their optimizer step added.

    Call it on every TP source (TP rank 0) that has an iterator, with the same ``micro_batches``;
    declare ``fields=megapack.LOSS_FIELDS`` (with any fields of your own) in
    `megapack.get_batch_on_this_tp_rank`.

    Args:
        data_iterator: yields `PackedBatch`es or Megatron batch dicts, one per micro-batch.
        micro_batches: micro-batches per optimizer step on this rank (Megatron's
            ``get_num_microbatches()``).
        group: the data-parallel group of this TP source (megatron-core's
            ``parallel_state.get_data_parallel_group()``, the default); None for a single DP rank.
        timeout: seconds the step's all-gather waits (default: megapack's timeout).

    Yields:
        The items in order, each a PackedBatch with ``loss_documents`` and ``loss_step`` in its
        extras, or a dict with those keys. A step is read whole before its first item is yielded.

    Raises:
        ValueError: DP ranks read different numbers of micro-batches for a step (data uneven
            across DP ranks), on every rank, naming the counts; or ``micro_batches`` < 1.
        RemoteRankError: another DP rank failed to read or check its step (its own error is
            raised there); the failing rank raises its own error.
        CollectiveError: a DP peer is stuck or gone.
    """
    check_int("micro_batches", micro_batches, minimum=1)
    pg = _default_group() if group is _DATA_PARALLEL else group
    if pg is not None and dist.get_world_size(pg) == 1:
        pg = None
    return _steps(iter(data_iterator), micro_batches, pg, timeout)


def _steps(
    items: Iterator[Any], micro_batches: int, group: Any, timeout: float | None
) -> Iterator[Any]:
    for step in itertools.count():
        error: Exception | None = None
        try:
            batch = list(itertools.islice(items, micro_batches))
            documents, totals = step_loss_fields(
                [segment_trained(*item_segments(item)) for item in batch]
            )
        except Exception as exc:  # told to the peers, then raised here
            batch, documents, totals, error = [], [], np.zeros(3, dtype=np.int64), exc
        if group is not None:
            totals = _agree(step, totals, error, group, timeout)
        if error is not None:
            raise error
        if not batch:
            return
        warn_if_untrained(totals, f"with_loss_fields step {step}")
        for item, rows in zip(batch, documents, strict=True):
            yield attach_loss_fields(item, rows, totals)


def _agree(
    step: int, totals: np.ndarray, error: Exception | None, group: Any, timeout: float | None
) -> np.ndarray:
    """Every DP rank's step totals summed, after one all-gather that also checks they agree."""
    control = control_group(group)
    what = f"megapack.with_loss_fields (step {step})"
    mine = torch.tensor([*totals.tolist(), int(error is not None)], dtype=torch.int64)
    rows = comm.all_gather(
        mine.to(comm.tensor_device(control)), group=control, what=what, timeout=timeout
    )
    gathered = np.stack([r.cpu().numpy() for r in rows])
    ranks = comm.group_ranks(group)
    if gathered[:, 3].any():
        messages = comm.all_gather_strings(
            "" if error is None else f"{type(error).__name__}: {error}",
            group=control,
            what=what,
            timeout=timeout,
        )
        if error is None:
            failed = int(np.flatnonzero(gathered[:, 3])[0])
            raise RemoteRankError(ranks[failed], step, messages[failed])
        return totals
    counts = gathered[:, 2].tolist()
    if len(set(counts)) > 1:
        raise ValueError(
            f"DP ranks {ranks} read {counts} micro-batches for step {step}: the data is uneven "
            "across data-parallel ranks, so one rank would train a step the others do not; give "
            "every DP rank the same number of micro-batches (e.g. pad with zero-loss micro-batches)"
        )
    return gathered[:, :3].sum(axis=0)


def _default_group() -> Any:
    """megatron-core's data-parallel group when its model parallelism is initialized, else None."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():
        from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return ps.get_data_parallel_group()


def step_batches(
    bins: Sequence[Sequence[Any]],
    *,
    seq_len: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    micro_batches: int = 1,
    rows_per_micro_batch: int = 1,
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
    split_documents: str = "whole",
) -> list[PackedBatch]:
    """This DP rank's micro-batches of one global batch of `StreamingPacker` bins, with loss fields.

    The bins are dealt as the packer's ``balance`` docstring says: bin ``i`` to global micro-batch
    ``i // rows_per_micro_batch``, which is DP rank ``(i // rows_per_micro_batch) % dp_size``'s.
    Every rank passes the same bins (each runs the same packer) and builds only its own rows; the
    step's denominators come from all of them, with no collective. A short last global batch is
    filled with zero-loss rows.

    Args:
        bins: at most ``dp_size * micro_batches * rows_per_micro_batch`` bins, each a list of
            `megapack.packing.Piece` whose ``doc`` is a `megapack.data.Document`, a dict with
            ``tokens`` (and ``loss_mask``) or a token sequence.
        seq_len, pad_to_multiple_of, pad_token_id: the rows, as `PackedBatch.from_documents`.
        split_documents: "whole" (pieces of one stream document in this step are one document)
            or "pieces".

    Returns:
        ``micro_batches`` PackedBatches, each ``rows_per_micro_batch`` rows.
    """
    for name, value in (
        ("dp_size", dp_size),
        ("micro_batches", micro_batches),
        ("rows_per_micro_batch", rows_per_micro_batch),
        ("seq_len", seq_len),
    ):
        check_int(name, value, minimum=1)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside dp_size={dp_size}")
    whole = check_reading(split_documents) == "whole"
    slots = dp_size * micro_batches * rows_per_micro_batch
    if len(bins) > slots:
        raise ValueError(
            f"{len(bins)} bins given for one global batch of {slots} rows (dp_size {dp_size} x "
            f"micro_batches {micro_batches} x rows_per_micro_batch {rows_per_micro_batch})"
        )
    rows = [list(b) for b in bins] + [[] for _ in range(slots - len(bins))]
    trained: list[np.ndarray] = []
    keys: list[np.ndarray | None] = []
    spare = 1 + max((p.doc_index for b in rows for p in b), default=0)  # padding segments' keys
    for j in range(dp_size * micro_batches):
        counts, ids = [], []
        for row in rows[j * rows_per_micro_batch : (j + 1) * rows_per_micro_batch]:
            for piece in row:
                mask = _piece_arrays(piece)[1]
                counts.append(int(np.count_nonzero(mask[1:])))
                ids.append(piece.doc_index)
            used = sum(_aligned(p.stop - p.start, pad_to_multiple_of) for p in row)
            if not row or has_padding_segment(used, seq_len, pad_to_multiple_of):
                counts.append(0)
                ids.append(spare)
                spare += 1
        trained.append(np.array(counts, dtype=np.int64))
        keys.append(np.array(ids, dtype=np.int64) if whole else None)
    documents, totals = step_loss_fields(trained, keys)
    warn_if_untrained(totals, "the global batch of step_batches")
    out = []
    for i in range(micro_batches):
        j = dp_rank + i * dp_size
        built = [
            _row(r, seq_len, pad_to_multiple_of, pad_token_id)
            for r in rows[j * rows_per_micro_batch : (j + 1) * rows_per_micro_batch]
        ]
        out.append(attach_loss_fields(PackedBatch.concat(built), documents[j], totals))
    return out


def _aligned(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def _piece_arrays(piece: Any) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss mask) of a packer piece's ``start:stop`` slice of its document."""
    doc = piece.doc
    if isinstance(doc, int | np.integer):
        raise TypeError(
            f"stream document {piece.doc_index} is a bare length ({doc}); a batch needs its tokens"
        )
    if hasattr(doc, "tokens") and hasattr(doc, "loss_mask"):
        tokens, mask = np.asarray(doc.tokens), np.asarray(doc.loss_mask)
    elif isinstance(doc, Mapping):
        tokens = np.asarray(doc["tokens"])
        mask = np.asarray(doc.get("loss_mask", np.ones(len(tokens))))
    else:
        tokens = np.asarray(doc.cpu() if isinstance(doc, torch.Tensor) else doc)
        mask = np.ones(len(tokens), dtype=np.float32)
    return tokens[piece.start : piece.stop], mask[piece.start : piece.stop]


def _row(row: list[Any], seq_len: int, multiple: int, pad_token_id: int) -> PackedBatch:
    if not row:  # a filler row of a short last global batch: one all-padding document
        docs: list[Any] = [
            {"tokens": np.full(seq_len, pad_token_id), "loss_mask": np.zeros(seq_len)}
        ]
    else:
        docs = [dict(zip(("tokens", "loss_mask"), _piece_arrays(p), strict=True)) for p in row]
    return PackedBatch.from_documents(
        docs, seq_len=seq_len, pad_to_multiple_of=multiple, pad_token_id=pad_token_id
    )
