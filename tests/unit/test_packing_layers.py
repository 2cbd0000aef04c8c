"""megapack.packing.layers: stratify and deal_layers against per-row references of the rules in
their docstrings (sorts stable, ties to the lower index), on inputs full of equal costs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.packing.dealing import balance_order
from megapack.packing.layers import REFINE_ABOVE, deal_layers, stratify
from megapack.packing.options import LoadOptions
from tests.unit.test_packing_dealing import refine


def stratify_reference(order: list[int], costs: list[float], dp: int, seed: int) -> list[int]:
    """Real rows by decreasing cost (ties in ``order``'s order), cut into layers of ``dp``, the
    layers in ``default_rng(seed).permutation`` order, then the short layer, then the fillers."""
    real = [x for x in order if x >= 0]
    ranked = sorted(real, key=lambda x: -costs[x])  # Python's sort is stable
    full = len(ranked) // dp
    layers = [ranked[i * dp : (i + 1) * dp] for i in range(full)]
    shuffled = [x for i in np.random.default_rng(seed).permutation(full) for x in layers[i]]
    return shuffled + ranked[full * dp :] + [-1] * (len(order) - len(real))


def pipeline(costs: list[float]) -> list[int]:
    up = sorted(range(len(costs)), key=lambda j: (costs[j], j))
    return up if len(up) <= 2 else [up[0], *up[:1:-1], up[1]]


def deal_reference(order: list[int], costs: list[float], dp: int, m: int, r: int) -> list[int]:
    """`deal_layers`' docstring, one row at a time."""
    per, slots = dp * m * r, m * r
    full = sum(x >= 0 for x in order) // per
    out = list(order)
    for b in range(full):
        rows = order[b * per : (b + 1) * per]  # layer l: rows[l * dp : (l + 1) * dp]
        c = [costs[x] for x in rows]
        rank, loads = [0] * per, [0.0] * dp
        # layers by decreasing cost of their costliest row; in each, the costliest row goes to
        # the rank with the lowest load so far, the next to the next lowest, ...
        for layer in sorted(range(slots), key=lambda y: (-max(c[y * dp : (y + 1) * dp]), y)):
            by_cost = sorted(range(dp), key=lambda i: (-c[layer * dp + i], i))
            by_load = sorted(range(dp), key=lambda k: (loads[k], k))
            for i, k in zip(by_cost, by_load, strict=True):
                rank[layer * dp + i] = k
                loads[k] += c[layer * dp + i]
        if slots > 1 and max(loads) > REFINE_ABOVE * (sum(loads) / dp):
            rank = refine(c, rank, dp)
        for k in range(dp):
            mine = [p for p in range(per) if rank[p] == k]
            if r > 1:  # snake, costliest first, over the m micro-batches
                mine = sorted(mine, key=lambda p: -c[p])
                micro = [[mine[q * m + (j if q % 2 == 0 else m - 1 - j)] for q in range(r)]
                         for j in range(m)]  # fmt: skip
            else:
                micro = [[p] for p in mine]
            order_on_rank = pipeline([sum(c[p] for p in batch) for batch in micro])
            for j, taken in enumerate(order_on_rank):  # micro-batch j of rank k
                at = b * per + (j * dp + k) * r
                out[at : at + r] = [rows[p] for p in micro[taken]]
    if full * per < len(order):
        rest = np.array(order[full * per :])
        layout = {"dp_size": dp, "micro_batches": m, "rows_per_micro_batch": r}
        out[full * per :] = balance_order(rest, np.array(costs), LoadOptions(**layout)).tolist()
    return out


@settings(max_examples=80, deadline=None)
@given(
    costs=st.lists(st.sampled_from([1, 2, 3, 5, 8]) | st.integers(0, 40), min_size=1, max_size=48),
    fillers=st.integers(0, 4),
    dp=st.integers(1, 4),
    seed=st.integers(0, 50),
)
def test_layers_stratify_matches_the_reference(
    costs: list[int], fillers: int, dp: int, seed: int
) -> None:
    values = [float(c) for c in costs]
    order = [*np.random.default_rng(seed + 1).permutation(len(costs)).tolist(), *[-1] * fillers]
    got = stratify(np.array(order), np.array(values), dp, np.random.default_rng(seed))
    assert got.dtype == np.int64
    assert got.tolist() == stratify_reference(order, values, dp, seed)


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(
        st.sampled_from([1, 2, 3, 5, 8]) | st.integers(0, 40) | st.integers(5000, 5004),
        min_size=1,
        max_size=80,
    ),
    fillers=st.integers(0, 3),
    dp=st.integers(1, 6),
    m=st.integers(1, 4),
    r=st.integers(1, 3),
    seed=st.integers(0, 50),
    layered=st.booleans(),
)
def test_layers_deal_matches_the_reference(
    costs: list[int], fillers: int, dp: int, m: int, r: int, seed: int, layered: bool
) -> None:
    values = [float(c) for c in costs]
    order = [*np.random.default_rng(seed).permutation(len(costs)).tolist(), *[-1] * fillers]
    if layered:
        order = stratify(np.array(order), np.array(values), dp, np.random.default_rng(seed))
        order = order.tolist()
    layout = {"dp_size": dp, "micro_batches": m, "rows_per_micro_batch": r}
    got = deal_layers(np.array(order), np.array(values), LoadOptions(**layout))
    assert got.tolist() == deal_reference(order, values, dp, m, r)


