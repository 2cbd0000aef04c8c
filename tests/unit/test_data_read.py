"""read_documents: dispatch on the suffix, in-memory arrays, option checking, unknown suffixes."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest

from megapack.data import ByteTokenizer, read_documents
from megapack.data.jsonl import JsonlReader

EOS = ByteTokenizer.EOS


def test_jsonl_json_and_gz_suffixes(tmp_path: Path) -> None:
    line = json.dumps({"prompt": "a", "completion": "b"}) + "\n"
    for name in ("d.jsonl", "d.JSON", "d.jsonl.gz", "d.json.gz"):
        path = tmp_path / name
        data = line.encode()
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
        reader = read_documents(path, format="prompt_completion")
        assert isinstance(reader, JsonlReader)
        (doc,) = reader
        assert doc.tokens.tolist() == [97, 98, EOS] and doc.loss_mask.tolist() == [0, 1, 1]
        assert reader.stats.documents == 1


def test_tokenizer_is_passed_to_jsonl(tmp_path: Path) -> None:
    class Shifted(ByteTokenizer):
        def encode(self, text: str) -> list[int]:
            return [b + 1 for b in text.encode()]

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n')
    (doc,) = read_documents(path, Shifted(), append_eos=False)
    assert doc.tokens.tolist() == [98]


def test_numpy_files_and_in_memory_sources(tmp_path: Path) -> None:
    path = tmp_path / "t.npy"
    np.save(path, np.array([1, 0, 2, 0]))
    assert [d.tokens.tolist() for d in read_documents(path, eos_id=0)] == [[1, 0], [2, 0]]
    docs = list(read_documents(np.array([5, 6, 7]), offsets=[0, 1, 3], source="mem"))
    assert [(d.tokens.tolist(), d.source) for d in docs] == [([5], "mem[0]"), ([6, 7], "mem[1]")]
    assert [d.tokens.tolist() for d in read_documents([[1, 2], np.array([3])])] == [[1, 2], [3]]


def test_options_are_checked_against_the_reader(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n')
    with pytest.raises(TypeError, match=r"d.jsonl: option 'eos_id' does not apply to JSONL data; "):
        read_documents(path, eos_id=3)
    with pytest.raises(
        TypeError, match="option 'skip_bad' does not apply to numpy data; read_numpy"
    ):
        read_documents(tmp_path / "t.npy", skip_bad=True)
    with pytest.raises(TypeError, match="option 'offset' does not apply to array data"):
        read_documents(np.arange(3), offset=[0, 3])


def test_unknown_suffix_is_a_clear_error(tmp_path: Path) -> None:
    for name, shown in (("data.txt", "'.txt'"), ("data", "'(none)'"), ("t.npy.gz", "'.npy.gz'")):
        message = f"{name}: cannot tell the format from the suffix {shown}"
        with pytest.raises(ValueError, match=re.escape(message)):
            read_documents(tmp_path / name)


def test_bare_prefix_is_an_indexed_dataset(tmp_path: Path) -> None:
    prefix = tmp_path / "corpus.v2_text_document"
    with pytest.raises(ValueError, match="cannot tell the format"):
        read_documents(prefix)
    (tmp_path / "corpus.v2_text_document.idx").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"missing .*corpus.v2_text_document.bin"):
        read_documents(prefix)  # dispatched to read_indexed, which wants both files
