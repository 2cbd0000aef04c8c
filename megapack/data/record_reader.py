"""`RecordReader`: what every record format (JSONL, Parquet, Arrow) shares: batches, bad rows, counts.

A format only says how to walk its rows: `RecordReader._rows` yields `RawRow`s, each the row's
``where`` (``"file.jsonl:17"``, ``"file.parquet:row 16"``) and its payload, raw JSON bytes or an
already-decoded dict. Everything after that is shared and lives here:

1. rows are gathered in batches of ``batch_size``;
2. each batch becomes one `DocumentBatch` (`megapack.data.convert.convert_rows`: one
   ``tokenizer.encode_batch`` call, on all cores for a HF tokenizer, and the documents laid out
   back to back);
3. the next batch's ``encode_batch`` (which releases the GIL) runs in a thread while this thread
   parses, lays out and hands over the current one, or, with ``workers > 1``, step 2 runs in a
   pool of forked processes; order is kept;
4. bad rows: the first raises `BadLineError` (file, row, field, value, hint) in order, after the
   rows before it were yielded; with ``skip_bad`` they are counted in `ReaderStats`.

One way to open one, `RecordReader.open` (`read_jsonl` and `read_table` are its two formats'):
the same options for every format, checked before any row is read; a format adds only where its
rows come from (``_locate``) and how to walk them (``_rows``).

Two ways to consume a reader, one at a time: iterate it for `Document`s (views into the batches),
or call `RecordReader.batches` for the `DocumentBatch`es themselves (what ``megapack pack`` writes,
without a Python object per document).

``shard=(rank, world)`` keeps every ``world``-th row (or unit of rows, see the formats), so that
the ranks of a data-parallel group read disjoint shares covering the file exactly once.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections import Counter
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, ClassVar, Self

from megapack.core.checks import check_int
from megapack.data.chat import ChatTemplate
from megapack.data.convert import (
    DocumentBatch,
    ParsedRows,
    RawRow,
    build_batch,
    convert_rows,
    encode_all,
    parse_rows,
)
from megapack.data.document import Document
from megapack.data.records import (
    DEFAULT_FIELDS,
    FORMATS,
    BadLineError,
    Fields,
    Format,
    ModelChatTemplate,
)
from megapack.data.tokenizers import ByteTokenizer, Tokenizer

__all__ = ["DocumentBatch", "RawRow", "ReaderStats", "RecordReader", "check_shard"]

log = logging.getLogger(__name__)  # library code logs; the CLI prints

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

    Args:
        source: where the rows are, as the format's ``_locate`` found it (a path, a file list).
        tokenizer: encodes the records' text.
        skip_bad, shard, workers, skip: as `open`.
        batch_size: rows converted (and tokenized) together.
        **options: ``format``, ``append_eos``, ``chat_template``, ``fields``: as `open`.
    """

    OPENER: ClassVar[str] = "RecordReader.open"
    """The public name of the format's `open` (``read_jsonl``), for its error messages."""

    @classmethod
    def open(
        cls,
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
    ) -> Self:
        """Documents from the records at ``path``, one per line or row (``read_jsonl``,
        ``read_table``).

        Args:
            path: the input (the format says which: a ``.jsonl`` file, a Parquet file, ...).
            tokenizer: default `ByteTokenizer()`.
            format: ``"auto"`` detects each record's format from its keys; ``"text"``,
                ``"prompt_completion"`` or ``"chat"`` forces one (see `megapack.data.records`).
            skip_bad: skip and count bad records (see `RecordReader.stats`) instead of raising.
            append_eos: end each document with the tokenizer's eos id, learned (chat: see
                `record_to_document`).
            chat_template: how ``messages`` are rendered; default `ChatTemplate()`; a model's own:
                `HFChatTemplate`.
            fields: which keys (columns) hold text, prompt, completion, messages, tools.
            shard: ``(rank, world)``: read only this rank's share (see the format's module).
            workers: processes converting batches of records (1: in this process).
            skip: records of this shard to pass over unread (a resumed pack).

        Returns:
            The reader: iterate it for Documents, read ``.stats`` for counts.

        Raises:
            FileNotFoundError: no such input (raised here, before iterating).
            ImportError: the format needs a package that is not installed (pyarrow).
            ValueError: an unknown ``format``, or input the format cannot read (naming it).
            BadLineError: while iterating, on the first bad record unless ``skip_bad``.

        Example:
            a JSONL file with the line ``{"prompt": "a", "completion": "b"}`` at line 1 yields
            ``Document(tokens=[97, 98, 257], loss_mask=[0, 1, 1], source="file.jsonl:1")``.
        """
        source = cls._locate(Path(path), fields)
        if format not in FORMATS:
            raise ValueError(
                f"{cls.OPENER}: format={format!r}; expected one of {', '.join(FORMATS)}"
            )
        return cls(
            source,
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

    @classmethod
    def _locate(cls, path: Path, fields: Fields) -> Any:
        """Where a format's rows are, checked before any is read (each format implements it)."""
        raise NotImplementedError

    def __init__(
        self,
        source: Any,
        tokenizer: Tokenizer,
        *,
        skip_bad: bool,
        shard: tuple[int, int] | None = None,
        workers: int = 1,
        batch_size: int = BATCH_SIZE,
        skip: int = 0,
        **options: Any,
    ) -> None:
        workers = check_int("workers", workers, minimum=1)
        batch_size = check_int("batch_size", batch_size, minimum=1)
        skip = check_int("skip", skip, minimum=0)
        self.source = source
        """Where the rows are (a format's ``_locate``)."""
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
        self._mode = ""
        self._converted = self._read()
        self._docs = self._documents()
        self._batch_iter = self._checked_batches()

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
        self._use("documents")
        return next(self._docs)

    def batches(self) -> Iterator[DocumentBatch]:
        """The rest of the input as `DocumentBatch`es (bad rows counted or raised as documents are).

        Each batch's ``rows_done`` are counted when it is yielded. Use either this or iteration
        by documents on one reader, not both.

        Raises:
            ValueError: documents were already drawn from this reader.
        """
        self._use("batches")
        return self._batch_iter

    def _use(self, mode: str) -> None:
        if self._mode != mode:
            if self._mode:
                raise ValueError(
                    f"this reader is already read by {self._mode}; open a new reader to read it "
                    f"by {mode}"
                )
            self._mode = mode

    def close(self) -> None:
        """Stop reading and close the file; later ``next`` calls raise StopIteration."""
        self._docs.close()
        self._batch_iter.close()
        self._converted.close()

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

    def _read(self) -> Generator[DocumentBatch, None, None]:
        if self._workers == 1:
            yield from self._ahead()
            return
        context = multiprocessing.get_context("fork")
        with context.Pool(
            self._workers, initializer=_init_worker, initargs=(self.tokenizer, self._options)
        ) as pool:
            yield from pool.imap(_convert_in_worker, self._batches())

    def _ahead(self) -> Iterator[DocumentBatch]:
        """Converted batches, the next one encoding in a thread while this one is finished.

        The tokenizer's ``encode_batch`` releases the GIL, so this thread's Python work (reading
        and parsing the next rows, laying out the encoded batch, and the caller's writing it)
        overlaps with it; order is kept.
        """
        pool = ThreadPoolExecutor(1)
        try:
            pending: list[tuple[ParsedRows, Future[list[list[int]]]]] = []
            for batch in self._batches():
                parsed = parse_rows(batch, self._options)
                pending.append((parsed, pool.submit(encode_all, self.tokenizer, parsed.texts)))
                if len(pending) == 2:
                    done, encoding = pending.pop(0)
                    yield build_batch(done, self.tokenizer, self._options, encoding.result())
            for done, encoding in pending:
                yield build_batch(done, self.tokenizer, self._options, encoding.result())
        finally:
            # Never join the thread here: a reader dropped mid-file is finalized by the garbage
            # collector wherever it runs, even inside threading's bookkeeping while another
            # thread starts, and joining there deadlocks. The idle thread exits by itself.
            pool.shutdown(wait=False, cancel_futures=True)

    def _documents(self) -> Generator[Document, None, None]:
        for batch in self._converted:
            errors = iter(batch.errors)
            bad = next(errors, None)
            for d in range(len(batch)):
                while bad is not None and bad[0] == d:
                    self._bad(bad[1])
                    bad = next(errors, None)
                doc = batch.document(d)
                self.rows_done += 1
                self._counts["documents"] += 1
                self._counts["tokens"] += len(doc)
                yield doc
            while bad is not None:
                self._bad(bad[1])
                bad = next(errors, None)

    def _checked_batches(self) -> Generator[DocumentBatch, None, None]:
        for batch in self._converted:
            if batch.errors and not self._skip_bad:
                before = batch.errors[0][0]
                if before:
                    yield self._counted(batch.head(before))
                self._bad(batch.errors[0][1])
            for _, error in batch.errors:
                self._bad(error)
            yield self._counted(batch)

    def _counted(self, batch: DocumentBatch) -> DocumentBatch:
        self.rows_done += len(batch)
        self._counts["documents"] += len(batch)
        self._counts["tokens"] += int(batch.offsets[-1])
        return batch

    def _bad(self, error: BadLineError) -> None:
        """A bad row: raise it, or (``skip_bad``) count it."""
        self.rows_done += 1
        if not self._skip_bad:
            raise error
        self._counts["skipped"] += 1
        self._problems[error.problem] += 1
        log.debug("skipped %s", error)
        if len(self._errors) < MAX_QUOTED_ERRORS:
            self._errors.append(str(error))


def _init_worker(tokenizer: Tokenizer, options: dict[str, Any]) -> None:
    # A worker process's own copy of what convert_rows needs; it lives as long as the process.
    _WORKER_STATE["tokenizer"], _WORKER_STATE["options"] = tokenizer, options


def _convert_in_worker(rows: list[RawRow]) -> DocumentBatch:
    return convert_rows(rows, _WORKER_STATE["tokenizer"], _WORKER_STATE["options"])


_WORKER_STATE: dict[str, Any] = {}
"""Per worker process (set by the pool initializer); empty in the main process."""
