"""The GPU kit's arithmetic and report, on CPU: FLOPs, length mixes, ratios, target verdicts, JSON.

The GPU runs themselves are in tests/functional/test_gpu_kit.py (the dry run here, ``gpu``-marked
tests on a GPU).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megapack.bench.gpu import (
    PADDED,
    TARGETS,
    length_mixes,
    step_estimate,
    summarize,
    target_checks,
)
from megapack.bench.gpu_model import PRESET, TOY, GptShape
from megapack.bench.gpu_report import (
    CHECK_KEYS,
    THROUGHPUT_KEYS,
    Check,
    Report,
    markdown,
    record_crash,
)


# -- FLOPs ---------------------------------------------------------------------------------------
def test_training_flops_worked_example() -> None:
    """The module docstring's example, counted by hand: every weight matrix a token meets, x2, x3."""
    h, d, g, f, v, layers = 64, 16, 2, 256, 256, 2
    per_token = 2 * (layers * (h * (h + 2 * g * d) + h * h + 2 * h * f) + h * v)
    assert TOY.matmul_flops_per_token() == per_token == 212_992
    attention = 4 * h * layers * (3 * 4 // 2 + 2 * 3 // 2)  # (query, key) pairs: 6 + 3
    assert TOY.training_flops([3, 2]) == 3 * (5 * per_token + attention) == 3_208_704


def test_flops_are_per_document_not_per_row() -> None:
    """THD-aware: a row's FLOPs are its documents' FLOPs summed (no cross-document attention)."""
    lengths = [1, 700, 33, 2048]
    assert PRESET.training_flops(lengths) == sum(PRESET.training_flops([n]) for n in lengths)
    whole_row = PRESET.training_flops([sum(lengths)])
    assert whole_row > PRESET.training_flops(lengths)  # one 2,782-token document attends more
    gated = GptShape(**{**{k: getattr(TOY, k) for k in TOY.__slots__}, "gated": True})
    assert gated.matmul_flops_per_token() - TOY.matmul_flops_per_token() == 2 * 2 * 64 * 256


def test_preset_is_the_advertised_size() -> None:
    assert PRESET.parameters() == 835_850_240  # the kit's "model" check compares it to GPTModel's
    assert (PRESET.head_dim, PRESET.num_attention_heads // PRESET.num_query_groups) == (128, 4)
    assert PRESET.matmul_flops_per_token() == 2 * (
        PRESET.parameters() - 2048 * 32000 - 4096 - 16 * 4 * 2048
    )


# -- length mixes ---------------------------------------------------------------------------------
def test_length_mixes() -> None:
    source = [2048, 1500, 700, 90, 3]
    mixes = length_mixes(source, 2000, max_len=4096, seed=1)
    assert set(mixes["openchat"]) <= set(source) and len(mixes["openchat"]) == 2000
    assert 185 <= np.median(mixes["sft-short"]) <= 215  # lognormal, median 200
    assert min(mixes["sft-short"]) >= 1 and max(mixes["sft-short"]) <= 4096
    assert mixes == length_mixes(source, 2000, max_len=4096, seed=1)
    small = length_mixes(source, 50, max_len=64, scale=1 / 32)
    assert max(small["openchat"]) <= 64 and min(small["openchat"]) >= 1
    assert max(small["sft-short"]) <= 64


# -- the summary and the targets ------------------------------------------------------------------
def rows(packed_tps: float = 70_000.0, fixed_tps: float = 30_000.0, longest_tps: float = 60_000.0) -> list[dict[str, Any]]:  # fmt: skip
    base = {
        "seq_len": 4096,
        "mix": "openchat",
        "status": "ok",
        "flops": 2.0e15,
        "real_tokens": 100_000,
        "micro_batches": 13,
    }
    return [
        base | {"mode": "packed", "tokens_per_s": packed_tps, "step_s": 5.0, "slots": 106_496},
        base | {"mode": "padded_fixed", "tokens_per_s": fixed_tps, "step_s": 9.0, "slots": 262_144},
        base | {"mode": "padded_longest", "tokens_per_s": longest_tps, "step_s": 6.0, "slots": 120_000},
    ]  # fmt: skip


def test_summarize() -> None:
    summary = summarize(rows(), ceiling_flops=800e12)
    assert [s["config"] for s in summary] == [
        f"openchat, seq 4096, vs {label}" for label in PADDED.values()
    ]
    assert all(tuple(s) == THROUGHPUT_KEYS for s in summary)
    fixed, longest = summary
    assert fixed["ratio"] == pytest.approx(70_000 / 30_000)
    assert fixed["theoretical_ratio"] == pytest.approx(262_144 / 106_496)
    assert longest["theoretical_ratio"] == pytest.approx(120_000 / 106_496)
    assert (
        fixed["mfu"] == longest["mfu"] == pytest.approx(2.0e15 / 5.0 / 800e12)
    )  # the packed run's
    failed = rows()
    failed[1] |= {"status": "error", "detail": "OutOfMemoryError"}
    fixed, longest = summarize(failed, ceiling_flops=800e12)
    assert fixed["ratio"] is None and fixed["padded_tokens_per_s"] is None
    assert fixed["theoretical_ratio"] == pytest.approx(262_144 / 106_496)  # slots are known anyway
    assert longest["ratio"] == pytest.approx(70_000 / 60_000)


def sync(*statuses: str) -> list[Check]:
    return [Check(name=f"sync {i}", status=s, detail="") for i, s in enumerate(statuses)]  # type: ignore[arg-type]


def test_targets_met_and_not_met() -> None:
    # 0.84B on an H200 as a colleague measured it: 2.31x of a 2.46 slot ratio (0.94), 1.15x, 47%
    share, slot_ratio = TARGETS["share_of_slot_ratio"], 262_144 / 106_496
    met = summarize(rows(packed_tps=30_000 * slot_ratio * share + 1, longest_tps=10_000), 800e12)
    checks = target_checks(met, sync("passed", "passed"), seq_len=4096, applies=True)
    assert [c.status for c in checks] == ["passed"] * 4, checks
    just_under = summarize(
        rows(packed_tps=30_000 * slot_ratio * share - 50, longest_tps=70_000 / 1.09), 1e15
    )
    checks = target_checks(just_under, sync("passed", "failed"), seq_len=4096, applies=True)
    assert [c.status for c in checks] == ["failed"] * 4, checks
    assert (
        "= 0.949" in checks[0].detail
        and "1.09x" in checks[1].detail
        and "40.0%" in checks[2].detail
    )
    assert "sync 1" in checks[3].detail


def test_targets_not_measured_or_not_applicable() -> None:
    checks = target_checks([], [], seq_len=4096, applies=True)
    assert [c.status for c in checks] == ["failed"] * 4
    assert all(
        "not measured" in c.detail or "0 sync" in c.detail or "passed" in c.detail
        for c in checks[:3]
    )
    skipped = target_checks(
        summarize(rows(), 1e15), sync("passed"), seq_len=4096, applies=False, why_not="dry run"
    )
    assert [(c.status, c.detail) for c in skipped] == [("skipped", "dry run")] * 4


# -- the report ------------------------------------------------------------------------------------
def test_report_json_shape_and_markdown(tmp_path: Path) -> None:
    report = Report(
        out=tmp_path / "out",
        device="NVIDIA H100 80GB HBM3",
        torch="2.11.0+cu130",
        notes=["note one"],
    )
    report.throughput = summarize(rows(), 800e12)
    report.details = rows()
    report.add(Check(name="attention: sdpa", status="passed", detail="worst 1e-7 | fine"),
               Check(name="sync", status="failed", detail="RuntimeError\n  File x"))  # fmt: skip
    data = json.loads((tmp_path / "out" / "gpu-report.json").read_text())
    assert list(data) == ["device", "torch", "checks", "throughput"]
    assert all(tuple(c) == CHECK_KEYS for c in data["checks"])
    assert all(tuple(t) == THROUGHPUT_KEYS for t in data["throughput"])
    assert data["checks"][1] == {
        "name": "sync",
        "status": "failed",
        "detail": "RuntimeError\n  File x",
    }
    text = (tmp_path / "out" / "gpu-report.md").read_text()
    assert text == markdown(data, ["note one"], rows())
    assert "1 passed, 1 failed, 0 skipped" in text and "note one" in text
    assert (
        "| attention: sdpa | passed | worst 1e-7 \\| fine |" in text
    )  # a | in a detail is escaped
    assert (
        "| openchat, seq 4096, vs padded to seq | 70,000 | 30,000 | 2.33 | 2.46 | 95% | 50.0% |"
        in text
    )
    assert "| 4096 | openchat | padded_fixed | ok | 30,000 | 9.000 | " in text
    assert report.failed == [report.checks[1]]
    with pytest.raises(ValueError, match="status must be one of"):
        Check(name="x", status="ok", detail="")  # type: ignore[arg-type]


def test_record_crash_keeps_what_was_measured(tmp_path: Path) -> None:
    Report(
        out=tmp_path, device="gpu", torch="t", checks=[Check(name="a", status="passed", detail="")]
    ).write()
    log = tmp_path / "gpu-kit.log"
    log.write_text("\n".join(f"line {i}" for i in range(100)))
    record_crash(tmp_path, 137, log)
    data = json.loads((tmp_path / "gpu-report.json").read_text())
    assert [c["status"] for c in data["checks"]] == ["passed", "failed"]
    last = data["checks"][-1]
    assert last["name"] == "kit process" and "killed by signal 9" in last["detail"]
    assert "line 99" in last["detail"] and "line 69" not in last["detail"]
    fresh = tmp_path / "fresh"
    record_crash(fresh, 1, None)  # nothing written before the crash: a report with just that
    data = json.loads((fresh / "gpu-report.json").read_text())
    assert data["device"] == "unknown" and data["checks"][0]["detail"].startswith(
        "the kit's Python process exited 1"
    )


def test_a_step_is_estimated_from_the_same_mode_at_the_shorter_length() -> None:
    # measured on an H100 (seq 4096): openchat padded to seq, 262,144 slots in 3.079 s; the
    # slowest per slot was a small step (short SFT padded to its longest: 25,194 slots, 1.392 s)
    per_slot = [1.303 / 106_496, 3.079 / 262_144, 1.392 / 25_194]
    # seq 8192: twice the slots, attention up to twice per slot: at most 4x the step
    assert step_estimate((4096, 262_144, 3.079), 8192, 524_288, per_slot) == pytest.approx(
        4 * 3.079
    )
    # the same length again (or shorter): the slots alone
    assert step_estimate((4096, 262_144, 3.079), 4096, 131_072, per_slot) == pytest.approx(
        3.079 / 2
    )
    # nothing measured for this mode yet: the slowest seconds per slot so far, times the slots
    assert step_estimate(None, 8192, 114_688, per_slot) == pytest.approx(114_688 * 1.392 / 25_194)
    assert step_estimate(None, 4096, 1_000, []) == 0.0  # the first step: nothing to go by
