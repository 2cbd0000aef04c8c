"""megapack.packing.partial: each move of the partial packing against brute force over every
allowed swap or subset, on small random states (the search's heuristics keep every item and the
seq_len; these tests check that each step is the best one its rule allows)."""

from __future__ import annotations

import itertools
import random

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megapack.packing.partial import LINEAR, PAIR_LIMIT, SQUARED, TENURE, PartialPacking


def values(weights: list[int], objective: str) -> list[int]:
    """The pool objective's value of each item (module docstring): ``M w - 1`` with ``M`` = items
    + 1, or ``w ** 2``."""
    m = len(weights) + 1
    return [m * w - 1 if objective == LINEAR else w * w for w in weights]


@st.composite
def states(draw: st.DrawFn) -> tuple[list[int], int, list[list[int]], list[int], str, int]:
    seq_len = draw(st.integers(8, 20))
    weights = draw(st.lists(st.integers(1, seq_len), min_size=2, max_size=16))
    where = draw(st.lists(st.integers(-1, 4), min_size=len(weights), max_size=len(weights)))
    bins: list[list[int]] = [[] for _ in range(5)]
    pool = []
    for i, b in enumerate(where):  # an item that does not fit its bin goes to the pool
        if b >= 0 and sum(weights[j] for j in bins[b]) + weights[i] <= seq_len:
            bins[b].append(i)
        else:
            pool.append(i)
    objective = draw(st.sampled_from([LINEAR, SQUARED]))
    return weights, seq_len, bins, pool, objective, draw(st.integers(0, 1000))


def make(state: tuple) -> PartialPacking:
    weights, seq_len, bins, pool, objective, seed = state
    return PartialPacking(weights, weights, seq_len, [list(b) for b in bins], list(pool),
                          objective=objective, rng=random.Random(seed))  # fmt: skip


def best_swap_change(p: PartialPacking, weights: list[int], value: list[int]) -> int | None:
    """The smallest change of the pool's objective over every allowed swap: up to two movable
    items (at most one if the bin has more than `PAIR_LIMIT`) out of a bin, one or two pool items
    in, fitting, no weight class that is still tabu leaving, and not a swap of equal value."""
    step = p.steps + 1
    best = None
    outs_of = []
    for k, items in enumerate(p.items):
        sizes = (0, 1, 2) if len(items) <= PAIR_LIMIT else (0, 1)
        outs_of += [(k, out) for r in sizes for out in itertools.combinations(items, r)]
    ins = [c for r in (1, 2) for c in itertools.combinations(p.pool, r)]
    for k, out in outs_of:
        if any(p.tabu_until[weights[i]] >= step for i in out):
            continue
        room = p.c - int(p.load[k]) + sum(weights[i] for i in out)
        for put in ins:
            change = sum(value[i] for i in out) - sum(value[i] for i in put)
            if sum(weights[i] for i in put) <= room and change != 0:
                best = change if best is None else min(best, change)
    return best


@settings(max_examples=150, deadline=None)
@given(state=states(), steps=st.integers(1, 6))
# cases found by search where a changed objective or a missing pair makes another swap the best
@example(
    state=(
        [1, 1, 1, 1, 1, 1, 5, 5, 10],
        10,
        [[0, 1, 2, 3, 4, 5], [], [], [], []],
        [6, 7, 8],
        LINEAR,
        0,
    ),
    steps=1,
)
@example(
    state=(
        [5, 1, 1, 1, 5, 1, 1, 1, 8, 1],
        8,
        [[1, 5, 6], [7, 9], [4], [2, 3], [0]],
        [8],
        LINEAR,
        0,
    ),
    steps=1,
)
@example(state=([1, 2], 8, [[1], [], [], [], []], [0], LINEAR, 0), steps=1)
@example(state=([1, 1], 8, [[0], [], [], [], []], [1], LINEAR, 0), steps=1)
def test_partial_tabu_step_makes_the_best_allowed_swap(state: tuple, steps: int) -> None:
    weights, seq_len, _, _, objective, _ = state
    p = make(state)
    value = values(weights, objective)
    anchors = [list(a) for a in p.anchors]
    for _ in range(steps):
        before, pool = sum(value[i] for i in p.pool), set(p.pool)
        want = best_swap_change(p, weights, value)
        step = p.steps + 1
        moved = p.tabu_step()
        assert moved == (want is not None)
        if not moved:
            break
        assert sum(value[i] for i in p.pool) - before == want
        assert [list(a) for a in p.anchors] == anchors  # items over half a bin never move
        for k, items in enumerate(p.items):
            assert p.load[k] == sum(weights[i] for i in p.anchors[k] + items) <= seq_len
        held = sorted([i for b in p.bins() for i in b] + p.pool)
        assert held == list(range(len(weights)))
        for i in pool - set(p.pool):  # the weights that went in may not leave for a while
            assert step + TENURE <= p.tabu_until[weights[i]] < step + 2 * TENURE


