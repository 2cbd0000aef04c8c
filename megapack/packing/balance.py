"""Compute-balanced global batches: which packed row goes to which (DP rank, micro-batch slot).

All data-parallel ranks meet at the gradient all-reduce, so a step lasts as long as its most
expensive rank. Rows hold the same number of tokens but not the same compute (`cost.CostModel`:
``a * tokens + b * sum(len_i^2)``); this module spreads the costly rows over the ranks.

Dealing (what `PackedDataset` serves, `LoadOptions`): an *order* is a sequence of row indices, ``-1`` for a
zero-loss filler row. Micro-batch ``j`` is ``order[j * R:(j + 1) * R]`` (``R`` rows per micro-batch)
and goes to DP rank ``j % dp`` as that rank's item ``j // dp``; global batch (optimizer step) ``g``
is micro-batches ``g * dp * M`` to ``(g + 1) * dp * M - 1``, ``M`` on each rank.

    token plan    the seeded shuffle, dealt round-robin (what PackedDataset did before balance)
    compute plan  `compute_order` of that shuffle:
                  1. global batches: the rows sorted by cost and cut into *layers* of dp rows
                     of about the same cost; the layers shuffled (seeded) and laid end to end,
                     so a global batch is M * R random layers (`layers.stratify`);
                  2. rank sets in each global batch: longest-processing-time first (each row,
                     most expensive first, to the cheapest rank that still has a free slot, so
                     every rank gets exactly its M * R slots; vectorized one layer at a time in
                     `layers.deal_layers`), then pairwise swaps between the most expensive rank
                     and another that lower the maximum, until none does;
                  3. micro-batches on a rank: its rows snaked over its M micro-batches
                     (`balance_order`, the fallback below: LPT + swaps);
                  4. their order on the rank (pipeline parallelism): the cheapest micro-batch
                     first and the second cheapest last, the others from most to least
                     expensive (`pipeline_order`). Correctness does not depend on it; the
                     pipeline fill waits on the first micro-batch's forward and the drain on
                     the last one's backward, so cheap ones there shorten the bubble.
                  If that is less balanced than the token plan (possible on tiny inputs), the
                  token plan's own global batches dealt by steps 2-4 (`balance_order`, each
                  batch never worse than before) are the fallback: never less balanced.

Worked example, rows with costs ``[8, 1, 8, 1]``, dp 2, M 2, R 1, seed 1 (whose shuffle keeps
them in that order, `order_rows`). The token plan deals rows 0, 2 to rank 0 (cost 16) and rows
1, 3 to rank 1 (cost 2): imbalance 16 / 9 = 1.78. The compute plan's order is ``[1, 3, 0, 2]``:
each rank runs a 1-cost row, then an 8-cost row (cost 9 each, imbalance 1.0). Packing efficiency
does not change: the rows are the same.

Measured here on the OpenChat V1 lengths (seq_len 2,048, BFD, 4,673 rows), dp 8, M 4, with the
Llama-3-8B cost (`cost.py`): imbalance 1.0090 (token plan) -> 1.0001; with ``b`` alone
(``sum(len^2)``): 1.136 -> 1.0005, and 1.111 -> 1.0003 with two rows per micro-batch; 6-30 ms
to plan the epoch.

Imbalance (torchtitan #3938): the mean over global batches of ``max rank cost / mean rank cost``.
"""

from __future__ import annotations

import numpy as np

from megapack.packing.dealing import balance_order, partition, pipeline_order
from megapack.packing.names import BALANCE_MODES
from megapack.packing.options import LoadOptions

__all__ = [
    "BALANCE_MODES",  # defined in megapack.packing.names, the one home of choice lists
    "balance_order",
    "compute_order",
    "imbalance",
    "order_rows",
    "partition",
    "pipeline_order",
    "rank_costs",
]


