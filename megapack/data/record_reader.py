"""`RecordReader`: what every record format (JSONL, Parquet, Arrow) shares: batches, bad rows, counts.

A format only says how to walk its rows: `RecordReader._rows` yields `RawRow`s, each the row's
``where`` (``"file.jsonl:17"``, ``"file.parquet:row 16"``) and its payload, raw JSON bytes or an
already-decoded dict. Everything after that is shared and lives here:

1. rows are gathered in batches of ``batch_size``;
2. each row becomes a record (``json.loads`` for bytes), then a `Document` through
   `record_to_document`; the batch's text fields are tokenized first with one
   ``tokenizer.encode_batch`` call (the HF tokenizer runs it on all cores), so the per-row path
   finds its tokens in a small cache;
3. step 2 of the next batch runs in a thread while the caller consumes this one (``encode_batch``
   releases the GIL), or, with ``workers > 1``, in a pool of forked processes; order is kept;
4. bad rows: the first raises `BadLineError` (file, row, field, value, hint) in order, after the
   rows before it were yielded; with ``skip_bad`` they are counted in `ReaderStats`.

``shard=(rank, world)`` keeps every ``world``-th row (or unit of rows, see the formats), so that
the ranks of a data-parallel group read disjoint shares covering the file exactly once.
"""

from __future__ import annotations

import json
import multiprocessing
from collections import Counter
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any, NamedTuple

from megapack.data.chat import ChatTemplate
from megapack.data.document import Document
from megapack.data.records import BadLineError, record_to_document
from megapack.data.tokenizers import Tokenizer

MAX_QUOTED_ERRORS = 5
BATCH_SIZE = 512
"""Rows converted (and tokenized with one ``encode_batch``) together."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReaderStats:
    """Counts of a reader so far.

    Example:
        a file with 4 good lines, a blank line, an invalid JSON line and a line with an empty
        ``text`` read with ``skip_bad=True``: ``lines=6, documents=4, skipped=2, blank=1,
        skipped_by_problem={"invalid JSON": 1, "empty": 1}``.
    """

    lines: int = 0
    """Rows read: non-blank lines of JSONL, rows of a table (of this shard)."""
    blank: int = 0
    """Blank (whitespace-only) JSONL lines ignored."""
    documents: int = 0
    """Documents yielded."""
    tokens: int = 0
    """Tokens in the documents yielded."""
    skipped: int = 0
    """Bad rows skipped (only with ``skip_bad=True``; otherwise the first one raises)."""
    skipped_by_problem: MappingProxyType[str, int] = field(
        default_factory=lambda: MappingProxyType({})
    )
    """Skipped rows per `BadLineError.problem`, e.g. ``{"invalid JSON": 2, "unknown role": 1}``."""
    first_errors: tuple[str, ...] = ()
    """The messages of the first few skipped rows (at most `MAX_QUOTED_ERRORS`), for logs."""


class RawRow(NamedTuple):
    """One row before conversion: where it is and what it holds."""

    where: str
    """``"path:line"`` or ``"path:row i"``, the document's source and the prefix of errors."""
    payload: bytes | dict[str, Any]
    """Raw JSON bytes (JSONL, parsed here) or the row's columns as a dict (tables)."""
    first: bool = False
    """The first line of its file (a UTF-8 byte-order mark is allowed there)."""


def check_shard(shard: tuple[int, int] | None) -> tuple[int, int]:
    """``shard`` as ``(rank, world)``, default ``(0, 1)``.

    Raises:
        TypeError: not a pair of ints.
        ValueError: ``world < 1`` or ``rank`` outside ``range(world)``.
    """
    if shard is None:
        return 0, 1
    if (
        not isinstance(shard, tuple | list)
        or len(shard) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in shard)
    ):
        raise TypeError(f"shard must be a (rank, world) pair of ints, got {shard!r}")
    rank, world = shard
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard=({rank}, {world}): need world >= 1 and 0 <= rank < world")
    return rank, world


