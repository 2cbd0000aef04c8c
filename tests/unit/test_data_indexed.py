"""read_indexed: round trips through megatron-core's own IndexedDatasetBuilder, and file errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megapack.data import Document, read_documents, read_indexed

# Documents as lists of sequences (megatron "items"); [] is a document with no sequences.
DOCS = [[[5, 6, 7]], [[8, 9], [10], [11, 12, 13]], [], [[65_000]], [[1]]]


def build(prefix: Path, dtype: type[np.number], docs: list[list[list[int]]] = DOCS) -> Path:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for sequences in docs:
        for seq in sequences:
            builder.add_item(torch.tensor(seq))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


@pytest.mark.parametrize("dtype", [np.uint16, np.int32], ids=["uint16", "int32"])
def test_round_trip_one_document_per_megatron_document(tmp_path: Path, dtype: type) -> None:
    prefix = build(tmp_path / "corpus_text_document", dtype)
    docs = list(read_indexed(prefix))
    assert [d.tokens.tolist() for d in docs] == [
        [5, 6, 7],
        [8, 9, 10, 11, 12, 13],
        [65_000],
        [1],
    ]
    assert [d.boundaries for d in docs] == [(), (2, 3), (), ()]  # sequence starts
    assert [d.source for d in docs] == [f"{prefix}[{i}]" for i in (0, 1, 3, 4)]  # [2] is empty
    assert all(d.tokens.dtype == np.int64 and d.loss_mask.tolist() == [1] * len(d) for d in docs)


def test_add_document_and_every_way_to_name_the_pair(tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "sents"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    builder.add_document(torch.tensor([1, 2, 3, 4, 5]), lengths=[2, 3])
    builder.add_document(torch.tensor([70_000]), lengths=[1])
    builder.finalize(f"{prefix}.idx")
    expected = [
        Document(
            tokens=[1, 2, 3, 4, 5], loss_mask=np.ones(5), boundaries=(2,), source=f"{prefix}[0]"
        ),
        Document(tokens=[70_000], loss_mask=np.ones(1), source=f"{prefix}[1]"),
    ]
    for name in (prefix, f"{prefix}.bin", f"{prefix}.idx", str(prefix)):
        assert list(read_indexed(name)) == expected
        assert list(read_documents(name)) == expected


def test_random_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    docs = [
        [rng.integers(0, 50_000, rng.integers(1, 30)).tolist() for _ in range(rng.integers(1, 4))]
        for _ in range(40)
    ]
    prefix = build(tmp_path / "rand", np.uint16, docs)
    got = list(read_indexed(prefix))
    assert [d.tokens.tolist() for d in got] == [[t for seq in seqs for t in seq] for seqs in docs]
    assert [d.boundaries for d in got] == [
        tuple(np.cumsum([len(s) for s in seqs])[:-1].tolist()) for seqs in docs
    ]


def test_missing_file_names_it(tmp_path: Path) -> None:
    prefix = build(tmp_path / "c", np.int32)
    Path(f"{prefix}.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing .*c\.bin; give the prefix"):
        read_indexed(prefix)


def test_bad_header_version_and_float_dtype(tmp_path: Path) -> None:
    prefix = build(tmp_path / "c", np.int32)
    idx = Path(f"{prefix}.idx")
    raw = idx.read_bytes()
    idx.write_bytes(b"NOTANIDX!" + raw[9:])
    with pytest.raises(ValueError, match=r"c\.idx: not a megatron-core index file .*b'NOTANIDX!'"):
        read_indexed(prefix)
    idx.write_bytes(raw[:9] + (2).to_bytes(8, "little") + raw[17:])
    with pytest.raises(ValueError, match="index version 2; only version 1"):
        read_indexed(prefix)
    idx.write_bytes(raw[:17] + bytes([7]) + raw[18:])  # megatron's code for float32
    with pytest.raises(TypeError, match="dtype code 7 is not an integer token dtype"):
        read_indexed(prefix)


def test_truncated_bin_is_refused(tmp_path: Path) -> None:
    prefix = build(tmp_path / "c", np.int32)
    bin_ = Path(f"{prefix}.bin")
    bin_.write_bytes(bin_.read_bytes()[:-4])
    with pytest.raises(ValueError, match=r"c\.bin: 40 bytes but the index needs 44; .* truncated"):
        read_indexed(prefix)