def order_rows(
    row_costs: np.ndarray,
    loading: LoadOptions,
    *,
    seed: int | tuple[int, ...] = 0,
    pad: bool = True,
) -> np.ndarray:
    """The order in which a data loader deals rows (module docstring), for either plan.

    Args:
        row_costs: [rows] cost of every row (unused by the token plan).
        loading: the dealing (``dp_size``, ``micro_batches``, ``rows_per_micro_batch``) and the
            plan: ``balance`` "token" (the seeded shuffle) or "compute" (`compute_order` of it).
        seed: the shuffle's seed (``np.random.default_rng(seed).permutation``).
        pad: append ``-1`` filler rows up to whole global batches.

    Example:
        >>> costs, deal = np.array([8.0, 1, 8, 1]), LoadOptions(dp_size=2, micro_batches=2)
        >>> order_rows(costs, deal, seed=1).tolist()
        [0, 1, 2, 3]
        >>> from megapack.packing.cost import CostModel
        >>> compute = LoadOptions(dp_size=2, micro_batches=2, balance="compute", cost=CostModel(a=1, b=0))
        >>> order_rows(costs, compute, seed=1).tolist()
        [1, 3, 0, 2]
    """
    seeds = (seed,) if isinstance(seed, int | np.integer) else tuple(seed)
    order = np.random.default_rng(seeds).permutation(len(row_costs))
    if pad:
        filler = np.full(-len(order) % loading.rows_per_step, -1, dtype=np.int64)
        order = np.concatenate((order, filler))
    if loading.balance == "token":
        return order
    return compute_order(order, row_costs, loading, seed=(*seeds, 13))


def compute_order(
    order: np.ndarray,
    row_costs: np.ndarray,
    loading: LoadOptions,
    *,
    seed: int | tuple[int, ...] = 0,
) -> np.ndarray:
    """The compute plan for a token-plan ``order``: balanced global batches, balanced ranks.

    Two candidates: (2) `layers.stratify`, global batches made of layers of ``dp_size``
    similar rows, then dealt (`layers.deal_layers`, vectorized), kept if it is at least as
    balanced as the token plan; otherwise
    the better of it and (1) `balance_order` of ``order`` itself (the same global batches, each
    no worse than in the token plan). Either way never less balanced than the token plan.

    Args:
        order: [N] token-plan order (``-1`` for filler rows, which `stratify` keeps in the last
            global batch).
        row_costs: [rows] cost of every row.
        loading: the dealing (``dp_size``, ``micro_batches``, ``rows_per_micro_batch``).
        seed: seeds `stratify` (e.g. ``(seed, epoch)``).

    Returns:
        [N] order: the same entries, each real row exactly once.
    """
    from megapack.packing.layers import deal_layers, stratify

    layered = stratify(order, row_costs, loading.dp_size, np.random.default_rng(seed))
    layered = deal_layers(layered, row_costs, loading)
    if imbalance(layered, row_costs, loading) <= imbalance(order, row_costs, loading):
        return layered  # (1) can only do better than the token plan; skip computing it
    same_batches = balance_order(order, row_costs, loading)
    if imbalance(same_batches, row_costs, loading) < imbalance(layered, row_costs, loading):
        return same_batches
    return layered


def rank_costs(order: np.ndarray, row_costs: np.ndarray, loading: LoadOptions) -> np.ndarray:
    """[global batches, dp_size] step cost of every rank (a partial last batch padded with 0)."""
    order = np.asarray(order, dtype=np.int64)
    costs = np.where(order >= 0, np.asarray(row_costs, dtype=np.float64)[order], 0.0)
    costs = np.concatenate((costs, np.zeros(-len(costs) % loading.rows_per_step)))
    micro = costs.reshape(-1, loading.rows_per_micro_batch).sum(axis=1)
    return micro.reshape(-1, loading.micro_batches, loading.dp_size).sum(axis=1)


def imbalance(order: np.ndarray, row_costs: np.ndarray, loading: LoadOptions) -> float:
    """Mean over the full global batches of ``max rank cost / mean rank cost`` (1.0: perfect).

    A global batch with filler rows (the last one, when the rows do not fill it) is left out: no
    plan balances one real row over eight ranks, and what a filler row costs depends on the
    kernel. Only when no batch is full are all of them counted.

    Example, costs ``[3, 1, 2, 2]``, dp 2, one micro-batch of one row: rank costs ``[3, 1]`` and
    ``[2, 2]``, imbalance ``(3 / 2 + 2 / 2) / 2``:

        >>> imbalance(np.arange(4), np.array([3.0, 1, 2, 2]), LoadOptions(dp_size=2))
        1.25
    """
    order = np.asarray(order, dtype=np.int64)
    steps = rank_costs(order, row_costs, loading)
    per_batch = loading.rows_per_step
    padded = np.concatenate((order, np.full(-len(order) % per_batch, -1, dtype=np.int64)))
    full = (padded.reshape(-1, per_batch) >= 0).all(axis=1)
    if full.any():
        steps = steps[full]
    mean = steps.mean(axis=1)
    keep = mean > 0
    if not keep.any():
        return 1.0
    return float(np.round(np.mean(steps[keep].max(axis=1) / mean[keep]), 12))
