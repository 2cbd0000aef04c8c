"""`PackedBatch`: one THD micro-batch of packed documents, and conversions into it.

Shape legend (THD: micro-batch rows concatenated into one row of T tokens):

    tokens, labels, position_ids   [1, T] int64
    loss_mask                      [1, T] float32
    cu_seqlens                     [n + 1] int32, cumulative real document lengths, from 0
    cu_seqlens_padded              [n + 1] int32 or None, cumulative padded lengths (buffer offsets)
    max_seqlen                     Python int, longest segment of the buffer

Worked example, documents of lengths [3, 2, 4] with tokens ``a b c | d e | f g h i``:

    tokens        [a, b, c, d, e, f, g, h, i]
    labels        [b, c, P, e, P, g, h, i, P]      (P = pad_token_id: no next token in the document)
    loss_mask     [1, 1, 0, 1, 0, 1, 1, 1, 0]
    position_ids  [0, 1, 2, 0, 1, 0, 1, 2, 3]
    cu_seqlens    [0, 3, 5, 9]                     max_seqlen 4

With ``pad_to_multiple_of=4`` each document is padded to [4, 4, 4] tokens; ``cu_seqlens`` stays
[0, 3, 5, 9] and ``cu_seqlens_padded`` is [0, 4, 8, 12] (Transformer Engine's THD convention:
the real lengths plus the padded offsets where each document starts in the buffer). Without
``cu_seqlens_padded``, ``cu_seqlens`` itself indexes the buffer and must end at T; trailing row
padding is then a segment of its own, as in Megatron's SFT datasets, so no kernel leaves it
uninitialized.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from megapack.core.checks import check_int
from megapack.core.extras import check_extras, document_extras, join_rows
from megapack.core.fields import CU_DTYPE, MASK_DTYPE, TOKEN_DTYPE, BatchField
from megapack.core.seq_params import make_packed_seq_params

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams

DocumentLike = Sequence[int] | np.ndarray | torch.Tensor | Mapping[str, Any]
"""What `PackedBatch.from_documents` takes as one document: token ids (a list, a numpy array, a 1-D
tensor), a dict with ``tokens`` (and ``loss_mask``), or a `megapack.data.Document`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedBatch:
    """A packed micro-batch in THD layout; see the module docstring for a worked example."""

    tokens: torch.Tensor
    """[1, T] int64 input token ids."""
    labels: torch.Tensor
    """[1, T] int64 targets: the next token within the same document."""
    loss_mask: torch.Tensor
    """[1, T] float32, 1 where the position's label is trained, 0 on padding and document ends."""
    position_ids: torch.Tensor
    """[1, T] int64, restarting at 0 for every document."""
    cu_seqlens: torch.Tensor
    """[n + 1] int32 cumulative real document lengths, starting at 0, strictly increasing."""
    cu_seqlens_padded: torch.Tensor | None = None
    """[n + 1] int32 cumulative padded lengths (buffer offsets), or None without per-document padding."""
    max_seqlen: int
    """Length of the longest buffer segment (padded segments when ``cu_seqlens_padded`` is set)."""
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """A trainer's own fields by name, each declared with `megapack.BatchField` where the batch is
    delivered: per token [1, T], per sample [n, ...], ragged [sum n_i, ...]."""

    @property
    def num_tokens(self) -> int:
        """T, the number of positions in the buffer, padding included."""
        return int(self.tokens.shape[-1])

    def validate(self) -> PackedBatch:
        """Check the THD contract; raise ValueError/TypeError naming the field and value.

        Returns:
            self, so that ``batch = PackedBatch(...).validate()`` reads naturally.
        """
        if not self._grid_ok():
            self._check_grid()  # raises, naming the field
        if self.extras:
            check_extras(self.extras)
        total = self.num_tokens
        if total == 0:
            raise ValueError("PackedBatch.tokens is empty (T == 0)")
        real, lengths = _check_cu("PackedBatch.cu_seqlens", self.cu_seqlens)
        if self.cu_seqlens_padded is None:
            if real[-1] != total:
                raise ValueError(
                    f"PackedBatch.cu_seqlens ends at {real[-1]} but the buffer has T={total} tokens; "
                    "cover trailing padding with a final segment or give cu_seqlens_padded"
                )
        else:
            lengths = self._check_padded(real, lengths, total)
        if not isinstance(self.max_seqlen, int) or isinstance(self.max_seqlen, bool):
            raise TypeError(
                f"PackedBatch.max_seqlen must be a Python int, got {type(self.max_seqlen).__name__} "
                f"({self.max_seqlen!r}); use int(...)"
            )
        longest = int(lengths.max())
        if self.max_seqlen < longest:
            raise ValueError(
                f"PackedBatch.max_seqlen={self.max_seqlen} is below the longest segment ({longest})"
            )
        return self

    def _grid_ok(self) -> bool:
        """The grid fields' contract in one pass, no message (`validate` runs on every transfer)."""
        tokens, labels, positions, mask = (
            self.tokens,
            self.labels,
            self.position_ids,
            self.loss_mask,
        )
        if not type(tokens) is type(labels) is type(positions) is type(mask) is torch.Tensor:
            return False
        shape = tokens.shape
        return (
            len(shape) == 2
            and shape[0] == 1
            and labels.shape == shape
            and positions.shape == shape
            and mask.shape == shape
            and tokens.dtype == TOKEN_DTYPE
            and labels.dtype == TOKEN_DTYPE
            and positions.dtype == TOKEN_DTYPE
            and mask.dtype == MASK_DTYPE
            and tokens.get_device() == labels.get_device() == positions.get_device()
            and mask.get_device() == tokens.get_device()
        )

    def _check_grid(self) -> None:
        """The grid fields' contract, raising TypeError/ValueError naming the first field that breaks it."""
        grid = ("tokens", "labels", "position_ids", "loss_mask")
        for name in grid:
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"PackedBatch.{name} must be a torch.Tensor, got {type(value).__name__}"
                )
            if value.dim() != 2 or value.shape[0] != 1:
                raise ValueError(
                    f"PackedBatch.{name} has shape {tuple(value.shape)}; THD batches are [1, T] "
                    "(concatenate micro-batch rows into one)"
                )
            if value.shape != self.tokens.shape:
                raise ValueError(
                    f"PackedBatch.{name} has shape {tuple(value.shape)} but tokens has "
                    f"{tuple(self.tokens.shape)}"
                )
            want = MASK_DTYPE if name == "loss_mask" else TOKEN_DTYPE
            _check_dtype(f"PackedBatch.{name}", value, want)
            if value.device != self.tokens.device:
                raise ValueError(
                    f"PackedBatch.{name} is on {value.device} but tokens is on {self.tokens.device}"
                )

    def _check_padded(self, real: np.ndarray, lengths: np.ndarray, total: int) -> np.ndarray:
        """``cu_seqlens_padded`` checked against the real boundaries and T; its segments' lengths."""
        padded, segments = _check_cu("PackedBatch.cu_seqlens_padded", self.cu_seqlens_padded)
        if len(padded) != len(real):
            raise ValueError(
                f"PackedBatch.cu_seqlens_padded has {len(padded)} entries but cu_seqlens has {len(real)}"
            )
        if padded[-1] != total:
            raise ValueError(
                f"PackedBatch.cu_seqlens_padded ends at {padded[-1]} but the buffer has T={total} tokens"
            )
        short = np.flatnonzero(segments < lengths)
        if len(short):
            i = int(short[0])
            raise ValueError(
                f"PackedBatch.cu_seqlens_padded segment {i} holds {padded[i + 1] - padded[i]} "
                f"positions but document {i} has {real[i + 1] - real[i]} tokens"
            )
        return segments

    def to_packed_seq_params(self) -> PackedSeqParams:
        """megatron-core's ``PackedSeqParams(qkv_format="thd", ...)`` for this batch."""
        return make_packed_seq_params(self.cu_seqlens, self.cu_seqlens_padded, self.max_seqlen)

    @classmethod
    def from_documents(
        cls,
        docs: Sequence[DocumentLike],
        *,
        seq_len: int | None = None,
        pad_to_multiple_of: int = 1,
        pad_token_id: int = 0,
        fields: Sequence[BatchField] = (),
    ) -> PackedBatch:
        """Pack documents into one THD row.

        Args:
            docs: token sequences (lists, numpy arrays, 1-D tensors), `megapack.data.Document`
                objects (as `read_documents` yields them; their ``loss_mask`` is kept), or dicts with
                ``tokens`` and an optional per-token ``loss_mask`` marking which tokens are learned
                as targets (e.g. 0 on a prompt, 1 on its completion).
            seq_len: pad the row to exactly this many tokens; ValueError if the documents do not fit.
            pad_to_multiple_of: pad each document to a multiple of this (e.g. 2 x context-parallel
                size, or 8/16 for FP8 kernels); then ``cu_seqlens_padded`` is set.
            pad_token_id: token id used for padding and for the label of each document's last token.
            fields: a trainer's own fields (`megapack.BatchField`), each in every document dict:
                per token a sequence as long as its tokens, placed at the labels as its ``at``
                says ("token": shifted by one like ``loss_mask``; "label": as given; 0 on
                padding), per sample one value, ragged a tensor [n_i, ...] (may be absent);
                they land in ``extras`` (`megapack.core.extras`).

        Returns:
            A validated PackedBatch on CPU.

        Example:
            >>> b = PackedBatch.from_documents([[5, 6, 7], [8, 9], [1, 2, 3, 4]])
            >>> b.cu_seqlens.tolist(), b.position_ids.tolist()
            ([0, 3, 5, 9], [[0, 1, 2, 0, 1, 0, 1, 2, 3]])
        """
        pad_to_multiple_of = check_int("pad_to_multiple_of", pad_to_multiple_of, minimum=1)
        if seq_len is not None:
            seq_len = check_int("seq_len", seq_len, minimum=1)
        if len(docs) == 0:
            raise ValueError("docs is empty: a PackedBatch needs at least one document")
        toks, masks = zip(*(_document_arrays(i, d) for i, d in enumerate(docs)), strict=True)
        lengths = np.array([len(t) for t in toks], dtype=np.int64)
        padded = -(-lengths // pad_to_multiple_of) * pad_to_multiple_of
        total = int(padded.sum())
        if seq_len is not None and total > seq_len:
            raise ValueError(
                f"{len(docs)} documents need {total} tokens (after padding to multiples of "
                f"{pad_to_multiple_of}) but seq_len={seq_len}; plan fewer documents per row"
            )
        width = seq_len if seq_len is not None else total

        tokens = np.full(width, pad_token_id, dtype=np.int64)
        labels = np.full(width, pad_token_id, dtype=np.int64)
        loss_mask = np.zeros(width, dtype=np.float32)
        position_ids = np.zeros(width, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
        for start, tok, mask, n, p in zip(starts, toks, masks, lengths, padded, strict=True):
            tokens[start : start + n] = tok
            labels[start : start + n - 1] = tok[1:]
            loss_mask[start : start + n - 1] = mask[1:]
            position_ids[start : start + p] = np.arange(p)
        real_cu = np.concatenate([[0], np.cumsum(lengths)])
        if pad_to_multiple_of > 1:
            padded_cu = np.concatenate([[0], np.cumsum(padded)])
            padded_cu[-1] = width  # trailing row padding belongs to the last document's pad
            position_ids[starts[-1] :] = np.arange(width - starts[-1])
            segment_lens = np.diff(padded_cu)
            cu, cu_padded = real_cu, padded_cu
        else:
            trailing = has_padding_segment(total, width, pad_to_multiple_of)
            cu = np.concatenate([real_cu, [width]]) if trailing else real_cu
            cu_padded = None
            segment_lens = np.diff(cu)
            position_ids[total:] = np.arange(width - total)
        return cls(
            tokens=torch.from_numpy(tokens)[None],
            labels=torch.from_numpy(labels)[None],
            loss_mask=torch.from_numpy(loss_mask)[None],
            position_ids=torch.from_numpy(position_ids)[None],
            cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
            cu_seqlens_padded=None
            if cu_padded is None
            else torch.from_numpy(cu_padded.astype(np.int32)),
            max_seqlen=int(segment_lens.max()),
            extras=document_extras(docs, fields, starts, lengths, width),
        ).validate()

    @classmethod
    def concat(cls, rows: Sequence[PackedBatch], fields: Sequence[BatchField] = ()) -> PackedBatch:
        """Concatenate packed rows into one THD micro-batch (boundaries offset row by row).

        Rows must agree on whether ``cu_seqlens_padded`` is set, and hold the same ``extras``,
        declared in ``fields`` (per token joined along the row, per sample and ragged one after
        another). Example: rows with ``cu_seqlens`` [0, 3, 4] and [0, 2, 4] give [0, 3, 4, 6, 8].
        """
        if not rows:
            raise ValueError("PackedBatch.concat needs at least one row")
        declared = {f.name: f for f in fields}
        names = {frozenset(r.extras) for r in rows}
        if len(names) != 1 or set(names.pop()) != set(declared):
            raise ValueError(
                f"PackedBatch.concat: rows hold extras {sorted({k for r in rows for k in r.extras})}"
                f" but fields= declares {sorted(declared)}: every row must hold every declared "
                "field and no other (its declaration says how to join it)"
            )
        padded = {r.cu_seqlens_padded is not None for r in rows}
        if len(padded) != 1:
            raise ValueError("PackedBatch.concat: some rows have cu_seqlens_padded and some do not")
        real: list[torch.Tensor] = [rows[0].cu_seqlens[:1]]
        buffer: list[torch.Tensor] = []
        offset = real_offset = 0
        for r in rows:
            real.append(r.cu_seqlens[1:] + real_offset)
            if r.cu_seqlens_padded is not None:
                buffer.append(
                    (r.cu_seqlens_padded if not buffer else r.cu_seqlens_padded[1:]) + offset
                )
            real_offset += int(r.cu_seqlens[-1])
            offset += r.num_tokens
        grid = {
            k: torch.cat([getattr(r, k) for r in rows], dim=1)
            for k in ("tokens", "labels", "loss_mask", "position_ids")
        }
        return cls(
            tokens=grid["tokens"],
            labels=grid["labels"],
            loss_mask=grid["loss_mask"],
            position_ids=grid["position_ids"],
            cu_seqlens=torch.cat(real),
            cu_seqlens_padded=torch.cat(buffer) if buffer else None,
            max_seqlen=max(r.max_seqlen for r in rows),
            extras={n: join_rows(f, [r.extras[n] for r in rows]) for n, f in declared.items()},
        ).validate()


def has_padding_segment(used: int, seq_len: int, pad_to_multiple_of: int) -> bool:
    """Whether `PackedBatch.from_documents` gives a row's trailing padding a segment of its own:
    without per-document padding, when the documents' ``used`` tokens leave the row short."""
    return pad_to_multiple_of == 1 and used < seq_len


def _check_dtype(name: str, value: torch.Tensor, want: torch.dtype) -> None:
    if value.dtype != want:
        raise TypeError(f"{name} has dtype {value.dtype}; expected {want}")


def _check_cu(name: str, cu: Any) -> tuple[np.ndarray, np.ndarray]:
    """The boundaries as int64 numpy (one copy to the host for a CUDA tensor), checked; and the
    lengths between them."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dim() != 1:
        raise ValueError(f"{name} has shape {tuple(cu.shape)}; expected 1-D [n + 1]")
    _check_dtype(name, cu, CU_DTYPE)
    values = (cu.numpy() if cu.get_device() < 0 else cu.cpu().numpy()).astype(np.int64)
    if len(values) < 2 or values[0] != 0:
        raise ValueError(f"{name} must start at 0 and hold >= 2 entries, got {values[:8].tolist()}")
    lengths = values[1:] - values[:-1]
    if lengths.min() <= 0:
        # Static shapes pad the boundaries with their final offset: zero-length documents at the
        # end only (`pad_static`). A zero-length document before a real one, or a step back, is
        # an error.
        real = np.flatnonzero(lengths > 0)
        last = int(real[-1]) if len(real) else -1
        bad = np.flatnonzero(lengths[: last + 1] <= 0)
        if len(bad) or lengths.min() < 0 or last < 0:
            i = int(bad[0] if len(bad) else np.flatnonzero(lengths <= 0)[0]) + 1
            repeat = values[i] == values[i - 1]
            raise ValueError(
                f"{name} is not strictly increasing: {values[i]} follows {values[i - 1]} at index {i}"
                + (
                    " (only trailing entries may repeat the final offset: zero-length documents "
                    "that pad a static shape)"
                    if repeat
                    else ""
                )
            )
    return values, lengths


def _document_arrays(index: int, doc: DocumentLike) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, target mask) of one document as numpy arrays."""
    mask: Any = None
    if hasattr(doc, "tokens") and hasattr(doc, "loss_mask"):  # a megapack.data.Document
        data_doc: Any = doc
        raw, mask = data_doc.tokens, data_doc.loss_mask
    elif isinstance(doc, Mapping):
        if "tokens" not in doc:
            raise ValueError(f"docs[{index}] is a dict without 'tokens' (keys {sorted(doc)})")
        raw, mask = doc["tokens"], doc.get("loss_mask")
    else:
        raw = doc
    if isinstance(raw, str | bytes):
        raise TypeError(
            f"docs[{index}] is a {type(raw).__name__} ({_preview(raw)}); expected token ids: "
            "tokenize text first, e.g. with megapack.data.read_documents or a Tokenizer"
        )
    tokens = np.asarray(raw.detach().cpu() if isinstance(raw, torch.Tensor) else raw)
    if tokens.ndim != 1 or len(tokens) == 0:
        raise ValueError(
            f"docs[{index}] must be a non-empty 1-D token sequence (list, numpy array, 1-D tensor), "
            f"a dict with 'tokens' or a megapack.data.Document; got {type(doc).__name__} "
            f"{_preview(doc)} with token shape {tokens.shape}"
        )
    if not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"docs[{index}] tokens must be integers, got dtype {tokens.dtype}")
    if mask is None:
        return tokens.astype(np.int64), np.ones(len(tokens), dtype=np.float32)
    mask_arr = np.asarray(
        mask.detach().cpu() if isinstance(mask, torch.Tensor) else mask, dtype=np.float32
    )
    if mask_arr.shape != tokens.shape:
        raise ValueError(
            f"docs[{index}] loss_mask has {mask_arr.shape[0] if mask_arr.ndim else 0} entries "
            f"but the document has {len(tokens)} tokens"
        )
    return tokens.astype(np.int64), mask_arr


def _preview(value: Any, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
