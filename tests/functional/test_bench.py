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
        assert r["pack_anon_mib"] is None or 0 < r["pack_anon_mib"] <= r["pack_peak_mib"], r
        assert r["ratio"] == pytest.approx(r["pack_s"] / r["bare_s"]) and r["verdict"] in (
            "ok",
            "SLOW",
        )
    assert {(r["tp"], r["seq_len"]) for r in data["transfer"]} == {(2, 4096), (4, 4096)}
    for r in data["transfer"]:
        timed = ("megapack_ms", "megapack_collectives_ms", "megapack_fields_ms", "per_tensor_ms",
                 "bare_megatron_ms")  # fmt: skip
        assert all(r[k] > 0 for k in (*timed, "prefetch_step_ms", "compute_ms")), r
        assert r["prefetch_blocked_ms"] >= 0 and r["prefetch_step_ms"] >= r["compute_ms"], r
        stages = r["bytes_per_stage"]
        assert set(stages) == {"only", "first", "middle", "last", "mtp"}, stages
        assert stages["mtp"] == stages["only"], stages  # MTP layers need both ends' fields
        assert stages["middle"] < min(stages["first"], stages["last"]) <= stages["only"], stages
        assert r["payload_bytes"] == stages["only"] == r["megatron_bytes"], r  # fields in full
        # three float32 per-token fields: 3 x 4 bytes a token more
        assert r["fields_payload_bytes"] == r["payload_bytes"] + 3 * 4 * r["seq_len"], r
    assert "megapack / bare" in done.stdout and "Bytes per micro-batch" in done.stdout
    from megapack.bench.modes import MODES

    modes = {(r["dataset"], r["mode"]) for r in data["throughput"]}
    assert modes == {(d, m) for d in ("openchat", "sft-short") for m in MODES}
    for r in data["throughput"]:
        assert r["tokens_per_s"] > 0 and 0 < r["efficiency"] <= 1 and len(r["step_times"]) == 2
        assert r["executed_flops"] >= r["useful_flops"] > 0, r  # padding and spans cost, never save
    packed = {r["dataset"]: r for r in data["throughput"] if r["mode"] == "packed"}
    for r in data["throughput"]:  # the same documents in every mode, a window of a plan
        assert r["tokens"] == packed[r["dataset"]]["tokens"] and r["pool"] == 2000, r
        full = r["mode"] in (
            "packed",
            "grouped",
            "ceiling",
        )  # the others: a sample, as many as packed
        ran = (
            r["micro_batches"]
            if full
            else min(r["micro_batches"], packed[r["dataset"]]["micro_batches"])
        )
        assert r["timed_micro_batches"] == ran and (r["timed_tokens"] == r["tokens"]) == (
            ran == r["micro_batches"]
        ), r
        assert r["attention"] in (
            ("sdpa", "bucketed") if r["mode"] in ("packed", "ceiling") else ("dense (padded rows)",)
        )
    for r in packed.values():  # no filler: every packed micro-batch full of rows from a big plan
        assert r["micro_batches"] == 4 and r["slots"] == 4 * 4 * 512 and r["fill"] > 0.95, r
        assert r["attention_choice"].startswith(("the faster packed step", "the only candidate")), r
    assert (
        "Attention of packed rows and the ceiling (padded rows run dense): openchat: "
        in done.stdout
    )
    assert "the modes interleaved step by step" in done.stdout
    assert "--quick: every size is small" in done.stdout and "Note:" not in done.stdout
    for header in ("| tp | seq_len | megapack |", "| dataset | baseline | packed tokens/s | baseline tokens/s | ratio [min, max] |",
                   "| dataset | algorithm | rows | efficiency | seconds | target |"):  # fmt: skip
        assert header in done.stdout  # the README's tables
    assert done.stdout.count("met") >= 4  # a verdict for every target
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
    # the run ends with its summary: every target on one line, the same verdicts as the JSON,
    # and exit code 0 whether or not each was met (docs/benchmarks.md, "Exit code")
    targets = data["targets"]
    counts = {
        s: sum(t["section"] == s for t in targets)
        for s in ("transfer", "packing", "balance", "pack")
    }
    assert counts == {"transfer": 4, "packing": 3, "balance": 2, "pack": 3}, targets
    met = sum(t["met"] for t in targets)
    summary = done.stdout[done.stdout.index("## Summary: ") :]
    assert summary.startswith(f"## Summary: {met} of {len(targets)} targets met")
    for t in targets:
        timed = " (timed)" if t["timed"] else ""
        line = f"| {t['section']} | {t['target']}{timed} | {t['value']} | {'met' if t['met'] else 'NOT MET'} |"
        assert line in summary.splitlines(), (line, summary)
    assert done.stdout.rstrip().endswith('docs/benchmarks.md, "Exit code").')
    assert any("growth for 10x the documents" in t["target"] for t in targets)


def test_quick_run_never_overwrites_a_full_run(tmp_path: Path) -> None:
    full = tmp_path / "bench.json"
    full.write_text(json.dumps({"settings": {"quick": False}, "throughput": []}))
    cmd = [sys.executable, "-m", "megapack", "bench", "--quick", "--json", str(full)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "holds a full run's results; --quick would overwrite them" in done.stderr
    assert json.loads(full.read_text())["settings"] == {"quick": False}  # untouched
    script = (Path(__file__).resolve().parents[2] / "scripts" / "bench.sh").read_text()
    assert "out=bench-out/quick" in script
