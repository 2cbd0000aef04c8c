"""Packing benchmark: every algorithm's efficiency against the lower bound, planning time and memory.

Also the streaming packer at buffer 1,000 on the real lengths, and BFD on ``big_n`` lognormal lengths
with its peak traced memory (the O(n) target).
"""

from __future__ import annotations

import time
import tracemalloc
from typing import Any

import numpy as np

from megapack.bench.datasets import OPENCHAT_CAP
from megapack.packing.names import ALGORITHMS


def run_packing(lengths: list[int], best_search_steps: int, big_n: int) -> list[dict[str, Any]]:
    """Rows for OpenChat at seq_len 2,048 (all algorithms; "best" with ``best_search_steps``) and
    ``big_n`` lognormal lengths (BFD only)."""
    from megapack.packing import PackOptions, plan

    rows = []
    cases: list[tuple[str, np.ndarray, int, tuple[str, ...]]] = [
        ("openchat", np.asarray(lengths), OPENCHAT_CAP, ALGORITHMS),
        (f"lognormal-{big_n:,}", _lognormal(big_n), 4096, ("bfd",)),
    ]
    for name, values, seq_len, algorithms in cases:
        for algorithm in algorithms:
            # tracemalloc slows Python code: trace only the O(n) memory row
            traced = name != "openchat"
            if traced:
                tracemalloc.start()
            start = time.perf_counter()
            options = PackOptions(
                seq_len=seq_len, algorithm=algorithm, search_steps=best_search_steps
            )
            result = plan(values, options)
            seconds = time.perf_counter() - start
            peak = tracemalloc.get_traced_memory()[1] if traced else None
            tracemalloc.stop()
            rows.append(
                _row(
                    name,
                    algorithm,
                    seq_len,
                    result.num_bins,
                    result.packed_tokens,
                    result.lower_bound,
                    seconds,
                    peak,
                )
            )
    from megapack.packing import StreamingPacker

    start = time.perf_counter()
    bins = list(StreamingPacker(OPENCHAT_CAP, buffer_size=1000).pack(lengths))
    seconds = time.perf_counter() - start
    bound = next(r["lower_bound"] for r in rows if r["dataset"] == "openchat")
    tokens = sum(p.stop - p.start for b in bins for p in b)
    rows.append(
        _row(
            "openchat",
            "streaming bfd, buffer 1,000",
            OPENCHAT_CAP,
            len(bins),
            tokens,
            bound,
            seconds,
            None,
        )
    )
    return rows


def _row(
    dataset: str,
    algorithm: str,
    seq_len: int,
    bins: int,
    tokens: int,
    bound: int,
    seconds: float,
    peak: int | None,
) -> dict[str, Any]:
    return {
        "dataset": dataset,
        "algorithm": algorithm,
        "capacity": seq_len,  # the report's key (bench JSON records keep it)
        "rows": bins,
        "efficiency": tokens / (bins * seq_len),
        "lower_bound": bound,
        "lower_bound_efficiency": tokens / (bound * seq_len),
        "seconds": seconds,
        "peak_mib": None if peak is None else peak / 2**20,
    }


def _lognormal(n: int) -> np.ndarray:
    return np.clip(np.random.default_rng(0).lognormal(6, 1, n), 1, 4096).astype(np.int64)
