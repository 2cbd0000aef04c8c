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


class Counting:
    """A `ByteTokenizer` that records every ``encode`` and ``encode_batch`` call."""

    def __init__(self) -> None:
        self.base = ByteTokenizer()
        self.eos_id, self.pad_id, self.bos_id = 257, 256, 258
        self.vocab_size = 259
        self.single: list[str] = []
        self.batched: list[list[str]] = []

    def encode(self, text: str) -> list[int]:
        self.single.append(text)
        return self.base.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        self.batched.append(list(texts))
        return [self.base.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return self.base.decode(ids)


def test_convert_rows_encodes_every_text_in_one_batch() -> None:
    """The module's cost claim: one ``encode_batch`` call holds the plain rows' texts and the
    chat contents; ``encode`` only sees what the template adds (role headers, each once)."""
    chat = {"messages": [{"role": "user", "content": "question"},
                         {"role": "assistant", "content": "answer"}]}  # fmt: skip
    rows = [RawRow("d:1", {"text": "plain"}), RawRow("d:2", chat), RawRow("d:3", {"text": 7}),
            RawRow("d:4", {"prompt": "p", "completion": "c"})]  # fmt: skip
    tok = Counting()
    batch = convert_rows(rows, tok, {})
    assert (
        unpack(batch)[1].tokens.tolist()
        == record_to_document(chat, where="d:2", tokenizer=ByteTokenizer()).tokens.tolist()
    )
    assert tok.batched == [["plain", "p", "c", "question", "answer"]]
    assert not {"plain", "p", "c", "question", "answer"} & set(tok.single)
    assert len(tok.single) == len(set(tok.single))  # a header encoded once is reused
    # renamed columns, and a row that is not an object before the chat: the same one call
    renamed = {"conv": chat["messages"]}
    rows = [RawRow("d:1", b"[1, 2]\n"), RawRow("d:2", renamed), RawRow("d:3", {"body": "x"})]
    tok = Counting()
    batch = convert_rows(rows, tok, {"fields": Fields(text="body", messages="conv")})
    assert len(batch) == 2 and tok.batched == [["x", "question", "answer"]]
    assert not {"x", "question", "answer"} & set(tok.single)
    tok = Counting()
    assert len(convert_rows([RawRow("d:1", b"{bad\n")], tok, {})) == 0
    assert tok.batched == []  # nothing to encode: no call at all


def test_prefetched_answers_from_its_cache() -> None:
    from megapack.data.convert import Prefetched, encode_all

    tok = Counting()
    cached = Prefetched(tok, ["a", "bc"])
    assert tok.batched == [["a", "bc"]] and tok.single == []
    assert cached.encode("bc") == [98, 99] and cached.encode("a") == [97] and tok.single == []
    assert cached.encode("z") == [122] and cached.encode("z") == [122] and tok.single == ["z"]
    given = Prefetched(tok, ["q"], [[7]])
    assert given.encode("q") == [7] and len(tok.batched) == 1
    assert (cached.vocab_size, cached.eos_id, cached.pad_id) == (tok.vocab_size, 257, 256)
    assert cached.decode([104, 105]) == "hi"

    class NoBatch:  # a minimal tokenizer: encode only
        def encode(self, text: str) -> list[int]:
            return [len(text)]

    assert encode_all(NoBatch(), ["ab", "c"]) == [[2], [1]]  # type: ignore[arg-type]


def test_convert_rows_ambiguous_and_partial_rows_match_record_to_document() -> None:
    """Rows the fast path must leave to `record_to_document` (which explains what is wrong)."""
    records = [{"text": "a", "prompt": "b"}, {"text": "a", "completion": "c"}, {"prompt": "p"},
               {"completion": "c"}, {"text": " "}, {"prompt": "p", "completion": " "},
               {"prompt": "p", "completion": "c", "messages": []}, {"text": ["x"]}]  # fmt: skip
    rows = [RawRow(f"d:{i}", r) for i, r in enumerate(records)]
    for options in ({}, {"format": "prompt_completion"}, {"format": "text"}):
        got, want = (
            unpack(convert_rows(rows, ByteTokenizer(), options)),
            reference(rows, ByteTokenizer(), options),
        )
        assert [str(x) if isinstance(x, BadLineError) else x.tokens.tolist() for x in got] == [
            str(x) if isinstance(x, BadLineError) else x.tokens.tolist() for x in want
        ]


class Zero(ByteTokenizer):
    def encode(self, text: str) -> list[int]:
        return [0] if text == "nul" else super().encode(text)


def test_convert_rows_arrays_and_id_checks() -> None:
    batch = convert_rows([RawRow("d:1", {"text": "nul"})], Zero(), {})  # id 0 is a token id
    assert batch.tokens.tolist() == [0, 257]
    assert (batch.tokens.dtype, batch.loss_mask.dtype, batch.offsets.dtype) == (
        np.int64, np.float32, np.int64,
    )  # fmt: skip
    empty = convert_rows([RawRow("d:1", {"text": ""})], EmptyOnZz(), {})  # no document at all
    assert (empty.tokens.dtype, empty.tokens.shape, empty.offsets.tolist()) == (np.int64, (0,), [0])
    rows = [RawRow(f"d:{i}", {"text": t}) for i, t in enumerate(["ok", "fine", "bad"])]
    with pytest.raises(ValueError, match=r"^Document from d:2: tokens\[0\] is -1"):
        convert_rows(rows, Negative(), {})


def test_document_batch_head_is_a_whole_batch_of_the_first_documents() -> None:
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    rows = [RawRow("d:1", chat), RawRow("d:2", {"text": "hi"}), RawRow("d:3", {"text": "yo"})]
    batch = convert_rows(rows, ByteTokenizer(), {})
    head = batch.head(2)
    end = int(batch.offsets[2])
    assert head.offsets.tolist() == batch.offsets[:3].tolist()
    assert head.tokens.tolist() == batch.tokens[:end].tolist()
    assert head.loss_mask.tolist() == batch.loss_mask[:end].tolist()
    assert head.boundaries == batch.boundaries[:2] and head.boundaries[0] != ()
    assert head.sources == ("d:1", "d:2") and head.errors == ()
    assert [head.document(d).tokens.tolist() for d in range(2)] == [
        batch.document(d).tokens.tolist() for d in range(2)
    ]


@pytest.mark.parametrize(
    ("raw", "first", "problem", "value", "hint"),
    [
        (b'{"text": "\xff"}', False, "invalid UTF-8", b'{"text": "\xff"}',
         "bad byte at offset 10 of the line; re-encode the file as UTF-8"),
        (b"{bad  \r", False, "invalid JSON", "{bad  ",
         "Expecting property name enclosed in double quotes at column 2 of 6; each line must be one "
         "complete JSON object"),
        (b"{baX\r", False, "invalid JSON", "{baX",
         "Expecting property name enclosed in double quotes at column 2 of 4; each line must be one "
         "complete JSON object"),
        (b"{bad\r", False, "invalid JSON", "{bad",
         "Expecting property name enclosed in double quotes at column 2 of 4; each line must be one "
         "complete JSON object"),
        (b'{"a": "\x01"}', False, "invalid JSON", '{"a": "\x01"}',
         "Invalid control character at column 8 of 10; each line must be one complete JSON object"),
        (b" [1, 2,", True, "invalid JSON", " [1, 2,",
         "Expecting value at column 8 of 7; each line must be one complete JSON object (the line "
         "ends early: was it cut short?) (this looks like a JSON array: write one element per line "
         "instead)"),
        (b" [1, 2,", False, "invalid JSON", " [1, 2,",
         "Expecting value at column 8 of 7; each line must be one complete JSON object (the line "
         "ends early: was it cut short?)"),
        (b"\xef\xbb\xbf{bad", True, "invalid JSON", "{bad",
         "Expecting property name enclosed in double quotes at column 2 of 4; each line must be one "
         "complete JSON object"),
    ],
)  # fmt: skip
def test_unreadable_lines_name_every_part(
    raw: bytes, first: bool, problem: str, value: Any, hint: str
) -> None:
    with pytest.raises(BadLineError) as caught:
        _record(RawRow("f.jsonl:3", raw, first))
    error = caught.value
    assert (error.where, error.field, error.problem, error.value, error.hint) == (
        "f.jsonl:3", "<line>", problem, value, hint,
    )  # fmt: skip
    assert _record(RawRow("f.jsonl:1", b'\xef\xbb\xbf{"a": 1}', True)) == {"a": 1}
