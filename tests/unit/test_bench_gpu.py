"""The GPU kit's arithmetic and report, on CPU: FLOPs, length mixes, ratios with their spread,
device peaks, target verdicts, the profile, JSON (the modes: test_bench_modes.py).

The GPU runs themselves are in tests/functional/test_gpu_kit.py (the dry run here, ``gpu``-marked
tests on a GPU).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megapack.bench.baselines import summarize
from megapack.bench.gpu.devices import peak_bf16_flops
from megapack.bench.gpu.model import PRESET, TOY, GptShape
from megapack.bench.gpu.report import (
    CHECK_KEYS,
    THROUGHPUT_KEYS,
    Check,
    Report,
    markdown,
    record_crash,
)
from megapack.bench.gpu.targets import target_checks
from megapack.bench.gpu.throughput import length_mixes, step_estimate
from megapack.bench.modes import LABELS


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


def test_device_peaks_by_name() -> None:
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == (989e12, "H100 SXM")
    assert peak_bf16_flops("NVIDIA H100 NVL") == (835e12, "H100 NVL")
    assert peak_bf16_flops("NVIDIA H200") == (989e12, "H200")
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == (312e12, "A100")
    assert peak_bf16_flops("NVIDIA B200") == (2250e12, "B200")
    assert peak_bf16_flops("NVIDIA GH200 480GB") == (989e12, "GH200")
    assert peak_bf16_flops("NVIDIA L4") == (None, "unknown device")


# -- the summary and the targets ------------------------------------------------------------------
def rows(packed: list[float] | None = None, grouped_s: list[float] | None = None,
         ceiling_s: list[float] | None = None, fixed_s: list[float] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    base = {"config": "openchat, seq 4096", "status": "ok", "tokens": 100_000, "useful_flops": 2.0e15,
            "micro_batches": 13, "seq_len": 4096, "mix": "openchat"}  # fmt: skip
    return [
        base | {"mode": "packed", "step_times": packed or [5.0] * 5, "slots": 106_496, "executed_flops": 2.1e15},
        base | {"mode": "padded_fixed", "step_times": fixed_s or [9.0] * 5, "slots": 262_144, "executed_flops": 5.0e15},
        base | {"mode": "grouped", "step_times": grouped_s or [5.5] * 5, "slots": 110_000, "executed_flops": 2.2e15},
        base | {"mode": "ceiling", "step_times": ceiling_s or [5.2] * 5, "slots": 106_496, "executed_flops": 2.3e15},
    ]  # fmt: skip


def test_summarize_with_spread_and_denominators() -> None:
    summary = summarize(
        rows(packed=[5.0, 5.0, 4.0, 6.0, 5.0]), peak_flops=989e12, matmul_flops=760e12
    )
    assert [s["baseline"] for s in summary] == [
        LABELS[m] for m in ("padded_fixed", "grouped", "ceiling")
    ]
    assert all(tuple(s) == THROUGHPUT_KEYS for s in summary)
    fixed = summary[0]
    assert fixed["ratio"] == pytest.approx(9.0 / 5.0)
    assert (fixed["ratio_min"], fixed["ratio_max"]) == pytest.approx((9 / 6, 9 / 4))
    assert fixed["spread"] == pytest.approx((9 / 4 - 9 / 6) / (9 / 5)) and fixed["noisy"]
    assert fixed["slot_ratio"] == pytest.approx(262_144 / 106_496)
    assert fixed["flop_ideal"] == pytest.approx(5.0 / 2.1)
    assert fixed["mfu"] == pytest.approx(2.0e15 / 5.0 / 989e12)  # MFU: against the peak
    assert fixed["mfu_of_matmul"] == pytest.approx(2.0e15 / 5.0 / 760e12)
    assert fixed["packed_tflops"] == pytest.approx(2.1e15 / 5.0 / 1e12)
    steady = summarize(rows())[1]
    assert steady["spread"] == 0.0 and not steady["noisy"] and steady["mfu"] is None  # unknown peak
    failed = rows()
    failed[1] |= {"status": "error", "detail": "OutOfMemoryError"}
    fixed, grouped_entry, _ = summarize(failed)
    assert fixed["ratio"] is None and fixed["baseline_tokens_per_s"] is None
    assert fixed["slot_ratio"] == pytest.approx(262_144 / 106_496)  # slots are known anyway
    assert grouped_entry["ratio"] == pytest.approx(5.5 / 5.0)


def test_targets_met_in_every_configuration() -> None:
    """Packed at 0.98 of grouped's executed rate (ideal 1.05: ratio 1.029), 0.96 of the ceiling's,
    MFU 2e15 / 4.5 / 989e12 = 44.9% < 45%: the stretch alone fails."""
    summary = summarize(configs(packed_s=4.5, grouped_s=4.5 * 1.029, ceiling_s=4.5 * 1.04 * 0.96),
                        peak_flops=989e12)  # fmt: skip
    checks = target_checks(summary, seq_lens=(4096, 8192), applies=True)
    assert len(checks) == 4 * 3 + 1
    assert [c.status for c in checks[:-1]] == ["passed"] * 12, checks
    assert (
        checks[0].name
        == "target: packed / grouped >= 0.97x the executed-FLOP ideal (openchat, seq 4096)"
    )
    assert checks[0].detail.startswith("met: 0.980 against >= 0.97 (spread 0%)"), checks[0].detail
    assert "ideal 1.050" in checks[0].detail and "1.029x [1.029, 1.029]" in checks[1].detail
    assert checks[2].detail.startswith("met: 0.960 against >= 0.95"), checks[2].detail
    stretch = checks[-1]
    assert stretch.name == "target (stretch): packed MFU (bf16 peak) >= 45% (openchat, seq 4096)"
    assert stretch.status == "failed" and stretch.detail.startswith(
        "NOT MET: 44.9% against >= 0.45"
    )


def test_the_first_runs_throughput_targets_are_those_of_what_it_ran() -> None:
    """OpenChat at seq 4,096, packed and grouped only (the first run's throughput-4k): the ideal and
    grouped targets of that configuration and the stretch MFU, no ceiling target (not timed)."""
    narrowed = [r for r in configs(packed_s=4.5, grouped_s=4.5 * 1.029, ceiling_s=4.5)
                if r["config"] == "openchat, seq 4096" and r["mode"] in ("packed", "grouped")]  # fmt: skip
    summary = summarize(narrowed, peak_flops=989e12)
    checks = target_checks(
        summary, seq_lens=(4096,), applies=True, mixes=("openchat",), ceiling=False
    )
    assert [c.name for c in checks] == [
        "target: packed / grouped >= 0.97x the executed-FLOP ideal (openchat, seq 4096)",
        "target: packed >= 1.0x grouped where the ideal >= 1.03 (openchat, seq 4096)",
        "target (stretch): packed MFU (bf16 peak) >= 45% (openchat, seq 4096)",
    ]
    assert [c.status for c in checks] == ["passed", "passed", "failed"], checks
    assert checks[0].detail.startswith("met: 0.980 against >= 0.97 (spread 0%)")
    skipped = target_checks([], seq_lens=(4096,), applies=False, why_not="dry run", mixes=("openchat",),
                            ceiling=False)  # fmt: skip
    assert [c.status for c in skipped] == ["skipped"] * 3
    missing = target_checks([], seq_lens=(4096,), applies=True, mixes=("openchat",), ceiling=False)
    assert missing[0].status == "failed" and missing[0].detail.startswith("not measured")


def test_targets_not_met_just_under() -> None:
    summary = summarize(configs(packed_s=5.0, grouped_s=5.0 * 1.05 * 0.969, ceiling_s=5.0 * 1.04 * 0.949),
                        peak_flops=2.0e15 / 5.0 / 0.451)  # fmt: skip
    checks = target_checks(summary, seq_lens=(4096,), applies=True)
    ideal, grouped, ceiling, _, _, _, mfu = checks
    assert (ideal.status, grouped.status, ceiling.status, mfu.status) == (
        "failed",
        "passed",
        "failed",
        "passed",
    )
    assert ideal.detail.startswith("NOT MET: 0.969 against >= 0.97"), ideal.detail
    assert ceiling.detail.startswith("NOT MET: 0.949 against >= 0.95"), ceiling.detail


def test_a_noisy_target_fails_as_too_noisy_to_judge() -> None:
    rows = configs(packed_s=4.0, grouped_s=4.4, ceiling_s=4.5)
    rows[0]["step_times"] = [4.0, 4.0, 3.7, 4.0, 4.2]  # packed: the ratio spreads ~13%
    summary = summarize(rows, peak_flops=989e12)
    checks = target_checks(summary, seq_lens=(4096,), applies=True)
    assert [c.status for c in checks[:3]] == ["failed"] * 3  # every packed/baseline ratio spreads
    assert all(c.detail.startswith("TOO NOISY TO JUDGE: spread 13% > 10%") for c in checks[:3]), (
        checks
    )
    assert checks[-1].detail.startswith("TOO NOISY TO JUDGE"), checks[
        -1
    ]  # MFU: packing's own times
    steady = summarize(configs(packed_s=4.0, grouped_s=4.4, ceiling_s=4.5), peak_flops=989e12)
    assert target_checks(steady, seq_lens=(4096,), applies=True)[0].status == "passed"


def test_the_grouped_target_applies_where_the_ideal_reaches_1_03() -> None:
    rows = configs(packed_s=4.0, grouped_s=3.98, ceiling_s=4.5)
    grouped = next(r for r in rows if r["mode"] == "grouped")
    grouped["executed_flops"] = 2.1e15 * 1.02  # an ideal of 1.02
    checks = target_checks(summarize(rows), seq_lens=(4096,), applies=True)
    assert (
        checks[0].status == "passed" and "ideal 1.020" in checks[0].detail
    )  # 0.995 / 1.02 = 0.975
    assert checks[1].status == "skipped" and checks[1].detail.startswith(
        "the ideal is 1.020 < 1.03"
    )
    grouped["executed_flops"] = 2.1e15 * 1.03
    checks = target_checks(summarize(rows), seq_lens=(4096,), applies=True)
    assert checks[1].status == "failed" and checks[1].detail.startswith(
        "NOT MET: 0.995 against >= 1"
    )


def test_targets_not_measured_or_not_applicable() -> None:
    checks = target_checks([], seq_lens=(4096, 8192), applies=True)
    assert [c.status for c in checks] == ["failed"] * 13
    assert all(c.detail.startswith("not measured") for c in checks), checks
    unknown = target_checks(summarize(configs(4.0, 4.4, 4.5)), seq_lens=(4096,), applies=True)
    assert unknown[-1].status == "failed" and "unknown device" in unknown[-1].detail
    half = [r for r in configs(4.0, 4.4, 4.5) if r["mode"] != "ceiling"]
    assert target_checks(summarize(half), seq_lens=(4096,), applies=True)[2].detail.startswith(
        "not measured"
    )
    skipped = target_checks(summarize(configs(4.0, 4.4, 4.5)), seq_lens=(4096,), applies=False,
                            why_not="dry run")  # fmt: skip
    assert [(c.status, c.detail) for c in skipped] == [("skipped", "dry run")] * 7


def configs(packed_s: float, grouped_s: float, ceiling_s: float) -> list[dict[str, Any]]:
    """Every target configuration with the same figures: grouped's executed FLOPs 1.05x packing's,
    the ceiling's 1.30 / 1.25 = 1.04x."""
    out = []
    for seq in (4096, 8192):
        for mix in ("openchat", "sft-short"):
            for r in rows(
                packed=[packed_s] * 5, grouped_s=[grouped_s] * 5, ceiling_s=[ceiling_s] * 5
            ):
                r = dict(r, config=f"{mix}, seq {seq}", step_times=list(r["step_times"]))
                if r["mode"] == "grouped":
                    r["executed_flops"] = 2.1e15 * 1.05
                if r["mode"] == "ceiling":
                    r["executed_flops"] = 2.1e15 * 1.30 / 1.25
                out.append(r)
    return out


# -- the report ------------------------------------------------------------------------------------
def test_report_json_shape_and_markdown(tmp_path: Path) -> None:
    report = Report(out=tmp_path / "out", device="NVIDIA H100 80GB HBM3", torch="2.11.0+cu130",
                    notes=["note one"], peak="H100 SXM, 989 TFLOP/s")  # fmt: skip
    report.throughput = summarize(rows(), peak_flops=989e12, matmul_flops=760e12)
    report.details = [r | {"step_s": 5.0, "tokens_per_s": 20_000.0} for r in rows()]
    report.profile = [{"mode": "packed", "micro_batches": 13, "host_ms": 70.0, "device_ms": 60.5,
                       "by_owner_ms": {"megapack": 1.0, "megatron": 9.0, "torch": 2.0},
                       "top": [("aten::mm", 20.0)]}]  # fmt: skip
    report.add(Check(name="attention: sdpa", status="passed", detail="worst 1e-7 | fine"),
               Check(name="sync", status="failed", detail="RuntimeError\n  File x"),
               Check(name="attention: auto", status="info", detail="flex"))  # fmt: skip
    data = json.loads((tmp_path / "out" / "gpu-report.json").read_text())
    assert list(data) == ["device", "torch", "peak", "checks", "throughput", "profile"]
    assert all(tuple(c) == CHECK_KEYS for c in data["checks"])
    assert all(tuple(t) == THROUGHPUT_KEYS for t in data["throughput"])
    assert data["checks"][1] == {
        "name": "sync",
        "status": "failed",
        "detail": "RuntimeError\n  File x",
    }
    text = (tmp_path / "out" / "gpu-report.md").read_text()
    assert text == markdown(data, ["note one"], report.details)
    assert "1 passed, 1 failed, 0 skipped, 1 info" in text and "note one" in text
    assert "bf16 peak: H100 SXM, 989 TFLOP/s" in text
    assert (
        "| attention: sdpa | passed | worst 1e-7 \\| fine |" in text
    )  # a | in a detail is escaped
    assert ("| openchat, seq 4096 | length-grouped padding, sorted step, token budget | 20,000 | "
            "18,182 | 1.10 [1.10, 1.10] | 1.03 | 1.05 | 1.050 | 420.0 | 400.0 | 40.4% | 52.6% |") in text  # fmt: skip
    assert (
        "| packed | 13 | 70.0 | 60.5 | megapack 1.0, megatron 9.0, torch 2.0 | aten::mm 20.00 |"
        in text
    )
    assert (
        "| 4096 | openchat | padded_fixed | ok | 20,000 | 5.000 | 13 | 262,144 | 100,000 | 1000.0 |"
        in text
    )
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


# -- the profile -----------------------------------------------------------------------------------
def test_profile_step_attributes_the_host_time_by_owner() -> None:
    import torch

    from megapack import PackedBatch
    from megapack.bench.gpu.profile import OWNERS, profile_step

    weight = torch.randn(64, 64, requires_grad=True)

    def step() -> None:  # megapack's code (a batch) and torch's (a matmul and its backward)
        batch = PackedBatch.from_documents([[1, 2, 3], [4, 5]], seq_len=64)
        (batch.tokens.float() @ weight).sum().backward()

    out = profile_step(step, torch.device("cpu"))
    assert out["host_ms"] > 0 and out["device_ms"] is None
    assert tuple(out["by_owner_ms"]) == OWNERS and out["by_owner_ms"]["megapack"] > 0
    assert sum(out["by_owner_ms"].values()) <= out["host_ms"] * 1.5  # one thread's time, roughly
    names = [name for name, _ in out["top"]]
    assert "aten::mm" in names and all(ms >= 0 for _, ms in out["top"])
