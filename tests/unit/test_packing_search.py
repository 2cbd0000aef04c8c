"""The "best" local search (megapack.packing.search, partial, subset_sum): exact subset sums against
brute force, the partial packing's moves keep every item and the seq_len, and the search never
returns more bins than it started with, reproducibly for a seed."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.packing import lower_bound, plan
from megapack.packing import search as search_module
from megapack.packing.bfd import best_fit_decreasing
from megapack.packing.partial import LINEAR, SQUARED, PartialPacking
from megapack.packing.search import improve
from megapack.packing.subset_sum import best_subset, split_in_two


def subset_sums(weights: list[int]) -> set[int]:
    return {sum(c) for r in range(len(weights) + 1) for c in itertools.combinations(weights, r)}


@settings(max_examples=100, deadline=None)
@given(weights=st.lists(st.integers(1, 30), max_size=10), seq_len=st.integers(0, 60))
def test_best_subset_is_exact(weights: list[int], seq_len: int) -> None:
    best, chosen = best_subset(weights, seq_len)
    assert best == max(s for s in subset_sums(weights) if s <= seq_len)
    assert sum(weights[j] for j in chosen) == best and len(set(chosen)) == len(chosen)


@settings(max_examples=100, deadline=None)
@given(weights=st.lists(st.integers(1, 20), max_size=9), seq_len=st.integers(1, 30))
def test_split_in_two_is_exact(weights: list[int], seq_len: int) -> None:
    first = split_in_two(weights, seq_len)
    total = sum(weights)
    possible = any(total - seq_len <= s <= seq_len for s in subset_sums(weights))
    assert (first is not None) == possible
    if first is not None:
        one = sum(weights[j] for j in first)
        assert one <= seq_len and total - one <= seq_len


def test_descent_worked_example() -> None:
    # The PartialPacking docstring: sizes [6, 3, 3, 4, 4], bins [[0, 1], [3]], pool [2, 4].
    sizes = [6, 3, 3, 4, 4]
    state = PartialPacking(
        sizes,
        sizes,
        10,
        [[0, 1], [3]],
        [2, 4],
        objective=LINEAR,
        rng=random.Random(0),
    )
    assert state.fits(0) is False and state.fits(1) is True  # pool 3 + 4 = 7 fits one new bin
    assert state.descent(target=0) is True  # bin 0 swaps its 3 for a 4, bin 1 takes 3 + 3
    assert state.pool == [] and state.load.tolist() == [10, 10]
    assert sorted(state.bins()[0]) == [0, 4] and sorted(state.bins()[1]) == [1, 2, 3]


@pytest.mark.parametrize("objective", [LINEAR, SQUARED])
def test_tabu_steps_keep_items_and_capacity(objective: str) -> None:
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 60, 300).tolist()
    where = best_fit_decreasing(np.array(sizes), 100)
    bins = [np.flatnonzero(where == b).tolist() for b in range(int(where.max()) + 1)]
    pool = bins.pop() + bins.pop()
    classes = np.unique(sizes, return_inverse=True)[1].tolist()
    state = PartialPacking(
        sizes, classes, 100, bins, pool, objective=objective, rng=random.Random(2)
    )
    for step in range(300):
        if step % 50 == 0:
            state.descent(target=1)
        if not state.tabu_step():
            break
        assert all(sum(sizes[i] for i in b) <= 100 for b in state.bins())
        held = sorted([i for b in state.bins() for i in b] + state.pool)
        assert held == list(range(len(sizes)))
    assert state.steps > 0


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 30), min_size=1, max_size=60),
    seq_len=st.integers(30, 40),
    seed=st.integers(0, 5),
)
def test_improve_never_adds_bins_and_is_reproducible(
    sizes: list[int], seq_len: int, seed: int
) -> None:
    arr = np.array(sizes, dtype=np.int64)
    start = best_fit_decreasing(arr, seq_len)
    kwargs: dict[str, Any] = {
        "seed": seed,
        "max_steps": 300,
        "lower_bound": lower_bound(arr, seq_len),
    }
    out = improve(arr, start, seq_len, **kwargs)
    assert np.array_equal(out, improve(arr, start, seq_len, **kwargs))
    num = int(out.max()) + 1
    assert sorted(set(out.tolist())) == list(range(num)) and num <= int(start.max()) + 1
    assert np.bincount(out, weights=arr).max() <= seq_len


def test_working_set_cap_keeps_other_bins(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 500, 2000)
    start = best_fit_decreasing(sizes, 1000)
    monkeypatch.setattr(search_module, "MAX_WORKING_BINS", 8)
    out = improve(sizes, start, 1000, seed=0, max_steps=200)
    assert int(out.max()) <= int(start.max())
    assert np.bincount(out, weights=sizes).max() <= 1000


def test_zero_search_steps_is_bfd() -> None:
    lengths = [3, 3, 2, 2, 2, 2, 3, 3]
    assert plan(lengths, 10, algorithm="best", search_steps=0).bins == plan(lengths, 10).bins
    assert plan(lengths, 10, algorithm="best", search_steps=0).num_bins == 3
    assert plan(lengths, 10, algorithm="best", search_steps=1_000).num_bins == 2


def test_seed_changes_the_search_not_the_guarantee() -> None:
    rng = np.random.default_rng(4)
    lengths = np.clip(rng.lognormal(5.5, 0.8, 800), 1, 1000).astype(np.int64)
    bfd = plan(lengths, 1000)
    plans = [plan(lengths, 1000, algorithm="best", seed=s, search_steps=400) for s in (0, 1)]
    assert all(p.num_bins <= bfd.num_bins for p in plans)
    assert plans[0] == plan(lengths, 1000, algorithm="best", seed=0, search_steps=400)


class Recorder:
    """Wraps PartialPacking to keep every attempt's state and record its objective, bins, pool."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.attempts: list[tuple[str, list[list[int]], list[int]]] = []
        self.states: list[PartialPacking] = []
        real = search_module.PartialPacking

        def make(weights: Any, classes: Any, seq_len: int, bins: Any, pool: Any, **kw: Any) -> Any:
            self.attempts.append((kw["objective"], [list(b) for b in bins], list(pool)))
            self.states.append(real(weights, classes, seq_len, bins, pool, **kw))
            return self.states[-1]

        monkeypatch.setattr(search_module, "PartialPacking", make)