class RecordReader(Iterator[Document]):
    """Base of `JsonlReader` and `TableReader`: a single-pass iterator of Documents with counts.

    Also a context manager: ``with read_jsonl(path) as reader: ...`` closes the file early.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_bad: bool,
        shard: tuple[int, int] | None = None,
        workers: int = 1,
        batch_size: int = BATCH_SIZE,
        skip: int = 0,
        **options: Any,
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise ValueError(f"skip must be a non-negative int, got {skip!r}")
        self.tokenizer = tokenizer
        self.shard = check_shard(shard)
        self.skip = skip
        """Rows of this shard passed over unread (a resumed pack's completed rows)."""
        self.rows_done = 0
        """Rows after ``skip`` whose document was yielded or that were skipped as bad."""
        self._options = options
        self._skip_bad = skip_bad
        self._workers = workers
        self._batch_size = batch_size
        self._counts = {"lines": 0, "blank": 0, "documents": 0, "tokens": 0, "skipped": 0}
        self._problems: Counter[str] = Counter()
        self._errors: list[str] = []
        self._docs = self._read()

    def _rows(self) -> Iterator[RawRow]:
        """This shard's rows, in file order (each format implements it)."""
        raise NotImplementedError

    @property
    def stats(self) -> ReaderStats:
        """A snapshot of the counts so far (complete once the reader is exhausted)."""
        return ReaderStats(
            **self._counts,
            skipped_by_problem=MappingProxyType(dict(self._problems)),
            first_errors=tuple(self._errors),
        )

    def __next__(self) -> Document:
        return next(self._docs)

    def close(self) -> None:
        """Stop reading and close the file; later ``next`` calls raise StopIteration."""
        self._docs.close()

    def __enter__(self) -> RecordReader:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _batches(self) -> Iterator[list[RawRow]]:
        batch: list[RawRow] = []
        rows = self._rows()
        for _ in range(self.skip):
            if next(rows, None) is None:
                return
        for row in rows:
            self._counts["lines"] += 1
            batch.append(row)
            if len(batch) >= self._batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    def _read(self) -> Generator[Document, None, None]:
        if self._workers == 1:
            yield from self._count(self._ahead())
            return
        context = multiprocessing.get_context("fork")
        with context.Pool(
            self._workers, initializer=_init_worker, initargs=(self.tokenizer, self._options)
        ) as pool:
            yield from self._count(pool.imap(_convert_in_worker, self._batches()))

    def _ahead(self) -> Iterator[list[Document | BadLineError]]:
        """Converted batches, the next one converting in a thread while this one is consumed.

        The tokenizer's ``encode_batch`` releases the GIL, so it overlaps with the caller's Python
        work on the previous batch (writing it, planning); order is kept.
        """
        with ThreadPoolExecutor(1) as pool:
            pending: Future[list[Document | BadLineError]] | None = None
            for batch in self._batches():
                future = pool.submit(convert_rows, batch, self.tokenizer, self._options)
                if pending is not None:
                    yield pending.result()
                pending = future
            if pending is not None:
                yield pending.result()

    def _count(
        self, results: Iterator[list[Document | BadLineError]]
    ) -> Generator[Document, None, None]:
        for batch in results:
            for item in batch:
                self.rows_done += 1
                if isinstance(item, BadLineError):
                    if not self._skip_bad:
                        raise item
                    self._counts["skipped"] += 1
                    self._problems[item.problem] += 1
                    if len(self._errors) < MAX_QUOTED_ERRORS:
                        self._errors.append(str(item))
                    continue
                self._counts["documents"] += 1
                self._counts["tokens"] += len(item)
                yield item


def convert_rows(
    rows: Sequence[RawRow], tokenizer: Tokenizer, options: dict[str, Any]
) -> list[Document | BadLineError]:
    """Documents (or the error of each bad row) of a batch of rows, in order."""
    records: list[Any] = []
    for row in rows:
        try:
            records.append(_record(row))
        except BadLineError as e:
            records.append(e)
    tokenizer = Prefetched(tokenizer, _texts(records, options))
    out: list[Document | BadLineError] = []
    for row, record in zip(rows, records, strict=True):
        if isinstance(record, BadLineError):
            out.append(record)
            continue
        try:
            out.append(record_to_document(record, where=row.where, tokenizer=tokenizer, **options))
        except BadLineError as e:
            out.append(e)
    return out


class Prefetched:
    """A tokenizer whose ``encode`` first looks in a cache filled by one ``encode_batch`` call."""

    def __init__(self, base: Tokenizer, texts: list[str]) -> None:
        self.base = base
        batch = getattr(base, "encode_batch", None)
        ids = batch(texts) if batch is not None else [base.encode(t) for t in texts]
        self._cache: dict[str, list[int]] = dict(zip(texts, ids, strict=True))
        self.eos_id, self.pad_id, self.bos_id = base.eos_id, base.pad_id, base.bos_id
        self.vocab_size = base.vocab_size

    def encode(self, text: str) -> list[int]:
        """Cached ids of ``text`` (encoded and cached on a miss, e.g. a chat header)."""
        hit = self._cache.get(text)
        if hit is None:
            hit = self._cache[text] = self.base.encode(text)
        return list(hit)

    def decode(self, ids: Sequence[int]) -> str:
        """The base tokenizer's decode."""
        return self.base.decode(ids)


def _texts(records: list[Any], options: dict[str, Any]) -> list[str]:
    """The distinct string fields of the records, to encode in one batch (a model's own chat
    template renders whole conversations itself: their contents are not worth encoding alone)."""
    own_template = not isinstance(options.get("chat_template") or ChatTemplate(), ChatTemplate)
    fields = options.get("fields")
    names = (
        (fields.text, fields.prompt, fields.completion, fields.messages)
        if fields is not None
        else ("text", "prompt", "completion", "messages")
    )
    texts: dict[str, None] = {}
    for record in records:
        if not isinstance(record, dict):
            continue
        for name in names:
            value = record.get(name)
            if isinstance(value, str):
                texts[value] = None
            elif isinstance(value, list) and not own_template:
                for message in value:
                    content = message.get("content") if isinstance(message, dict) else None
                    if isinstance(content, str):
                        texts[content] = None
    return list(texts)


def _record(row: RawRow) -> Any:
    """The record of a row: the dict itself, or the parsed JSON line."""
    if isinstance(row.payload, dict):
        return row.payload
    raw = row.payload
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadLineError(
            row.where,
            "<line>",
            "invalid UTF-8",
            raw,
            f"bad byte at offset {e.start} of the line; re-encode the file as UTF-8",
        ) from e
    if row.first:
        text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark some editors write
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        hint = f"{e.msg} at column {e.colno}; each line must be one complete JSON object"
        if row.first and text.lstrip().startswith("["):
            hint += " (this looks like a JSON array: write one element per line instead)"
        raise BadLineError(row.where, "<line>", "invalid JSON", text.rstrip("\r\n"), hint) from e


def _init_worker(tokenizer: Tokenizer, options: dict[str, Any]) -> None:
    # A worker process's own copy of what convert_rows needs; it lives as long as the process.
    _WORKER_STATE["tokenizer"], _WORKER_STATE["options"] = tokenizer, options


def _convert_in_worker(rows: list[RawRow]) -> list[Document | BadLineError]:
    return convert_rows(rows, _WORKER_STATE["tokenizer"], _WORKER_STATE["options"])


_WORKER_STATE: dict[str, Any] = {}
"""Per worker process (set by the pool initializer); empty in the main process."""
