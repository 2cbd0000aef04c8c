"""Fair baselines timed fairly (`megapack.bench.baselines`): modes interleaved step by step, the
ratios paired round by round, a sampled context baseline's rates from what it ran."""

from __future__ import annotations

import doctest
from typing import Any

import pytest

from megapack.bench import baselines
from megapack.bench.baselines import interleave, summarize
from megapack.bench.gpu.report import THROUGHPUT_KEYS
from megapack.bench.modes import LABELS


def test_docstring_examples() -> None:
    result = doctest.testmod(baselines)
    assert result.failed == 0 and result.attempted >= 5


def test_interleave_runs_every_mode_in_turn_round_after_round() -> None:
    order: list[str] = []
    clock = iter(range(100))

    def run(mode: str) -> Any:
        return lambda: order.append(mode) or float(next(clock))

    times, errors = interleave({m: run(m) for m in "ABC"}, warmup=2, steps=3)
    assert "".join(order) == "ABC" * 5  # ABC ABC ..., never AAAAA BBBBB
    assert times == {"A": [6.0, 9.0, 12.0], "B": [7.0, 10.0, 13.0], "C": [8.0, 11.0, 14.0]}
    assert errors == {}


def test_interleave_records_a_failing_mode_and_goes_on() -> None:
    order: list[str] = []
    freed: list[tuple[str, str]] = []

    def oom() -> float:
        order.append("B")
        if order.count("B") == 2:
            raise MemoryError("out of memory")
        return 2.0

    runs = {"A": lambda: order.append("A") or 1.0, "B": oom, "C": lambda: order.append("C") or 3.0}
    times, errors = interleave(
        runs, warmup=1, steps=2, on_error=lambda m, e: freed.append((m, str(e)))
    )
    assert "".join(order) == "ABCABCAC"  # B fails in round 2 and sits the rest out
    assert times == {"A": [1.0, 1.0], "C": [3.0, 3.0]}
    assert errors == {"B": "MemoryError: out of memory"} and freed == [("B", "out of memory")]

    def always() -> float:
        raise MemoryError("out of memory")

    with pytest.raises(MemoryError):  # several ranks: fail together, never skip on one rank
        interleave({"A": runs["A"], "B": always}, warmup=0, steps=3, catch=False)


def row(mode: str, times: list[float], **extra: Any) -> dict[str, Any]:
    return {"config": "c", "mode": mode, "status": "ok", "step_times": times, "tokens": 1000,
            "useful_flops": 6e12, **extra}  # fmt: skip


def test_a_sampled_baseline_is_rated_on_what_it_ran() -> None:
    """Padded to seq ran 2 of its 10 micro-batches (200 of the 1,000 tokens): its tokens/s and
    TFLOP/s count those; the slot ratio and the ideal count the whole layout."""
    packed = row("packed", [1.0, 1.1, 0.9], slots=1024, executed_flops=7e12)
    fixed = row("padded_fixed", [0.5, 0.5, 0.5], slots=10_240, executed_flops=5e13,
                timed_tokens=200, timed_executed_flops=1e13, timed_useful_flops=1.2e12)  # fmt: skip
    (entry,) = summarize([packed, fixed], peak_flops=1e13)
    assert tuple(entry) == THROUGHPUT_KEYS and entry["baseline"] == LABELS["padded_fixed"]
    assert entry["baseline_tokens_per_s"] == pytest.approx(200 / 0.5)
    assert entry["baseline_tflops"] == pytest.approx(1e13 / 0.5 / 1e12)
    assert entry["packed_tokens_per_s"] == pytest.approx(1000 / 1.0)
    # round by round: (1000 / p) / (200 / 0.5) = 2.5 / p
    assert (entry["ratio_min"], entry["ratio"], entry["ratio_max"]) == pytest.approx(
        (2.5 / 1.1, 2.5, 2.5 / 0.9)
    )
    assert entry["slot_ratio"] == 10.0 and entry["flop_ideal"] == pytest.approx(5e13 / 7e12)
    # executed FLOP/s, round by round: (7e12 / p) / (1e13 / 0.5) = 0.35 / p
    assert entry["executed_ratio"] == pytest.approx(0.35)
    assert entry["packed_spread"] == pytest.approx(0.2) and entry["mfu"] == pytest.approx(0.6)


def test_ratios_pair_the_same_round() -> None:
    """A slow phase that hits both modes in one round moves neither ratio."""
    packed = row("packed", [1.0, 2.0, 1.0], slots=1, executed_flops=1.0)
    grouped = row("grouped", [1.1, 2.2, 1.1], slots=1, executed_flops=1.0)
    (entry,) = summarize([packed, grouped])
    assert entry["ratio_min"] == pytest.approx(1.1) and entry["ratio_max"] == pytest.approx(1.1)
    assert entry["spread"] == pytest.approx(0.0) and not entry["noisy"]
    assert entry["packed_spread"] == pytest.approx(1.0)  # packing's own steps did spread
