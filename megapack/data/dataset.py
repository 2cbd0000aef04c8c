"""`PackedDataset`: documents packed once into rows, served as equal per-rank shards of `PackedBatch`es.

Construction plans the packing once (`megapack.packing.plan`) on the documents' *aligned* lengths,
ceil(len / pad_to_multiple_of) * pad_to_multiple_of, so alignment padding can never overflow a row
(Megatron-Bridge #4593 planned on raw lengths and padded afterwards). Documents longer than a row
are first cut at message boundaries where possible (`split_document`; each cut costs the one
target that crossed it), or truncated, dropped or refused, as ``long_docs`` says.

Each epoch shuffles the rows with ``(seed, epoch)``, groups ``rows_per_micro_batch`` rows into one
THD micro-batch, and pads the number of micro-batches to a multiple of ``dp_size * micro_batches``
with zero-loss micro-batches, so every data-parallel rank gets the same count, in whole optimizer
steps (item i of rank r is micro-batch r + i * dp_size). Nothing is dropped. With
``balance="compute"`` the shuffled rows are formed into global batches (``dp_size *
micro_batches`` micro-batches) of similar-cost layers and dealt so that each rank's step costs
about the same under ``cost``, each rank's micro-batches in pipeline-friendly order
(`megapack.packing.balance`); every rank computes the same order, without communication.

With ``loss_fields=True`` every micro-batch also carries the loss fields of its optimizer step
(`megapack.core.loss_fields`: each document segment's trained tokens in the step, and the step's
trained tokens, documents and micro-batches), computed from the plan on every rank alike, with no
collective: every rank knows every rank's rows. Pieces of a document that ``long_docs="split"``
cut count as one document where they meet in a step (``split_documents="whole"``) or each as its
own (``"pieces"``). Declare ``fields=megapack.LOSS_FIELDS`` where the batches are delivered.

Storage is flat numpy arrays (tokens, loss mask, document offsets, bins as (doc, start, stop)
slices, and each stored document's input document, ``origins``, shared by a split document's
pieces), the same in memory and on disk: `save` writes them, `load` memory-maps them back.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch.distributed as dist

from megapack.core.batch import PackedBatch, has_padding_segment
from megapack.core.checks import check_int
from megapack.core.loss_fields import (
    attach_loss_fields,
    check_reading,
    step_loss_fields,
    warn_if_untrained,
)
from megapack.data.document import Document
from megapack.data.fingerprint import fingerprint
from megapack.data.layout import check_layout, plan_layout, read_layout, write_layout
from megapack.data.resume import DatasetIterator, state_after
from megapack.data.split import split_document
from megapack.packing.names import BALANCE_MODES, LONG_DOC_POLICIES

if TYPE_CHECKING:
    from megapack.packing.cost import CostModel

LONG_DOCS = LONG_DOC_POLICIES  # the one list, in megapack.packing.names


class PackedDataset:
    """Map-style dataset of packed micro-batches for one data-parallel rank.

    Args:
        documents: the corpus (e.g. ``list(megapack.data.read_documents("train.jsonl"))``).
        seq_len: tokens per row; a multiple of ``pad_to_multiple_of``.
        rows_per_micro_batch: rows concatenated into one THD micro-batch (Megatron's micro-batch size).
        pad_to_multiple_of: pad every document to a multiple of this (e.g. 8/16 for FP8 kernels).
        cp_size: context-parallel size: documents are padded to lcm(pad_to_multiple_of, 2 * cp_size)
            as the "document" CP layout needs, and rows are planned on those padded lengths.
        algorithm: `megapack.packing.plan` algorithm ("bfd", "ffd", "first_fit", "next_fit", "best").
        long_docs: documents longer than ``seq_len``: "split", "truncate", "drop" or "error".
        seed: shuffles rows per epoch (with ``epoch``) and seeds the packer.
        dp_rank, dp_size: this rank's shard of micro-batches.
        pad_token_id: id for padding tokens and for labels that have no next token.
        balance: "token" (rows shuffled and dealt round-robin) or "compute" (each global batch
            balanced across ranks under ``cost``; `megapack.packing.balance`).
        micro_batches: micro-batches per rank per optimizer step (Megatron's global batch size /
            (micro-batch size x dp_size)); the epoch is padded to whole steps.
        cost: a `megapack.packing.CostModel`, required by ``balance="compute"``.
        loss_fields: attach each step's loss fields (`megapack.core.loss_fields.LOSS_FIELDS`)
            to every micro-batch, for `megapack.megatron.normalized_loss`'s step modes;
            ``micro_batches`` and ``dp_size`` must then be the trainer's.
        split_documents: with ``loss_fields``, "whole" (the pieces of a split document in one
            step are one document) or "pieces" (each piece a document).
        max_documents: at most this many documents (or pieces) a row, for static shapes
            (`megapack.StaticShape`, `megapack.core.static.segments_for`); ``megapack stats``
            suggests one.

    Example:
        >>> ds = PackedDataset(docs, seq_len=4096, rows_per_micro_batch=2, dp_rank=r, dp_size=8)  # doctest: +SKIP
        >>> ds.set_epoch(1); batch = ds[0]       # a PackedBatch of [1, 8192] tokens      # doctest: +SKIP
    """

    def __init__(
        self,
        documents: Iterable[Document],
        seq_len: int,
        *,
        rows_per_micro_batch: int = 1,
        pad_to_multiple_of: int = 1,
        cp_size: int = 1,
        algorithm: str = "bfd",
        long_docs: str = "split",
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        pad_token_id: int = 0,
        balance: str = "token",
        micro_batches: int = 1,
        cost: CostModel | None = None,
        loss_fields: bool = False,
        split_documents: str = "whole",
        max_documents: int | None = None,
    ) -> None:
        multiple = check_layout(seq_len, pad_to_multiple_of, cp_size, long_docs)
        docs = list(documents)
        if not docs:
            raise ValueError(_empty_message(documents))
        counts = {"input_documents": len(docs), "split_documents": 0}
        origins = np.arange(len(docs), dtype=np.int64)
        if long_docs == "split":
            counts["split_documents"] = sum(len(doc) > seq_len for doc in docs)
            pieces = [split_document(doc, seq_len) for doc in docs]
            origins = np.repeat(origins, [len(p) for p in pieces])
            docs = [piece for doc_pieces in pieces for piece in doc_pieces]
        lengths = np.array([len(d) for d in docs], dtype=np.int64)
        layout, self.meta = plan_layout(
            lengths,
            seq_len,
            multiple=multiple,
            cp_size=cp_size,
            algorithm=algorithm,
            long_docs=long_docs,
            seed=seed,
            pad_token_id=pad_token_id,
            max_documents=max_documents,
        )
        self.meta.update(counts)  # what `megapack pack` reports: inputs, and how many were split
        self._arrays = {
            "tokens": np.concatenate([d.tokens for d in docs]),
            "loss_mask": np.concatenate([d.loss_mask for d in docs]),
            **layout,
            "origins": origins,
        }
        self.meta["fingerprint"] = fingerprint(self._arrays)  # its identity, for resume checks
        self._configure(
            rows_per_micro_batch,
            dp_rank,
            dp_size,
            pad_token_id,
            balance,
            micro_batches,
            cost,
            loss_fields,
            split_documents,
        )

    def _configure(
        self,
        rows_per_micro_batch: int,
        dp_rank: int,
        dp_size: int,
        pad_token_id: int,
        balance: str = "token",
        micro_batches: int = 1,
        cost: CostModel | None = None,
        loss_fields: bool = False,
        split_documents: str = "whole",
    ) -> None:
        from megapack.packing.balance import check_balance

        _check_positive(rows_per_micro_batch=rows_per_micro_batch, dp_size=dp_size)
        _check_positive(micro_batches=micro_batches)
        if balance not in BALANCE_MODES:
            raise ValueError(f"balance={balance!r}; choose one of {BALANCE_MODES}")
        check_balance(
            balance,
            dp_size=dp_size,
            micro_batches=micro_batches,
            rows_per_micro_batch=rows_per_micro_batch,
            cost=cost,
        )
        self.balance, self.micro_batches, self.cost = balance, micro_batches, cost
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside dp_size={dp_size}")
        self.rows_per_micro_batch, self.dp_rank, self.dp_size = (
            rows_per_micro_batch,
            dp_rank,
            dp_size,
        )
        self.pad_token_id = pad_token_id
        if not isinstance(loss_fields, bool):
            raise TypeError(f"loss_fields must be True or False, got {loss_fields!r}")
        self.loss_fields, self.split_documents = loss_fields, check_reading(split_documents)
        whole = loss_fields and split_documents == "whole"
        if whole and "origins" not in self._arrays and int(self.meta.get("split_documents", 0)):
            raise ValueError(
                f"split_documents='whole' needs to know which rows' pieces come from one "
                f"document, but this directory ({self.meta.get('split_documents')} documents "
                "split) has no origins.npy: it was packed by an earlier megapack. Re-run "
                "`megapack pack`, or pass split_documents='pieces'"
            )
        self._step_fields: tuple[tuple[int, int], list[np.ndarray], np.ndarray] | None = None
        self._plan = (dp_size, micro_batches)
        """(dp_size, micro_batches) this epoch's order is planned for; a resumed run keeps its
        checkpoint's until the epoch ends (`DatasetIterator.load_state_dict`)."""
        self.epoch = 0
        self._order: np.ndarray | None = None  # row order of self.epoch, computed on first use
        rows = int(self.meta["rows"])
        # the last micro-batch may hold fewer rows
        self.num_micro_batches = -(-rows // rows_per_micro_batch)
        step = dp_size * micro_batches
        self.padded_micro_batches = -(-self.num_micro_batches // step) * step
        _warn_if_mostly_filler(
            self.num_micro_batches, self.padded_micro_batches, dp_size, micro_batches
        )

    @property
    def seq_len(self) -> int:
        return int(self.meta["seq_len"])

    @property
    def plan(self) -> tuple[int, int]:
        """(dp_size, micro_batches) this epoch's order is planned for."""
        return self._plan

    def set_epoch(self, epoch: int, *, plan: tuple[int, int] | None = None) -> None:
        """Reshuffle the rows for ``epoch`` (the same order on every rank), planned for ``plan``,
        (dp_size, micro_batches): by default this dataset's own; a resumed epoch keeps its
        checkpoint's (`DatasetIterator.load_state_dict`)."""
        self.epoch, self._order = epoch, None
        self._plan = (self.dp_size, self.micro_batches) if plan is None else plan

    def __len__(self) -> int:
        """Micro-batches of this rank: the same on every rank."""
        return self.padded_micro_batches // self.dp_size

    def __getitem__(self, index: int) -> PackedBatch:
        if not 0 <= index < len(self):
            raise IndexError(
                f"PackedDataset index {index} out of range for {len(self)} micro-batches"
            )
        global_index = self.dp_rank + index * self.dp_size
        rows = self.order()[
            global_index * self.rows_per_micro_batch : (global_index + 1)
            * self.rows_per_micro_batch
        ]
        if (rows < 0).all():
            batch = self._padding_micro_batch()
        else:
            batch = PackedBatch.concat(
                [self._row(int(r)) if r >= 0 else self._filler_row() for r in rows]
            )
        if not self.loss_fields:
            return batch
        step = index // self.micro_batches
        documents, totals = self.step_loss_fields(step)
        return attach_loss_fields(
            batch, documents[global_index - step * self.dp_size * self.micro_batches], totals
        )

    def step_loss_fields(self, step: int) -> tuple[list[np.ndarray], np.ndarray]:
        """The loss fields of optimizer step ``step`` of this epoch, from the plan alone.

        Returns:
            (``loss_documents`` of each of the step's ``dp_size * micro_batches`` micro-batches, in
            global order, [segments, 2]; ``loss_step`` [3]); see `megapack.core.loss_fields`.
            Cached for the last step asked (a rank asks for one step ``micro_batches`` times).
        """
        key = (self.epoch, step)
        if self._step_fields is not None and self._step_fields[0] == key:
            return self._step_fields[1], self._step_fields[2]
        size = self.dp_size * self.micro_batches
        rows_per = self.rows_per_micro_batch
        order = self.order()
        whole = self.split_documents == "whole"
        trained: list[np.ndarray] = []
        keys: list[np.ndarray | None] = []
        spare = len(self._arrays["doc_offsets"])  # keys past every document's: padding segments
        for j in range(step * size, (step + 1) * size):
            counts, ids = [], []
            for row in order[j * rows_per : (j + 1) * rows_per]:
                row_counts, row_ids = self._row_segments(int(row))
                counts += row_counts
                ids += [spare + i if d < 0 else d for i, d in enumerate(row_ids)]
                spare += len(row_ids)
            trained.append(np.array(counts, dtype=np.int64))
            keys.append(np.array(ids, dtype=np.int64) if whole else None)
        documents, totals = step_loss_fields(trained, keys)
        warn_if_untrained(totals, f"step {step} of epoch {self.epoch}")
        self._step_fields = (key, documents, totals)
        return documents, totals

    def _row_segments(self, row: int) -> tuple[list[int], list[int]]:
        """(trained tokens, input document or -1) of each segment `_row` gives row ``row``."""
        if row < 0:
            return [0], [-1]  # a filler row: one all-padding document
        a = self._arrays
        origins = a.get("origins")
        counts, ids, used = [], [], 0
        for doc, start, stop in a["slices"][a["bin_offsets"][row] : a["bin_offsets"][row + 1]]:
            base = int(a["doc_offsets"][doc])
            counts.append(int(np.count_nonzero(a["loss_mask"][base + start + 1 : base + stop])))
            ids.append(int(doc) if origins is None else int(origins[doc]))
            used += int(stop - start)
        if has_padding_segment(used, self.seq_len, int(self.meta["pad_to_multiple_of"])):
            counts.append(0)
            ids.append(-1)
        return counts, ids

    def order(self) -> np.ndarray:
        """This epoch's rows in dealing order, ``-1`` for zero-loss filler rows (same on every rank).

        Micro-batch ``j`` is ``order()[j * R:(j + 1) * R]`` and is item ``j // dp_size`` of DP rank
        ``j % dp_size`` (``R = rows_per_micro_batch``).
        """
        if self._order is None:
            from megapack.packing.balance import order_rows

            rows = int(self.meta["rows"])
            costs = (
                self.cost.bin_costs(self._arrays["slices"], self._arrays["bin_offsets"])
                if self.cost is not None
                else np.zeros(rows)
            )
            self._order = order_rows(
                costs,
                balance=self.balance,
                dp_size=self._plan[0],
                micro_batches=self._plan[1],
                rows_per_micro_batch=self.rows_per_micro_batch,
                seed=(int(self.meta["seed"]), self.epoch),
            )
        return self._order

    def __iter__(self) -> DatasetIterator:
        return DatasetIterator(self)

    def iterate(
        self,
        *,
        lockstep: bool = False,
        group: dist.ProcessGroup | None = None,
        repeat: bool = False,
    ) -> Iterator[PackedBatch]:
        """This rank's micro-batches in order: a resumable `DatasetIterator` (``repeat``: epoch
        after epoch, else one epoch).

        Inside a pipeline schedule (megatron-core's ``get_forward_backward_func()``, training or
        ``forward_only`` evaluation), wrap the loop, not the data: the TP source of each stage
        passes this iterator to `megapack.lockstep_steps`, which reads each step ahead and stops
        every rank of every stage and DP rank at the same step (a data call inside the schedule
        cannot: a later stage waits for activations and never reaches its own)::

            it = train.iterate() if topo.is_source else None
            for step_iterator in megapack.lockstep_steps(it, micro_batches=num_microbatches, topology=topo):
                schedule(..., data_iterator=step_iterator, num_microbatches=num_microbatches)

        ``lockstep=True`` is for loops that call `megapack.get_batch_on_this_tp_rank` (or use the
        batch) directly on every rank of ``group``, e.g. an evaluation without pipelining: every
        rank of ``group`` stops at the same micro-batch (`megapack.lockstep`), here, on each item.

        Raises:
            TypeError: ``lockstep`` or ``repeat`` is not a bool.
            ValueError: ``group`` given without ``lockstep=True`` (it would be ignored).
        """
        for name, value in (("lockstep", lockstep), ("repeat", repeat)):
            if not isinstance(value, bool):
                raise TypeError(f"iterate: {name} must be True or False, got {value!r}")
        if group is not None and not lockstep:
            raise ValueError(
                "iterate: group= is used only with lockstep=True; pass lockstep=True, or drop group="
            )
        iterator = DatasetIterator(self, repeat=repeat)
        if not lockstep:
            return iterator
        from megapack.distributed.sync import lockstep as in_lockstep

        return in_lockstep(iterator, group=group)

    def settings(self) -> dict[str, Any]:
        """What ranks reading this dataset must agree on, for `megapack.lockstep_steps`' checks.

        The dataset's identity (`megapack.data.resume.identity`: what a checkpoint must share to
        resume it, e.g. rows, seed, rows per micro-batch, balance), how it is dealt (``dp_size``,
        ``micro_batches``, ``loss_fields``, ``seq_len``) and ``dp_rank``, which DP ranks must not
        share and the pipeline stages and CP ranks of one DP rank must. Plain JSON values.

        Example: ``PackedDataset.load("packed/", rows_per_micro_batch=2, dp_rank=1, dp_size=4)``
        gives ``{..., "rows_per_micro_batch": 2, "dp_rank": 1, "dp_size": 4, "micro_batches": 1,
        "loss_fields": False, "seq_len": 4096}``.
        """
        from megapack.data.resume import identity

        return {
            **identity(self),
            "rows_per_micro_batch": self.rows_per_micro_batch,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "micro_batches": self.micro_batches,
            "loss_fields": self.loss_fields,
            "seq_len": self.seq_len,
        }

    def state_for(
        self,
        *,
        consumed_samples: int | None = None,
        micro_batch_size: int | None = None,
        iterations: int | None = None,
        global_batch_size: int | None = None,
        plan: tuple[int, int] | None = None,
    ) -> dict[str, Any]:
        """The `DatasetIterator` state after what Megatron-LM counts, in its own units.

        Megatron-LM counts *samples*: each ``forward_step`` call is one of its micro-batches of
        ``--micro-batch-size`` samples, and gets one micro-batch of this dataset
        (``rows_per_micro_batch`` rows, whatever that size). So with THD's ``--micro-batch-size
        1`` a sample is a whole packed micro-batch; with ``--micro-batch-size`` equal to
        ``rows_per_micro_batch``, a row. Give either counter (both: they must agree); see
        `megapack.data.resume.state_after` for the checks and the errors.

        Args:
            consumed_samples: ``args.consumed_train_samples``; needs ``micro_batch_size``.
            micro_batch_size: ``args.micro_batch_size`` (no default: it fixes what a sample is).
            iterations: ``args.iteration``, optimizer steps done (``dp_size x micro_batches``
                micro-batches each).
            global_batch_size: ``args.global_batch_size``, checked against ``micro_batch_size x
                dp_size x micro_batches``.
            plan: with ``balance="compute"`` (required there), the (dp_size, micro_batches) the
                checkpoint's epoch was planned for: this run's unless the DP size changed in it
                (`DatasetIterator.state_dict` records it; counters cannot).

        Example (Megatron-LM's pretrain_gpt, building the train iterator)::

            it = dataset.iterate(repeat=True)
            it.load_state_dict(dataset.state_for(consumed_samples=args.consumed_train_samples,
                                                 micro_batch_size=args.micro_batch_size,
                                                 global_batch_size=args.global_batch_size))
        """
        return state_after(
            self,
            consumed_samples=consumed_samples,
            micro_batch_size=micro_batch_size,
            iterations=iterations,
            global_batch_size=global_batch_size,
            plan=plan,
        )

    def _row(self, row: int) -> PackedBatch:
        a = self._arrays
        docs = []
        for doc, start, stop in a["slices"][a["bin_offsets"][row] : a["bin_offsets"][row + 1]]:
            base = int(a["doc_offsets"][doc])
            docs.append(
                {
                    "tokens": a["tokens"][base + start : base + stop],
                    "loss_mask": a["loss_mask"][base + start : base + stop],
                }
            )
        return PackedBatch.from_documents(
            docs,
            seq_len=self.seq_len,
            pad_to_multiple_of=int(self.meta["pad_to_multiple_of"]),
            pad_token_id=self.pad_token_id,
        )

    def _filler_row(self) -> PackedBatch:
        """A zero-loss row: one all-padding document."""
        filler = {
            "tokens": np.full(self.seq_len, self.pad_token_id),
            "loss_mask": np.zeros(self.seq_len),
        }
        m = int(self.meta["pad_to_multiple_of"])
        return PackedBatch.from_documents(
            [filler], seq_len=self.seq_len, pad_to_multiple_of=m, pad_token_id=self.pad_token_id
        )

    def _padding_micro_batch(self) -> PackedBatch:
        """Zero-loss filler micro-batch that evens out data-parallel shards."""
        return PackedBatch.concat([self._filler_row()] * self.rows_per_micro_batch)

    def save(self, directory: str | Path) -> Path:
        """Write the packed dataset (arrays + meta.json, its fingerprint included) to
        ``directory``; `load` reads it back."""
        return write_layout(directory, self._arrays, self.meta)

    @classmethod
    def load(
        cls,
        directory: str | Path,
        *,
        rows_per_micro_batch: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        pad_token_id: int | None = None,
        balance: str = "token",
        micro_batches: int = 1,
        cost: CostModel | None = None,
        loss_fields: bool = False,
        split_documents: str = "whole",
    ) -> PackedDataset:
        """Memory-map a dataset written by `save` or ``megapack pack`` (padding with its recorded
        pad id by default). Its contents' fingerprint is checked against ``meta.json`` (computed,
        and logged, for a directory packed before it was recorded): `megapack.data.layout`."""
        meta, arrays = read_layout(directory)
        dataset = cls.__new__(cls)
        dataset.meta, dataset._arrays = meta, arrays
        pad = int(meta.get("pad_token_id", 0)) if pad_token_id is None else pad_token_id
        dataset._configure(
            rows_per_micro_batch,
            dp_rank,
            dp_size,
            pad,
            balance,
            micro_batches,
            cost,
            loss_fields,
            split_documents,
        )
        return dataset


FILLER_WARNING = 0.10
"""Above this share of an epoch's micro-batches being zero-loss filler, `PackedDataset` warns."""


def _warn_if_mostly_filler(real: int, padded: int, dp_size: int, micro_batches: int) -> None:
    """Warn when more than `FILLER_WARNING` of the epoch's micro-batches are filler.

    Example: 86 rows, 1 row a micro-batch, ``micro_batches=1000`` on 1 DP rank: the epoch is padded
    to one step of 1,000 micro-batches, 914 of them (91%) filler that trains nothing.
    """
    filler = padded - real
    if filler <= FILLER_WARNING * padded:
        return
    warnings.warn(
        f"PackedDataset: {filler:,} of the epoch's {padded:,} micro-batches ({filler / padded:.0%}) "
        f"are zero-loss filler: {real:,} micro-batch{'es' if real != 1 else ''} of data padded to "
        f"whole steps of dp_size {dp_size} x micro_batches {micro_batches} = "
        f"{dp_size * micro_batches:,}. Every filler "
        "micro-batch costs a forward and backward and trains nothing: use fewer micro-batches a "
        "step or fewer DP ranks for this data, or more data",
        stacklevel=4,
    )


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        check_int(name, value, minimum=1)


def _empty_message(documents: Iterable[Document]) -> str:
    """Why ``documents`` gave nothing, naming the usual cause: a one-pass iterator already consumed."""
    if iter(documents) is documents:
        return (
            f"documents is empty: the iterator ({type(documents).__name__}) yielded no documents. "
            "read_documents(...) returns a one-pass iterator: if an earlier PackedDataset or list() "
            "consumed it, call read_documents again, or keep docs = list(read_documents(...)) to reuse"
        )
    return "documents is empty: nothing to pack"
