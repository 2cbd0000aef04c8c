"""Megatron SFT-style packed batches: rows of documents with per-row ``cu_seqlens``, merged into THD.

Megatron's SFT datasets (and NeMo's packed datasets) give ``tokens``, ``labels``, ``loss_mask`` and
``position_ids`` of shape [b, s] and ``cu_seqlens`` of shape [b, k]: each row's boundaries start at
0, end at s, and are padded after that with -1 or with repeats of s (both conventions exist).
`merge_rows` turns them into one THD row of T = b * s tokens (`MergedRows`, which
`megapack.PackedBatch.from_megatron_batch` validates), row offsets added, sentinels removed, so
``cu_seqlens`` is 1-D int32 on every rank; Megatron-LM returned it 2-D on TP rank 0 and
1-D on the others, and dropped every sample after the first with micro-batch size > 1.

Example: rows of s=4 with cu_seqlens ``[[0, 3, 4, -1], [0, 4, 4, 4]]`` merge into ``[0, 3, 4, 8]``.

With per-document padding (context parallelism) the batch also carries ``cu_seqlens_padded``
[b, k'] in the same row convention (buffer offsets, 0 to s), and ``cu_seqlens`` holds the real
lengths: its first n + 1 entries per row (n documents, from the padded row), then -1 or repeats.
Merged as Transformer Engine expects: buffer offsets row by row, real lengths back to back.
Example, s=8: padded ``[[0, 4, 8], [0, 8, 8]]`` and real ``[[0, 3, 5], [0, 6, 6]]`` merge into
``cu_seqlens_padded [0, 4, 8, 16]`` and ``cu_seqlens [0, 3, 5, 11]``.

Imports nothing from megapack: `megapack.batch` builds on it, never the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

GRID_NAMES = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass(frozen=True, kw_only=True, slots=True)
class MergedRows:
    """b rows of an SFT-style batch as one THD row, dtypes as given (not yet validated)."""

    grid: dict[str, torch.Tensor]
    """``tokens``, ``labels``, ``loss_mask``, ``position_ids``, each [1, b * s]."""
    cu_seqlens: torch.Tensor
    """[n + 1] int32 merged boundaries, on the tokens' device (real lengths when padded is set)."""
    cu_seqlens_padded: torch.Tensor | None = None
    """[n + 1] int32 merged buffer boundaries, from the batch's ``cu_seqlens_padded`` rows."""
    max_seqlen: int
    """The given ``max_seqlen`` (its maximum over rows) or the longest document."""


def merge_rows(batch: Mapping[str, Any]) -> MergedRows:
    """Merge a Megatron SFT-style batch of b rows into one THD row (see `PackedBatch.from_megatron_batch`)."""
    tokens = grid_tensor(batch, "tokens")
    b, s = tokens.shape
    grid = {
        name: grid_tensor(batch, name, (b, s)) for name in ("labels", "loss_mask", "position_ids")
    }
    grid["tokens"] = tokens
    cu_rows = _cu_rows(batch, "cu_seqlens", b)
    padded_rows = (
        None if batch.get("cu_seqlens_padded") is None else _cu_rows(batch, "cu_seqlens_padded", b)
    )
    merged, merged_padded = [0], [0]
    for row in range(b):
        if padded_rows is None:
            bounds = _row_boundaries(cu_rows[row], s, row)
            merged.extend(int(v) + row * s for v in bounds[1:])
            continue
        padded = _row_boundaries(padded_rows[row], s, row, name="cu_seqlens_padded")
        real = _real_boundaries(cu_rows[row], len(padded), row)
        offset = merged[-1]
        merged.extend(int(v) + offset for v in real[1:])
        merged_padded.extend(int(v) + row * s for v in padded[1:])
    cu = np.asarray(merged, dtype=np.int64)
    buffer = cu if padded_rows is None else np.asarray(merged_padded, dtype=np.int64)
    longest = int(np.diff(cu).max())
    max_seqlen = int(np.diff(buffer).max())  # the longest buffer segment, padding included
    if batch.get("max_seqlen") is not None:
        given = batch["max_seqlen"]
        given_max = int(given.max().item() if isinstance(given, torch.Tensor) else np.max(given))
        if given_max < longest:
            raise ValueError(
                f"max_seqlen={given_max} is below the longest document ({longest} tokens)"
            )
        max_seqlen = max(max_seqlen, given_max)
    device = grid["tokens"].device
    return MergedRows(
        grid={name: grid[name].reshape(1, b * s) for name in GRID_NAMES},
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)).to(device),
        cu_seqlens_padded=None
        if padded_rows is None
        else torch.from_numpy(buffer.astype(np.int32)).to(device),
        max_seqlen=max_seqlen,
    )


