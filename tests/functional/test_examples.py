"""The examples run end to end under torchrun on CPU (gloo), as the README shows them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def torchrun(nproc: int, script: str, *args: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        f"examples/{script}",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def test_demo_prints_every_rank_and_stops_cleanly() -> None:
    out = torchrun(4, "demo_tp_pp.py", "--tp", "2", "--pp", "2")
    for rank, stage in enumerate(["first", "first", "last", "last"]):
        assert f"rank {rank} | stage {stage}" in out
    assert out.count("clean stop") == 4
    assert out.count("cu_seqlens=(") == 8  # every rank, both steps, gets cu_seqlens


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_pretrain_example_trains(mode: str) -> None:
    flags = ["--padded"] if mode == "padded" else []
    out = torchrun(
        2,
        "pretrain_gpt_packed.py",
        "--pp",
        "2",
        "--steps",
        "3",
        "--docs",
        "12",
        "--seq-len",
        "128",
        *flags,
    )
    assert out.startswith(f"{mode}: tp=1 pp=2")
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], out
    assert len(re.findall(r"real tokens/s", out)) == 3


def test_pretrain_example_trains_with_context_parallelism() -> None:
    out = torchrun(2, "pretrain_gpt_packed.py", "--cp", "2", "--cp-layout", "document",
                   "--steps", "3", "--docs", "12", "--seq-len", "128")  # fmt: skip
    assert out.startswith("packed: tp=1 pp=1 cp=2")
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], out


@pytest.mark.parametrize("grid", [["--pp", "2"], ["--cp", "2"]], ids=["pp2", "cp2"])
def test_rl_example_runs_a_grpo_step_with_declared_fields(grid: list[str]) -> None:
    out = torchrun(2, "rl_step_packed.py", *grid, "--steps", "3")
    assert out.startswith("grpo: ") and "16 completions of 4 prompts" in out, out
    losses = [float(x) for x in re.findall(r"policy loss ([+-]\d+\.\d+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], out  # the surrogate goes down


def test_quickstart_packs_a_jsonl_file_then_trains_through_the_schedule(tmp_path: Path) -> None:
    """The README's quickstart as it reads: `megapack pack`, then examples/quickstart.py on
    tp 2 x pp 2 (megatron-core's 1F1B, DDP, per-token loss, lockstep_steps)."""
    words = [
        "a",
        "packed",
        "row",
        "of",
        "tokens",
        "trains",
        "faster",
        "than",
        "padding",
        "every",
        "document",
    ]
    lines = [
        json.dumps({"prompt": " ".join(words[i % 5 : i % 5 + 3]), "completion": " ".join(words * (1 + i % 4))})
        for i in range(80)
    ]  # fmt: skip
    (tmp_path / "sft.jsonl").write_text("\n".join(lines) + "\n")
    pack = [sys.executable, "-m", "megapack.cli", "pack", str(tmp_path / "sft.jsonl"),
            "--seq-len", "256", "--out", str(tmp_path / "packed")]  # fmt: skip
    done = subprocess.run(pack, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = torchrun(4, "quickstart.py", str(tmp_path / "packed"), "--tp", "2", "--pp", "2")
    losses = [
        float(x) for x in re.findall(r"^step \d+: loss (\d+\.\d+) over \d+ trained", out, re.M)
    ]
    assert len(losses) == 3 and losses[-1] < losses[0], out
