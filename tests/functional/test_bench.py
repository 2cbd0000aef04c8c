"""`megapack bench --quick` runs every section and writes the table, the JSON schema and the plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed


def test_quick_bench_writes_table_json_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "megapack.cli",
        "bench",
        "--quick",
        "--json",
        str(out),
        "--plots",
        str(tmp_path / "plots"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    for title in (
        "## Transfer",
        "## Throughput",
        "## Packing",
        "## Pack:",
        "megatron-core",
        "commit",
    ):
        assert title in done.stdout
    data = json.loads(out.read_text())
    assert {"env", "transfer", "throughput", "packing", "pack"} <= set(data)
    small, large = data["pack"]
    assert large["documents"] == 10 * small["documents"] and large["tokens"] > 5 * small["tokens"]
    for r in data["pack"]:
        assert r["bare_s"] > 0 and r["pack_s"] > 0 and r["pack_peak_mib"] > 0
        assert r["ratio"] == pytest.approx(r["pack_s"] / r["bare_s"]) and r["verdict"] in (
            "ok",
            "SLOW",
        )
    assert {(r["tp"], r["seq_len"]) for r in data["transfer"]} == {(2, 4096), (4, 4096)}
    for r in data["transfer"]:
        timed = ("megapack_ms", "per_tensor_ms", "bare_megatron_ms", "bare_payload_ms")
        assert all(r[k] > 0 for k in (*timed, "prefetch_step_ms", "compute_ms")), r
        assert r["prefetch_blocked_ms"] >= 0 and r["prefetch_step_ms"] >= r["compute_ms"], r
        stages = r["bytes_per_stage"]
        assert set(stages) == {"only", "first", "middle", "last", "mtp"}, stages
        assert stages["mtp"] == stages["only"], stages  # MTP layers need both ends' fields
        assert stages["middle"] < min(stages["first"], stages["last"]) <= stages["only"], stages
        # the lean wire ships tokens to the last stage too (labels are rebuilt from them), so MTP
        # (which also embeds tokens) costs at most the position_ids, which are derived when standard
        assert stages["last"] <= stages["mtp"], stages
        assert r["payload_bytes"] == stages["only"] and r["megatron_bytes"] > 0
    assert "megapack / bare Megatron" in done.stdout and "Bytes per micro-batch" in done.stdout
    modes = {(r["dataset"], r["mode"]) for r in data["throughput"]}
    assert modes == {
        (d, m)
        for d in ("openchat", "sft-short")
        for m in ("packed", "padded_fixed", "padded_longest")
    }
    for r in data["throughput"]:
        assert r["tokens_per_s"] > 0 and 0 < r["efficiency"] <= 1
        if r["mode"] == "padded_fixed":  # one document per row never needs fewer rows than packing
            assert r["theoretical_speedup"] >= 1.0
    algorithms = {r["algorithm"] for r in data["packing"] if r["dataset"] == "openchat"}
    assert algorithms == {
        "next_fit",
        "first_fit",
        "ffd",
        "bfd",
        "best",
        "streaming bfd, buffer 1,000",
    }
    best = {r["algorithm"]: r["rows"] for r in data["packing"] if r["dataset"] == "openchat"}
    assert best["best"] <= best["bfd"]
    for name in ("throughput.png", "transfer.png", "packing.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    # balance section: both plans side by side, the target verdict, the CPU timing of both plans
    assert "## Balance" in done.stdout
    verdicts = [r["verdict"] for r in data["balance"] if r["verdict"]]
    assert verdicts and all(v in ("pass", "FAIL") for v in verdicts)
    for r in data["balance"]:
        assert r["imbalance_compute_plan"] <= r["imbalance_token_plan"]
    assert {r["mode"] for r in data["balance_timing"]} == {"token", "compute"}
    assert all(r["slowest_rank_s"] >= r["ideal_s"] > 0 for r in data["balance_timing"])
