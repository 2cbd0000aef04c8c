"""`compare_plans`: the token plan and the compute plan of one corpus side by side.

Both plans pack the same rows (``plan(lengths, packing)``) and deal them to ``dp_size`` ranks in
global batches of `LoadOptions.rows_per_step` rows (balance.py); they differ only in which rank gets
which row. Reported for each:

    imbalance   mean over the full global batches of max rank cost / mean rank cost
    efficiency  real tokens / (rows padded to whole global batches x seq_len)

Example, lengths ``[4, 4, 2, 2, 1, 1, 1, 1]`` at seq_len 4 (rows ``[4] [4] [2, 2] [1, 1, 1, 1]``),
dp 2, one micro-batch, cost ``sum(len^2)`` (rows cost 16, 16, 8, 4): the token plan's seed-0
shuffle pairs 8 with 16 and 4 with 16 (imbalance (16 / 12 + 16 / 10) / 2 = 1.467); the compute
plan puts the two 16s in one global batch (imbalance (1 + 8 / 6) / 2 = 1.167).

    >>> from megapack.packing import CostModel
    >>> r = compare_plans([4, 4, 2, 2, 1, 1, 1, 1], 4, LoadOptions(dp_size=2, cost=CostModel(a=0, b=1)))
    >>> round(r["imbalance_token_plan"], 3), round(r["imbalance_compute_plan"], 3)
    (1.467, 1.167)
    >>> r["efficiency_token_plan"] == r["efficiency_compute_plan"] == 1.0
    True
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from megapack.packing.balance import imbalance, order_rows
from megapack.packing.names import BALANCE_MODES
from megapack.packing.options import LoadOptions, PackOptions, pack_options, with_shortcuts
from megapack.packing.planner import plan


def compare_plans(
    lengths: Sequence[int] | np.ndarray, packing: PackOptions | int, loading: LoadOptions
) -> dict[str, Any]:
    """Imbalance and efficiency of the token and the compute plan (module docstring).

    Args:
        lengths: the documents' token counts.
        packing: how the rows are packed (`PackOptions`, or the ``seq_len`` alone).
        loading: how they are dealt: its ``dp_size``, ``micro_batches``,
            ``rows_per_micro_batch`` and ``cost`` (required; its ``balance`` is not read: both are).

    Returns:
        ``imbalance_token_plan``, ``imbalance_compute_plan``, ``efficiency_token_plan``,
        ``efficiency_compute_plan``, ``rows``, ``global_batches`` (full ones, the ones the
        imbalance averages), ``compute_plan_seconds`` (time to balance one epoch), and the
        settings (``dp_size``, ``micro_batches``, ``rows_per_micro_batch``, ``cost_a``, ``cost_b``).

    Raises:
        TypeError: ``loading`` has no cost.
    """
    options = pack_options(packing, {}, where="compare_plans")
    loading = with_shortcuts(LoadOptions, loading, {}, where="compare_plans")
    if loading.cost is None:
        raise TypeError(
            "compare_plans needs loading=LoadOptions(cost=CostModel(...)): the cost both plans "
            "are measured by"
        )
    packed = plan(lengths, options)
    costs = loading.cost.bin_costs(packed.slices, packed.bin_offsets)
    result: dict[str, Any] = {
        "dp_size": loading.dp_size,
        "micro_batches": loading.micro_batches,
        "rows_per_micro_batch": loading.rows_per_micro_batch,
        "cost_a": loading.cost.a,
        "cost_b": loading.cost.b,
    }
    per_batch = loading.rows_per_step
    padded_rows = -(-packed.num_bins // per_batch) * per_batch
    for mode in BALANCE_MODES:
        start = time.perf_counter()
        order = order_rows(costs, dataclasses.replace(loading, balance=mode), seed=options.seed)
        if mode == "compute":
            result["compute_plan_seconds"] = time.perf_counter() - start
        result[f"imbalance_{mode}_plan"] = imbalance(order, costs, loading)
        real = int((order >= 0).sum())
        assert real == packed.num_bins and len(order) == padded_rows  # same rows, same padding
        result[f"efficiency_{mode}_plan"] = packed.packed_tokens / (padded_rows * options.seq_len)
    result["rows"] = packed.num_bins
    result["global_batches"] = packed.num_bins // per_batch
    return result
