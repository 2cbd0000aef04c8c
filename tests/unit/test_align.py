"""align_by_kind: every micro-step holds one kind on all ranks; nothing lost; single kinds keep order."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.packing import align_by_kind


def kind_of(mb: tuple[str, int]) -> str:
    return mb[0]


def pad(example: tuple[str, int]) -> tuple[str, int]:
    return (example[0], -1)  # -1 marks a zero-loss padding micro-batch of the example's kind


def test_worked_example_from_the_docstring() -> None:
    mbs = [("t", 0), ("t", 1), ("i", 0), ("t", 2)]
    ranks = align_by_kind(mbs, 2, kind=kind_of, make_padding=pad)
    assert ranks == [[("t", 0), ("i", 0), ("t", 2)], [("t", 1), ("i", -1), ("t", -1)]]


@settings(max_examples=300, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["text", "image", "audio"]), max_size=40),
    num_ranks=st.integers(min_value=1, max_value=8),
)
def test_kinds_aligned_on_every_mix(kinds: list[str], num_ranks: int) -> None:
    mbs = [(k, i) for i, k in enumerate(kinds)]
    ranks = align_by_kind(mbs, num_ranks, kind=kind_of, make_padding=pad)
    assert len(ranks) == num_ranks
    steps = len(ranks[0])
    assert all(len(r) == steps for r in ranks)
    for step in range(steps):
        assert len({r[step][0] for r in ranks}) == 1, f"step {step} mixes kinds"
    dealt = [mb for r in ranks for mb in r]
    assert Counter(mb for mb in dealt if mb[1] >= 0) == Counter(mbs)  # each original exactly once
    padding = Counter(mb[0] for mb in dealt if mb[1] < 0)
    for k, n in Counter(kinds).items():
        assert padding[k] == -n % num_ranks  # the fewest padding micro-batches that can work


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=0, max_value=30), num_ranks=st.integers(min_value=1, max_value=8))
def test_single_kind_keeps_order(n: int, num_ranks: int) -> None:
    mbs = [("text", i) for i in range(n)]
    ranks = align_by_kind(mbs, num_ranks, kind=kind_of, make_padding=pad)
    in_order = [r[step] for step in range(len(ranks[0])) for r in ranks]
    assert [mb for mb in in_order if mb[1] >= 0] == mbs


def test_padding_keeps_the_example_inputs() -> None:
    mbs = [{"kind": "image", "pixel_values": [1, 2], "loss_mask": [1]}]
    ranks = align_by_kind(
        mbs,
        2,
        kind=lambda mb: mb["kind"],
        make_padding=lambda ex: {**ex, "loss_mask": [0] * len(ex["loss_mask"])},
    )
    assert ranks[1][0] == {"kind": "image", "pixel_values": [1, 2], "loss_mask": [0]}


@pytest.mark.parametrize(
    ("bad", "error", "got"),
    [
        (0, ValueError, "0"),
        (-1, ValueError, "-1"),
        (1.5, TypeError, "float 1.5"),
        (True, TypeError, "bool True"),
    ],
)
def test_num_ranks_must_be_positive_int(bad: object, error: type, got: str) -> None:
    with pytest.raises(error, match=f"num_ranks must be an int >= 1, got {got}$"):
        align_by_kind([], bad, kind=kind_of, make_padding=pad)  # type: ignore[arg-type]
