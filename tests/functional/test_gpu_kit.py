"""The GPU kit end to end: its dry run on CPU (as CI runs it), a dead kit process, a leaking real GPT,
and ``gpu``-marked tests that run the real checks on a CUDA device (skipped at collection without one).

The dry run is ``bash scripts/gpu_check.sh --dry-run --out DIR``: the same steps as on a GPU at toy
sizes in fp32, every CUDA-only check skipped with its reason, everything else passed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megapack.bench.gpu.report import CHECK_KEYS, THROUGHPUT_KEYS

ROOT = Path(__file__).resolve().parents[2]


def on_gpu(test: Any) -> Any:
    """Marks a test ``gpu`` and skips it at collection without CUDA."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the kit's device checks")  # fmt: skip
    return pytest.mark.gpu(skip(test))


SAME_PYTHON = {**os.environ, "PYTHON": sys.executable}
"""The script runs the kit with this test's Python (and its torch build), not whatever python3 is."""


def run_kit(out: Path, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:  # fmt: skip
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=240, env={**SAME_PYTHON, **(env or {})},
    )  # fmt: skip
    return done, json.loads((out / "gpu-report.json").read_text())


def test_dry_run_report(tmp_path: Path) -> None:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done, report = run_kit(tmp_path / "kit")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    failed = [c for c in report["checks"] if c["status"] == "failed"]
    assert done.returncode == 0 and not failed, (failed, done.stdout[-3000:], done.stderr[-3000:])
    # CPU seconds, not wall time: a loaded CI machine stretches the wall clock (~20 s idle, 2 cores)
    assert cpu_s < 60, f"the dry run took {cpu_s:.0f} CPU s; it must stay under a minute"
    assert list(report) == ["device", "torch", "peak", "checks", "throughput", "profile"]
    assert report["device"].startswith("cpu") and report["torch"] == torch.__version__
    assert report["peak"] == "unknown device"  # no MFU without a known peak: never a guess
    checks = report["checks"]
    assert all(tuple(c) == CHECK_KEYS for c in checks)
    by_status = {
        s: [c for c in checks if c["status"] == s] for s in ("passed", "failed", "skipped", "info")
    }
    assert not by_status["failed"], by_status["failed"]
    for c in by_status["skipped"]:  # only what needs CUDA, saying so
        assert "CUDA" in c["detail"] or c["name"].startswith("target"), c
    passed = " / ".join(c["name"] for c in by_status["passed"])
    for name in ("attention: sdpa, float32, fwd+bwd", "packed == padded per-token losses (float32",
                 "packed == padded per-token losses (bfloat16, attention ",
                 "model: 0.1M-parameter GPT", "throughput"):  # fmt: skip
        assert name in passed, f"{name!r} did not pass: {checks}"
    info = " / ".join(c["name"] for c in by_status["info"])
    for name in ("set-up", "attention: auto", "attention time", "throughput spread", "profile"):
        assert name in info, f"{name!r} is not an info line: {checks}"
    skipped = " / ".join(c["name"] for c in by_status["skipped"])
    for name in ("attention: torch_varlen", "sync: positive control", "sync: get_batch_on_this_tp_rank",
                 "sync: prefetch", "sync: packed GPT forward + backward", "sync: whole step: megatron-core",
                 "sync: whole step, documents padded", "sync: attention sdpa",
                 "target (stretch): packed MFU (bf16 peak) >= 45% (openchat, seq 4096)",
                 "target: packed / grouped >= 0.97x the executed-FLOP ideal (sft-short, seq 256)",
                 "target: packed >= 1.0x grouped where the ideal >= 1.03 (openchat, seq 128)",
                 "target: packed executed TFLOP/s >= 0.95x the THD ceiling's (openchat, seq 256)",
                 "target: 0 synchronizing CUDA calls", "target: one run of the kit within 6 minutes"):  # fmt: skip
        assert name in skipped, f"{name!r} was not skipped: {checks}"
    throughput_targets = [
        c
        for c in by_status["skipped"]
        if c["name"].startswith(("target: packed", "target (stretch)"))
    ]
    assert len(throughput_targets) == 4 * 3 + 1  # 3 targets x 4 configurations, the stretch MFU
    from megapack.bench.modes import BASELINES, LABELS

    rows = report["throughput"]
    assert [(r["config"], r["baseline"]) for r in rows] == [
        (f"{mix}, seq {seq}", LABELS[m])
        for seq in (128, 256) for mix in ("openchat", "sft-short") for m in BASELINES
    ]  # fmt: skip
    for r in rows:
        assert tuple(r) == THROUGHPUT_KEYS
        assert r["mfu"] is None and 0 < r["mfu_of_matmul"] < 1, r  # no peak for a CPU
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"] and isinstance(r["noisy"], bool), r
        for key in ("packed_tokens_per_s", "baseline_tokens_per_s", "slot_ratio", "flop_ideal",
                    "packed_tflops", "baseline_tflops"):  # fmt: skip
            assert isinstance(r[key], float) and r[key] > 0, (key, r)
    assert [p["mode"] for p in report["profile"]] == ["packed", *BASELINES]
    for p in report["profile"]:
        assert p["host_ms"] > 0 and p["device_ms"] is None and p["top"], p
        assert p["by_owner_ms"]["megatron"] > 0 and p["by_owner_ms"]["megapack"] > 0, p
    text = (tmp_path / "kit" / "gpu-report.md").read_text()
    assert "DRY RUN" in text and "## Checks" in text and "## Packing against each baseline" in text
    # the versions in the header: a CPU build of torch has no cuDNN, PyPI's CUDA build has one
    # (GPU or not)
    raw = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    library = "none" if raw is None else rf"\d+\.\d+\.\d+ \({raw}\)"
    assert re.search(rf", cuDNN {library}, cudnn frontend ", text), text[:500]
    assert "sections: attention, losses, syncs, throughput, profile, graph" in text
    assert (
        "| 128 | sft-short | padded_fixed | ok |" in text and " (4) |" in text
    )  # sampled: 4 timed
    assert "## Where a step's time goes" in text
    assert (tmp_path / "kit" / "gpu-kit.log").read_text().count("skipped") >= len(
        by_status["skipped"]
    )


