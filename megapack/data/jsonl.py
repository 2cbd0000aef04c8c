"""`read_jsonl`: documents from a JSON-lines file, one per line, with counts of what was skipped.

The reader streams: one line in memory at a time, bytes decoded per line so that invalid UTF-8 is
reported with its line number like any other bad line. Blank lines are ignored (and counted).
``.gz`` files are decompressed on the fly. The record formats and their loss masks are described in
`megapack.data.records`; chat rendering in `megapack.data.chat`.

Bad lines: by default the first one raises `BadLineError` (a ValueError) naming file, line, field
and value. With ``skip_bad=True`` they are skipped and counted, and `JsonlReader.stats` says how
many, why, and quotes the first few messages so that a run can log them::

    reader = read_jsonl("sft.jsonl", tokenizer, skip_bad=True)
    docs = list(reader)
    print(reader.stats)   # JsonlStats(lines=1000, documents=997, skipped=3, ...)

Design: the reader is an iterator object rather than a generator so that the counts live on it
(``reader.stats``, an immutable snapshot taken when asked) instead of in an out-parameter. Cost:
``json.loads`` plus ``encode`` per line. Measured on the 2-core dev machine with `ByteTokenizer`:
5,000 lines of ~900 bytes in 0.39 s (text) and 0.49 s (two-message chats), about 10 MB/s per core.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections import Counter
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import IO, Any

from megapack.data.chat import ChatTemplate
from megapack.data.document import Document
from megapack.data.records import FORMATS, BadLineError, Format, record_to_document
from megapack.data.tokenizers import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)  # library code logs; the CLI prints

MAX_QUOTED_ERRORS = 5


@dataclass(frozen=True, kw_only=True, slots=True)
class JsonlStats:
    """Counts of a `JsonlReader` so far.

    Example:
        a file with 4 good lines, a blank line, an invalid JSON line and a line with an empty
        ``text`` read with ``skip_bad=True``: ``lines=6, documents=4, skipped=2, blank=1,
        skipped_by_problem={"invalid JSON": 1, "empty": 1}``.
    """

    lines: int = 0
    """Non-blank lines read."""
    blank: int = 0
    """Blank (whitespace-only) lines ignored."""
    documents: int = 0
    """Documents yielded."""
    tokens: int = 0
    """Tokens in the documents yielded."""
    skipped: int = 0
    """Bad lines skipped (only with ``skip_bad=True``; otherwise the first one raises)."""
    skipped_by_problem: MappingProxyType[str, int] = field(
        default_factory=lambda: MappingProxyType({})
    )
    """Skipped lines per `BadLineError.problem`, e.g. ``{"invalid JSON": 2, "unknown role": 1}``."""
    first_errors: tuple[str, ...] = ()
    """The messages of the first few skipped lines (at most `MAX_QUOTED_ERRORS`), for logs."""


class JsonlReader(Iterator[Document]):
    """A single-pass iterator of Documents over one JSONL file; build it with `read_jsonl`.

    Also a context manager: ``with read_jsonl(path) as reader: ...`` closes the file early.
    """

    def __init__(
        self,
        path: Path,
        tokenizer: Tokenizer,
        *,
        format: Format,
        skip_bad: bool,
        append_eos: bool,
        chat_template: ChatTemplate | None,
    ) -> None:
        self.path = path
        self.tokenizer = tokenizer
        self._options: dict[str, Any] = {
            "format": format,
            "append_eos": append_eos,
            "chat_template": chat_template,
        }
        self._skip_bad = skip_bad
        self._counts = {"lines": 0, "blank": 0, "documents": 0, "tokens": 0, "skipped": 0}
        self._problems: Counter[str] = Counter()
        self._errors: list[str] = []
        self._stream: IO[bytes] | None = None
        self._lines = self._read()

    @property
    def stats(self) -> JsonlStats:
        """A snapshot of the counts so far (complete once the reader is exhausted)."""
        return JsonlStats(
            **self._counts,
            skipped_by_problem=MappingProxyType(dict(self._problems)),
            first_errors=tuple(self._errors),
        )

    def __next__(self) -> Document:
        return next(self._lines)

    def close(self) -> None:
        """Stop reading and close the file; later ``next`` calls raise StopIteration."""
        self._lines.close()

    def __enter__(self) -> JsonlReader:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _read(self) -> Generator[Document, None, None]:
        opener = gzip.open if self.path.suffix == ".gz" else open
        with opener(self.path, "rb") as stream:
            for number, raw in enumerate(stream, start=1):
                if not raw.strip():
                    self._counts["blank"] += 1
                    continue
                self._counts["lines"] += 1
                try:
                    doc = self._parse(raw, f"{self.path}:{number}", number)
                except BadLineError as e:
                    if not self._skip_bad:
                        raise
                    self._counts["skipped"] += 1
                    self._problems[e.problem] += 1
                    log.debug("skipped %s", e)
                    if len(self._errors) < MAX_QUOTED_ERRORS:
                        self._errors.append(str(e))
                    continue
                self._counts["documents"] += 1
                self._counts["tokens"] += len(doc)
                yield doc

    def _parse(self, raw: bytes, where: str, number: int) -> Document:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadLineError(
                where,
                "<line>",
                "invalid UTF-8",
                raw,
                f"bad byte at offset {e.start} of the line; re-encode the file as UTF-8",
            ) from e
        if number == 1:
            text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark some editors write
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            reason = e.msg.removesuffix(" at")  # json's "Invalid control character at"
            hint = f"{reason} at column {e.colno}; each line must be one complete JSON object"
            if number == 1 and text.lstrip().startswith("["):
                hint += " (this looks like a JSON array: write one element per line instead)"
            raise BadLineError(where, "<line>", "invalid JSON", text.rstrip("\r\n"), hint) from e
        return record_to_document(record, where=where, tokenizer=self.tokenizer, **self._options)


def read_jsonl(
    path: str | os.PathLike[str],
    tokenizer: Tokenizer | None = None,
    *,
    format: Format = "auto",
    skip_bad: bool = False,
    append_eos: bool = True,
    chat_template: ChatTemplate | None = None,
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
        chat_template: how ``messages`` are rendered; default `ChatTemplate()`.

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
    )
