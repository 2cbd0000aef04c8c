"""read_jsonl: exact tokens and masks per format, chat rendering, every bad line, skip_bad counts."""

from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megapack import PackedBatch
from megapack.data import (
    BadLineError,
    ByteTokenizer,
    ChatTemplate,
    Document,
    read_jsonl,
)
from megapack.data.jsonl import JsonlStats

EOS = ByteTokenizer.EOS


def b(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def write(path: Path, *lines: Any) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def chat(*turns: tuple[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def test_text_and_prompt_completion_worked_examples(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", {"text": "hi"}, {"prompt": "a", "completion": "bc", "id": 7})
    text, pc = read_jsonl(path, ByteTokenizer())
    assert text.tokens.tolist() == [104, 105, EOS] and text.loss_mask.tolist() == [1, 1, 1]
    assert text.source == f"{path}:1" and text.boundaries == ()
    assert pc.tokens.tolist() == [97, 98, 99, EOS] and pc.loss_mask.tolist() == [0, 1, 1, 1]
    assert pc.source == f"{path}:2"
    assert (text.tokens.dtype, text.loss_mask.dtype) == (np.int64, np.float32)
    no_eos = list(read_jsonl(path, append_eos=False))
    assert [d.tokens.tolist() for d in no_eos] == [[104, 105], [97, 98, 99]]
    assert no_eos[1].loss_mask.tolist() == [0, 1, 1]


def test_chat_worked_example_masks_only_assistant_turns(tmp_path: Path) -> None:
    path = write(tmp_path / "c.jsonl", chat(("user", "hi"), ("assistant", "yo")))
    (doc,) = read_jsonl(path)
    user = [*b("<|user|>\nhi\n"), EOS]
    reply = [*b("<|assistant|>\nyo\n"), EOS]
    assert doc.tokens.tolist() == user + reply
    assert doc.loss_mask.tolist() == [0] * 13 + [0] * 14 + [1, 1, 1, 1]  # "yo", "\n", eos
    assert doc.boundaries == (13,)


def test_chat_learned_tokens_are_exactly_the_assistant_replies(tmp_path: Path) -> None:
    turns = [
        ("system", "be brief"),
        ("user", "2+2?"),
        ("assistant", "4"),
        ("tool", "ok"),
        ("user", "and 3+3?"),
        ("assistant", "6, surely"),
    ]
    (doc,) = read_jsonl(write(tmp_path / "c.jsonl", chat(*turns)))
    learned = doc.tokens[doc.loss_mask == 1].tolist()
    assert learned == [*b("4\n"), EOS, *b("6, surely\n"), EOS]
    starts = [0, *doc.boundaries]
    for (role, _), start in zip(turns, starts, strict=True):  # every message starts at a boundary
        header = b(f"<|{role}|>\n")
        assert doc.tokens[start : start + len(header)].tolist() == header
    assert len(doc.boundaries) == len(turns) - 1


def test_custom_template_without_eos_per_turn_appends_one_eos(tmp_path: Path) -> None:
    template = ChatTemplate(header="[{role}]", footer="|", eos_per_turn=False)
    path = write(tmp_path / "c.jsonl", chat(("user", "q"), ("assistant", "a")))
    (doc,) = read_jsonl(path, chat_template=template)
    assert doc.tokens.tolist() == [*b("[user]q|[assistant]a|"), EOS]
    assert doc.loss_mask.tolist() == [0] * 8 + [0] * 11 + [1, 1, 1]
    (ends_with_user,) = read_jsonl(
        write(tmp_path / "u.jsonl", chat(("assistant", "a"), ("user", "q"))), chat_template=template
    )
    assert ends_with_user.loss_mask.tolist()[-1] == 0  # eos after a user turn is not learned


def test_chat_template_checks_its_fields() -> None:
    with pytest.raises(ValueError, match=r"ChatTemplate.header '<\{rol\}>' is not a valid format"):
        ChatTemplate(header="<{rol}>")
    with pytest.raises(ValueError, match="learned_roles has 'bot'"):
        ChatTemplate(learned_roles=("bot",))


def test_forced_format_ignores_other_keys(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", {"text": "t", "prompt": "p", "completion": "c"})
    with pytest.raises(BadLineError, match="ambiguous format"):
        list(read_jsonl(path))
    (doc,) = read_jsonl(path, format="text")
    assert doc.tokens.tolist() == [116, EOS]
    (doc,) = read_jsonl(path, format="prompt_completion")
    assert doc.tokens.tolist() == [112, 99, EOS] and doc.loss_mask.tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="format='chatml'; expected one of auto, text"):
        read_jsonl(path, format="chatml")  # type: ignore[arg-type]


def test_blank_lines_gzip_and_byte_order_mark(tmp_path: Path) -> None:
    raw = '\ufeff{"text": "a"}\n\n   \n{"text": "b"}'  # BOM, blank lines, no final newline
    plain = tmp_path / "d.jsonl"
    plain.write_text(raw, encoding="utf-8")
    packed = tmp_path / "d.jsonl.gz"
    packed.write_bytes(gzip.compress(raw.encode("utf-8")))
    for path in (plain, packed):
        reader = read_jsonl(path)
        assert [d.tokens.tolist() for d in reader] == [[97, EOS], [98, EOS]]
        assert [reader.stats.lines, reader.stats.blank, reader.stats.documents] == [2, 2, 2]
        assert reader.stats.tokens == 4


BAD_LINES = [  # (line, problem, field, fragment of the message)
    ("{not json", "invalid JSON", "<line>", "'{not json'. Hint: Expecting property name"),
    ('["a", "b"]', "not a JSON object", "<line>", "got ['a', 'b']"),
    ('{"txt": "hi"}', "missing", "text", "got ['txt']. Hint: each line needs"),
    ('{"text": 5}', "wrong type", "text", "got 5. Hint: text fields must be JSON strings"),
    ('{"text": ""}', "empty", "text", "got ''"),
    ('{"text": "  \\n"}', "empty", "text", "got '  \\n'"),
    ('{"prompt": "p"}', "missing", "completion", "got ['prompt']"),
    ('{"prompt": "p", "completion": null}', "wrong type", "completion", "got None"),
    ('{"text": "t", "messages": []}', "ambiguous format", "<line>", "keys of text and chat"),
    ('{"messages": "hi"}', "wrong type", "messages", "got 'hi'"),
    ('{"messages": []}', "empty", "messages", "got []"),
    ('{"messages": ["hi"]}', "wrong type", "messages[0]", "got 'hi'"),
    ('{"messages": [{"role": "user"}]}', "missing", "messages[0].content", "got ['role']"),
    (
        json.dumps(chat(("user", "q"), ("robot", "x"))),
        "unknown role",
        "messages[1].role",
        "'robot'",
    ),
    (
        '{"messages": [{"role": 1, "content": "x"}]}',
        "wrong type",
        "messages[0].role",
        "got 1",
    ),
    (
        json.dumps(chat(("assistant", ["part"]))),
        "wrong type",
        "messages[0].content",
        "['part']",
    ),
    (json.dumps(chat(("user", "q"), ("assistant", ""))), "empty", "messages[1].content", "got ''"),
    (
        json.dumps(chat(("user", "q"))),
        "nothing to learn",
        "messages",
        "needs at least one assistant",
    ),
]


@pytest.mark.parametrize(
    ("line", "problem", "field", "fragment"),
    BAD_LINES,
    ids=[f"{f}:{p}" for _, p, f, _ in BAD_LINES],
)
def test_every_bad_line_names_file_line_field_value(
    tmp_path: Path, line: str, problem: str, field: str, fragment: str
) -> None:
    path = write(tmp_path / "bad.jsonl", {"text": "ok"}, "", line)
    reader = read_jsonl(path)
    assert next(reader).tokens.tolist() == [111, 107, EOS]
    with pytest.raises(BadLineError) as info:
        next(reader)
    message = str(info.value)
    what = "the line" if field == "<line>" else f"field {field!r}"
    assert message.startswith(f"{path}:3: {what}: {problem}, got "), message
    assert fragment in message and "Hint: " in message
    assert isinstance(info.value, ValueError) and info.value.problem == problem


def test_long_values_are_truncated_in_messages(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.jsonl", {"text": ["x" * 500]})
    with pytest.raises(BadLineError, match=r"got \['xxx.*\.\.\.\. Hint") as info:
        list(read_jsonl(path))
    assert len(str(info.value)) < 300


def test_invalid_utf8_and_json_array_hints(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(BadLineError, match=r"bad.jsonl:2: the line: invalid UTF-8, .* offset 10 "):
        list(read_jsonl(path))
    array = tmp_path / "array.json"
    array.write_text('[\n{"text": "a"}\n]\n')
    with pytest.raises(BadLineError, match="looks like a JSON array: write one element per line"):
        list(read_jsonl(array))


def test_skip_bad_counts_every_skipped_line(tmp_path: Path) -> None:
    lines = [line for line, *_ in BAD_LINES]
    path = write(tmp_path / "mixed.jsonl", {"text": "a"}, *lines[:4], "", {"text": "b"}, *lines[4:])
    reader = read_jsonl(path, skip_bad=True)
    docs = list(reader)
    assert [d.tokens.tolist() for d in docs] == [[97, EOS], [98, EOS]]
    assert [d.source for d in docs] == [f"{path}:1", f"{path}:7"]
    stats = reader.stats
    assert isinstance(stats, JsonlStats)
    assert (stats.lines, stats.blank, stats.documents, stats.skipped) == (20, 1, 2, 18)
    expected: dict[str, int] = {}
    for _, problem, *_ in BAD_LINES:
        expected[problem] = expected.get(problem, 0) + 1
    assert dict(stats.skipped_by_problem) == expected
    assert len(stats.first_errors) == 5 and stats.first_errors[0].startswith(f"{path}:2: ")


def test_stats_are_a_snapshot_and_close_stops_reading(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", {"text": "a"}, {"text": "b"}, {"text": "c"})
    with read_jsonl(path) as reader:
        next(reader)
        before = reader.stats
        next(reader)
        assert (before.documents, reader.stats.documents) == (1, 2)
    with pytest.raises(StopIteration):
        next(reader)
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl: no such JSONL file"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_documents_pack_into_a_batch(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", {"prompt": "a", "completion": "b"}, {"text": "hi"})
    docs: list[Document] = list(read_jsonl(path))
    batch = PackedBatch.from_documents([d.as_dict() for d in docs], pad_token_id=256)
    assert batch.tokens.tolist() == [[97, 98, EOS, 104, 105, EOS]]
    assert batch.labels.tolist() == [[98, EOS, 256, 105, EOS, 256]]
    assert batch.loss_mask.tolist() == [[1, 1, 0, 1, 1, 0]]  # predicting "a" is never learned
    assert batch.cu_seqlens.tolist() == [0, 3, 6]


def test_a_reader_dropped_mid_file_never_joins_its_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The garbage collector finalizes a reader dropped after a bad line wherever it runs, even
    inside threading's own bookkeeping while another thread starts: joining the encode thread
    there deadlocked the test suite. Closing must not join it."""
    joins: list[str] = []
    join = threading.Thread.join

    def recording_join(self: threading.Thread, timeout: float | None = None) -> None:
        joins.append(self.name)
        join(self, timeout)

    monkeypatch.setattr(threading.Thread, "join", recording_join)
    reader = read_jsonl(write(tmp_path / "bad.jsonl", {"text": "ok"}, "", '{"text": 5}'))
    next(reader)
    with pytest.raises(BadLineError):
        next(reader)
    reader.close()
    assert joins == []
