"""Lower bounds L1 and L2 (megapack.packing.bounds): hand examples, a loop-by-loop reference of the
vectorized L2, and validity against the exact optimum of tiny instances found by brute force."""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.bench.datasets import bundled_lengths_path
from megapack.packing import lower_bound
from megapack.packing.bounds import l1_bound, l2_bound

OPENCHAT = bundled_lengths_path()  # package data: always there, never skipped


@pytest.mark.parametrize(
    ("sizes", "seq_len", "l1", "l2"),
    [
        ([7, 7, 7, 4, 4, 4], 10, 4, 5),  # the module docstring's example: the 4s fit beside no 7
        ([6, 6, 6, 6, 5, 5], 10, 4, 5),  # L(5): four 6s alone, the two 5s need a fifth bin
        ([6, 6, 6, 4, 4, 4], 10, 3, 3),  # perfect pairs: both bounds are tight
        ([10, 10, 1], 10, 3, 3),
        ([3, 2, 4], 5, 2, 2),
        ([1], 1, 1, 1),
        ([], 7, 0, 0),
    ],
)
def test_hand_examples(sizes: list[int], seq_len: int, l1: int, l2: int) -> None:
    arr = np.array(sizes, dtype=np.int64)
    assert (l1_bound(arr, seq_len), l2_bound(arr, seq_len)) == (l1, l2)
    assert lower_bound(arr, seq_len) == max(l1, l2)


def l2_reference(sizes: list[int], seq_len: int) -> int:
    """Martello-Toth L2 straight from its definition, trying every K in [0, C/2]."""
    best = 0
    for k in range(seq_len // 2 + 1):
        j1 = [w for w in sizes if w > seq_len - k]
        j2 = [w for w in sizes if seq_len - k >= w and 2 * w > seq_len]
        j3 = [w for w in sizes if k <= w and 2 * w <= seq_len]
        spill = sum(j3) - (len(j2) * seq_len - sum(j2))
        best = max(best, len(j1) + len(j2) + max(0, -(-spill // seq_len)))
    return best


def optimum(sizes: list[int], seq_len: int) -> int:
    """Fewest bins, by exhaustive search over assignments (tiny inputs only)."""
    items = tuple(sorted(sizes, reverse=True))

    @cache
    def solve(i: int, loads: tuple[int, ...]) -> int:
        if i == len(items):
            return len(loads)
        options = {
            tuple(sorted((*loads[:b], load + items[i], *loads[b + 1 :])))
            for b, load in enumerate(loads)
            if load + items[i] <= seq_len
        }
        options.add(tuple(sorted((*loads, items[i]))))
        return min(solve(i + 1, o) for o in options)

    return solve(0, ())


@settings(max_examples=150, deadline=None)
@given(seq_len=st.integers(1, 40), data=st.data())
def test_vectorized_l2_equals_definition(seq_len: int, data: st.DataObject) -> None:
    sizes = data.draw(st.lists(st.integers(1, seq_len), max_size=40))
    assert l2_bound(np.array(sizes, dtype=np.int64), seq_len) == l2_reference(sizes, seq_len)


@settings(max_examples=80, deadline=None)
@given(seq_len=st.integers(1, 12), data=st.data())
def test_bounds_never_exceed_the_optimum(seq_len: int, data: st.DataObject) -> None:
    sizes = data.draw(st.lists(st.integers(1, seq_len), max_size=7))
    arr = np.array(sizes, dtype=np.int64)
    best = optimum(sizes, seq_len)
    assert l1_bound(arr, seq_len) <= lower_bound(arr, seq_len) <= best


def test_openchat_bounds_match_the_data_readme() -> None:
    lengths = np.array(json.loads(OPENCHAT.read_text()), dtype=np.int64)
    assert (l1_bound(lengths, 2048), l2_bound(lengths, 2048)) == (4650, 4663)
