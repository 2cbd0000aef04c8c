"""`convert_rows`: a batch of raw rows to one `DocumentBatch`, documents back to back.

A reader (`megapack.data.record_reader`) hands over rows in batches of 512; each batch becomes
one `DocumentBatch`: the documents' tokens and loss masks concatenated in two flat arrays, with
``offsets`` marking where each starts, and the bad rows beside them. Building the batch at once
instead of one `Document` (two small arrays, a validation pass) per row is what keeps
``megapack pack`` close to bare tokenization: the per-row Python work held the GIL that the next
batch's tokenizing shares (measured: ~0.35 s of 5,000 rows' 2.8 s of CPU).

Two paths, one result:

* plain rows, ``{"text": str}`` and ``{"prompt": str, "completion": str}`` with non-blank strings
  (auto-detected or forced with ``format=``), are encoded with one ``encode_batch`` call and laid
  out directly: ids + eos into one int64 array, loss mask ones except the prompts;
* every other row (chats, bad rows, a text that encodes to no tokens) goes through
  `record_to_document`, the one definition of the formats, which builds its Document or raises
  the `BadLineError` naming file, row and field; its arrays are copied into the batch.

Worked example, ``ByteTokenizer`` (eos 257), rows ``{"text": "hi"}``, ``{"text": ""}``,
``{"prompt": "a", "completion": "b"}``::

    tokens     [104, 105, 257, 97, 98, 257]     offsets [0, 3, 6]
    loss_mask  [1, 1, 1, 0, 1, 1]               errors  ((1, BadLineError("...:2: field 'text': empty ...")),)

(an error's number is how many documents of the batch come before it: the order of rows is kept).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from megapack.data.chat import ChatTemplate
from megapack.data.document import Document
from megapack.data.records import DEFAULT_FIELDS, BadLineError, Fields, record_to_document
from megapack.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer


class RawRow(NamedTuple):
    """One row before conversion: where it is and what it holds."""

    where: str
    """``"path:line"`` or ``"path:row i"``, the document's source and the prefix of errors."""
    payload: bytes | dict[str, Any]
    """Raw JSON bytes (JSONL, parsed here) or the row's columns as a dict (tables)."""
    first: bool = False
    """The first line of its file (a UTF-8 byte-order mark is allowed there)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DocumentBatch:
    """The documents of a batch of rows, back to back, and the rows that failed; see the module.

    ``len(batch)`` is its number of documents; ``batch.document(d)`` the d-th as a `Document`.
    """

    tokens: np.ndarray
    """[T] int64, every document's token ids, one after the other."""
    loss_mask: np.ndarray
    """[T] float32, their loss masks, aligned with ``tokens``."""
    offsets: np.ndarray
    """[D + 1] int64, document d is ``tokens[offsets[d]:offsets[d + 1]]``; ``offsets[0] == 0``."""
    boundaries: tuple[tuple[int, ...], ...]
    """Per document, its segment starts (`Document.boundaries`; ``()`` for text rows)."""
    sources: tuple[str, ...]
    """Per document, where it came from (``"file.jsonl:17"``)."""
    errors: tuple[tuple[int, BadLineError], ...] = ()
    """The bad rows, each as (documents of this batch before it, its error), in row order."""

    def __len__(self) -> int:
        return len(self.sources)

    @property
    def rows(self) -> int:
        """Input rows behind the batch: its documents and its bad rows."""
        return len(self.sources) + len(self.errors)

    def document(self, d: int) -> Document:
        """Document ``d`` (views of the batch's arrays, validated as any Document)."""
        a, b = int(self.offsets[d]), int(self.offsets[d + 1])
        return Document(
            tokens=self.tokens[a:b],
            loss_mask=self.loss_mask[a:b],
            boundaries=self.boundaries[d],
            source=self.sources[d],
        )

    def head(self, d: int) -> DocumentBatch:
        """The first ``d`` documents, without errors (what comes before the first bad row)."""
        end = int(self.offsets[d])
        return DocumentBatch(
            tokens=self.tokens[:end],
            loss_mask=self.loss_mask[:end],
            offsets=self.offsets[: d + 1],
            boundaries=self.boundaries[:d],
            sources=self.sources[:d],
        )


