"""The megapack command line end to end: JSONL -> `megapack pack` -> PackedDataset -> get_batch_on_this_tp_rank."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from megapack import Topology, get_batch_on_this_tp_rank
from megapack.cli import main
from megapack.data import PackedDataset, read_documents

LINES = [
    {"text": "The quick brown fox jumps over the lazy dog. " * 3},
    {"prompt": "Translate to French: cat", "completion": " chat"},
    {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello there"},
        ]
    },
    {"text": "x" * 300},  # longer than a row: split
    {"text": "short one"},
]


def write_jsonl(path: Path, bad_line: bool = False) -> Path:
    rows = [json.dumps(line) for line in LINES]
    if bad_line:
        rows.insert(2, '{"prompt": "no completion"}')
    path.write_text("\n".join(rows) + "\n")
    return path


def test_pack_round_trip_loses_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_jsonl(tmp_path / "train.jsonl")
    assert main(["pack", str(src), "--seq-len", "128", "--out", str(tmp_path / "packed")]) == 0
    pieces = sum(
        -(-len(d) // 128) for d in read_documents(src)
    )  # long documents are split, none dropped
    out = capsys.readouterr().out
    assert f"read {len(LINES)} documents from {src}" in out
    longer = sum(len(d) > 128 for d in read_documents(src))  # the text line of 150 and "x" * 300
    assert longer == 2
    assert (
        f"2 of 5 documents longer than --seq-len 128: split into pieces ({pieces} pieces packed"
        in out
    )
    ds = PackedDataset.load(tmp_path / "packed")
    topo = Topology.single()
    data = iter(ds)
    got: Counter[int] = Counter()
    learned = 0
    while True:
        try:
            batch = get_batch_on_this_tp_rank(data, topology=topo)
        except StopIteration:
            break
        learned += int(batch["loss_mask"].sum().item())
        cu = batch["cu_seqlens"].tolist()
        tokens = batch["tokens"][0].tolist()
        for a, b in itertools.pairwise(cu):
            got.update(tokens[a:b])
    want = Counter(t for d in read_documents(src) for t in d.tokens.tolist())
    pad = 256  # ByteTokenizer's pad id fills the rows' trailing segments
    del got[pad]
    assert got == want
    # A document's first token is never a target (nothing before it in the document predicts it);
    # every other learned token is trained, except the first token of each piece after a cut.
    targets = sum(int(d.loss_mask[1:].sum()) for d in read_documents(src))
    cuts = ds.meta["documents"] - len(LINES)
    assert learned == targets - cuts


def test_bad_line_is_named_or_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_jsonl(tmp_path / "bad.jsonl", bad_line=True)
    assert main(["pack", str(src), "--seq-len", "128", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert f"{src}:3" in err and "completion" in err
    assert (
        main(["pack", str(src), "--seq-len", "128", "--out", str(tmp_path / "p"), "--skip-bad"])
        == 0
    )
    assert f"read {len(LINES)} documents from {src}; 1 bad line skipped" in capsys.readouterr().out


def test_stats_prints_every_algorithm_and_plots(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "train.jsonl")
    png = tmp_path / "lengths.png"
    cmd = [
        sys.executable,
        "-m",
        "megapack.cli",
        "stats",
        str(src),
        "--seq-len",
        "128",
        "--plot",
        str(png),
        "--search-steps",
        "1000",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    for algorithm in ("next_fit", "first_fit", "ffd", "bfd", "best", "lower bound"):
        assert f"| {algorithm} |" in out
    assert "length histogram" in out and "tokens lost" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
