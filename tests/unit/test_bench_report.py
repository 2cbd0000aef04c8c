"""The bench prints the README's tables, with a met / not met verdict for every target."""

from __future__ import annotations

from typing import Any

from megapack.bench.report import markdown, packing_table, throughput_table, verdict

SETTINGS = {"quick": False, "best_time_limit_s": 10.0}


def results(**sections: list[dict[str, Any]]) -> dict[str, Any]:
    return {"settings": SETTINGS, "transfer": [], "throughput": [], "packing": [], **sections}


def test_verdicts() -> None:
    assert verdict(1.19, 1.2, at_most=True) == "1.19, met"
    assert verdict(2.34, 1.2, at_most=True) == "2.34, not met"
    assert verdict(0.9, 0.9, at_most=False) == "0.90, met"
    assert verdict(0.89, 0.9, at_most=False) == "0.89, not met"


def test_throughput_table_compares_packing_with_each_baseline() -> None:
    base = {"dataset": "openchat", "config": "openchat", "status": "ok", "tokens": 1000,
            "useful_flops": 5e9}  # fmt: skip
    rows = [
        base | {"mode": "packed", "step_times": [0.1, 0.12], "slots": 1024, "executed_flops": 6e9},
        base | {"mode": "grouped", "step_times": [0.15, 0.12], "slots": 1200, "executed_flops": 7e9},
        base | {"mode": "padded_fixed", "step_times": [0.3, 0.3], "slots": 4096, "executed_flops": 2e10},
    ]  # fmt: skip
    text = markdown(results(throughput=rows))
    # the ratios step by step: 0.15 / 0.10 and 0.12 / 0.12 -> median 1.25 [1.00, 1.50], noisy
    # executed FLOP/s round by round: (6e9 / p) / (7e9 / g) -> 0.857 x 1.25 = 1.07 (median)
    assert ("| openchat | length-grouped padding, sorted step, token budget | 9,091 | 7,407 | "
            "1.25 [1.00, 1.50] noisy | 1.17 | 1.17 | 1.07 | 54.55 | 51.85 |") in text  # fmt: skip
    assert (
        "| openchat | padded to seq | 9,091 | 3,333 | 2.75 [2.50, 3.00] noisy | 4.00 | 3.33 | 0.82 |"
        in text
    )
    assert "met" not in text  # no target on CPU times
    assert "Attention of" not in text  # no backend choice in these rows


def test_throughput_notes_say_how_a_step_was_laid_out_and_which_attention_ran() -> None:
    base = {"dataset": "openchat", "config": "openchat", "status": "ok", "tokens": 1000, "useful_flops": 5e9,
            "step_times": [0.1], "slots": 1024, "executed_flops": 6e9, "documents": 9, "pool": 2000,
            "fill": 0.991, "micro_batches": 4, "timed_micro_batches": 4}  # fmt: skip
    rows = [
        base | {"mode": "packed", "attention": "bucketed", "attention_choice": "the faster packed step, ..."},
        base | {"mode": "padded_fixed", "micro_batches": 9, "timed_tokens": 400},
    ]  # fmt: skip
    text = throughput_table(rows, {"throughput_steps": 1})
    assert ("A step: openchat: 4 packed micro-batches (9 documents, 99.1% full) from a plan over "
            "2,000, every mode over the same documents.") in text  # fmt: skip
    assert "Timed on their first micro-batches: openchat padded_fixed 4 of 9." in text
    assert "(padded rows run dense): openchat: bucketed, the faster packed step, ..." in text


def test_packing_table_targets() -> None:
    rows = [
        {"dataset": "openchat", "algorithm": "bfd", "rows": 4673, "efficiency": 0.99494, "seconds": 0.012},
        {"dataset": "openchat", "algorithm": "best", "rows": 4666, "efficiency": 0.99642, "seconds": 6.0},
        {"dataset": "openchat", "algorithm": "streaming bfd, buffer 1,000", "rows": 4674,
         "efficiency": 0.98, "seconds": 0.11},
        {"dataset": "lognormal-1,000,000", "algorithm": "bfd", "capacity": 4096, "rows": 157517,
         "lower_bound": 157510, "efficiency": 0.99995, "seconds": 2.5, "peak_mib": 92.4},
    ]  # fmt: skip
    text = markdown(results(packing=rows))
    assert "| openchat | bfd | 4,673 | 99.49% | 0.01 |  |" in text
    assert "| openchat | best | 4,666 | 99.64% | 6.00 | >= 99.62% within 10 s: met |" in text
    assert (
        "| openchat | streaming bfd, buffer 1,000 | 4,674 | 98.00% | 0.11 | >= 99%: not met |"
        in text
    )
    assert (
        "| lognormal 1,000,000 (capacity 4,096) | bfd | 157,517 (bound 157,510) | 99.995% | "
        "2.50, 92 MiB peak | < 2 s (2 s per 1M lengths), O(n): not met |"
    ) in text


def test_quick_runs_say_their_verdicts_are_indicative() -> None:
    quick = {**results(), "settings": {**SETTINGS, "quick": True}}
    assert markdown(quick).startswith("--quick: every size is small")
    assert "--quick" not in markdown(results())


def test_the_readme_shows_the_tables_the_bench_prints() -> None:
    """The benchmarks guide's throughput and packing tables have exactly the bench's columns."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    one = {"dataset": "d", "mode": "packed", "tokens_per_s": 1.0, "efficiency": 1.0,
           "algorithm": "bfd", "rows": 1, "seconds": 0.1, "config": "d"}  # fmt: skip
    for table in (
        throughput_table([one], SETTINGS),
        packing_table([{**one, "dataset": "openchat"}], SETTINGS),
    ):
        header = table.splitlines()[0]
        assert header in readme, f"docs/benchmarks.md lacks the bench's table header {header}"
