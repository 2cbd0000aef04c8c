"""`compare_plans`: the token plan and the compute plan of one corpus side by side.

Both plans pack the same rows (``plan(lengths, seq_len, algorithm=...)``) and deal them to
``dp_size`` ranks in global batches of ``dp_size * micro_batches * rows_per_micro_batch`` rows
(balance.py); they differ only in which rank gets which row. Reported for each:

    imbalance   mean over the full global batches of max rank cost / mean rank cost
    efficiency  real tokens / (rows padded to whole global batches x seq_len)

Example, lengths ``[4, 4, 2, 2, 1, 1, 1, 1]`` at seq_len 4 (rows ``[4] [4] [2, 2] [1, 1, 1, 1]``),
dp 2, one micro-batch, cost ``sum(len^2)`` (rows cost 16, 16, 8, 4): the token plan's seed-0
shuffle pairs 8 with 16 and 4 with 16 (imbalance (16 / 12 + 16 / 10) / 2 = 1.467); the compute
plan puts the two 16s in one global batch (imbalance (1 + 8 / 6) / 2 = 1.167).

    >>> from megapack.packing import CostModel
    >>> r = compare_plans([4, 4, 2, 2, 1, 1, 1, 1], 4, dp_size=2, cost=CostModel(a=0, b=1))
    >>> round(r["imbalance_token_plan"], 3), round(r["imbalance_compute_plan"], 3)
    (1.467, 1.167)
    >>> r["efficiency_token_plan"] == r["efficiency_compute_plan"] == 1.0
    True
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from megapack.packing.balance import check_balance, imbalance, order_rows
from megapack.packing.cost import CostModel
from megapack.packing.names import BALANCE_MODES
from megapack.packing.plan import plan


def compare_plans(
    lengths: Sequence[int] | np.ndarray,
    seq_len: int,
    *,
    dp_size: int,
    micro_batches: int = 1,
    rows_per_micro_batch: int = 1,
    cost: CostModel,
    algorithm: str = "bfd",
    seed: int = 0,
) -> dict[str, Any]:
    """Imbalance and efficiency of the token and the compute plan (module docstring).

    Returns:
        ``imbalance_token_plan``, ``imbalance_compute_plan``, ``efficiency_token_plan``,
        ``efficiency_compute_plan``, ``rows``, ``global_batches`` (full ones, the ones the
        imbalance averages), ``compute_plan_seconds`` (time to balance one epoch), and the
        settings (``dp_size``, ``micro_batches``, ``rows_per_micro_batch``, ``cost_a``, ``cost_b``).
    """
    check_balance(
        "compute",
        dp_size=dp_size,
        micro_batches=micro_batches,
        rows_per_micro_batch=rows_per_micro_batch,
        cost=cost,
    )
    packed = plan(lengths, seq_len, algorithm=algorithm, seed=seed)
    costs = cost.bin_costs(packed.slices, packed.bin_offsets)
    layout: dict[str, int] = {"dp_size": dp_size, "micro_batches": micro_batches}
    layout["rows_per_micro_batch"] = rows_per_micro_batch
    result: dict[str, Any] = {**layout, "cost_a": cost.a, "cost_b": cost.b}
    per_batch = dp_size * micro_batches * rows_per_micro_batch
    padded_rows = -(-packed.num_bins // per_batch) * per_batch
    for mode in BALANCE_MODES:
        start = time.perf_counter()
        order = order_rows(
            costs,
            balance=mode,
            dp_size=dp_size,
            micro_batches=micro_batches,
            rows_per_micro_batch=rows_per_micro_batch,
            seed=seed,
        )
        if mode == "compute":
            result["compute_plan_seconds"] = time.perf_counter() - start
        result[f"imbalance_{mode}_plan"] = imbalance(order, costs, **layout)
        real = int((order >= 0).sum())
        assert real == packed.num_bins and len(order) == padded_rows  # same rows, same padding
        result[f"efficiency_{mode}_plan"] = packed.packed_tokens / (padded_rows * seq_len)
    result["rows"] = packed.num_bins
    result["global_batches"] = packed.num_bins // per_batch
    return result