def _cu_rows(batch: Mapping[str, Any], name: str, b: int) -> np.ndarray:
    """``batch[name]`` as a [b, k] integer array ([k] is accepted for b == 1)."""
    raw = batch[name]
    rows = np.asarray(raw.detach().cpu() if isinstance(raw, torch.Tensor) else raw)
    if rows.ndim == 1 and b == 1:
        rows = rows[None]
    if rows.ndim != 2 or rows.shape[0] != b:
        raise ValueError(
            f"{name} has shape {tuple(rows.shape)}; expected [b, k] with b={b} rows like tokens"
        )
    if not np.issubdtype(rows.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {rows.dtype}")
    return rows


def _real_boundaries(values: np.ndarray, count: int, row: int) -> np.ndarray:
    """A row's real-length boundaries next to padded ones: the first ``count`` entries, then sentinels.

    Example: padded ``[0, 4, 8]`` (s=8) with real ``[0, 3, 5, -1]`` -> ``[0, 3, 5]``.
    """
    bounds, tail = values[:count], values[count:]
    if len(bounds) < count or bounds[0] != 0 or (np.diff(bounds) <= 0).any():
        raise ValueError(
            f"cu_seqlens row {row} must start at 0 and rise strictly over the {count} boundaries of "
            f"cu_seqlens_padded row {row}, got {values.tolist()}"
        )
    bad = tail[(tail != -1) & (tail != bounds[-1])]
    if len(bad):
        raise ValueError(
            f"cu_seqlens row {row} has {int(bad[0])} after its {count} boundaries (the count of "
            f"cu_seqlens_padded row {row}); only -1 or repeats of {int(bounds[-1])} may follow"
        )
    return bounds


def grid_tensor(
    batch: Mapping[str, Any], name: str, shape: tuple[int, ...] | None = None
) -> torch.Tensor:
    """``batch[name]`` as a [b, s] tensor, checked against ``shape`` (default: ``batch['tokens']``'s)."""
    if name not in batch or batch[name] is None:
        raise ValueError(f"batch is missing {name!r} (got keys {sorted(batch)})")
    value = batch[name]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"batch[{name!r}] must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != 2:
        raise ValueError(f"batch[{name!r}] has shape {tuple(value.shape)}; expected [b, s]")
    if name == "loss_mask":
        if value.dtype.is_complex:
            raise TypeError(
                f"batch['loss_mask'] has dtype {value.dtype}; expected a real or bool mask"
            )
    elif value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(
            f"batch[{name!r}] has dtype {value.dtype}; expected integer token ids/positions"
        )
    if shape is not None and tuple(value.shape) != shape:
        raise ValueError(f"batch[{name!r}] has shape {tuple(value.shape)} but tokens has {shape}")
    return value


def _row_boundaries(values: np.ndarray, s: int, row: int, name: str = "cu_seqlens") -> np.ndarray:
    """One row's boundaries up to the first ``s``; the rest must be sentinels (-1 or s)."""
    if len(values) < 2 or values[0] != 0:
        raise ValueError(
            f"{name} row {row} must start with 0 and hold >= 2 boundaries, got {values.tolist()}"
        )
    past = values[values > s]
    if len(past):
        raise ValueError(
            f"{name} row {row} has boundary {int(past[0])} past the sequence length s={s} "
            f"(row {values.tolist()})"
        )
    hits = np.flatnonzero(values == s)
    if len(hits) == 0:
        real = values[values >= 0]
        raise ValueError(
            f"{name} row {row} never reaches the sequence length s={s} (last boundary {int(real.max())}; "
            f"row {values.tolist()}); boundaries must cover the whole row, padding included"
        )
    end = int(hits[0])
    bounds, tail = values[: end + 1], values[end + 1 :]
    bad_tail = tail[(tail != -1) & (tail != s)]
    if len(bad_tail):
        raise ValueError(
            f"{name} row {row} has {int(bad_tail[0])} after reaching s={s}; after the last boundary "
            "only -1 or repeats of s may follow"
        )
    step = np.diff(bounds)
    if (step <= 0).any():
        i = int(np.flatnonzero(step <= 0)[0])
        raise ValueError(
            f"{name} row {row} is not strictly increasing: {int(bounds[i + 1])} follows "
            f"{int(bounds[i])} at index {i + 1} (row {values.tolist()})"
        )
    return bounds