def convert_rows(
    rows: Sequence[RawRow], tokenizer: Tokenizer, options: dict[str, Any]
) -> DocumentBatch:
    """The `DocumentBatch` of ``rows`` (``options``: `record_to_document`'s keyword arguments).

    Its parts may run in different threads, as `RecordReader` does: `parse_rows` (JSON),
    `encode_all` of the texts (``encode_batch``, which releases the GIL) and `build_batch`.
    """
    return build_batch(parse_rows(rows, options), tokenizer, options)


class ParsedRows(NamedTuple):
    """`parse_rows`'s result: what `build_batch` needs."""

    rows: Sequence[RawRow]
    """The rows."""
    plan: list[Any]
    """Per row: its BadLineError, its record (for `record_to_document`), or (first text, count)
    of a plain row whose texts are ``texts[first : first + count]``."""
    texts: list[str]
    """The plain rows' texts, in order, then the other rows' distinct texts (chat messages): all
    encoded in one call."""
    plain: int
    """How many of ``texts`` are the plain rows'."""


def parse_rows(rows: Sequence[RawRow], options: dict[str, Any]) -> ParsedRows:
    """Parse the rows' JSON and pick out the texts of the plain ones (see the module docstring)."""
    fields: Fields = options.get("fields") or DEFAULT_FIELDS
    fmt = options.get("format", "auto")
    plan: list[Any] = []
    texts: list[str] = []
    for row in rows:
        try:
            record = _record(row)
        except BadLineError as e:
            plan.append(e)
            continue
        keys = _plain_keys(record, fmt, fields)
        if keys is None:
            plan.append(record)
        else:
            plan.append((len(texts), len(keys)))
            texts.extend(record[key] for key in keys)
    plain = len(texts)
    slow = [e for e in plan if not isinstance(e, tuple | BadLineError)]
    return ParsedRows(rows, plan, texts + _texts(slow, options) if slow else texts, plain)


def build_batch(
    parsed: ParsedRows,
    tokenizer: Tokenizer,
    options: dict[str, Any],
    ids: list[list[int]] | None = None,
) -> DocumentBatch:
    """Encode the plain rows' texts in one call (unless ``ids`` has them: `encode_all` of
    ``parsed.texts``), convert the others, lay the documents out."""
    rows, plan, texts, plain = parsed
    append_eos = options.get("append_eos", True)
    if ids is None:
        ids = encode_all(tokenizer, texts) if texts else []
    eos = tokenizer.eos_id
    flat: list[int] = []
    lengths: list[int] = []
    prompts: list[tuple[int, int]] = []  # [start, stop) of each prompt: loss mask 0
    slow: list[tuple[int, Document]] = []  # documents record_to_document built
    boundaries: list[tuple[int, ...]] = []
    sources: list[str] = []
    errors: list[tuple[int, BadLineError]] = []
    prefetched: Prefetched | None = None
    start = 0
    for row, entry in zip(rows, plan, strict=True):
        pieces = ids[entry[0] : entry[0] + entry[1]] if isinstance(entry, tuple) else None
        if pieces and all(pieces):
            if len(pieces) == 2:
                prompts.append((start, start + len(pieces[0])))
            for piece in pieces:
                flat += piece
            if append_eos:
                flat.append(eos)
            boundaries.append(())
        else:
            if isinstance(entry, BadLineError):
                errors.append((len(sources), entry))
                continue
            if isinstance(entry, tuple):  # a text encoding to no tokens: the slow path says so
                entry = _record(row)
            if prefetched is None:
                prefetched = Prefetched(tokenizer, texts[plain:], ids[plain:])
            try:
                doc = record_to_document(entry, where=row.where, tokenizer=prefetched, **options)
            except BadLineError as e:
                errors.append((len(sources), e))
                continue
            slow.append((start, doc))
            flat += doc.tokens.tolist()
            boundaries.append(doc.boundaries)
        sources.append(row.where)
        lengths.append(len(flat) - start)
        start = len(flat)
    if type(tokenizer) in (HFTokenizer, ByteTokenizer):  # ids are Python ints by construction
        tokens = np.fromiter(flat, dtype=np.int64, count=len(flat))  # 35% faster than np.array
    else:  # any other tokenizer's ids are checked: np.array keeps floats float
        tokens = np.array(flat) if flat else np.zeros(0, dtype=np.int64)
    if tokens.dtype.kind not in "iu" or (tokens.size and tokens.min() < 0):
        _refuse_ids(flat, lengths, sources)
    mask = np.ones(len(tokens), dtype=np.float32)
    for a, b in prompts:
        mask[a:b] = 0.0
    for a, doc in slow:
        mask[a : a + len(doc)] = doc.loss_mask
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return DocumentBatch(
        tokens=tokens.astype(np.int64, copy=False),
        loss_mask=mask,
        offsets=offsets,
        boundaries=tuple(boundaries),
        sources=tuple(sources),
        errors=tuple(errors),
    )


