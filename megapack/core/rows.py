"""Megatron SFT-style packed rows merged into one THD row (`merge_rows`), as Megatron's datasets lay them out.

Megatron's SFT datasets (and NeMo's packed ones) give ``tokens``, ``labels``, ``loss_mask`` and
``position_ids`` of shape [b, s] and ``cu_seqlens`` [b, k]: each row's boundaries start at 0, end
at s, then hold -1 or repeats of s (both conventions exist). The merged boundaries get row offsets
and lose the sentinels, so ``cu_seqlens`` is 1-D int32 on every rank (Megatron-LM returned it 2-D
on TP rank 0 and 1-D on the others, and dropped every sample after the first with mbs > 1).

Example, s=4: ``[[0, 3, 4, -1], [0, 4, 4, 4]]`` -> ``[0, 3, 4, 8]``. With ``cu_seqlens_padded``
[b, k'] the real lengths go back to back and the buffer offsets row by row (Transformer Engine's
THD convention): s=8, padded ``[[0, 4, 8], [0, 8, 8]]`` and real ``[[0, 3, 5], [0, 6, 6]]`` ->
``cu_seqlens_padded [0, 4, 8, 16]``, ``cu_seqlens [0, 3, 5, 11]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from megapack.core.batch import PackedBatch
from megapack.core.fields import GRID_NAMES, MASK_DTYPE, TOKEN_DTYPE


def merge_rows(batch: Mapping[str, Any]) -> PackedBatch:
    """A Megatron SFT-style packed batch of b rows of s tokens as one validated THD PackedBatch.

    ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` are [b, s]; ``cu_seqlens`` [b, k]
    ([k] when b == 1), optional ``cu_seqlens_padded`` [b, k'] and ``max_seqlen`` (at least the
    longest document); other keys are not read here. See the module docstring for the merge.
    """
    tokens = grid_tensor(batch, "tokens")
    rows, cols = (int(n) for n in tokens.shape)
    grid = {name: grid_tensor(batch, name, (rows, cols)) for name in GRID_NAMES}
    cu_rows = _cu_rows(batch, "cu_seqlens", rows)
    padded_rows = None
    if batch.get("cu_seqlens_padded") is not None:
        padded_rows = _cu_rows(batch, "cu_seqlens_padded", rows)
    merged, merged_padded = [0], [0]
    for row in range(rows):
        if padded_rows is None:
            bounds = _row_boundaries(cu_rows[row], cols, row)
            merged.extend(int(v) + row * cols for v in bounds[1:])
            continue
        padded = _row_boundaries(padded_rows[row], cols, row, name="cu_seqlens_padded")
        real = _real_boundaries(cu_rows[row], len(padded), row)
        offset = merged[-1]
        merged.extend(int(v) + offset for v in real[1:])
        merged_padded.extend(int(v) + row * cols for v in padded[1:])
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
    flat = {k: v.reshape(1, rows * cols) for k, v in grid.items()}
    return PackedBatch(
        tokens=flat["tokens"].to(TOKEN_DTYPE),
        labels=flat["labels"].to(TOKEN_DTYPE),
        loss_mask=flat["loss_mask"].to(MASK_DTYPE),
        position_ids=flat["position_ids"].to(TOKEN_DTYPE),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)).to(device),
        cu_seqlens_padded=None
        if padded_rows is None
        else torch.from_numpy(buffer.astype(np.int32)).to(device),
        max_seqlen=max_seqlen,
    ).validate()


def grid_tensor(
    batch: Mapping[str, Any], name: str, shape: tuple[int, ...] | None = None
) -> torch.Tensor:
    """``batch[name]`` as a [b, s] tensor, checked against ``shape`` (None: ``batch['tokens']``
    itself, which must hold at least one token)."""
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
    if not value.numel():  # (the others are checked against tokens, which this refuses empty)
        raise ValueError(
            f"batch[{name!r}] has shape {tuple(value.shape)}; a micro-batch needs at least one "
            "row of at least one token"
        )
    return value


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
            f"{name} row {row} never reaches the sequence length s={s} (last boundary "
            f"{int(real.max())}; row {values.tolist()}); boundaries must cover the whole row, "
            "padding included"
        )
    end = int(hits[0])
    bounds, tail = values[: end + 1], values[end + 1 :]
    bad_tail = tail[(tail != -1) & (tail != s)]
    if len(bad_tail):
        raise ValueError(
            f"{name} row {row} has {int(bad_tail[0])} after reaching s={s}; after the last "
            "boundary only -1 or repeats of s may follow"
        )
    step = np.diff(bounds)
    if (step <= 0).any():
        i = int(np.flatnonzero(step <= 0)[0])
        raise ValueError(
            f"{name} row {row} is not strictly increasing: {int(bounds[i + 1])} follows "
            f"{int(bounds[i])} at index {i + 1} (row {values.tolist()})"
        )
    return bounds