PLANTED = """import sys
from megapack.bench.gpu import kit

def planted(run):
    raise RuntimeError("planted: the attention-rows section broke")

kit.RUNNERS["attention-rows"] = planted
sys.exit(kit.main(sys.argv[1:]))
"""
"""The kit with its attention-rows section replaced by one that raises (a planted failure)."""
FIRST_RUN_SECTIONS = {
    "smoke": ("sync: positive control", "host-wait probe: positive control", "smoke: "),
    "attention-rows": ("section attention-rows",),
    "throughput-4k": ("model: ", "throughput-4k", "throughput spread", "target: packed", "target (stretch)"),
    "graph-launch": ("graph: ",),
}  # fmt: skip
"""Which section each check of the first-run plan belongs to, by the start of its name."""


def test_the_first_run_plan_dry_run_goes_on_after_a_failed_section(tmp_path: Path) -> None:
    """``--plan first-run --dry-run`` through the script, with a planted failure in its second
    section: every section reports, in the plan's order, the planted failure is one failed check
    and the sections after it run as they do on CPU (passed, info, or skipped for want of CUDA)."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = -m ] && [ "$2" = megapack.bench.gpu.kit ]; then shift 2; '
        f'exec {sys.executable} -c "$PLANTED" "$@"; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--plan", "first-run", "--out", str(tmp_path / "kit")],
        capture_output=True, text=True, timeout=240, env={**SAME_PYTHON, "PYTHON": str(fake), "PLANTED": PLANTED},
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert cpu_s < 60, f"the first-run dry run took {cpu_s:.0f} CPU s; it must stay under a minute"
    assert done.returncode == 1, (done.stdout[-3000:], done.stderr[-3000:])  # a check failed
    checks = json.loads((tmp_path / "kit" / "gpu-report.json").read_text())["checks"]
    failed = [c for c in checks if c["status"] == "failed"]
    assert [c["name"] for c in failed] == ["section attention-rows"], failed
    assert failed[0]["detail"].startswith("RuntimeError: planted: the attention-rows section broke")
    order = []
    for c in checks[1:-1]:  # between the set-up and the time target: the plan's sections
        (section,) = [s for s, starts in FIRST_RUN_SECTIONS.items() if c["name"].startswith(starts)]
        if not order or order[-1] != section:
            order.append(section)
    assert order == ["smoke", "attention-rows", "throughput-4k", "graph-launch"], order
    assert checks[0]["name"] == "set-up"
    assert checks[-1]["name"] == "target: the first-run plan within 5 minutes"
    for c in checks:  # what did not run here says it needs CUDA (or is a target of a GPU run)
        if c["status"] == "skipped":
            assert "CUDA" in c["detail"] or c["name"].startswith("target"), c
    by_name = {c["name"]: c for c in checks}
    for name in ("cudnn", "torch_varlen"):  # unavailable on CPU, with the reason: not the stand-in
        assert by_name[f"smoke: {name}"]["detail"] == f"cannot train float32 on cpu here: {name} runs on CUDA only"  # fmt: skip
    refusal = "smoke: bucketed: refused by GraphStep before its warm-up (expected: a capture cannot hold it)"
    assert by_name[refusal]["status"] == "passed", by_name[refusal]
    assert by_name["throughput-4k"]["status"] == "passed"
    assert "1 mix (openchat) x 2 modes (packed, grouped)" in by_name["throughput-4k"]["detail"]
    graphs = [c for c in checks if c["name"].startswith("graph: launch-bound")]
    assert graphs and not [
        c for c in checks if c["name"].startswith("graph: 0.1M")
    ]  # launch-bound only
    text = (tmp_path / "kit" / "gpu-report.md").read_text()
    assert "sections: smoke, attention-rows, throughput-4k, graph-launch" in text
    assert ("attention backend of the kit's models: auto (the first-run plan trains cudnn where it "
            "can; cudnn is unavailable here: cudnn runs on CUDA only); plan first-run") in text  # fmt: skip


def test_a_run_of_one_section(tmp_path: Path) -> None:
    """``--only attention`` runs the attention checks and nothing that trains: no model, no
    throughput; the flags reach the kit through the script."""
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--only", "attention", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=SAME_PYTHON,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    names = [c["name"] for c in report["checks"]]
    assert names[0] == "set-up" and any(n.startswith("attention: sdpa") for n in names)
    assert not any(
        n.startswith(("model", "throughput", "sync", "packed == padded", "graph")) for n in names
    )
    assert report["throughput"] == [] and report["profile"] == []
    assert "sections: attention" in (tmp_path / "gpu-report.md").read_text()


def test_the_script_passes_the_kits_flags_through(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\nfor a in "$@"; do [ "$a" = megapack.bench.gpu.kit ] && { echo "kit: $*"; exit 0; }; done\n'
                    f'exec {sys.executable} "$@"\n')  # fmt: skip
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake)}
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=60, env=env)
    script = str(ROOT / "scripts" / "gpu_check.sh")
    done = run(
        [
            "bash",
            script,
            "--only",
            "throughput,profile",
            "--backend=sdpa",
            "--dry-run",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert done.returncode == 0, done.stderr
    assert (
        f"kit: -m megapack.bench.gpu.kit --out {tmp_path / 'o'} --only throughput,profile --backend=sdpa --dry-run"
        in done.stdout
    )
    assert "kit: -m megapack.bench.gpu.kit --list" in run(["bash", script, "--list"]).stdout
    planned = run(["bash", script, "--plan", "first-run", "--out", str(tmp_path / "p")])
    assert (
        f"kit: -m megapack.bench.gpu.kit --out {tmp_path / 'p'} --plan first-run" in planned.stdout
    )
    bad = run(["bash", script, "--only"])
    assert bad.returncode == 2 and "--only needs a value" in bad.stderr
    listed = subprocess.run(["bash", script, "--list"], capture_output=True, text=True, timeout=60, env=SAME_PYTHON)  # fmt: skip
    assert listed.returncode == 0 and "--only attention,losses,syncs,graph" in listed.stdout
    assert "--plan first-run  (~" in listed.stdout


def test_a_dead_kit_process_is_a_failed_check(tmp_path: Path) -> None:
    """The kit killed mid-run (SIGKILL): the script still leaves a report, ending in a failed check."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'for a in "$@"; do [ "$a" = megapack.bench.gpu.kit ] && { echo "measured half"; kill -9 $$; }; done\n'
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    done, report = run_kit(tmp_path / "kit", env={"PYTHON": str(fake)})
    assert done.returncode == 1, done.stderr[-2000:]
    last = report["checks"][-1]
    assert (last["name"], last["status"]) == ("kit process", "failed")
    assert "killed by signal 9" in last["detail"] and "measured half" in last["detail"]


