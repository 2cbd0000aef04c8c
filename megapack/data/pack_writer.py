"""`PackWriter`: pack a corpus of any size to disk with memory bounded by its number of documents.

``megapack pack`` used to read every document into a list, concatenate them (a second copy) and
plan; its memory grew with every token. The writer streams instead:

1. documents (from any reader; long ones split at message boundaries when ``long_docs="split"``)
   are appended as they arrive to ``tokens.npy`` and ``loss_mask.npy``: raw data behind a
   fixed-size header that is filled in at the end, so the files are ordinary ``.npy`` arrays;
   only their lengths stay in memory (8 bytes a document). A reader's `DocumentBatch`es
   (`RecordReader.batches`) are written whole, a batch's arrays as they are, with no Python
   object per document (the way ``megapack pack`` writes; a batch holding a document longer
   than a row goes document by document);
2. after every ``checkpoint_every`` documents the files are flushed and ``progress.json`` records
   how far they go and how many input rows produced them (a *completed shard* of the input);
3. at the end, the plan is made from the lengths alone (`megapack.data.packed_dir.plan_packed_dir`,
   the function `PackedDataset` uses, with the writer's `PackOptions`) and written as
   ``slices.npy`` / ``bin_offsets.npy`` with ``doc_offsets.npy`` and ``meta.json`` (which
   records the options). Rows are slices of the token memmap, so they are not
   copied again: the directory is exactly what `PackedDataset.save` writes, and
   `PackedDataset.load` reads it unchanged (the same arrays, byte for byte). ``meta.json``
   records the contents' fingerprint (`megapack.data.fingerprint`, read from the written files)
   and, where given, the tokenizer's name, vocabulary size and eos id.

Resuming: a run that stopped (killed, out of disk) leaves ``progress.json`` and no ``meta.json``.
``PackWriter(out, ..., resume=True)`` truncates the files to the last checkpoint and reports
``rows_done``, the input rows to skip (``read_jsonl(..., skip=rows_done)``); a different
configuration (input, any `PackOptions` field, tokenizer, ...) is refused naming the setting.

Peak memory: about two reader batches of documents in flight (their encodings: 100-150 bytes a
token of a batch, so longer documents take more), the write buffer (``buffer_tokens``) and a few
hundred bytes per document (lengths, then the plan); not the corpus' tokens (docs/data.md,
measured by ``megapack bench``'s pack section).
"""

from __future__ import annotations

import io
import json
import os
from array import array
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import numpy as np

from megapack.core.checks import check_int
from megapack.data.convert import DocumentBatch
from megapack.data.document import Document
from megapack.data.fingerprint import fingerprint
from megapack.data.packed_dir import NothingToPack, plan_packed_dir, write_packed_dir
from megapack.data.split import split_document
from megapack.packing.options import PackOptions, pack_options

PROGRESS_VERSION = 1
HEADER_BYTES = 128
"""Reserved .npy header size (a multiple of 64, holds any 1-D shape)."""
ARRAYS: dict[str, np.dtype[Any]] = {"tokens": np.dtype(np.int64), "loss_mask": np.dtype(np.float32)}


