"""Static shapes: every packed micro-batch with the same shapes, so a CUDA graph can replay over it.

A packed row's token fields are [1, T] whatever it holds, but its boundaries have one entry per
document plus one, and ``max_seqlen`` is its longest document: both change every micro-batch, so
no graph captured over one batch fits the next. `StaticShape` fixes them:

    cu_seqlens, cu_seqlens_padded   max_segments + 1 entries, padded with the final offset
                                    (zero-length documents at the end, as torchtitan does)
    max_seqlen                      a fixed int (the row length, or a declared bound)

Every kernel, RoPE, the CP share and the losses give exactly the unpadded results on such
boundaries (tested per backend), with zeros where nothing is. A batch with more segments than
the shape holds is an error naming the cap: cap the documents per row where the rows are packed
(``max_documents=`` of `megapack.packing.plan`, `megapack.data.PackedDataset`, the
StreamingPacker, ``megapack pack --max-documents``; ``megapack stats`` suggests one), and size
the shape with `segments_for`.

Worked example, documents of 3 and 2 tokens in a row of 8 (a trailing padding segment of 3):

    cu_seqlens [0, 3, 5, 8]  ->  StaticShape(max_segments=5, max_seqlen=8)  ->  [0, 3, 5, 8, 8, 8]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from megapack.core.checks import check_int

PER_SEGMENT = ("loss_documents",)
"""Fields with one row per segment (`megapack.core.loss_fields`): padded with zero rows."""


@dataclasses.dataclass(frozen=True, slots=True)
class StaticShape:
    """The fixed boundary count and ``max_seqlen`` of every packed micro-batch (module docstring)."""

    max_segments: int
    """Document segments a micro-batch may hold (its boundaries have one entry more)."""
    max_seqlen: int
    """The ``max_seqlen`` every micro-batch reports (at least its longest segment)."""

    def __post_init__(self) -> None:
        check_int("StaticShape.max_segments", self.max_segments, minimum=1)
        check_int("StaticShape.max_seqlen", self.max_seqlen, minimum=1)


def segments_for(max_documents: int, rows_per_micro_batch: int = 1) -> int:
    """The segments of a micro-batch of ``rows_per_micro_batch`` rows of at most ``max_documents``
    documents each: each row may add one segment of trailing padding.

    Example:
        >>> segments_for(40, rows_per_micro_batch=2)
        82
    """
    check_int("max_documents", max_documents, minimum=1)
    check_int("rows_per_micro_batch", rows_per_micro_batch, minimum=1)
    return rows_per_micro_batch * (max_documents + 1)


def static_batch(batch: Any, shape: StaticShape) -> Any:
    """A `megapack.PackedBatch` in ``shape`` (its boundaries and per-segment extras padded)."""
    values = {
        "cu_seqlens": batch.cu_seqlens,
        "cu_seqlens_padded": batch.cu_seqlens_padded,
        "max_seqlen": batch.max_seqlen,
        **batch.extras,
    }
    padded = pad_static(values, shape)
    extras = {k: padded[k] for k in batch.extras}
    return dataclasses.replace(
        batch,
        cu_seqlens=padded["cu_seqlens"],
        extras=extras,
        cu_seqlens_padded=padded["cu_seqlens_padded"],
        max_seqlen=padded["max_seqlen"],
    ).validate()


def pad_static(values: Mapping[str, Any], shape: StaticShape) -> dict[str, Any]:
    """A packed micro-batch's values (a field name -> tensor or int dict) in ``shape``.

    Raises:
        ValueError: more segments than ``shape.max_segments``, or a segment longer than
            ``shape.max_seqlen``, naming the cap and how to meet it.
    """
    out = dict(values)
    cu = values["cu_seqlens"]
    segments = int(cu.numel()) - 1
    if segments > shape.max_segments:
        raise ValueError(
            f"the batch has {segments} document segments but the static shape holds "
            f"max_segments={shape.max_segments}: cap the documents per row where rows are packed "
            "(max_documents=, megapack pack --max-documents; megapack stats suggests one) or "
            "raise the cap"
        )
    if values["max_seqlen"] > shape.max_seqlen:
        raise ValueError(
            f"the batch's longest segment has {values['max_seqlen']} positions but the static "
            f"shape's max_seqlen={shape.max_seqlen}; declare max_seqlen >= the row length"
        )
    extra = shape.max_segments - segments
    for name in ("cu_seqlens", "cu_seqlens_padded"):
        bounds = values.get(name)
        if bounds is not None and extra:
            out[name] = torch.cat([bounds, bounds[-1:].expand(extra)])
    for name in PER_SEGMENT:
        rows = values.get(name)
        if rows is not None and extra:
            out[name] = torch.cat([rows, rows.new_zeros(extra, *rows.shape[1:])])
    out["max_seqlen"] = shape.max_seqlen
    return out