# -- packed == padded catches a leak in megatron-core's real GPT (CPU, gloo) ------------------------
class DropsBoundaries(torch.nn.Module):
    """GPTModel called without packed_seq_params: a packed row becomes one causal sequence."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, packed_seq_params: Any = None, **kwargs: Any) -> Any:
        return self.model(*args, packed_seq_params=None, **kwargs)


def losses_with_and_without_boundaries() -> list[tuple[str, str]]:
    from megapack.bench.gpu.checks import packed_vs_padded
    from megapack.bench.gpu.model import build_gpt
    from megapack.bench.gpu.sizes import DRY
    from megapack.bench.gpu.steps import set_up as _set_up

    cpu = torch.device("cpu")
    _set_up(cpu, seed=0)
    model = build_gpt(DRY.shape, device=cpu, dtype=torch.float32, max_sequence_length=128)
    out = []
    for candidate in (model, DropsBoundaries(model)):
        check = packed_vs_padded(candidate, device=cpu, dtype=torch.float32, lengths=DRY.loss_lengths,
                                 seq_len=128, vocab_size=DRY.shape.vocab_size, label="losses")  # fmt: skip
        out.append((check.status, check.detail))
    return out


@pytest.mark.distributed
def test_packed_vs_padded_catches_a_leak_in_megatron_gpt(dist_pool: Any) -> None:
    (results,) = dist_pool.run(losses_with_and_without_boundaries, 1, timeout=120)
    (ok, ok_detail), (leak, leak_detail) = results
    assert ok == "passed", ok_detail
    assert leak == "failed", leak_detail
    worst = float(leak_detail.split("largest per-token difference ")[1].split(" ")[0])
    assert worst > 100 * 1e-4, leak_detail  # far outside the fp32 tolerance, not a rounding case


# -- on a GPU ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda_world() -> Iterator[torch.device]:
    """One-rank torch.distributed world and megatron-core parallel state on the GPU, as the kit sets up."""
    from megapack.bench.gpu.steps import set_up as _set_up
    from megapack.bench.gpu.steps import tear_down as _tear_down

    device = torch.device("cuda", torch.cuda.current_device())
    _set_up(device, seed=0)
    try:
        yield device
    finally:
        _tear_down()


def small_preset(device: torch.device, dtype: torch.dtype) -> Any:
    from megapack.bench.gpu.model import PRESET, build_gpt

    shape = dataclasses.replace(PRESET, num_layers=2)
    return shape, build_gpt(shape, device=device, dtype=dtype, max_sequence_length=2048)


def packed_batches(vocab: int, seq_len: int = 2048, count: int = 10) -> list[Any]:
    from megapack.bench.modes import micro_batches

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, vocab, n) for n in rng.integers(1, 1500, 3 * count)]
    return micro_batches("packed", docs, seq_len, 1)[:count]


@on_gpu
def test_attention_backends_against_the_reference_on_gpu(cuda_world: torch.device) -> None:
    from megapack.bench.gpu.checks import attention_checks

    checks = attention_checks(
        cuda_world, torch.bfloat16, heads=16, groups=4, head_dim=128, max_len=1024
    )
    assert not [c for c in checks if c.status == "failed"], checks
    ran = [c.name for c in checks if c.status == "passed" and "fwd+bwd" in c.name]
    assert any("sdpa" in n for n in ran) and len(ran) >= 2, (
        checks
    )  # sdpa and at least one fused kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@on_gpu
def test_packed_equals_padded_on_gpu(cuda_world: torch.device, dtype: torch.dtype) -> None:
    from megapack.bench.gpu.checks import packed_vs_padded

    shape, model = small_preset(cuda_world, dtype)
    check = packed_vs_padded(model, device=cuda_world, dtype=dtype, lengths=[1, 7, 900, 33, 512, 2, 300],
                             seq_len=2048, vocab_size=shape.vocab_size, label="losses")  # fmt: skip
    assert check.status == "passed", check.detail


@on_gpu
def test_zero_syncs_in_delivery_prefetch_and_a_packed_step_on_gpu(cuda_world: torch.device) -> None:
    from megapack.bench.gpu.syncs import sync_checks

    shape, model = small_preset(cuda_world, torch.bfloat16)
    checks = sync_checks(model, packed_batches(shape.vocab_size), device=cuda_world)
    assert [c.status for c in checks] == ["passed"] * 4, "\n".join(c.detail for c in checks)


class ItemInForward(torch.nn.Module):
    """A per-token loss whose forward reads a value back to the host: a real synchronizing call."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(32000, 1)

    def forward(self, tokens: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.embedding(tokens)[..., 0]
        if out.sum().item() > 1e30:  # the .item() is the sync
            out = out * 2
        return out


@on_gpu
def test_the_sync_check_sees_a_real_sync_on_gpu(cuda_world: torch.device) -> None:
    from megapack.bench.gpu.syncs import sync_checks

    checks = sync_checks(ItemInForward().to(cuda_world), packed_batches(32000), device=cuda_world)
    assert [c.status for c in checks][3] == "failed", checks
    assert "synchronizing" in checks[3].detail and "in forward" in checks[3].detail


@on_gpu
def test_throughput_smoke_on_gpu(cuda_world: torch.device) -> None:
    from megapack import Topology
    from megapack.bench.baselines import summarize
    from megapack.bench.datasets import bundled_lengths_path, load_lengths
    from megapack.bench.gpu.devices import peak_bf16_flops
    from megapack.bench.gpu.model import matmul_ceiling
    from megapack.bench.gpu.throughput import ThroughputSizes, length_mixes, run_gpu_throughput

    shape, model = small_preset(cuda_world, torch.bfloat16)
    sizes = ThroughputSizes(seq_lens=(2048,), pool=2000, step_tokens=16_384, documents=16, rows=2,
                            warmup=1, steps=2, length_scale=1.0)  # fmt: skip
    mixes = length_mixes(load_lengths(bundled_lengths_path())[0], 2000, max_len=2048)
    rows = run_gpu_throughput(model, shape, sizes, mixes, topology=Topology.single(cuda_world))
    assert [r["status"] for r in rows] == ["ok"] * 10, rows
    matmul = matmul_ceiling(cuda_world, torch.bfloat16, n=4096)
    assert matmul > 50e12, f"bf16 matmul at {matmul / 1e12:.0f} TFLOP/s"
    peak, _ = peak_bf16_flops(torch.cuda.get_device_name(cuda_world))
    for entry in summarize(rows, peak_flops=peak, matmul_flops=matmul):
        assert (
            entry["ratio"] > 0 and entry["slot_ratio"] > 0 and 0 < entry["mfu_of_matmul"] < 1.2
        ), entry
