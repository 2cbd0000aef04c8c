"""`read_jsonl`: documents from a JSON-lines file, one per line, with counts of what was skipped.

The reader streams: one batch of lines in memory at a time, bytes decoded per line so that invalid
UTF-8 is reported with its line number like any other bad line. Blank lines are ignored (and
counted). ``.gz`` files are decompressed on the fly. The record formats and their loss masks are
described in `megapack.data.records`; chat rendering in `megapack.data.chat` (built-in) and
`megapack.data.hf_chat` (a model's own template); batching, workers and bad-line counting in
`megapack.data.record_reader`.

Bad lines: by default the first one raises `BadLineError` (a ValueError) naming file, line, field
and value. With ``skip_bad=True`` they are skipped and counted, and `JsonlReader.stats` says how
many, why, and quotes the first few messages so that a run can log them::

    reader = read_jsonl("sft.jsonl", tokenizer, skip_bad=True)
    docs = list(reader)
    print(reader.stats)   # ReaderStats(lines=1000, documents=997, skipped=3, ...)

``shard=(rank, world)`` keeps lines ``rank, rank + world, ...`` (0-based, blank lines included in
the count), so the ranks' shares are disjoint and cover the file.

Design: the reader is an iterator object rather than a generator so that the counts live on it
(``reader.stats``, an immutable snapshot taken when asked) instead of in an out-parameter. Cost:
``json.loads`` plus ``encode`` per line. Measured on the 2-core dev machine with `ByteTokenizer`:
5,000 lines of ~900 bytes in 0.39 s (text) and 0.49 s (two-message chats), about 10 MB/s per core.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megapack.data.chat import ChatTemplate
from megapack.data.record_reader import RawRow, ReaderStats, RecordReader
from megapack.data.records import DEFAULT_FIELDS, FORMATS, Fields, Format, ModelChatTemplate
from megapack.data.tokenizers import ByteTokenizer, Tokenizer

JsonlStats = ReaderStats
"""The counts of a `JsonlReader` (the name before other formats shared them)."""


class JsonlReader(RecordReader):
    """A single-pass iterator of Documents over one JSONL file; build it with `read_jsonl`."""

    def __init__(self, path: Path, tokenizer: Tokenizer, **options: Any) -> None:
        self.path = path
        super().__init__(tokenizer, **options)

    def _rows(self) -> Iterator[RawRow]:
        rank, world = self.shard
        opener = gzip.open if self.path.suffix == ".gz" else open
        with opener(self.path, "rb") as stream:
            for index, raw in enumerate(stream):
                if index % world != rank:
                    continue
                if not raw.strip():
                    self._counts["blank"] += 1
                    continue
                yield RawRow(f"{self.path}:{index + 1}", raw, index == 0)


def read_jsonl(
    path: str | os.PathLike[str],
    tokenizer: Tokenizer | None = None,
    *,
    format: Format = "auto",
    skip_bad: bool = False,
    append_eos: bool = True,
    chat_template: ChatTemplate | ModelChatTemplate | None = None,
    fields: Fields = DEFAULT_FIELDS,
    shard: tuple[int, int] | None = None,
    workers: int = 1,
    skip: int = 0,
) -> JsonlReader:
    """Documents from a JSON-lines file (optionally ``.gz``), one per non-blank line.

    Args:
        path: the ``.jsonl`` file.
        tokenizer: default `ByteTokenizer()`.
        format: ``"auto"`` detects each line's format from its keys; ``"text"``,
            ``"prompt_completion"`` or ``"chat"`` forces one (see `megapack.data.records`).
        skip_bad: skip and count bad lines (see `JsonlReader.stats`) instead of raising.
        append_eos: end each document with the tokenizer's eos id, learned (chat: see
            `record_to_document`).
        chat_template: how ``messages`` are rendered; default `ChatTemplate()`; a model's own:
            `HFChatTemplate`.
        fields: which keys hold text, prompt, completion, messages, tools.
        shard: ``(rank, world)``: read only lines ``rank::world``.
        workers: processes converting batches of lines (1: in this process).
        skip: non-blank lines of this shard to pass over unread (a resumed pack).

    Returns:
        A `JsonlReader`: iterate it for Documents, read ``.stats`` for counts.

    Raises:
        FileNotFoundError: no such file (raised here, before iterating).
        BadLineError: while iterating, on the first bad line unless ``skip_bad``.

    Example:
        a file with the line ``{"prompt": "a", "completion": "b"}`` at line 1 yields
        ``Document(tokens=[97, 98, 257], loss_mask=[0, 1, 1], source="file.jsonl:1")``.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such JSONL file")
    if format not in FORMATS:
        raise ValueError(f"read_jsonl: format={format!r}; expected one of {', '.join(FORMATS)}")
    return JsonlReader(
        file,
        tokenizer if tokenizer is not None else ByteTokenizer(),
        format=format,
        skip_bad=skip_bad,
        append_eos=append_eos,
        chat_template=chat_template,
        fields=fields,
        shard=shard,
        workers=workers,
        skip=skip,
    )