@pytest.mark.parametrize("max_steps", [7, 50, 101])
def test_search_spends_exactly_its_step_budget(
    monkeypatch: pytest.MonkeyPatch, max_steps: int
) -> None:
    """Seven 4s at seq_len 10: the bound says 3 bins, but two 4s per bin is the most (4 bins),
    so the search never reaches its goal and spends its whole budget: the attempts' tabu steps
    (at least one each) add up to exactly ``max_steps``. Attempts alternate the squared (first)
    and the linear objective, and each deletes the 3 lightest of the 4 bins into the pool."""
    sizes = np.array([4] * 7, dtype=np.int64)
    start = best_fit_decreasing(sizes, 10)
    record = Recorder(monkeypatch)
    out = improve(sizes, start, 10, seed=1, max_steps=max_steps, lower_bound=3)
    assert np.array_equal(out, start)  # no packing with fewer bins exists
    assert sum(max(state.steps, 1) for state in record.states) == max_steps
    n = len(record.attempts)
    assert [a[0] for a in record.attempts] == [SQUARED, LINEAR] * (n // 2) + [SQUARED] * (n % 2)
    assert all(len(bins) == 1 for _, bins, _ in record.attempts)


def test_search_tries_only_bins_without_items_over_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes 6 3 | 5 4 | 4 4 | 4 at seq_len 10 (30 tokens, but no three bins hold them): the bin
    with the 6 (over half a bin) never goes to the pool; the one with the 5 (exactly half) does,
    so the first attempt deletes the other three bins."""
    sizes = np.array([6, 3, 5, 4, 4, 4, 4], dtype=np.int64)
    start = np.array([0, 0, 1, 1, 2, 2, 3])
    record = Recorder(monkeypatch)
    improve(sizes, start, 10, seed=0, max_steps=3, lower_bound=3)
    _, bins, pool = record.attempts[0]
    assert bins == [[0, 1]] and sorted(pool) == [2, 3, 4, 5, 6]


def test_search_works_on_the_bins_with_most_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """With more bins with room than MAX_WORKING_BINS, the ones with the most free space (ties in
    bin order) are searched; full bins never are; an input already at its bound comes back."""
    monkeypatch.setattr(search_module, "MAX_WORKING_BINS", 4)
    sizes = np.array([10, 9, 9, 3, 3, 8, 6, 5, 7, 3, 3], dtype=np.int64)
    start = np.array([0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9])  # free 0 1 1 4 2 4 5 3 7 7
    record = Recorder(monkeypatch)
    improve(sizes, start, 10, seed=0, max_steps=1, lower_bound=1)
    weights = record.states[0].w
    assert sorted(weights) == [3, 3, 3, 3, 5]  # bins 8, 9, 6 and, of the two with 4 free, bin 3
    at_bound = np.array([0, 0, 1])
    assert improve(np.array([5, 5, 4]), at_bound, 10, max_steps=100, lower_bound=2) is at_bound
    one = np.array([0])
    assert improve(np.array([5]), one, 10, max_steps=100) is one  # one bin: nothing to remove
