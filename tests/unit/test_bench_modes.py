"""The fair baselines' modes (`megapack.bench.modes`): a step as a real run has it, the same
documents in every mode, no filler row, grouped sorted once and filled to packing's budget, the
ceiling on packing's THD path, and what a step times."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megapack.bench import modes
from megapack.bench.gpu.model import TOY
from megapack.bench.modes import (
    FULL_MODES,
    MODES,
    SAMPLED_MODES,
    grouped,
    micro_batches,
    mode_cost,
    plan_step,
    schedule_shape,
    timed,
    timed_lengths,
)
from megapack.core.batch import PackedBatch


def docs_of(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 100, n) for n in lengths]


def test_docstring_examples() -> None:
    result = doctest.testmod(modes)
    assert result.failed == 0 and result.attempted >= 4


# -- a step as a real run has it ------------------------------------------------------------------
def test_a_step_is_a_window_of_a_plan_over_the_pool() -> None:
    rng = np.random.default_rng(3)
    pool = rng.integers(1, 2049, 2000).tolist()
    step = plan_step(pool, 4096, 2, 12, seed=0)
    assert step.pool_size == 2000 and step.pool_rows >= 480
    assert len(step.packing) == 24  # 12 micro-batches of 2 rows, every one real
    held = sorted(i for row in step.packing for i in row)
    assert held == list(range(len(step.lengths)))  # every step document in exactly one row
    assert step.pool == sorted(step.pool) and len(set(step.pool)) == len(step.pool)  # data order
    assert step.lengths == [pool[i] for i in step.pool]
    for row in step.packing:
        assert sum(step.lengths[i] for i in row) <= 4096
    assert step.fill(4096) > 0.99  # a plan over 2,000 documents packs its rows nearly full
    assert plan_step(pool, 4096, 2, 12, seed=1).pool != step.pool  # the seeded epoch order
    assert plan_step(pool, 4096, 2, 12, seed=0) == step


def test_a_step_leaves_the_epochs_remainder_row_out() -> None:
    # rows of 10: the plan is [8+2], [7+3], [9+1], [5]: the half-empty row is an epoch's last
    lengths = [8, 2, 7, 3, 9, 1, 5]
    for seed in range(8):  # whatever the epoch's order, the window never takes the [5] row
        step = plan_step(lengths, 10, 1, 3, seed=seed)
        assert sorted(step.lengths) == [1, 2, 3, 7, 8, 9] and step.fill(10) == 1.0, seed
    small = plan_step(lengths, 10, 2, 4, seed=0)  # the window wants every row: all of them
    assert sorted(small.lengths) == sorted(lengths) and len(small.packing) == 4


def test_a_step_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="document 1 has 11 tokens, above seq_len=10"):
        plan_step([3, 11], 10, 1, 1)
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1, got 0"):
        plan_step([3], 10, 1, 0)
    with pytest.raises(ValueError, match="lengths is empty"):
        plan_step([], 10, 1, 1)


# -- the modes: the same documents, no filler -----------------------------------------------------
def test_every_layout_holds_the_step_documents_and_no_filler() -> None:
    rng = np.random.default_rng(4)
    step = plan_step(rng.integers(1, 250, 400).tolist(), 256, 2, 5)
    docs = docs_of(step.lengths)
    total = sum(step.lengths)
    for mode in MODES:
        batches = micro_batches(mode, docs, 256, 2, packing=step.packing)
        tokens = [b.tokens if isinstance(b, PackedBatch) else b["tokens"] for b in batches]
        assert sum(int((t > 0).sum()) for t in tokens) == total, mode  # ids >= 1, padding 0
        cost = mode_cost(batches)
        assert cost.slots == sum(t.numel() for t in tokens) and sum(cost.spans) == cost.slots
        assert cost.executed_flops(TOY) >= TOY.training_flops(step.lengths), mode
        for b in batches:  # no row without a document (the old filler row held one pad token)
            if isinstance(b, PackedBatch):
                starts = b.cu_seqlens[:-1].tolist()
                assert all(s % 256 != 0 or (b.tokens[0, s] > 0) for s in starts), mode
            else:
                assert bool((b["tokens"][:, 0] > 0).all()), mode
    packed = micro_batches("packed", docs, 256, 2, packing=step.packing)
    assert len(packed) == 5 and all(b.tokens.shape == (1, 512) for b in packed)


def test_the_last_packed_micro_batch_holds_what_remains_without_a_filler_row() -> None:
    docs = docs_of([6, 5, 4])  # three rows of 8 (6, 5, 4 do not pair up), 2 rows a micro-batch
    batches = micro_batches("packed", docs, 8, 2)
    assert [b.tokens.shape[1] for b in batches] == [16, 8]  # the last one row, not two
    assert mode_cost(batches).spans == [6, 2, 5, 3, 4, 4]  # each document and its row's tail
    assert mode_cost(micro_batches("ceiling", docs, 8, 2)).slots == 24


def test_the_ceiling_is_one_document_per_row_on_packings_thd_path() -> None:
    docs = docs_of([3, 4, 2, 5, 1])
    packing = [[0, 1], [2, 3, 4]]  # rows of 8: 7 and 8 tokens
    ceiling = micro_batches("ceiling", docs, 8, 2, packing=packing)
    packed = micro_batches("packed", docs, 8, 2, packing=packing)
    assert len(ceiling) == 1 and isinstance(ceiling[0], PackedBatch)  # THD, like packing
    assert ceiling[0].cu_seqlens.tolist() == [0, 7, 8, 16]  # one document per row, then its tail
    assert packed[0].cu_seqlens.tolist() == [0, 3, 7, 8, 10, 15, 16]
    assert np.array_equal(ceiling[0].tokens.numpy(), packed[0].tokens.numpy())  # the same tokens
    c, p = mode_cost(ceiling), mode_cost(packed)
    assert c.slots == p.slots and c.spans == [7, 1, 8]
    assert c.executed_flops(TOY) - p.executed_flops(TOY) == 3 * 4 * 64 * 2 * (
        (28 + 1 + 36) - (6 + 10 + 1 + 3 + 15 + 1)
    )  # attention's (query, key) pairs only: 4 h layers per pair, x3 for training


# -- grouped: sorted once, filled to packing's budget ---------------------------------------------
def test_grouped_worked_example() -> None:
    docs = docs_of([3, 5, 2, 6, 1])
    groups = grouped(docs, 6, 2)  # budget 12 slots: [6, 5] -> 12, then [3, 2, 1] -> 9
    assert [[len(d) for d in g] for g in groups] == [[6, 5], [3, 2, 1]]
    batches = micro_batches("grouped", docs, 6, 2)
    assert [tuple(b["tokens"].shape) for b in batches] == [(2, 6), (3, 3)]
    assert mode_cost(batches).spans == [6, 6, 3, 3, 3]


def fewest_groups(lengths: list[int], budget: int) -> int:
    """Brute force over the sorted order: the fewest contiguous groups within the budget."""
    order = sorted(lengths, reverse=True)
    best = [0] + [len(order) + 1] * len(order)  # best[i]: groups for the first i documents
    for end in range(1, len(order) + 1):
        for start in range(end):
            if (end - start) * order[start] <= budget or end - start == 1:
                best[end] = min(best[end], best[start] + 1)
    return best[-1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 3))
@example([1] * 20, 1).via("many short documents: one micro-batch of 20")
@example([40, 1, 1, 39], 2).via("the longest pairs with the next, the short ones together")
def test_grouped_is_sorted_within_budget_and_fewest(lengths: list[int], rows: int) -> None:
    docs = [np.ones(n, dtype=np.int64) for n in lengths]
    groups = grouped(docs, 40, rows)
    assert sorted(id(d) for g in groups for d in g) == sorted(id(d) for d in docs)  # each once
    flat = [len(d) for g in groups for d in g]
    assert flat == sorted(lengths, reverse=True)  # the step sorted once, longest first
    for g in groups:
        assert len(g) * len(g[0]) <= rows * 40  # padded to its longest, within the budget
    assert len(groups) == fewest_groups(lengths, rows * 40)


# -- what a step times -----------------------------------------------------------------------------
def test_timed_runs_every_target_mode_whole_and_samples_the_context_baselines() -> None:
    assert set(FULL_MODES) | set(SAMPLED_MODES) == set(MODES)
    docs = docs_of([5] * 9)
    for mode in MODES:
        batches = micro_batches(mode, docs, 8, 2)
        ran = timed(mode, batches, 2)
        assert ran == (batches if mode in FULL_MODES else batches[:2]), mode
    lengths = [5, 6, 7, 8, 9]
    assert timed_lengths("grouped", lengths, 2, 1) == lengths
    assert timed_lengths("padded_fixed", lengths, 2, 1) == [5, 6]  # micro-batch 0: documents 0, 1


def test_schedule_shape() -> None:
    docs = docs_of([3, 5, 2])
    packed = micro_batches("packed", docs, 8, 2)
    assert schedule_shape(packed[0]) == (1, 16)
    assert schedule_shape(micro_batches("padded_fixed", docs, 8, 2)[0]) == (2, 8)
    with pytest.raises(ValueError, match="mode='padded'"):
        micro_batches("padded", docs, 8, 2)
