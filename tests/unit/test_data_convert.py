"""convert_rows: a batch's DocumentBatch is exactly what record_to_document gives row by row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megapack.data import ByteTokenizer, Document, Fields, read_jsonl
from megapack.data.convert import DocumentBatch, RawRow, _record, convert_rows
from megapack.data.jsonl import JsonlReader
from megapack.data.records import BadLineError, record_to_document

TEXTS = ["hi", "a b c", "", "   ", "\t\n", "héllo wörld", "x" * 50, "zz"]


class EmptyOnZz(ByteTokenizer):
    """ "zz" encodes to no tokens (a tokenizer dropping unknown text)."""

    def encode(self, text: str) -> list[int]:
        return [] if text == "zz" else super().encode(text)


def random_rows(seed: int, n: int = 120) -> list[RawRow]:
    rng = np.random.default_rng(seed)

    def text() -> Any:
        pick = int(rng.integers(0, len(TEXTS) + 2))
        return TEXTS[pick] if pick < len(TEXTS) else [None, 7][pick - len(TEXTS)]

    rows = []
    for i in range(n):
        kind = int(rng.integers(0, 9))
        record: Any = (
            {"text": text()},
            {"prompt": text(), "completion": text()},
            {"prompt": text()},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": text()}]},
            {"text": text(), "prompt": "p", "completion": "c"},  # ambiguous
            {"body": text(), "q": text(), "a": text()},
            {"text": text(), "id": i, "meta": {"x": 1}},
            [1, 2],  # not an object
            None,
        )[kind]  # fmt: skip
        if rng.random() < 0.5:
            raw = (b"{not json" if rng.random() < 0.05 else json.dumps(record).encode()) + b"\n"
            rows.append(RawRow(f"f.jsonl:{i + 1}", raw, i == 0))
        elif isinstance(record, dict):
            rows.append(RawRow(f"f.parquet:row {i}", record))
    return rows


def reference(rows: list[RawRow], tokenizer: Any, options: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for row in rows:
        try:
            out.append(
                record_to_document(_record(row), where=row.where, tokenizer=tokenizer, **options)
            )
        except BadLineError as e:
            out.append(e)
    return out


def unpack(batch: DocumentBatch) -> list[Any]:
    items: list[Any] = [batch.document(d) for d in range(len(batch))]
    for before, error in reversed(batch.errors):
        items.insert(before, error)
    return items


OPTIONS = [
    {},
    {"format": "text"},
    {"format": "prompt_completion"},
    {"format": "chat"},
    {"append_eos": False},
    {"fields": Fields(text="body", prompt="q", completion="a")},
]


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "auto"
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_convert_rows_matches_record_to_document(options: dict[str, Any], seed: int) -> None:
    rows = random_rows(seed)
    tokenizer = EmptyOnZz() if seed else ByteTokenizer()  # a subclass: ids checked with np.array
    got, want = unpack(convert_rows(rows, tokenizer, options)), reference(rows, tokenizer, options)
    assert len(got) == len(want) == len(rows)
    assert any(isinstance(w, Document) for w in want) and any(
        isinstance(w, BadLineError) for w in want
    )
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w)
        if isinstance(w, BadLineError):
            assert str(g) == str(w)
            continue
        assert g.source == w.source and g.boundaries == w.boundaries
        assert g.tokens.dtype == np.int64 and np.array_equal(g.tokens, w.tokens)
        assert g.loss_mask.dtype == np.float32 and np.array_equal(g.loss_mask, w.loss_mask)


def test_convert_rows_worked_example() -> None:
    rows = [RawRow("d.jsonl:1", {"text": "hi"}), RawRow("d.jsonl:2", {"text": ""}),
            RawRow("d.jsonl:3", {"prompt": "a", "completion": "b"})]  # fmt: skip
    batch = convert_rows(rows, ByteTokenizer(), {})
    assert batch.tokens.tolist() == [104, 105, 257, 97, 98, 257]
    assert batch.loss_mask.tolist() == [1, 1, 1, 0, 1, 1]
    assert batch.offsets.tolist() == [0, 3, 6] and batch.sources == ("d.jsonl:1", "d.jsonl:3")
    assert len(batch) == 2 and batch.rows == 3
    ((before, error),) = batch.errors
    assert before == 1 and str(error).startswith("d.jsonl:2: field 'text': empty")
    head = batch.head(1)
    assert head.tokens.tolist() == [104, 105, 257] and head.errors == () and len(head) == 1


class Negative(ByteTokenizer):
    def encode(self, text: str) -> list[int]:
        return [-1] if text == "bad" else super().encode(text)


class Floats(ByteTokenizer):
    def encode(self, text: str) -> list[int]:
        return [1.5] if text == "bad" else super().encode(text)  # type: ignore[list-item]


def test_convert_rows_refuses_ids_that_are_not_token_ids() -> None:
    rows = [RawRow("d.jsonl:1", {"text": "ok"}), RawRow("d.jsonl:2", {"text": "bad"})]
    with pytest.raises(ValueError, match=r"Document from d.jsonl:2: tokens\[0\] is -1"):
        convert_rows(rows, Negative(), {})
    with pytest.raises(TypeError, match=r"Document from d\.jsonl:2: tokens has dtype float64"):
        convert_rows(rows, Floats(), {})


def corpus(path: Path) -> Path:
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(10)]
    lines[6] = '{"text": 3}'
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reader_batches_count_like_documents(tmp_path: Path) -> None:
    src = corpus(tmp_path / "d.jsonl")
    docs = JsonlReader(src, ByteTokenizer(), skip_bad=True, batch_size=4)
    flat = [d.tokens.tolist() for d in docs]
    batched = JsonlReader(src, ByteTokenizer(), skip_bad=True, batch_size=4)
    batches = list(batched.batches())
    assert [len(b) for b in batches] == [4, 3, 2]  # the bad row 7 is in the second batch
    assert [b.document(d).tokens.tolist() for b in batches for d in range(len(b))] == flat
    assert batched.stats == docs.stats and batched.stats.skipped == 1
    assert batched.rows_done == docs.rows_done == 10
    forked = JsonlReader(src, ByteTokenizer(), skip_bad=True, batch_size=4, workers=2)
    again = list(forked.batches())  # converted in worker processes, pickled back
    assert [b.tokens.tolist() for b in again] == [b.tokens.tolist() for b in batches]
    assert [str(e) for b in again for _, e in b.errors] == [
        str(e) for b in batches for _, e in b.errors
    ]
    assert forked.stats == docs.stats


def test_reader_batches_stop_at_the_first_bad_row(tmp_path: Path) -> None:
    reader = JsonlReader(
        corpus(tmp_path / "d.jsonl"), ByteTokenizer(), skip_bad=False, batch_size=4
    )
    it = reader.batches()
    assert len(next(it)) == 4
    head = next(it)  # rows 5, 6 come before the bad row 7
    assert head.sources == (f"{tmp_path / 'd.jsonl'}:5", f"{tmp_path / 'd.jsonl'}:6")
    with pytest.raises(BadLineError, match=r"d.jsonl:7: field 'text': wrong type"):
        next(it)
    assert reader.rows_done == 7 and reader.stats.documents == 6


def test_reader_read_one_way_only(tmp_path: Path) -> None:
    reader = read_jsonl(corpus(tmp_path / "d.jsonl"), skip_bad=True)
    next(reader)
    with pytest.raises(ValueError, match="already read by documents; open a new reader"):
        reader.batches()
    other = read_jsonl(corpus(tmp_path / "d.jsonl"), skip_bad=True)
    other.batches()
    with pytest.raises(ValueError, match="already read by batches"):
        next(other)
