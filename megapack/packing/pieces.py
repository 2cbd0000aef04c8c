"""Pieces: what a packer packs, ``(doc_index, start, stop)``, and the long-document policies.

A *piece* is tokens ``start:stop`` of document ``doc_index``, at most ``seq_len`` tokens: a whole
document that fits a row is one piece ``(i, 0, length)``; a document longer than a row is handled
by ``long_docs``:

    "split"     pieces of ``seq_len`` tokens plus a shorter last one; no token is lost
    "truncate"  one piece of the first ``seq_len`` tokens; the rest counts as truncated
    "drop"      no piece; the document counts as dropped
    "error"     ValueError naming the first long document (its index and length)

One name, three forms: `Piece`, one piece as a `StreamingPacker` yields it (with its document);
`Pieces`, many pieces as columns (``doc_index``, ``start``, ``stop`` arrays: `make_pieces`'s
result, what `megapack.packing.plan` packs); and a plan's rows of pieces (`PackPlan.slices`, an
``[n, 3]`` array; `PackPlan.bins`, ``(doc_index, start, stop)`` tuples).

Worked example, lengths ``[12, 3]`` at seq_len 5 with "split": pieces ``(0, 0, 5), (0, 5, 10),
(0, 10, 12), (1, 0, 3)`` (sizes 5, 5, 2, 3), one split document holding 12 tokens. With "truncate":
``(0, 0, 5), (1, 0, 3)`` and 7 truncated tokens; with "drop": ``(1, 0, 3)`` and 12 dropped tokens.

Pieces are listed by document, then by position in the document. Everything is vectorized numpy:
O(n) time and memory for n documents (1,000,000 lengths: about 70 ms with splitting, 5 ms without).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from megapack.packing.names import LONG_DOC_POLICIES
from megapack.packing.options import check_choice


class Piece(NamedTuple):
    """Tokens ``start:stop`` of ``doc``, the ``doc_index``-th document (as a `StreamingPacker`
    yields it: ``doc_index`` counts the stream's documents from 0)."""

    doc_index: int
    """Which document: its index in the input (the stream), from 0."""
    start: int
    """First token of the piece within the document."""
    stop: int
    """One past the last token."""
    doc: Any
    """The document as the input gave it (token ids or a bare length)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LongDocCounts:
    """What the long-document policy did to the documents (of `Pieces` and of a `PackPlan`)."""

    num_docs: int
    """Documents given, kept or not."""
    num_split_docs: int = 0
    """Documents longer than ``seq_len``, split into several pieces (possibly in several rows)."""
    split_tokens: int = 0
    """Tokens of the split documents; all of them are packed."""
    num_truncated_docs: int = 0
    """Documents cut to their first ``seq_len`` tokens."""
    truncated_tokens: int = 0
    """Tokens cut off truncated documents; not packed."""
    num_dropped_docs: int = 0
    """Documents left out for being longer than ``seq_len``."""
    dropped_tokens: int = 0
    """Tokens of the dropped documents; not packed."""

    def counts(self) -> dict[str, int]:
        """The counts alone, as keywords for another `LongDocCounts` (a plan of these pieces)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(LongDocCounts)}


@dataclass(frozen=True, kw_only=True, slots=True)
class Pieces(LongDocCounts):
    """The pieces of a set of documents after the long-document policy, as columns.

    Example, lengths ``[12, 3]``, seq_len 5, "split": ``doc_index [0, 0, 0, 1]``, ``start [0, 5,
    10, 0]``, ``stop [5, 10, 12, 3]``, ``num_split_docs 1``, ``split_tokens 12``.
    """

    doc_index: np.ndarray
    """[m] int64, the document each piece comes from, non-decreasing."""
    start: np.ndarray
    """[m] int64, first token of the piece within its document."""
    stop: np.ndarray
    """[m] int64, one past the last token; ``0 < stop - start <= seq_len``."""

    @property
    def sizes(self) -> np.ndarray:
        """[m] int64 piece sizes, ``stop - start``."""
        return self.stop - self.start


