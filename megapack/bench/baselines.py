"""Fair baselines, timed fairly: the modes of `megapack.bench.modes` interleaved step by step
(`interleave`) and summarized against packing (`summarize`). One module for `megapack bench` and
the GPU kit.

Interleaving: every mode runs one step, then every mode again (ABCDE ABCDE ...), first the
untimed warm-up rounds, then the timed ones, so a slow phase of the machine (another job, clocks,
a thermal limit) lands on every mode alike; the i-th timed step of packing is paired with the i-th
of each baseline, from the same round.

Each measured mode is a row: ``config`` (what the modes share, e.g. ``"openchat, seq 4096"``),
``mode``, ``status`` ("ok" when timed), ``step_times`` (seconds of each timed step); of the mode's
whole layout of the step's documents (the same documents in every mode): ``tokens``, ``slots``,
``useful_flops``, ``executed_flops``; and of what a step runs, where a context baseline runs a
sample of its micro-batches (`megapack.bench.modes.timed`): ``timed_tokens``,
``timed_useful_flops``, ``timed_executed_flops`` (absent: the whole layout ran).

`summarize` gives one entry per (config, baseline):

    ratio, ratio_min, ratio_max   packed tokens/s over the baseline's, round by round: median, min,
                                  max; verdicts read the median
    spread                        (max - min) / median of that ratio; ``noisy`` above `NOISY`
    slot_ratio                    the baseline's token slots over packing's
    flop_ideal                    the baseline's executed FLOPs over packing's: what a step would
                                  gain if time followed executed FLOPs
    executed_ratio                packing's executed FLOP/s over the baseline's, round by round,
                                  median (equal to ratio / flop_ideal when both ran every
                                  micro-batch): packed / grouped >= 0.97x the ideal is this >= 0.97
    packed_tflops, baseline_tflops   executed FLOPs per second (median step) of each
    packed_spread                 (max - min) / median of packing's own step times
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
    >>> round(e["executed_ratio"], 4), round(e["packed_spread"], 4)
    (1.8333, 0.6667)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from typing import Any

from megapack.bench.gpu.report import THROUGHPUT_KEYS
from megapack.bench.modes import BASELINES, LABELS

NOISY = 0.10
"""A ratio whose (max - min) / median exceeds this is noisy; a target on it is too noisy to judge."""
ENTRY_KEYS = THROUGHPUT_KEYS
"""The keys of every entry, as the GPU kit's report writes them."""


def interleave(
    runs: Mapping[str, Callable[[], float]],
    *,
    warmup: int,
    steps: int,
    catch: bool = True,
    on_error: Callable[[str, Exception], None] | None = None,
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Run every mode's step in turn, round after round (module docstring): ``warmup`` untimed
    rounds, then ``steps`` timed ones. Each callable runs one step and returns its seconds.

    Returns:
        (seconds of every timed step per mode, error per mode). With ``catch`` a mode whose step
        raises is recorded as ``"TypeName: message"`` (``on_error(mode, exc)`` runs first, e.g. to
        free memory) and left out of the later rounds; without it the exception propagates (runs
        on several ranks must fail together).

    Example:
        >>> order = []
        >>> def run(mode):
        ...     return lambda: order.append(mode) or 1.0
        >>> times, errors = interleave({"A": run("A"), "B": run("B")}, warmup=1, steps=2)
        >>> "".join(order), times, errors
        ('ABABAB', {'A': [1.0, 1.0], 'B': [1.0, 1.0]}, {})
    """
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    errors: dict[str, str] = {}
    for round_ in range(warmup + steps):
        for mode, run in runs.items():
            if mode in errors:
                continue
            try:
                seconds = run()
            except Exception as exc:
                if not catch:
                    raise
                if on_error is not None:
                    on_error(mode, exc)
                errors[mode] = f"{type(exc).__name__}: {exc}"
                times.pop(mode, None)
                continue
            if round_ >= warmup:
                times[mode].append(seconds)
    return times, errors


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
        entry["packed_tokens_per_s"] = _timed(packed, "tokens") / p_step
        entry["packed_tflops"] = _timed(packed, "executed_flops") / p_step / 1e12
        rate = _timed(packed, "useful_flops") / p_step
        entry["mfu"] = rate / peak if peak else None
        entry["mfu_of_matmul"] = rate / matmul if matmul else None
        times = packed["step_times"]
        entry["packed_spread"] = (max(times) - min(times)) / statistics.median(times)
    if b_step is not None:
        entry["baseline_tokens_per_s"] = _timed(base, "tokens") / b_step
        entry["baseline_tflops"] = _timed(base, "executed_flops") / b_step / 1e12
    if p_step is not None and b_step is not None:
        rounds = list(zip(packed["step_times"], base["step_times"], strict=False))
        tokens = _timed(packed, "tokens") / _timed(base, "tokens")  # 1: the same documents
        pairs = [tokens * b / p for p, b in rounds]
        median = statistics.median(pairs)
        entry |= {"ratio": median, "ratio_min": min(pairs), "ratio_max": max(pairs)}
        entry["spread"] = (max(pairs) - min(pairs)) / median
        entry["noisy"] = entry["spread"] > NOISY
        flops = _timed(packed, "executed_flops") / _timed(base, "executed_flops")
        entry["executed_ratio"] = statistics.median(flops * b / p for p, b in rounds)
    return entry


def _timed(row: dict[str, Any], key: str) -> float:
    """What the timed steps ran: ``timed_<key>`` where a sample ran, else the whole layout's."""
    value = row.get(f"timed_{key}")
    return float(row[key] if value is None else value)


def _median_step(row: dict[str, Any]) -> float | None:
    if row.get("status") != "ok" or not row.get("step_times"):
        return None
    return statistics.median(row["step_times"])
