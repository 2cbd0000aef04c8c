"""Packing for context parallelism: PackedDataset(cp_size=...), `megapack pack/stats --cp-size`, the bench."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megapack.cli import main
from megapack.core.cp_share import check_cp_spans, cp_pad_multiple
from megapack.data import PackedDataset
from megapack.data.document import Document


def docs(lengths: list[int]) -> list[Document]:
    return [
        Document(tokens=np.arange(1, n + 1), loss_mask=np.ones(n, dtype=np.float32))
        for n in lengths
    ]


def test_pad_multiple_is_the_lcm_with_two_cp() -> None:
    assert [cp_pad_multiple(c) for c in (1, 2, 4, 8)] == [1, 4, 8, 16]
    assert cp_pad_multiple(2, 8) == 8 and cp_pad_multiple(4, 3) == 24 and cp_pad_multiple(1, 3) == 3
    with pytest.raises(ValueError, match="cp_size must be an int >= 1, got 0"):
        cp_pad_multiple(0)


@pytest.mark.parametrize("cp", [2, 4])
def test_dataset_rows_split_by_document_on_every_cp_rank(cp: int) -> None:
    lengths = [5, 3, 17, 1, 9, 30, 2, 11]
    ds = PackedDataset(docs(lengths), 32, cp_size=cp)
    assert ds.packing.cp_size == cp and ds.packing.multiple == 2 * cp
    assert ds.meta["packing"]["cp_size"] == cp and ds.meta["packing"]["pad_to_multiple_of"] == 1
    real = 0
    for batch in ds:
        assert batch.cu_seqlens_padded is not None
        check_cp_spans(batch.cu_seqlens_padded, cp)  # raises if a span is not a multiple of 2 * cp
        real += int(np.diff(batch.cu_seqlens.numpy()).sum())
    assert real >= sum(lengths)  # every document, plus one filler document per filler row
    padded = sum(-(-n // (2 * cp)) * 2 * cp for n in lengths)
    assert ds.meta["padding_tokens"] == padded - sum(lengths)
    assert ds.meta["efficiency"] == pytest.approx(sum(lengths) / (ds.meta["rows"] * 32))


def test_dataset_plans_rows_on_padded_lengths() -> None:
    # Four documents of 5 fit one row of 20 unpadded; padded to 8 (cp=4) they need two rows.
    assert PackedDataset(docs([5] * 4), 24).meta["rows"] == 1
    ds = PackedDataset(docs([5] * 4), 24, cp_size=4)
    assert ds.meta["rows"] == 2 and ds.meta["padding_tokens"] == 12


def test_dataset_seq_len_must_divide_by_the_cp_multiple() -> None:
    with pytest.raises(
        ValueError, match=r"seq_len=30 must be a multiple of 8 \(pad_to_multiple_of=1, cp_size=4"
    ):
        PackedDataset(docs([5]), 30, cp_size=4)


def test_cli_pack_and_stats_take_cp_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps({"text": "y" * n}) + "\n" for n in (5, 13, 2, 40, 7)))
    assert (
        main(["pack", str(src), "--seq-len", "64", "--cp-size", "2", "--out", str(tmp_path / "p")])
        == 0
    )
    assert "alignment padding tokens" in capsys.readouterr().out
    ds = PackedDataset.load(tmp_path / "p")
    assert ds.packing.cp_size == 2 and ds.packing.multiple == 4
    for batch in ds:
        check_cp_spans(batch.cu_seqlens_padded, 2)  # type: ignore[arg-type]
    argv = ["stats", str(src), "--seq-len", "72", "--cp-size", "4", "--pad-multiple", "3"]
    assert main([*argv, "--search-steps", "100"]) == 0
    out = capsys.readouterr().out
    assert "documents padded to multiples of 24 (cp_size=4, pad multiple 3)" in out
    assert main([*argv[:3], "64", *argv[4:]]) == 2  # as pack: rows hold whole padded documents
    assert "--seq-len 64 must be a multiple of 24" in capsys.readouterr().err
    assert (
        main(["pack", str(src), "--seq-len", "60", "--cp-size", "4", "--out", str(tmp_path / "q")])
        == 2
    )
    assert (
        "--seq-len 60 must be a multiple of 8 (lcm(--pad-multiple 1, 2 x --cp-size 4))"
        in capsys.readouterr().err
    )


def test_bench_cp_padding_section() -> None:
    from megapack.bench.cp_padding import markdown, run_cp_padding

    lengths = [5, 3, 17, 1, 9, 30, 2, 11] * 10
    rows = run_cp_padding(lengths, 32, cps=(2, 4))
    by = {(r["layout"], r["cp"]): r for r in rows}
    assert by[("row", 2)]["padding_tokens"] == 0 and by[("row", 4)]["padding_tokens"] == 0
    assert by[("document", 2)]["padding_tokens"] == sum(-(-n // 4) * 4 - n for n in lengths)
    assert by[("document", 4)]["padding_tokens"] > by[("document", 2)]["padding_tokens"]
    assert by[("document", 4)]["rows"] >= by[("row", 4)]["rows"] == by[("none", 1)]["rows"]
    for r in rows:
        assert 0 < r["efficiency"] <= 1
    assert "| document | 4 |" in markdown(rows)