def best_fill(weights: list[int], room: int) -> int:
    sums = {sum(c) for r in range(len(weights) + 1) for c in itertools.combinations(weights, r)}
    return max(s for s in sums if s <= room)


@settings(max_examples=150, deadline=None)
@given(state=states(), target=st.integers(0, 2))
def test_partial_descent_leaves_no_bin_it_could_fill_better(state: tuple, target: int) -> None:
    """After a descent that did not reach ``target``, no bin can hold more of its own movable
    items plus the pool (exact subset sums); one that did (True) leaves a pool that fits it."""
    weights, seq_len = state[0], state[1]
    p = make(state)
    done = p.descent(target)
    assert not done or p.fits(target)
    assert sorted([i for b in p.bins() for i in b] + p.pool) == list(range(len(weights)))
    for k, items in enumerate(p.items):
        assert p.load[k] == sum(weights[i] for i in p.anchors[k] + items) <= seq_len
        if not done:
            movable = [weights[i] for i in items + p.pool]
            assert p.load[k] == p.fixed[k] + best_fill(movable, seq_len - p.fixed[k])


@settings(max_examples=100, deadline=None)
@given(state=states(), target=st.integers(0, 2), limit=st.integers(0, 4))
def test_partial_ends(state: tuple, target: int, limit: int) -> None:
    """fits: the pool fits ``target`` new bins (two: some split of it, by brute force);
    solution: every item once, the pool in at most ``target`` new bins; repacked: the pool by
    best fit, or None past ``limit`` new bins."""
    weights, seq_len = state[0], state[1]
    p = make(state)
    sizes = [weights[i] for i in p.pool]
    total = sum(sizes)
    two = any(
        sum(c) <= seq_len and total - sum(c) <= seq_len
        for r in range(len(sizes) + 1)
        for c in itertools.combinations(sizes, r)
    )
    want = total == 0 if target == 0 else total <= seq_len if target == 1 else two
    assert p.fits(target) == want
    kept = p.bins()
    assert all(kept) and len(kept) == sum(
        1 for a, b in zip(p.anchors, p.items, strict=True) if a + b
    )
    if want:
        out = p.solution(target)
        assert sorted(i for b in out for i in b) == list(range(len(weights)))
        assert len(out) - len(kept) <= target
        assert all(sum(weights[i] for i in b) <= seq_len for b in out)
    from megapack.packing.bfd import best_fit_decreasing

    need = (
        int(best_fit_decreasing(np.array(sizes, dtype=np.int64), seq_len).max()) + 1 if sizes else 0
    )
    repacked = p.repacked(limit)
    if need > limit:
        assert repacked is None
    else:
        assert repacked is not None and len(repacked) == len(kept) + need
        assert sorted(i for b in repacked for i in b) == list(range(len(weights)))
        assert all(sum(weights[i] for i in b) <= seq_len for b in repacked)


def test_partial_pairs_leave_a_bin_of_pair_limit_items() -> None:
    """Eight 1s in a bin of 9 (`PAIR_LIMIT` movable items) and a 3 in the pool: only two 1s
    leaving make room, and a bin of eight items still offers its pairs."""
    sizes = [1] * PAIR_LIMIT + [3]
    p = PartialPacking(sizes, sizes, 9, [list(range(PAIR_LIMIT))], [PAIR_LIMIT], objective=LINEAR,
                       rng=random.Random(0))  # fmt: skip
    assert p.tabu_step() is True
    assert sorted(sizes[i] for i in p.pool) == [1, 1] and p.load.tolist() == [9]
