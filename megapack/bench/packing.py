"""Packing benchmark: every algorithm's efficiency against the lower bound, and its planning time."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from megapack.bench.datasets import OPENCHAT_CAP

ALGORITHMS = ("next_fit", "first_fit", "ffd", "bfd", "best")


def run_packing(lengths: list[int], best_time_limit_s: float, big_n: int) -> list[dict[str, Any]]:
    """Rows for OpenChat at capacity 2,048 (all algorithms) and ``big_n`` lognormal lengths (BFD only)."""
    from megapack.packing import plan

    rows = []
    cases: list[tuple[str, np.ndarray, int, tuple[str, ...]]] = [
        ("openchat", np.asarray(lengths), OPENCHAT_CAP, ALGORITHMS),
        (f"lognormal-{big_n:,}", _lognormal(big_n), 4096, ("bfd",)),
    ]
    for name, values, capacity, algorithms in cases:
        for algorithm in algorithms:
            start = time.perf_counter()
            result = plan(values, capacity, algorithm=algorithm, time_limit_s=best_time_limit_s)
            seconds = time.perf_counter() - start
            tokens = result.num_bins * capacity * result.efficiency
            rows.append({
                "dataset": name, "algorithm": algorithm, "capacity": capacity, "rows": result.num_bins,
                "efficiency": result.efficiency, "lower_bound": result.lower_bound,
                "lower_bound_efficiency": tokens / (result.lower_bound * capacity), "seconds": seconds,
            })  # fmt: skip
    return rows


def _lognormal(n: int) -> np.ndarray:
    return np.clip(np.random.default_rng(0).lognormal(6, 1, n), 1, 4096).astype(np.int64)
