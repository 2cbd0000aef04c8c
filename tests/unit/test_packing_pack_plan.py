"""megapack.packing.pack_plan.PackPlan: construction checks, equality, reordering, the compact
arrays, validation messages and the report, on plans small enough to check by hand."""

from __future__ import annotations

import numpy as np
import pytest

from megapack.packing import PackPlan, plan

# lengths [3, 2, 4] at seq_len 5, best fit decreasing: bins [[2]], [[0], [1]]
BINS = [[(2, 0, 4)], [(0, 0, 3), (1, 0, 2)]]


def make(**kw: object) -> PackPlan:
    args: dict = {"seq_len": 5, "algorithm": "bfd", "lower_bound": 2, "num_docs": 3}
    args |= {"bin_offsets": [0, 1, 3], "slices": [[2, 0, 4], [0, 0, 3], [1, 0, 2]]} | kw
    return PackPlan(**args)


def test_pack_plan_stores_read_only_int64_arrays() -> None:
    p = make(bin_offsets=np.array([0.0, 1, 3]), slices=np.array([2, 0, 4, 0, 0, 3, 1, 0, 2]))
    assert p.bins == BINS and p.slices.shape == (3, 3)
    for array in (p.bin_offsets, p.slices):
        assert array.dtype == np.int64 and not array.flags.writeable


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([1, 3], r"^PackPlan\.bin_offsets must be 1-D and start at 0, got \[1 3\]$"),
        ([], r"^PackPlan\.bin_offsets must be 1-D and start at 0, got \[\]$"),
        ([[0, 3]], r"^PackPlan\.bin_offsets must be 1-D and start at 0, got \[\[0 3\]\]$"),
        ([2, 3, 4, 5, 6, 7, 8], r"^PackPlan\.bin_offsets must be 1-D .*got \[2 3 4 5 6\]$"),
        ([0, 1, 2], r"^PackPlan\.bin_offsets ends at 2 but there are 3 slices$"),
    ],
)
def test_pack_plan_refuses_bad_offsets(offsets: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(bin_offsets=offsets)


def test_pack_plan_equality_compares_every_field_and_array() -> None:
    p = make()
    assert p == make() and p != "not a plan"
    assert p.__eq__(3) is NotImplemented
    assert p != make(algorithm="ffd")
    assert p != make(num_dropped_docs=1)
    assert p != make(slices=[[2, 0, 4], [1, 0, 2], [0, 0, 3]])  # same offsets, other slices
    assert p != make(bin_offsets=[0, 2, 3])  # same slices, other bins


def test_pack_plan_bins_by_index() -> None:
    p = make()
    assert p.bin(0).tolist() == [[2, 0, 4]] and p.bin(-2).tolist() == [[2, 0, 4]]
    assert p.bin(-1).tolist() == p.bin(1).tolist() == [[0, 0, 3], [1, 0, 2]]
    for b in (2, -3):
        with pytest.raises(IndexError, match=f"^bin {b} out of range for a plan with 2 bins$"):
            p.bin(b)


def test_pack_plan_from_bins_defaults() -> None:
    p = PackPlan.from_bins([[(4, 0, 3)], [(1, 0, 5), (1, 5, 6)]], 6)
    assert (p.algorithm, p.num_docs, p.lower_bound) == ("custom", 5, 2)  # 1 + largest doc index
    assert p.bin_offsets.tolist() == [0, 1, 3]
    assert PackPlan.from_bins([[(4, 0, 3)]], 6, num_docs=9, algorithm="mine").num_docs == 9
    empty = PackPlan.from_bins([], 6)
    assert (empty.num_bins, empty.num_docs, empty.lower_bound) == (0, 0, 0)


def test_pack_plan_reordered_keeps_everything_but_the_order() -> None:
    p = plan([3, 2, 4, 12, 7], 5, long_docs="truncate")
    again = p.reordered(np.arange(p.num_bins))
    assert again == p and again is not p
    flipped = p.reordered(list(range(p.num_bins))[::-1])
    assert flipped.bins == p.bins[::-1]
    assert flipped.reordered(list(range(p.num_bins))[::-1]) == p
    for name in ("truncated_tokens", "num_truncated_docs", "lower_bound", "algorithm"):
        assert getattr(flipped, name) == getattr(p, name)
    split = plan([12, 3], 5)
    assert split.num_bins == 3 and split.reordered([2, 1, 0]).reordered([2, 1, 0]) == split
    assert (split.num_split_docs, split.split_tokens) == (1, 12)
    dropped = plan([12, 3], 5, long_docs="drop")
    assert dropped.reordered([0]) == dropped
    bad = [*range(9), 9, 9]
    with pytest.raises(
        ValueError, match=r"^order must be a permutation of range\(2\), got \[1, 1\]\.\.\.$"
    ):
        make().reordered([1, 1])
    with pytest.raises(ValueError, match=r"got \[0, 1, 2, 3, 4, 5, 6, 7\]\.\.\.$"):
        make().reordered(bad)


def test_pack_plan_to_arrays() -> None:
    arrays = make().to_arrays()
    assert {k: v.tolist() for k, v in arrays.items()} == {
        "bin_offsets": [0, 1, 3], "doc_index": [2, 0, 1], "start": [0, 0, 0], "stop": [4, 3, 2],
    }  # fmt: skip
    split = plan([12], 5).to_arrays()
    assert (split["start"].tolist(), split["stop"].tolist()) == ([0, 5, 10], [5, 10, 12])


@pytest.mark.parametrize(
    ("bins", "message"),
    [
        ([[(0, 0, 3)], []], r"^bin 1 of the plan is empty$"),
        ([[(0, 0, 3)], [], []], r"^bin 1 of the plan is empty$"),
        ([[(0, 2, 2)]], r"^piece 0 \[0, 2, 2\] is empty or negative$"),
        ([[(0, 0, 3), (1, 3, 1)]], r"^piece 1 \[1, 3, 1\] is empty or negative$"),
        ([[(0, -1, 2)]], r"^piece 0 \[0, -1, 2\] is empty or negative$"),
        ([[(0, 0, 4), (1, 0, 3)]], r"^bin 0 holds 7 tokens > seq_len=5$"),
    ],
)
def test_pack_plan_validate_names_the_problem(bins: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PackPlan.from_bins(bins, 5).validate()


def test_pack_plan_report_worked_examples() -> None:
    assert plan([3, 2, 4], 5).report().splitlines() == [
        "PackPlan (bfd, seq_len 5)",
        "  documents    3 -> 3 pieces in 2 bins",
        "  tokens       9 packed in 10 slots: efficiency 90.000%",
        "  lower bound  2 bins: gap 0 bins (0.00%)",
        "  long docs    0 split (0 tokens, all packed), 0 truncated (0 tokens lost),"
        " 0 dropped (0 tokens lost)",
        "  bin fill     min 4, median 4, max 5",
    ]
    # two bins where one would do: gap 1 of 2 bins
    loose = PackPlan.from_bins([[(0, 0, 1000)], [(1, 0, 1000)]], 2048)
    assert loose.report().splitlines()[2:4] == [
        "  tokens       2,000 packed in 4,096 slots: efficiency 48.828%",
        "  lower bound  1 bins: gap 1 bins (50.00%)",
    ]
    assert plan([], 8).report().splitlines()[1:] == [
        "  documents    0 -> 0 pieces in 0 bins",
        "  tokens       0 packed in 0 slots: efficiency 0.000%",
        "  lower bound  0 bins: gap 0 bins (0.00%)",
        "  long docs    0 split (0 tokens, all packed), 0 truncated (0 tokens lost),"
        " 0 dropped (0 tokens lost)",
        "  bin fill     no bins",
    ]
    lossy = plan([12, 3, 9], 5, long_docs="truncate").report().splitlines()[4]
    assert lossy == (
        "  long docs    0 split (0 tokens, all packed), 2 truncated (11 tokens lost),"
        " 0 dropped (0 tokens lost)"
    )
