"""megapack.core.rows: Megatron SFT rows merged into one THD row, worked examples and every refusal
in full (the field, the row, its values and what may follow a row's last boundary)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from megapack.core.rows import grid_tensor, merge_rows

S = 8


def rows(cu: Any, b: int = 1, **extra: Any) -> dict[str, Any]:
    """b rows of s=8 tokens with boundaries ``cu`` (and e.g. ``cu_seqlens_padded``)."""
    tokens = torch.arange(b * S).reshape(b, S)
    return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(b, S),
            "position_ids": torch.arange(S).repeat(b, 1), "cu_seqlens": cu, **extra}  # fmt: skip


def refusal(batch: dict[str, Any], error: type = ValueError) -> str:
    with pytest.raises(error) as info:
        merge_rows(batch)
    return str(info.value)


def i32(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_grid_fields_take_the_contracts_dtypes_and_no_padded_boundaries_stay_none() -> None:
    batch = {
        "tokens": torch.arange(8, dtype=torch.int32).reshape(1, 8),
        "labels": torch.arange(1, 9, dtype=torch.int16).reshape(1, 8),
        "loss_mask": torch.tensor([[True] * 7 + [False]]),
        "position_ids": torch.arange(8, dtype=torch.uint8).reshape(1, 8),
        "cu_seqlens": i32([0, 5, 8]),
    }
    b = merge_rows(batch)
    assert (b.tokens.dtype, b.labels.dtype, b.position_ids.dtype) == (torch.int64,) * 3
    assert b.loss_mask.dtype == torch.float32 and b.loss_mask.tolist() == [[1.0] * 7 + [0.0]]
    assert b.labels.tolist() == [list(range(1, 9))] and b.cu_seqlens.tolist() == [0, 5, 8]
    assert b.cu_seqlens_padded is None and b.max_seqlen == 5


@pytest.mark.parametrize(
    "cu", [[[0, 3, 8]], np.array([[0, 3, 8]], dtype=np.int64), [0, 3, 8]], ids=["list", "numpy", "1-d"]
)  # fmt: skip
def test_boundaries_may_be_lists_or_numpy(cu: Any) -> None:
    assert merge_rows(rows(cu)).cu_seqlens.tolist() == [0, 3, 8]


def test_a_row_of_one_document_has_two_boundaries() -> None:
    b = merge_rows(rows(i32([[0, 8], [0, 8]]), b=2))
    assert b.cu_seqlens.tolist() == [0, 8, 16] and b.max_seqlen == 8


def test_float_boundaries_are_refused_in_full() -> None:
    assert refusal(rows(torch.tensor([[0.0, 3.0, 8.0]])), TypeError) == (
        "cu_seqlens must hold integers, got dtype float32"
    )


@pytest.mark.parametrize(
    ("cu", "message"),
    [
        ([[0, 3, 8], [0, -1, -1]],
         "cu_seqlens row 1 never reaches the sequence length s=8 (last boundary 0; row [0, -1, -1]); "
         "boundaries must cover the whole row, padding included"),
        ([[0, 3, 8], [0, 8, 5]],
         "cu_seqlens row 1 has 5 after reaching s=8; after the last boundary only -1 or repeats of s "
         "may follow"),
        ([[0, 3, 8, -1], [0, 1, 1, 8]],
         "cu_seqlens row 1 is not strictly increasing: 1 follows 1 at index 2 (row [0, 1, 1, 8])"),
        ([[0, 3, 8], [0, 9, -1]],
         "cu_seqlens row 1 has boundary 9 past the sequence length s=8 (row [0, 9, -1])"),
        ([[0, 3, 8], [2, 8, -1]], "cu_seqlens row 1 must start with 0 and hold >= 2 boundaries, got [2, 8, -1]"),
    ],
    ids=["never-reaches-s", "after-s", "not-increasing", "past-s", "not-from-0"],
)  # fmt: skip
def test_bad_rows_are_refused_in_full(cu: list[list[int]], message: str) -> None:
    assert refusal(rows(i32(cu), b=2)) == message


def test_padded_rows_real_lengths_of_one_and_repeats_of_the_last_real_boundary() -> None:
    # s=8, buffers [4, 4] per row; real lengths 1 and 4, then 4 and 2 (repeats of 6 follow).
    b = merge_rows(rows(i32([[0, 1, 5, -1], [0, 4, 6, 6]]), b=2,
                        cu_seqlens_padded=i32([[0, 4, 8], [0, 4, 8]])))  # fmt: skip
    assert b.cu_seqlens.tolist() == [0, 1, 5, 9, 11]
    assert b.cu_seqlens_padded.tolist() == [0, 4, 8, 12, 16] and b.max_seqlen == 4


@pytest.mark.parametrize(
    ("real", "message"),
    [
        ([[0, 3, 5], [1, 3, 5]], "cu_seqlens row 1 must start at 0 and rise strictly over the 3 "
         "boundaries of cu_seqlens_padded row 1, got [1, 3, 5]"),
        ([[0, 3, 5], [0, 3, 3]], "cu_seqlens row 1 must start at 0 and rise strictly over the 3 "
         "boundaries of cu_seqlens_padded row 1, got [0, 3, 3]"),
        ([[0, 3], [0, 3]], "cu_seqlens row 0 must start at 0 and rise strictly over the 3 "
         "boundaries of cu_seqlens_padded row 0, got [0, 3]"),
        ([[0, 3, 5, -1], [0, 3, 5, 4]], "cu_seqlens row 1 has 4 after its 3 boundaries (the count "
         "of cu_seqlens_padded row 1); only -1 or repeats of 5 may follow"),
    ],
    ids=["not-from-0", "not-rising", "too-few", "bad-tail"],
)  # fmt: skip
def test_bad_real_rows_next_to_padded_ones_are_refused_in_full(
    real: list[list[int]], message: str
) -> None:
    padded = i32([[0, 4, 8], [0, 4, 8]])
    assert refusal(rows(i32(real), b=2, cu_seqlens_padded=padded)) == message


def test_a_bad_padded_row_is_named_as_cu_seqlens_padded_with_its_row() -> None:
    padded = i32([[0, 4, 8], [0, 4, 7]])
    assert refusal(rows(i32([[0, 3, 5], [0, 3, 5]]), b=2, cu_seqlens_padded=padded)) == (
        "cu_seqlens_padded row 1 never reaches the sequence length s=8 (last boundary 7; row "
        "[0, 4, 7]); boundaries must cover the whole row, padding included"
    )


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    [
        ("labels", [[1] * S], TypeError, "batch['labels'] must be a torch.Tensor, got list"),
        ("tokens", torch.arange(S), ValueError, "batch['tokens'] has shape (8,); expected [b, s]"),
        ("tokens", torch.ones(1, S, dtype=torch.bool), TypeError,
         "batch['tokens'] has dtype torch.bool; expected integer token ids/positions"),
        ("position_ids", torch.zeros(1, S, dtype=torch.complex64), TypeError,
         "batch['position_ids'] has dtype torch.complex64; expected integer token ids/positions"),
        ("loss_mask", torch.zeros(1, S, dtype=torch.complex64), TypeError,
         "batch['loss_mask'] has dtype torch.complex64; expected a real or bool mask"),
    ],
    ids=["not-a-tensor", "1-d", "bool-tokens", "complex-positions", "complex-mask"],
)  # fmt: skip
def test_grid_refusals_in_full(name: str, value: Any, error: type, message: str) -> None:
    assert refusal(rows([0, 3, 8]) | {name: value}, error) == message
    assert grid_tensor(rows([0, 3, 8]), name).shape == (1, S)
