"""Packing against each baseline (`megapack.bench.layouts`): ratios with their spread, the ideals, the
executed FLOP rates and MFU by the field's definition. One summary for `megapack bench` and the kit.

Each measured mode is a row: ``config`` (what the modes share, e.g. ``"openchat, seq 4096"``),
``mode``, ``status`` ("ok" when timed), ``step_times`` (seconds of each timed step), ``tokens``
(the documents' tokens: the same in every mode), ``slots``, ``useful_flops`` and
``executed_flops`` of one step (`megapack.bench.layouts.LayoutCost`).

`summarize` gives one entry per (config, baseline):

    ratio, ratio_min, ratio_max   packed tokens/s over the baseline's, step by step (the i-th timed
                                  step of each): median, min, max; verdicts read the median
    spread                        (max - min) / median of that ratio; ``noisy`` above `NOISY`
    slot_ratio                    the baseline's token slots over packing's
    flop_ideal                    the baseline's executed FLOPs over packing's: what a step would
                                  gain if time followed executed FLOPs
    packed_tflops, baseline_tflops   executed FLOPs per second (median step) of each
    mfu                           packing's useful (model) FLOPs per second over the device's
                                  bf16 dense peak (`megapack.bench.gpu.devices`); None when unknown
    mfu_of_matmul                 the same over the measured matmul rate, beside it

Example:
    >>> ok = {"config": "c", "status": "ok", "tokens": 100, "useful_flops": 50.0}
    >>> rows = [ok | {"mode": "packed", "step_times": [1.0, 2.0], "slots": 128, "executed_flops": 60.0},
    ...         ok | {"mode": "padded_fixed", "step_times": [3.0, 5.0], "slots": 256, "executed_flops": 90.0}]
    >>> e = summarize(rows, peak_flops=100.0)[0]
    >>> e["ratio"], e["ratio_min"], e["ratio_max"], e["slot_ratio"], e["flop_ideal"], round(e["mfu"], 3)
    (2.75, 2.5, 3.0, 2.0, 1.5, 0.333)
"""

from __future__ import annotations

import statistics
from typing import Any

from megapack.bench.gpu.report import THROUGHPUT_KEYS
from megapack.bench.layouts import BASELINES, LABELS

NOISY = 0.10
"""A ratio whose (max - min) / median exceeds this is reported as noisy."""
ENTRY_KEYS = THROUGHPUT_KEYS
"""The keys of every entry, as the GPU kit's report writes them."""


def summarize(
    rows: list[dict[str, Any]],
    *,
    peak_flops: float | None = None,
    matmul_flops: float | None = None,
) -> list[dict[str, Any]]:
    """One entry (`ENTRY_KEYS`) per (config, baseline) with a packed row; see the module docstring.
    A value that was not measured is None."""
    out = []
    by_key = {(r["config"], r["mode"]): r for r in rows}
    for config in dict.fromkeys(r["config"] for r in rows):
        packed = by_key.get((config, "packed"), {})
        for mode in BASELINES:
            base = by_key.get((config, mode))
            if base is None:
                continue
            out.append(_entry(config, mode, packed, base, peak_flops, matmul_flops))
    return out


def _entry(
    config: str,
    mode: str,
    packed: dict[str, Any],
    base: dict[str, Any],
    peak: float | None,
    matmul: float | None,
) -> dict[str, Any]:
    entry: dict[str, Any] = dict.fromkeys(ENTRY_KEYS)
    entry |= {"config": config, "baseline": LABELS[mode]}
    if packed:
        entry["slot_ratio"] = base["slots"] / packed["slots"]
        entry["flop_ideal"] = base["executed_flops"] / packed["executed_flops"]
    p_step, b_step = _median_step(packed), _median_step(base)
    if p_step is not None:
        entry["packed_tokens_per_s"] = packed["tokens"] / p_step
        entry["packed_tflops"] = packed["executed_flops"] / p_step / 1e12
        rate = packed["useful_flops"] / p_step
        entry["mfu"] = rate / peak if peak else None
        entry["mfu_of_matmul"] = rate / matmul if matmul else None
    if b_step is not None:
        entry["baseline_tokens_per_s"] = base["tokens"] / b_step
        entry["baseline_tflops"] = base["executed_flops"] / b_step / 1e12
    if p_step is not None and b_step is not None:
        scale = packed["tokens"] / base["tokens"]  # 1: the same documents
        pairs = [
            scale * b / p for p, b in zip(packed["step_times"], base["step_times"], strict=False)
        ]
        median = statistics.median(pairs)
        entry |= {"ratio": median, "ratio_min": min(pairs), "ratio_max": max(pairs)}
        entry["spread"] = (max(pairs) - min(pairs)) / median
        entry["noisy"] = entry["spread"] > NOISY
    return entry


def _median_step(row: dict[str, Any]) -> float | None:
    if row.get("status") != "ok" or not row.get("step_times"):
        return None
    return statistics.median(row["step_times"])