class PackWriter:
    """Stream documents into a `PackedDataset` directory, resumably; see the module docstring.

    Args:
        out: the output directory.
        packing: how to pack the rows (`PackOptions`, recorded in ``meta.json``), or the
            ``seq_len`` alone.
        pad_token_id: the tokenizer's pad id, recorded for `PackedDataset.load`.
        config: anything else that must match on resume (input path, tokenizer, fields, ...).
        tokenizer, vocab_size, eos_id: what tokenized the documents, recorded in ``meta.json``
            (None where unknown, e.g. for token arrays read as they are).
        resume: continue the unfinished run in ``out`` from its last checkpoint.
        checkpoint_every: documents between checkpoints.
        buffer_tokens: tokens held before a write.

    Example:
        >>> writer = PackWriter("packed/", PackOptions(seq_len=4096), resume=True)  # doctest: +SKIP
        >>> reader = read_jsonl("train.jsonl", tok, skip=writer.rows_done)  # doctest: +SKIP
        >>> meta = writer.write(reader, position=lambda: reader.rows_done)  # doctest: +SKIP
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        packing: PackOptions | int,
        *,
        pad_token_id: int = 0,
        config: dict[str, Any] | None = None,
        resume: bool = False,
        checkpoint_every: int = 100_000,
        buffer_tokens: int = 1 << 16,
        tokenizer: str | None = None,
        vocab_size: int | None = None,
        eos_id: int | None = None,
    ) -> None:
        self.packing = pack_options(packing, {}, where="PackWriter")
        for name, value in (
            ("checkpoint_every", checkpoint_every),
            ("buffer_tokens", buffer_tokens),
        ):
            check_int(name, value, minimum=1)
        if tokenizer is not None and not isinstance(tokenizer, str):
            raise TypeError(f"tokenizer must be a name (str) or None, got {tokenizer!r}")
        self.tokenizer: dict[str, Any] = {
            "tokenizer": tokenizer,
            "vocab_size": None
            if vocab_size is None
            else check_int("vocab_size", vocab_size, minimum=1),
            "eos_id": None if eos_id is None else check_int("eos_id", eos_id, minimum=0),
        }
        """What tokenized the documents, as ``meta.json`` records it."""
        self.pad_token_id = check_int("pad_token_id", pad_token_id, minimum=0)
        self.out = Path(out)
        self.config = json.loads(json.dumps(config or {}, default=str))
        self.checkpoint_every = checkpoint_every
        self.buffer_tokens = buffer_tokens
        self.rows_done = 0
        self.input_documents = self.split_documents = 0  # saved with every checkpoint
        """Input rows behind the last checkpoint: what a resumed reader skips."""
        self.documents = 0
        self.tokens = 0
        self._lengths = array("q")  # int64, 8 bytes a document
        self._origins: array[int] | None = array("q")  # each document's input document
        self._start(resume)

    def _settings(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint: the packing and the pad id."""
        return {**self.packing.to_dict(), "pad_token_id": self.pad_token_id}

    def _start(self, resume: bool) -> None:
        progress = self.out / "progress.json"
        if (self.out / "meta.json").is_file() and progress.is_file():
            (self.out / "meta.json").unlink()  # a crash while finishing: redo the end
        if progress.is_file():
            if not resume:
                raise ValueError(
                    f"{self.out} holds an unfinished pack ({progress}): pass --resume (resume=True) "
                    "to continue it, or remove the directory to start over"
                )
            state = json.loads(progress.read_text())
            if state.get("version") != PROGRESS_VERSION:
                raise ValueError(
                    f"{progress} has version {state.get('version')!r}; this megapack resumes "
                    f"version {PROGRESS_VERSION}: remove the directory to start over"
                )
            saved = {"settings": state.get("settings"), "config": state.get("config")}
            mine = {"settings": self._settings(), "config": self.config}
            for part in ("settings", "config"):
                for key in sorted(set(saved[part] or {}) | set(mine[part])):
                    if (saved[part] or {}).get(key) != mine[part].get(key):
                        raise ValueError(
                            f"{self.out}: the unfinished pack was started with {key}="
                            f"{(saved[part] or {}).get(key)!r}, this run has {key}="
                            f"{mine[part].get(key)!r}; use the same settings to resume, or remove it"
                        )
            self.rows_done, self.documents, self.tokens = (
                int(state["rows"]),
                int(state["documents"]),
                int(state["tokens"]),
            )
            self.input_documents = int(state.get("input_documents", 0))
            self.split_documents = int(state.get("split_documents", 0))
            lengths = np.fromfile(self.out / "lengths.partial", dtype=np.int64)
            self._lengths.frombytes(lengths[: self.documents].tobytes())
            if (self.out / "origins.partial").is_file():
                origins = np.fromfile(self.out / "origins.partial", dtype=np.int64)
                assert self._origins is not None
                self._origins.frombytes(origins[: self.documents].tobytes())
            else:  # started by a megapack that did not record them: none are written
                self._origins = None
        elif (self.out / "meta.json").is_file() and not resume:
            raise ValueError(
                f"{self.out} already holds a finished pack (meta.json): choose another --out or "
                "remove it"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, IO[bytes]] = {}
        for name, dtype in ARRAYS.items():
            path = self.out / f"{name}.npy"
            mode = "r+b" if self.documents else "wb"
            if not path.exists():
                mode = "wb"
            handle = open(path, mode)  # noqa: SIM115 (closed in write / close)
            handle.truncate(HEADER_BYTES + self.tokens * dtype.itemsize)
            handle.seek(HEADER_BYTES + self.tokens * dtype.itemsize)
            self._files[name] = handle
        self._buffers: dict[str, list[np.ndarray]] = {name: [] for name in ARRAYS}
        self._buffered = 0

    def write(
        self,
        documents: Iterable[Document | DocumentBatch],
        *,
        position: Callable[[], int] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]:
        """Append ``documents``, plan, and finish the directory; returns its meta.

        Args:
            documents: the input, positioned after ``rows_done`` rows when resuming: Documents,
                or `DocumentBatch`es (a reader's ``batches()``; checkpoints then fall between
                batches).
            position: input rows this run's reader consumed so far (for checkpoints; the
                writer adds the ``rows_done`` it resumed from); default: documents read.
            on_progress: called as ``on_progress(documents, tokens)`` after every document
                (batch).

        Raises:
            NothingToPack: no documents at all (a ValueError).
            ValueError: a document the long-document policy refuses.
        """
        seen = since = 0
        start = self.rows_done
        seq_len, split = self.packing.seq_len, self.packing.long_docs == "split"
        refuse = self.packing.long_docs == "error"
        try:
            for item in documents:
                if refuse:
                    _refuse_long(item, seq_len)
                if isinstance(item, DocumentBatch):
                    count = self._append_batch(item, seq_len if split else 0)
                else:
                    count = 1
                    self.split_documents += split and len(item) > seq_len
                    for piece in split_document(item, seq_len) if split else (item,):
                        self._append(piece, self.input_documents)
                seen, since = seen + count, since + count
                self.input_documents += count
                if on_progress is not None:
                    on_progress(self.documents, self.tokens)
                if since >= self.checkpoint_every:
                    self._checkpoint(start + (position() if position else seen))
                    since = 0
            self._flush()
        finally:
            for handle in self._files.values():
                handle.close()
        return self._finish()

    def _append_batch(self, batch: DocumentBatch, split_above: int) -> int:
        """Append a batch's documents (split those over ``split_above`` tokens, if > 0)."""
        lengths = np.diff(batch.offsets)
        if split_above and len(batch) and int(lengths.max()) > split_above:
            for d in range(len(batch)):
                doc = batch.document(d)
                self.split_documents += len(doc) > split_above
                for piece in split_document(doc, split_above):
                    self._append(piece, self.input_documents + d)
            return len(batch)
        if self._origins is not None:
            first = self.input_documents
            self._origins.frombytes(np.arange(first, first + len(batch), dtype=np.int64).tobytes())
        self._buffers["tokens"].append(batch.tokens)
        self._buffers["loss_mask"].append(batch.loss_mask)
        self._lengths.frombytes(lengths.astype(np.int64, copy=False).tobytes())
        self.documents += len(batch)
        self.tokens += len(batch.tokens)
        self._buffered += len(batch.tokens)
        if self._buffered >= self.buffer_tokens:
            self._flush()
        return len(batch)

    def _append(self, doc: Document, origin: int) -> None:
        if self._origins is not None:
            self._origins.append(origin)
        self._buffers["tokens"].append(doc.tokens)
        self._buffers["loss_mask"].append(doc.loss_mask)
        self._lengths.append(len(doc))
        self.documents += 1
        self.tokens += len(doc)
        self._buffered += len(doc)
        if self._buffered >= self.buffer_tokens:
            self._flush()

    def _flush(self) -> None:
        for name, parts in self._buffers.items():
            if parts:
                data = parts[0] if len(parts) == 1 else np.concatenate(parts)
                data = np.ascontiguousarray(data, dtype=ARRAYS[name])
                self._files[name].write(data.data.cast("B"))  # no copy
            parts.clear()
        self._buffered = 0

    def _checkpoint(self, rows: int) -> None:
        self._flush()
        for handle in self._files.values():
            handle.flush()
            os.fsync(handle.fileno())
        np.frombuffer(self._lengths, dtype=np.int64).tofile(self.out / "lengths.partial")
        if self._origins is not None:
            np.frombuffer(self._origins, dtype=np.int64).tofile(self.out / "origins.partial")
        state = {
            "version": PROGRESS_VERSION,
            "settings": self._settings(),
            "config": self.config,
            "rows": rows,
            "documents": self.documents,
            "tokens": self.tokens,
            "input_documents": self.input_documents,
            "split_documents": self.split_documents,
        }
        tmp = self.out / "progress.json.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.out / "progress.json")  # atomic: a checkpoint is whole or absent
        self.rows_done = rows

    def _finish(self) -> dict[str, Any]:
        if not self._lengths:
            raise NothingToPack("documents is empty: nothing to pack")
        for name, dtype in ARRAYS.items():
            _write_header(self.out / f"{name}.npy", dtype, self.tokens)
        lengths = np.frombuffer(self._lengths, dtype=np.int64).copy()
        arrays, meta = plan_packed_dir(lengths, self.packing, pad_token_id=self.pad_token_id)
        meta.update(self.tokenizer)
        meta.update(input_documents=self.input_documents, split_documents=self.split_documents)
        written = {name: np.load(self.out / f"{name}.npy", mmap_mode="r") for name in ARRAYS}
        meta["fingerprint"] = fingerprint({**arrays, **written})
        if self._origins is not None:
            arrays["origins"] = np.frombuffer(self._origins, dtype=np.int64)
        write_packed_dir(self.out, arrays, meta)
        for leftover in ("progress.json", "lengths.partial", "origins.partial"):
            (self.out / leftover).unlink(missing_ok=True)
        return meta