def test_layers_deal_snakes_a_ranks_rows_over_its_micro_batches() -> None:
    """One rank, two micro-batches of three rows, costs 6 5 4 3 2 1: the snake gives micro-batch
    0 rows 6, 3, 2 (11) and micro-batch 1 rows 5, 4, 1 (10); the cheaper one runs first."""
    costs = np.array([6.0, 5, 4, 3, 2, 1])
    got = deal_layers(
        np.arange(6), costs, LoadOptions(dp_size=1, micro_batches=2, rows_per_micro_batch=3)
    )
    assert got.tolist() == [1, 2, 5, 0, 3, 4]


def test_layers_deal_refines_a_batch_the_layers_leave_uneven() -> None:
    """Costs [10, 1, 6, 5], layers {10, 1} then {6, 5}, dp 2, two micro-batches of one row: the
    layer deal gives 10 and 5 to rank 0, 1 and 6 to rank 1 (15 | 7, above `REFINE_ABOVE` x the
    mean 11); swapping 10 and 6 gives 11 | 11. Each rank runs its cheaper row first: micro-batch 0
    is rows 3 (5) and 1 (1), micro-batch 1 rows 2 (6) and 0 (10)."""
    costs = np.array([10.0, 1, 6, 5])
    got = deal_layers(np.arange(4), costs, LoadOptions(dp_size=2, micro_batches=2))
    assert got.tolist() == [3, 1, 2, 0]


def test_layers_deal_ties_between_layers_go_to_the_lower_layer() -> None:
    """Costs [1, 1 | 1, 3 | 5, 5 | 3, 5], dp 2, four micro-batches of one row. Layers by their
    costliest row, ties to the lower layer: {5, 5}, {3, 5}, {1, 3}, {1, 1}. Rows 4, 5 go to ranks
    0, 1 (5 | 5); row 7 to rank 0 and row 6 to rank 1 (10 | 8); row 3 to rank 1 and row 2 to
    rank 0 (11 | 11); rows 0, 1 to ranks 0, 1 (12 | 12). Rank 0 holds rows 0 2 4 7 (costs 1 1 5
    5) and runs 0, 7, 4, 2; rank 1 holds 1 3 5 6 (1 3 5 3) and runs 1, 5, 6, 3."""
    costs = np.array([1.0, 1, 1, 3, 5, 5, 3, 5])
    got = deal_layers(np.arange(8), costs, LoadOptions(dp_size=2, micro_batches=4))
    assert got.tolist() == [0, 1, 7, 5, 4, 6, 2, 3]


def test_layers_deal_refines_only_the_uneven_batches() -> None:
    """Two global batches of dp 2 x 2 rows. Batch 0 deals to 20,001 | 19,999: within
    `REFINE_ABOVE` of its mean, so no swap (one would give 20,000 | 20,000); rank 0 runs rows 1, 2
    and rank 1 rows 3, 0. Batch 1 deals to 30,001 | 2, refined, but no swap helps."""
    costs = np.array([10_000.0, 10_000, 10_001, 9_999, 1, 30_000, 1, 1])
    got = deal_layers(np.arange(8), costs, LoadOptions(dp_size=2, micro_batches=2))
    assert got.tolist() == [1, 3, 2, 0, 7, 4, 5, 6]


@pytest.mark.parametrize(
    ("costs", "dp", "m", "r"),
    [
        ([3.0, 1, 5, 1, 2, 2, 3, 3], 4, 2, 1),  # equal rows in a layer: the lower one first
        (
            [2.0, 1, 1, 1, 1, 5, 3, 5, 3, 3, 5, 3, 3, 3, 3, 5],
            4,
            2,
            2,
        ),  # ranks as loaded: lower first
        ([4.0, 3, 2, 1], 1, 2, 2),  # the snake over two passes: 4 + 1 and 3 + 2
    ],
)
def test_layers_deal_fixed_inputs_with_ties(costs: list[float], dp: int, m: int, r: int) -> None:
    """Inputs where a sort that does not keep ties in order, or no snake at two rows per
    micro-batch, deals differently (found by search; the random property may not draw them)."""
    layout = {"dp_size": dp, "micro_batches": m, "rows_per_micro_batch": r}
    got = deal_layers(np.arange(len(costs)), np.array(costs), LoadOptions(**layout))
    assert got.tolist() == deal_reference(list(range(len(costs))), costs, dp, m, r)
