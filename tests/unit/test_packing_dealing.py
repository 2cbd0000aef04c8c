"""megapack.packing.dealing: partition against a per-item reference of its rule (LPT with
cardinalities, then the best single swap out of the costliest group while it lowers the maximum,
ties to the lower index), worked examples, and balance_order never worse than its input per batch."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.packing.balance import rank_costs
from megapack.packing.dealing import balance_order, partition, pipeline_order
from megapack.packing.options import LoadOptions


def lpt(costs: list[float], sizes: list[int]) -> list[int]:
    """Largest first (ties: lower index), each to the least loaded group with room (ties: lower)."""
    loads, room, group = [0.0] * len(sizes), list(sizes), [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        g = min((g for g in range(len(sizes)) if room[g] > 0), key=lambda g: (loads[g], g))
        group[i], loads[g], room[g] = g, loads[g] + costs[i], room[g] - 1
    return group


def refine(costs: list[float], group: list[int], k: int) -> list[int]:
    """While one swap of an item of the costliest group (the first of equals) with a cheaper item
    of another group lowers that maximum, make the swap giving the lowest new maximum; ties go to
    the other group of lower load (then lower index), then to the lower item positions."""
    group, n = list(group), len(costs)
    while True:
        loads = [sum(costs[i] for i in range(n) if group[i] == g) for g in range(k)]
        top = loads.index(max(loads))
        mine = [i for i in range(n) if group[i] == top]
        best = None
        for other in sorted(range(k), key=lambda g: (loads[g], g)):
            theirs = [j for j in range(n) if group[j] == other]
            if other == top or loads[top] - loads[other] <= 1e-12 * loads[top]:
                continue
            for i in mine:
                for j in theirs:
                    moved = costs[i] - costs[j]
                    value = max(loads[top] - moved, loads[other] + moved)
                    lower = moved > 0 and value < loads[top] * (1 - 1e-12)
                    if lower and (best is None or value < best[0]):
                        best = (value, i, j)
        if best is None:
            return group
        _, i, j = best
        group[i], group[j] = group[j], group[i]


def heaviest(costs: list[float], group: list[int], k: int) -> float:
    """The largest group load."""
    return max(sum(c for c, g in zip(costs, group, strict=True) if g == j) for j in range(k))


def test_dealing_partition_worked_examples() -> None:
    # LPT: 5 -> g0, 4 -> g1, 3 -> g1 (4 < 5), 3 -> g0, 3 -> g1 (now full), 2 -> g0: 10 and 10
    assert partition(np.array([5.0, 4, 3, 3, 3, 2]), np.array([3, 3])).tolist() == [
        0, 1, 1, 0, 1, 0,
    ]  # fmt: skip
    # LPT leaves 17 | 15 (8 5 4 | 7 6 2); swapping 8 and 7 gives 16 | 16
    assert partition(np.array([8.0, 7, 6, 5, 4, 2]), np.array([3, 3])).tolist() == [
        1, 0, 1, 0, 0, 1,
    ]  # fmt: skip
    assert partition(np.array([1.0, 1, 1, 1]), np.array([2, 2])).tolist() == [0, 1, 0, 1]
    # from a start: 8 8 | 1 1 costs 16; every swap gives 9 | 9, the first one (items 0 and 1) wins
    start = np.array([0, 1, 0, 1])
    assert partition(np.array([8.0, 1, 8, 1]), np.array([2, 2]), start=start).tolist() == [
        1, 0, 0, 1,
    ]  # fmt: skip
    assert start.tolist() == [0, 1, 0, 1]  # the caller's array is not modified
    empty = partition(np.array([]), np.array([0, 0]))
    assert empty.dtype == np.int64 and empty.shape == (0,)


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.integers(0, 30) | st.sampled_from([1, 2, 4]), min_size=1, max_size=16),
    groups=st.integers(1, 6),
    data=st.data(),
)
def test_dealing_partition_matches_the_reference(
    costs: list[int], groups: int, data: st.DataObject
) -> None:
    n = len(costs)
    cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=groups - 1, max_size=groups - 1)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    values = [float(c) for c in costs]
    got = partition(np.array(values), np.array(sizes))
    assert got.dtype == np.int64
    assert np.bincount(got, minlength=groups).tolist() == sizes
    assert got.tolist() == refine(values, lpt(values, sizes), groups)
    start = data.draw(st.permutations([g for g in range(groups) for _ in range(sizes[g])]))
    got = partition(np.array(values), np.array(sizes), start=np.array(start))
    assert got.tolist() == refine(values, start, groups)


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.integers(1, 100), min_size=1, max_size=40),
    fillers=st.integers(0, 5),
    dp=st.integers(1, 4),
    m=st.integers(1, 3),
    r=st.integers(1, 2),
    seed=st.integers(0, 100),
)
def test_dealing_balance_order_never_worse_than_its_input_in_any_batch(
    costs: list[int], fillers: int, dp: int, m: int, r: int, seed: int
) -> None:
    """Each global batch keeps its rows (filler rows, -1, included) and its costliest rank costs
    no more than in the order given: one of the two candidates starts from that order."""
    values = np.array(costs, dtype=np.float64)
    order = np.concatenate(
        [np.random.default_rng(seed).permutation(len(costs)), np.full(fillers, -1)]
    )
    layout = {"dp_size": dp, "micro_batches": m, "rows_per_micro_batch": r}
    out = balance_order(order, values, LoadOptions(**layout))
    per_batch = dp * m * r
    for lo in range(0, len(order), per_batch):
        assert sorted(out[lo : lo + per_batch]) == sorted(order[lo : lo + per_batch])
    before = rank_costs(order, values, LoadOptions(**layout)).max(axis=1)
    after = rank_costs(out, values, LoadOptions(**layout)).max(axis=1)
    assert (after <= before).all()
    # the better of the two candidates: partition's rule from scratch, or from the given deal
    for b, lo in enumerate(range(0, len(order), per_batch)):
        batch = [values[i] if i >= 0 else 0.0 for i in order[lo : lo + per_batch].tolist()]
        rank = [(p // r) % dp for p in range(len(batch))]
        sizes = [rank.count(k) for k in range(dp)]
        candidates = [refine(batch, lpt(batch, sizes), dp), refine(batch, rank, dp)]
        best = min(heaviest(batch, x, dp) for x in candidates)
        assert after[b] == best


def test_dealing_balance_order_takes_the_better_candidate() -> None:
    """One global batch (3 ranks, one row each per micro-batch) where refining the given deal
    (3 8 8 | 1 2 9 | 17 10 9) beats LPT then refining: 25 against 26."""
    costs = [3.0, 1, 17, 8, 2, 10, 8, 9, 9]
    rank = [i % 3 for i in range(9)]
    from_lpt, from_deal = refine(costs, lpt(costs, [3, 3, 3]), 3), refine(costs, rank, 3)
    assert (heaviest(costs, from_lpt, 3), heaviest(costs, from_deal, 3)) == (26, 25)
    out = balance_order(np.arange(9), np.array(costs), LoadOptions(dp_size=3, micro_batches=3))
    assert rank_costs(out, np.array(costs), LoadOptions(dp_size=3, micro_batches=3)).max() == 25


def test_dealing_pipeline_order_ties_keep_index_order() -> None:
    """Ascending with ties by index, then the cheapest, the most expensive down to the third
    cheapest, and the second cheapest last."""
    costs = np.array([2.0, 2, 1, 1, 1, 1, 1, 1, 3, 2])  # ascending: 2 3 4 5 6 7 0 1 9 8
    assert pipeline_order(costs).tolist() == [2, 8, 9, 1, 0, 7, 6, 5, 4, 3]
    assert pipeline_order(np.array([[3.0, 1], [1, 3]])).tolist() == [[1, 0], [0, 1]]