def as_lengths(lengths: Sequence[int] | np.ndarray, *, name: str = "lengths") -> np.ndarray:
    """Validate document lengths and return them as a 1-D int64 array.

    Args:
        lengths: a sequence or 1-D array of positive integers.
        name: the argument name used in error messages.

    Returns:
        A new int64 array.

    Raises:
        TypeError: the values are not integers (floats, strings, booleans).
        ValueError: not 1-D, or a length is zero or negative (the message names the index).

    Example:
        >>> as_lengths([3, 2, 4]).tolist()
        [3, 2, 4]
    """
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        if arr.dtype == object and all(
            isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_) for v in arr
        ):
            arr = arr.astype(np.int64)
        else:
            raise TypeError(
                f"{name} must hold integers (token counts), got dtype {arr.dtype}; "
                "convert with np.asarray(lengths, dtype=np.int64) after rounding"
            )
    out = arr.astype(np.int64)
    bad = np.flatnonzero(out <= 0)
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"{name}[{i}] = {int(out[i])}: every document needs at least one token "
            f"({len(bad)} document(s) are empty or negative); filter empty documents before packing"
        )
    return out


def make_pieces(
    lengths: np.ndarray, seq_len: int, long_docs: str, *, first: int = 0, where: str = ""
) -> Pieces:
    """Turn validated lengths into pieces under a long-document policy (module docstring).

    Args:
        lengths: 1-D int64 array of positive lengths (from `as_lengths`).
        seq_len: tokens a row, positive.
        long_docs: one of ``LONG_DOC_POLICIES``.
        first, where: how errors name document ``i``: ``f"document {first + i}{where}"`` (the
            streaming packer passes its stream position and ``" of the stream"``).

    Returns:
        The pieces, ordered by document then position, with the loss counters filled in.

    Raises:
        ValueError: ``long_docs`` is unknown, or it is "error" and a document is longer than
            ``seq_len`` (the message names the first such index and its length).

    Example:
        >>> pieces = make_pieces(np.array([12, 3]), 5, "split")
        >>> pieces.start.tolist(), pieces.stop.tolist()
        ([0, 5, 10, 0], [5, 10, 12, 3])
    """
    check_choice("long_docs", long_docs, LONG_DOC_POLICIES)
    n = len(lengths)
    index = np.arange(n, dtype=np.int64)
    long = lengths > seq_len
    n_long = int(long.sum())
    if n_long == 0:
        return Pieces(doc_index=index, start=np.zeros(n, np.int64), stop=lengths.copy(), num_docs=n)
    long_tokens = int(lengths[long].sum())
    if long_docs == "error":
        i = int(np.flatnonzero(long)[0])
        raise ValueError(
            f"document {first + i}{where} has {int(lengths[i])} tokens, more than seq_len={seq_len} "
            f"({n_long} document(s) are too long); use long_docs='split', 'truncate' or 'drop' "
            "(megapack pack: --long-docs split)"
        )
    if long_docs == "drop":
        keep = ~long
        return Pieces(
            doc_index=index[keep],
            start=np.zeros(int(keep.sum()), np.int64),
            stop=lengths[keep],
            num_docs=n,
            num_dropped_docs=n_long,
            dropped_tokens=long_tokens,
        )
    if long_docs == "truncate":
        return Pieces(
            doc_index=index,
            start=np.zeros(n, np.int64),
            stop=np.minimum(lengths, seq_len),
            num_docs=n,
            num_truncated_docs=n_long,
            truncated_tokens=long_tokens - n_long * seq_len,
        )
    # "split": document i becomes ceil(length / seq_len) chunks.
    chunks = -(-lengths // seq_len)
    doc_index = np.repeat(index, chunks)
    first_item = np.cumsum(chunks) - chunks
    chunk_no = np.arange(len(doc_index), dtype=np.int64) - np.repeat(first_item, chunks)
    start = chunk_no * seq_len
    stop = np.minimum(start + seq_len, lengths[doc_index])
    return Pieces(
        doc_index=doc_index,
        start=start,
        stop=stop,
        num_docs=n,
        num_split_docs=n_long,
        split_tokens=long_tokens,
    )
