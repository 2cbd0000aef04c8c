"""`megapack stats --dp ... --json`: the token plan and the compute plan side by side."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megapack.cli import main
from megapack.packing import CostModel, LoadOptions
from megapack.packing.compare import compare_plans


def corpus(path: Path) -> Path:
    lengths = np.clip(np.random.default_rng(0).lognormal(3.5, 1.0, 300), 2, 400).astype(int)
    path.write_text("".join(json.dumps({"text": "a" * int(n)}) + "\n" for n in lengths))
    return path


def test_balance_stats_json_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, out = corpus(tmp_path / "docs.jsonl"), tmp_path / "stats.json"
    argv = ["stats", str(src), "--seq-len", "128", "--search-steps", "500", "--dp", "4"]
    argv += ["--micro-batches", "2", "--cost-a", "1", "--cost-b", "0.5", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert (
        "| token |" in printed and "| compute |" in printed and "dp 4, 2 micro-batches" in printed
    )
    got = json.loads(out.read_text())
    assert got["documents"] == 300 and got["rows_bfd"] >= got["lower_bound"]  # today's figures
    from megapack.data import ByteTokenizer, read_documents

    lengths = [len(d) for d in read_documents(src, ByteTokenizer())]
    deal = LoadOptions(dp_size=4, micro_batches=2, cost=CostModel(a=1, b=0.5))
    want = compare_plans(lengths, 128, deal)
    for key in ("imbalance_token_plan", "imbalance_compute_plan", "efficiency_token_plan"):
        assert got[key] == pytest.approx(want[key])
    assert got["imbalance_compute_plan"] < got["imbalance_token_plan"]
    assert got["efficiency_compute_plan"] == got["efficiency_token_plan"]


def test_balance_stats_model_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, out = corpus(tmp_path / "docs.jsonl"), tmp_path / "stats.json"
    shape = ["--hidden", "64", "--ffn", "256", "--layers", "2", "--heads", "4", "--vocab", "1000"]
    argv = ["stats", str(src), "--seq-len", "128", "--search-steps", "500", "--dp", "2", *shape]
    assert main([*argv, "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert (got["cost_a"], got["cost_b"]) == (973_824.0, 768.0)
    assert got["micro_batches"] == 1


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--hidden", "64"], "needs --ffn, --layers, --heads, --vocab"),
        (["--cost-b", "1", "--layers", "2"], "not both"),
        (["--cost-a", "-1"], "CostModel.a"),
        (["--dp", "0"], "--dp must be an integer >= 1, got 0"),
    ],
)
def test_balance_stats_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], words: str
) -> None:
    src = corpus(tmp_path / "docs.jsonl")
    assert main(["stats", str(src), "--seq-len", "128", "--search-steps", "0", *extra]) == 2
    assert words in capsys.readouterr().err
