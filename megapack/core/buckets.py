"""Length buckets of a packed micro-batch: its documents gathered into a few dense [n, L] batches.

Dense attention kernels (SDPA: cuDNN's Hopper kernels on a GPU, one call per batch on a CPU) take
equal-length rows. `plan_buckets` groups a micro-batch's documents by length class so that each
group runs as one right-padded dense batch, causally: a real query at position i of its document
sees keys 0..i, all real (padding only follows), so the result equals per-document attention.

    classes   8, 16, ..., 64 (multiples of 8), 80, 96, 112, 128 (of 16), then 2^k x {9, 10, ..., 16}
              / 8: 144, 160, ..., 256, 288, ... (`length_class`): a document is padded by less
              than 1/8 of its length, and every shape comes from one fixed set, so kernels'
              plans are reused
    buckets   at most `MAX_BUCKETS`: with more classes present, the two neighbours whose merge
              adds the least padded attention work (n x L^2) merge, repeatedly

A bucket is an int32 index [n, L]: row j lists the buffer positions of its document's real tokens,
then ``total`` T, the row's token count (the sentinel: a padding slot) up to L. The sentinel is T,
never the last boundary: where the boundaries end before T, position ``cu_buffer[-1]`` is a real
(tail) position, and a padding slot marked with it would alias it. Alignment padding, zero-length
documents and positions past the last boundary are in no bucket; their outputs are zero.

The plan is made where the lengths are on the host: the TP source, before sending the batch.
Declare ``fields=megapack.BUCKET_FIELDS`` and every rank receives it (one ragged field per bucket,
their shapes in the frame's header), so the kernel knows every shape without reading the device.

Worked example, buffer ``[0, 3, 8, 10, 16]`` (real lengths 3, 5, 2, 6), total 16: classes 8, 8, 8, 8,
one bucket [4, 8]: ``[[0, 1, 2, 16, ...], [3, 4, 5, 6, 7, 16, ...], [8, 9, 16, ...], [10, ..., 15, 16, 16]]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from megapack.core.fields import GRID_NAMES, BatchField

MAX_BUCKETS = 6
"""Most buckets a micro-batch is split into (one delivered field each)."""
BUCKET_FIELDS: tuple[BatchField, ...] = tuple(
    BatchField(f"attention_bucket_{i}", "ragged", torch.int32, "all") for i in range(MAX_BUCKETS)
)
"""Declare these (``fields=megapack.BUCKET_FIELDS``) to deliver the bucket plan with every batch."""
BUCKET_NAMES: tuple[str, ...] = tuple(f.name for f in BUCKET_FIELDS)
WORK_PER_SLOT = 128
"""The linear cost of a slot (gathers, scatters) in units of one attention pair, for merging."""


def length_class(n: int) -> int:
    """The smallest class >= n (module docstring); 0 for 0.

    Example:
        >>> [length_class(n) for n in (1, 8, 9, 65, 100, 129, 1000, 4096)]
        [8, 8, 16, 80, 112, 144, 1024, 4096]
    """
    return int(length_classes(np.array([n]))[0])


def length_classes(lengths: np.ndarray) -> np.ndarray:
    """`length_class` of every entry of ``lengths`` (int64, vectorized)."""
    n = np.asarray(lengths, dtype=np.int64)
    small = np.where(n <= 64, -(-n // 8) * 8, -(-n // 16) * 16)
    safe = np.maximum(n, 2)
    power = np.left_shift(1, np.ceil(np.log2(safe)).astype(np.int64) - 1)  # power < n <= 2 power
    eighths = -(-8 * safe // power)  # 9..16
    large = power * eighths // 8
    return np.where(n <= 0, 0, np.where(n <= 128, small, large))


def plan_buckets(
    cu_buffer: Sequence[int] | np.ndarray,
    cu_real: Sequence[int] | np.ndarray | None = None,
    *,
    total: int,
    max_buckets: int = MAX_BUCKETS,
) -> list[np.ndarray]:
    """The buckets of one micro-batch (module docstring): int32 [n, L] position indices.

    Args:
        cu_buffer: [k + 1] buffer boundaries (``cu_seqlens_padded``, else ``cu_seqlens``).
        cu_real: [k + 1] real boundaries (``cu_seqlens``) when documents are padded; None: the same.
        total: T, the micro-batch's token positions (>= ``cu_buffer[-1]``): the sentinel.
        max_buckets: most buckets.

    Raises:
        ValueError: ``total`` below the last boundary, or boundaries of different lengths.

    Example:
        >>> [b.shape for b in plan_buckets([0, 3, 8, 10, 16], total=16)]
        [(4, 8)]
        >>> plan_buckets([0, 3, 8, 10, 16], total=16)[0][0].tolist()
        [0, 1, 2, 16, 16, 16, 16, 16]
        >>> plan_buckets([0, 3, 8], total=10)[0][0].tolist()  # positions 8, 9: past the boundaries
        [0, 1, 2, 10, 10, 10, 10, 10]
    """
    starts_all = np.asarray(cu_buffer, dtype=np.int64)
    real = starts_all if cu_real is None else np.asarray(cu_real, dtype=np.int64)
    if real.shape != starts_all.shape:
        raise ValueError(
            f"cu_seqlens has {len(real)} entries but cu_seqlens_padded {len(starts_all)}"
        )
    sentinel = int(total)
    if len(starts_all) and sentinel < int(starts_all[-1]):
        raise ValueError(
            f"total={sentinel} is below the last boundary {int(starts_all[-1])}: pass the "
            "micro-batch's token count T (tokens.shape[-1]), which the boundaries never exceed"
        )
    lengths = np.diff(real)
    starts = starts_all[:-1]
    keep = lengths > 0
    lengths, starts = lengths[keep], starts[keep]
    if not len(lengths):
        return []
    classes = length_classes(lengths)
    groups = _merge(sorted(set(classes.tolist())), classes, max_buckets)
    bucket = _class_of(classes, groups)
    out = []
    for size in groups:
        mine = bucket == size
        offsets = np.arange(size, dtype=np.int64)[None, :]
        index = np.where(
            offsets < lengths[mine, None], starts[mine, None] + offsets, sentinel
        ).astype(np.int32)
        out.append(index)
    return out


def _merge(present: list[int], classes: np.ndarray, max_buckets: int) -> list[int]:
    """The bucket sizes: the classes present, neighbours merged up while there are too many."""
    counts = {c: int((classes == c).sum()) for c in present}
    sizes = list(present)
    while len(sizes) > max_buckets:
        best, cheapest = 0, math.inf
        for i in range(len(sizes) - 1):
            small, big = sizes[i], sizes[i + 1]
            extra = counts[small] * (big * big - small * small + WORK_PER_SLOT * (big - small))
            if extra < cheapest:
                best, cheapest = i, extra
        small = sizes.pop(best)
        counts[sizes[best]] += counts.pop(small)
    return sizes


def _class_of(classes: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Each document's bucket size: the smallest size >= its class."""
    bounds = np.asarray(sizes, dtype=np.int64)
    return bounds[np.searchsorted(bounds, classes, side="left")]


def with_bucket_plan(values: Mapping[str, Any]) -> dict[str, Any]:
    """A packed batch's values with the `BUCKET_NAMES` fields planned from its boundaries (on the
    TP source, where they are host tensors); absent buckets are None. The sentinel is the row's
    token count T: the last dim of the first token grid present (tokens, labels, loss_mask,
    position_ids), else the last boundary.

    Example:
        >>> values = {"cu_seqlens": torch.tensor([0, 3]), "tokens": torch.zeros(1, 5)}
        >>> with_bucket_plan(values)[BUCKET_NAMES[0]].tolist()
        [[0, 1, 2, 5, 5, 5, 5, 5]]
    """
    out = dict(values)
    buffer = values.get("cu_seqlens_padded")
    real = values["cu_seqlens"]
    cu_buffer = (real if buffer is None else buffer).tolist()
    grid = next((values[n] for n in GRID_NAMES if values.get(n) is not None), None)
    total = int(cu_buffer[-1]) if grid is None else int(grid.shape[-1])
    buckets = plan_buckets(cu_buffer, None if buffer is None else real.tolist(), total=total)
    for i, name in enumerate(BUCKET_NAMES):
        out[name] = torch.from_numpy(buckets[i]) if i < len(buckets) else None
    return out