def _refuse_long(item: Document | DocumentBatch, seq_len: int) -> None:
    """``long_docs="error"``: the first document longer than ``seq_len``, named by its source."""
    if isinstance(item, DocumentBatch):
        lengths = np.diff(item.offsets)
        long = np.flatnonzero(lengths > seq_len)
        if not len(long):
            return
        where, n = item.sources[int(long[0])], int(lengths[long[0]])
    elif len(item) > seq_len:
        where, n = item.source, len(item)
    else:
        return
    raise ValueError(
        f"{where}: a document of {n:,} tokens is longer than seq_len={seq_len:,} (--seq-len), and "
        "long_docs='error' refuses it: use --long-docs split, truncate or drop"
    )


def _write_header(path: Path, dtype: np.dtype[Any], count: int) -> None:
    """Fill the reserved header of a raw-data .npy file: a 1-D array of ``count`` items, written
    by numpy's own writer, so the file is byte for byte what ``np.save`` writes."""
    header = io.BytesIO()
    fields = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False}
    np.lib.format.write_array_header_1_0(header, {**fields, "shape": (count,)})
    if len(header.getvalue()) != HEADER_BYTES:
        raise ValueError(
            f"{path}: the .npy header of {count} items takes {len(header.getvalue())} bytes, "
            f"not the {HEADER_BYTES} reserved"
        )
    with open(path, "r+b") as handle:
        handle.write(header.getvalue())
