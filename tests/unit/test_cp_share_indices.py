"""megapack.core.cp_share: zigzag CP indices against a brute-force reference, TE's kernel, and bad spans."""

from __future__ import annotations

import importlib.util
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.core.cp_share import CP_LAYOUTS, check_cp_spans, cp_indices


def reference(cu: list[int], cp: int, rank: int, layout: str) -> list[int]:
    """Chunk every span by hand: 2*cp equal pieces, keep pieces rank and 2*cp-1-rank."""
    spans = [(cu[0], cu[-1])] if layout == "row" else list(itertools.pairwise(cu))
    kept: list[int] = []
    for a, b in spans:
        pieces = np.array_split(np.arange(a, b), 2 * cp)
        kept += pieces[rank].tolist() + pieces[2 * cp - 1 - rank].tolist()
    return kept


def test_worked_example_from_the_docstring() -> None:
    assert cp_indices([0, 8, 16], 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert cp_indices([0, 8, 16], 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    assert cp_indices([0, 8, 16], 2, 0, layout="row").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_indices([0, 8, 16], 2, 1, layout="row").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


@settings(max_examples=200, deadline=None)
@given(
    cp=st.sampled_from([1, 2, 3, 4, 8]),
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=12),
    layout=st.sampled_from(CP_LAYOUTS),
    data=st.data(),
)
def test_matches_brute_force_and_partitions_the_row(
    cp: int, chunks: list[int], layout: str, data: st.DataObject
) -> None:
    cu = np.concatenate([[0], np.cumsum(np.array(chunks) * 2 * cp)]).tolist()
    rank = data.draw(st.integers(0, cp - 1))
    got = cp_indices(torch.tensor(cu, dtype=torch.int32), cp, rank, layout=layout)  # type: ignore[arg-type]
    assert got.dtype == torch.int64
    assert got.tolist() == reference(cu, cp, rank, layout)
    everyone = torch.cat([cp_indices(cu, cp, r, layout=layout) for r in range(cp)])  # type: ignore[arg-type]
    assert sorted(everyone.tolist()) == list(range(cu[-1])), "CP shares must partition the row"


def test_total_argument_gives_the_same_indices() -> None:
    cu = torch.tensor([0, 4, 12, 16], dtype=torch.int32)
    assert cp_indices(cu, 2, 1, total=16).tolist() == cp_indices(cu, 2, 1).tolist()


def test_row_layout_needs_only_the_row_to_divide() -> None:
    # spans of 3 and 5 are not multiples of 4, but the row of 8 is
    assert cp_indices([0, 3, 8], 2, 0, layout="row").tolist() == [0, 1, 6, 7]
    with pytest.raises(
        ValueError, match=r"document 0 spans 3 positions, not a multiple of 2\*cp=4"
    ):
        cp_indices([0, 3, 8], 2, 0)


@pytest.mark.parametrize(
    ("cu", "cp", "layout", "match"),
    [
        (
            [0, 8, 13],
            2,
            "document",
            r"document 1 spans 5 .* pad_to_multiple_of=4 \(--pad-multiple 4\)",
        ),
        ([0, 6], 2, "row", r"row holds 6 positions, not a multiple of 2\*cp=4"),
        ([0, 12, 14, 15], 3, "document", r"document 1 spans 2 .*\(2 documents in all\)"),
    ],
)
def test_bad_spans_name_the_document_and_the_fix(
    cu: list[int], cp: int, layout: str, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        check_cp_spans(cu, cp, layout=layout)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cp_size": 0, "cp_rank": 0}, "cp_size must be an int >= 1, got 0"),
        ({"cp_size": 2, "cp_rank": 2}, "cp_rank must be an int from 0 to 1, got 2"),
        ({"cp_size": 2, "cp_rank": 0, "layout": "zigzag"}, "cp layout must be one of"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cp_indices([0, 8], **kwargs)


def test_float_boundaries_are_a_type_error() -> None:
    with pytest.raises(TypeError, match="cu_seqlens must hold integers"):
        cp_indices(torch.tensor([0.0, 8.0]), 2, 0)


TE = importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()


@pytest.mark.skipif(not TE, reason="Transformer Engine with CUDA is not installed here")
def test_document_layout_equals_transformer_engine() -> None:
    import transformer_engine_torch as tex  # type: ignore[import-not-found]

    for cp in (1, 2, 4, 8):
        rng = np.random.default_rng(cp)
        cu = np.concatenate([[0], np.cumsum(rng.integers(1, 9, 10) * 2 * cp)])
        cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
        for rank in range(cp):
            want = tex.thd_get_partitioned_indices(cu_t, int(cu[-1]), cp, rank)
            got = cp_indices(cu_t, cp, rank, total=int(cu[-1]))
            assert got.tolist() == want.tolist(), (cp, rank)


def test_the_docstring_refusal_in_full_with_the_default_layout_and_name() -> None:
    with pytest.raises(ValueError) as info:
        check_cp_spans([0, 8, 13], 2)
    assert str(info.value) == (
        "cu_seqlens document 1 spans 5 positions, not a multiple of 2*cp=4 (cp_size=2, "
        "layout='document'): pack with pad_to_multiple_of=4 (--pad-multiple 4) so every document "
        "is padded, or use cp_layout='row'"
    )
    check_cp_spans([0, 8, 16], 2)  # the document layout by default: spans of 8 divide by 4


def test_the_row_refusal_in_full_names_the_rows_end() -> None:
    with pytest.raises(ValueError) as info:
        check_cp_spans([0, 3, 6], 2, layout="row")
    assert str(info.value) == (
        "the row holds 6 positions, not a multiple of 2*cp=4 (cp_size=2, layout='row'): pad rows "
        "to a multiple of 4 (seq_len or pad_to_multiple_of)"
    )


@pytest.mark.parametrize(("cu", "shape"), [([5], "(1,)"), ([[0, 4], [0, 4]], "(2, 2)"), (5, "()")])
def test_boundaries_that_are_not_1d_with_two_entries_are_named(cu: object, shape: str) -> None:
    with pytest.raises(ValueError) as info:
        cp_indices(cu, 2, 0)  # type: ignore[arg-type]
    assert str(info.value) == f"cu_seqlens must be 1-D with >= 2 entries, got shape {shape}"


@pytest.mark.parametrize(
    ("cp_size", "cp_rank", "error", "message"),
    [
        (True, 0, TypeError, "cp_size must be an int >= 1, got bool True"),
        (2.0, 0, TypeError, "cp_size must be an int >= 1, got float 2.0"),
        (-1, 0, ValueError, "cp_size must be an int >= 1, got -1"),
        (2, True, TypeError, "cp_rank must be an int from 0 to 1, got bool True"),
        (2, 1.0, TypeError, "cp_rank must be an int from 0 to 1, got float 1.0"),
        (2, -1, ValueError, "cp_rank must be an int from 0 to 1, got -1"),
    ],
)
def test_bools_and_floats_are_not_cp_sizes_or_ranks(
    cp_size: object, cp_rank: object, error: type, message: str
) -> None:
    with pytest.raises(error) as info:
        cp_indices([0, 8], cp_size, cp_rank)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_with_total_the_boundaries_are_never_read_on_the_host() -> None:
    # A meta tensor has no values: any host read of it (int(cu[-1]), a span check) raises, so this
    # is what a GPU cu_seqlens goes through with total= (no device sync).
    cu = torch.tensor([0, 8, 16], dtype=torch.int32, device="meta")
    got = cp_indices(cu, 2, 1, total=16)
    assert got.device.type == "meta" and got.shape == (8,) and got.dtype == torch.int64
    got = cp_indices(cu, 4, 3, layout="row", total=16)
    assert got.device.type == "meta" and got.shape == (4,)


@pytest.mark.parametrize("layout", CP_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int64])
def test_positions_are_int64_whatever_the_boundaries_dtype(layout: str, dtype: torch.dtype) -> None:
    cu = torch.tensor([0, 8, 24], dtype=dtype)
    for rank in range(2):
        index = cp_indices(cu, 2, rank, layout=layout)  # type: ignore[arg-type]
        assert index.dtype == torch.int64
        assert torch.equal(index, cp_indices(cu.to(torch.int64), 2, rank, layout=layout))  # type: ignore[arg-type]