def _plain_keys(record: Any, fmt: str, fields: Fields) -> tuple[str, ...] | None:
    """The text keys of a plain text or prompt/completion record with non-blank strings, else None
    (the record then goes through `record_to_document`, which decides and explains)."""
    if not isinstance(record, dict):
        return None
    has_text = fields.text in record
    has_pc = fields.prompt in record or fields.completion in record
    if fmt == "auto":
        if fields.messages in record or has_text == has_pc:
            return None
        fmt = "text" if has_text else "prompt_completion"
    keys = fields.keys(fmt) if fmt in ("text", "prompt_completion") else ()
    for key in keys or (None,):
        value = record.get(key) if key is not None else None
        if not isinstance(value, str) or not value or value.isspace():
            return None
    return keys


def _refuse_ids(flat: list[Any], lengths: list[int], sources: list[str]) -> None:
    """Raise the error `Document` gives for the first document with ids that are not token ids."""
    start = 0
    for n, where in zip(lengths, sources, strict=True):
        Document(tokens=np.array(flat[start : start + n]), loss_mask=np.ones(n), source=where)
        start += n
    raise TypeError(f"token ids {np.array(flat).dtype} from the tokenizer; expected integers")


def encode_all(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Ids of every text: one ``encode_batch`` call when the tokenizer has it (all cores)."""
    batch = getattr(tokenizer, "encode_batch", None)
    return list(batch(texts)) if batch is not None else [tokenizer.encode(t) for t in texts]


class Prefetched:
    """A tokenizer whose ``encode`` first looks in a cache filled by one ``encode_batch`` call
    (or with the ``ids`` of ``texts`` given)."""

    def __init__(
        self, base: Tokenizer, texts: list[str], ids: list[list[int]] | None = None
    ) -> None:
        self.base = base
        ids = encode_all(base, texts) if ids is None else ids
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
    fields = options.get("fields") or DEFAULT_FIELDS
    names = (fields.text, fields.prompt, fields.completion, fields.messages)
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
    text = text.rstrip("\r\n")  # the line's end is not part of its JSON (nor of a column)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        reason = e.msg.removesuffix(" at")  # json's "Invalid control character at"
        hint = f"{reason} at column {e.colno} of {len(text)}; each line must be one complete JSON object"
        if e.pos >= len(text) or reason.startswith("Unterminated"):
            hint += " (the line ends early: was it cut short?)"
        if row.first and text.lstrip().startswith("["):
            hint += " (this looks like a JSON array: write one element per line instead)"
        raise BadLineError(row.where, "<line>", "invalid JSON", text, hint) from e
