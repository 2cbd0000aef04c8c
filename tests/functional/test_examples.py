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
    """The example's stdout, Python's warnings off."""
    return launch(nproc, script, *args).stdout


def launch(
    nproc: int, script: str, *args: str, warnings: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<script>`` under torchrun on CPU; fail naming its output if it fails.
    ``warnings``: keep Python's warnings (default: ``PYTHONWARNINGS=ignore``)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        f"examples/{script}",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)
    if not warnings:
        env["PYTHONWARNINGS"] = "ignore"
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


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


STEP_LINE = re.compile(
    r"^step (\d+): loss (\d+\.\d+) over (\d+) trained tokens; (\d+) real tokens in "
    r"(\d+\.\d+) s: ([\d,]+) real tokens/s$",
    re.M,
)
"""The quickstart's line a step (examples/quickstart.py's docstring)."""


def test_quickstart_packs_a_jsonl_file_then_trains_through_the_schedule(tmp_path: Path) -> None:
    """The README's quickstart as it reads: `megapack pack`, then examples/quickstart.py on
    tp 2 x pp 2 (megatron-core's 1F1B, DDP, per-token loss, lockstep_steps); each step's trained
    and real tokens counted once (the step's own, from the dataset), megatron-core's harmless
    warnings quiet and megapack's INFO lines shown."""
    from megapack.core.quiet import HARMLESS, HARMLESS_WITHOUT_CUDA
    from megapack.data import PackedDataset

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
    run = launch(4, "quickstart.py", str(tmp_path / "packed"), "--tp", "2", "--pp", "2",
                 warnings=True)  # fmt: skip
    steps = STEP_LINE.findall(run.stdout)
    assert [int(s[0]) for s in steps] == [0, 1, 2], run.stdout
    losses = [float(s[1]) for s in steps]
    assert losses[-1] < losses[0], run.stdout
    # dp 1 (4 ranks = tp 2 x pp 2): a step is the quickstart's 2 micro-batches of 2 rows
    data = PackedDataset.load(tmp_path / "packed", rows_per_micro_batch=2, micro_batches=2,
                              loss_fields=True)  # fmt: skip
    pad = data.pad_token_id  # the byte tokenizer's pad id is no byte: every other token is real
    for step, (_, _, trained, real, seconds, rate) in enumerate(steps):
        batches = [data[2 * step + i] for i in range(2)]
        assert int(trained) == int(batches[0].extras["loss_step"][0, 0]), run.stdout  # once
        assert int(trained) == sum(int(b.loss_mask.sum()) for b in batches)
        assert int(real) == sum(int((b.tokens != pad).sum()) for b in batches), run.stdout
        low, high = float(seconds) - 0.005, float(seconds) + 0.005  # printed to 0.01 s
        assert int(real) / high - 1 <= int(rate.replace(",", "")) <= int(real) / low + 1, run.stdout
    for message, _why in HARMLESS + HARMLESS_WITHOUT_CUDA:  # quiet_megatron's, on every rank
        assert not re.search(message, run.stderr), run.stderr[-3000:]
    info = re.findall(r"^\[rank \d\] INFO ", run.stderr, re.M)  # only megapack's logger is INFO
    assert info, run.stderr[-3000:]
