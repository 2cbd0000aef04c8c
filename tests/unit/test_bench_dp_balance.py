"""megapack.bench.dp_balance: both plans on real-looking lengths, the target verdict, the report."""

from __future__ import annotations

import numpy as np

from megapack.bench.dp_balance import long_tail_lengths, markdown, run_balance


def test_balance_bench_rows_and_verdict() -> None:
    lengths = np.clip(np.random.default_rng(0).lognormal(6.5, 1.0, 1500), 8, 2048).astype(int)
    rows = run_balance(lengths.tolist(), long_tail_n=800)
    assert {(r["dataset"], r["dp_size"], r["cost"]) for r in rows} == {
        (d, dp, c)
        for d in ("openchat", "long-tail")
        for dp in (2, 8)
        for c in ("llama3-8b", "sum(len^2)")
    }
    for r in rows:
        assert 1.0 <= r["imbalance_compute_plan"] <= r["imbalance_token_plan"]
        assert r["efficiency_loss_pt"] == 0.0
        want = max(1.02, 1 + (r["imbalance_token_plan"] - 1) / 2)
        assert r["target_imbalance"] == want
        checked = r["dataset"] == "openchat" and r["dp_size"] == 8
        assert r["verdict"] == (
            ("pass" if r["imbalance_compute_plan"] <= want else "FAIL") if checked else ""
        )
    text = markdown(rows, [])
    assert text.count("| pass |") + text.count("| FAIL |") == 2


def test_balance_bench_long_tail_is_long_tailed() -> None:
    values = long_tail_lengths(10_000)
    assert values.min() >= 16 and values.max() <= 16384
    assert np.median(values) < 400 and (values > 2048).mean() > 0.02
