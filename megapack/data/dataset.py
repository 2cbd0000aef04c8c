"""`PackedDataset`: documents packed once into rows, served as equal per-rank shards of `PackedBatch`es.

Two options objects say everything (`megapack.packing.options`): `PackOptions`, how the rows are
packed (recorded in the dataset's meta and its saved folder, read back by `load`), and
`LoadOptions`, how they are dealt and served (given again at each `load`). Their fields are also
keyword shortcuts: ``PackedDataset(docs, seq_len=4096, dp_rank=r, dp_size=8)`` is
``PackedDataset(docs, PackOptions(seq_len=4096), LoadOptions(dp_rank=r, dp_size=8))``.

Construction plans the packing once (`megapack.packing.plan`) on the documents' *aligned* lengths,
ceil(len / multiple) * multiple, so alignment padding can never overflow a row (Megatron-Bridge
#4593 planned on raw lengths and padded afterwards). Documents longer than a row are first cut at
message boundaries where possible (`split_document`; each cut costs the one target that crossed
it), or truncated, dropped or refused, as ``long_docs`` says.

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

import logging
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from megapack.core.batch import PackedBatch, has_padding_segment
from megapack.core.loss_fields import (
    attach_loss_fields,
    step_loss_fields,
    warn_if_untrained,
)
from megapack.data.document import Document
from megapack.data.fingerprint import fingerprint
from megapack.data.packed_dir import plan_packed_dir, read_packed_dir, write_packed_dir
from megapack.data.resume import DatasetIterator, state_after
from megapack.data.split import split_document
from megapack.packing.options import (
    LoadOptions,
    PackOptions,
    pack_options,
    split_shortcuts,
    with_shortcuts,
)

log = logging.getLogger("megapack.data")  # library code logs; the CLI prints


class PackedDataset:
    """Map-style dataset of packed micro-batches for one data-parallel rank.

    Args:
        documents: the corpus (e.g. ``list(megapack.data.read_documents("train.jsonl"))``).
        packing: how to pack the rows: `PackOptions` (seq_len, padding and ``cp_size``,
            algorithm, long_docs, max_documents, seed, search_steps), or the ``seq_len`` alone.
        loading: how to deal and serve them: `LoadOptions` (rows_per_micro_batch, micro_batches,
            dp_rank, dp_size, balance, cost, loss_fields, split_documents, pad_token_id); default
            its defaults (one DP rank, one row a micro-batch, one micro-batch a step).
        **shortcuts: fields of either options class as keywords, set in ``packing`` or
            ``loading`` (`megapack.packing.options.with_shortcuts`); the same defaults and checks.

    Attributes:
        packing, loading: the options, as given (read-only).
        meta: what ``meta.json`` holds: ``"packing"`` (the options as a dict), rows, efficiency,
            the long-document counts, the fingerprint, the tokenizer.

    Raises:
        TypeError: an option of the wrong type, or a keyword that is no option, naming it.
        ValueError: a bad option value (naming it and the value), no documents, or a long
            document ``long_docs="error"`` refuses.

    Example:
        >>> ds = PackedDataset(docs, seq_len=4096, rows_per_micro_batch=2, dp_rank=r, dp_size=8)  # doctest: +SKIP
        >>> ds.set_epoch(1); batch = ds[0]       # a PackedBatch of [1, 8192] tokens      # doctest: +SKIP
    """

    def __init__(
        self,
        documents: Iterable[Document],
        packing: PackOptions | int | None = None,
        loading: LoadOptions | None = None,
        **shortcuts: Any,
    ) -> None:
        pack_keywords, load_keywords = split_shortcuts(shortcuts, where="PackedDataset")
        self.packing = pack_options(packing, pack_keywords, where="PackedDataset")
        self.loading = with_shortcuts(LoadOptions, loading, load_keywords, where="PackedDataset")
        docs = list(documents)
        if not docs:
            raise ValueError(_empty_message(documents))
        seq_len = self.packing.seq_len
        counts = {"input_documents": len(docs), "split_documents": 0}
        origins = np.arange(len(docs), dtype=np.int64)
        if self.packing.long_docs == "split":
            counts["split_documents"] = sum(len(doc) > seq_len for doc in docs)
            pieces = [split_document(doc, seq_len) for doc in docs]
            origins = np.repeat(origins, [len(p) for p in pieces])
            docs = [piece for doc_pieces in pieces for piece in doc_pieces]
        lengths = np.array([len(d) for d in docs], dtype=np.int64)
        pad = self.loading.pad_token_id
        planned, self.meta = plan_packed_dir(lengths, self.packing, pad_token_id=pad or 0)
        self.meta.update(counts)  # what `megapack pack` reports: inputs, and how many were split
        self._arrays = {
            "tokens": np.concatenate([d.tokens for d in docs]),
            "loss_mask": np.concatenate([d.loss_mask for d in docs]),
            **planned,
            "origins": origins,
        }
        self.meta["fingerprint"] = fingerprint(self._arrays)  # its identity, for resume checks
        self._configure()

    def _configure(self) -> None:
        """The epoch's state for ``self.loading``, checked against what the folder holds."""
        loading = self.loading
        whole = loading.loss_fields and loading.split_documents == "whole"
        if whole and "origins" not in self._arrays and int(self.meta.get("split_documents", 0)):
            raise ValueError(
                f"split_documents='whole' needs to know which rows' pieces come from one "
                f"document, but this directory ({self.meta.get('split_documents')} documents "
                "split) has no origins.npy: it was packed by an earlier megapack. Re-run "
                "`megapack pack`, or pass split_documents='pieces'"
            )
        self._step_fields: tuple[tuple[int, int], list[np.ndarray], np.ndarray] | None = None
        self._plan = (loading.dp_size, loading.micro_batches)
        """(dp_size, micro_batches) this epoch's order is planned for; a resumed run keeps its
        checkpoint's until the epoch ends (`DatasetIterator.load_state_dict`)."""
        self.epoch = 0
        self._order: np.ndarray | None = None  # row order of self.epoch, computed on first use
        rows = int(self.meta["rows"])
        # the last micro-batch may hold fewer rows
        self.num_micro_batches = -(-rows // loading.rows_per_micro_batch)
        step = loading.dp_size * loading.micro_batches
        self.padded_micro_batches = -(-self.num_micro_batches // step) * step
        _warn_if_mostly_filler(
            self.num_micro_batches,
            self.padded_micro_batches,
            loading.dp_size,
            loading.micro_batches,
        )

    @property
    def pad_token_id(self) -> int:
        """The pad id: `LoadOptions.pad_token_id`, else the one the folder records."""
        if self.loading.pad_token_id is not None:
            return self.loading.pad_token_id
        return int(self.meta.get("pad_token_id", 0))

    @property
    def plan(self) -> tuple[int, int]:
        """(dp_size, micro_batches) this epoch's order is planned for."""
        return self._plan

    def set_epoch(self, epoch: int, *, plan: tuple[int, int] | None = None) -> None:
        """Reshuffle the rows for ``epoch`` (the same order on every rank), planned for ``plan``,
        (dp_size, micro_batches): by default this dataset's own; a resumed epoch keeps its
        checkpoint's (`DatasetIterator.load_state_dict`)."""
        self.epoch, self._order = epoch, None
        self._plan = (self.loading.dp_size, self.loading.micro_batches) if plan is None else plan

    def __len__(self) -> int:
        """Micro-batches of this rank: the same on every rank."""
        return self.padded_micro_batches // self.loading.dp_size

    def __getitem__(self, index: int) -> PackedBatch:
        if not 0 <= index < len(self):
            raise IndexError(
                f"PackedDataset index {index} out of range for {len(self)} micro-batches"
            )
        loading = self.loading
        global_index = loading.dp_rank + index * loading.dp_size
        per = loading.rows_per_micro_batch
        rows = self.order()[global_index * per : (global_index + 1) * per]
        if (rows < 0).all():
            batch = self._padding_micro_batch()
        else:
            batch = PackedBatch.concat(
                [self._row(int(r)) if r >= 0 else self._filler_row() for r in rows]
            )
        if not loading.loss_fields:
            return batch
        step = index // loading.micro_batches
        documents, totals = self.step_loss_fields(step)
        return attach_loss_fields(
            batch, documents[global_index - step * loading.dp_size * loading.micro_batches], totals
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
        size = self.loading.dp_size * self.loading.micro_batches
        rows_per = self.loading.rows_per_micro_batch
        order = self.order()
        whole = self.loading.split_documents == "whole"
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
        if has_padding_segment(used, self.packing.seq_len, self.packing.multiple):
            counts.append(0)
            ids.append(-1)
        return counts, ids

    def order(self) -> np.ndarray:
        """This epoch's rows in dealing order, ``-1`` for zero-loss filler rows (same on every rank).

        Micro-batch ``j`` is ``order()[j * R:(j + 1) * R]`` and is item ``j // dp_size`` of DP rank
        ``j % dp_size`` (``R = rows_per_micro_batch``). The epoch is dealt for `plan`'s
        (dp_size, micro_batches), the loading options' unless a resume kept its checkpoint's.
        """
        if self._order is None:
            from megapack.packing.balance import order_rows

            cost, a = self.loading.cost, self._arrays
            rows = int(self.meta["rows"])
            costs = (
                np.zeros(rows) if cost is None else cost.bin_costs(a["slices"], a["bin_offsets"])
            )
            dp_size, micro_batches = self._plan  # dp_rank is not the dealing's: any valid one
            deal = replace(self.loading, dp_rank=0, dp_size=dp_size, micro_batches=micro_batches)
            self._order = order_rows(costs, deal, seed=(self.packing.seed, self.epoch))
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
        ``micro_batches``, ``loss_fields`` of its `LoadOptions`, ``seq_len`` of its `PackOptions`)
        and ``dp_rank``, which DP ranks must not share and the pipeline stages and CP ranks of
        one DP rank must. Plain JSON values.

        Example: ``PackedDataset.load("packed/", rows_per_micro_batch=2, dp_rank=1, dp_size=4)``
        gives ``{..., "rows_per_micro_batch": 2, "dp_rank": 1, "dp_size": 4, "micro_batches": 1,
        "loss_fields": False, "seq_len": 4096}``.
        """
        from megapack.data.resume import identity

        loading = self.loading
        return {
            **identity(self),
            "rows_per_micro_batch": loading.rows_per_micro_batch,
            "dp_rank": loading.dp_rank,
            "dp_size": loading.dp_size,
            "micro_batches": loading.micro_batches,
            "loss_fields": loading.loss_fields,
            "seq_len": self.packing.seq_len,
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
            seq_len=self.packing.seq_len,
            pad_to_multiple_of=self.packing.multiple,
            pad_token_id=self.pad_token_id,
        )

    def _filler_row(self) -> PackedBatch:
        """A zero-loss row: one all-padding document."""
        seq_len, pad = self.packing.seq_len, self.pad_token_id
        filler = {"tokens": np.full(seq_len, pad), "loss_mask": np.zeros(seq_len)}
        return PackedBatch.from_documents(
            [filler], seq_len=seq_len, pad_to_multiple_of=self.packing.multiple, pad_token_id=pad
        )

    def _padding_micro_batch(self) -> PackedBatch:
        """Zero-loss filler micro-batch that evens out data-parallel shards."""
        return PackedBatch.concat([self._filler_row()] * self.loading.rows_per_micro_batch)

    def save(self, directory: str | Path) -> Path:
        """Write the packed dataset (arrays + meta.json, its fingerprint included) to
        ``directory``; `load` reads it back."""
        return write_packed_dir(directory, self._arrays, self.meta)

    @classmethod
    def load(
        cls, directory: str | Path, loading: LoadOptions | None = None, **shortcuts: Any
    ) -> PackedDataset:
        """Memory-map a dataset written by `save` or ``megapack pack``.

        The folder says how it was packed (its `PackOptions`, ``meta.json``'s "packing"); how to
        deal and serve it is ``loading``, and every field of `LoadOptions` is also a keyword
        shortcut: ``PackedDataset.load("packed/", rows_per_micro_batch=2, dp_rank=r, dp_size=8)``
        is ``PackedDataset.load("packed/", LoadOptions(rows_per_micro_batch=2, dp_rank=r,
        dp_size=8))``. Padding uses the folder's recorded pad id unless ``pad_token_id`` is given.
        Its contents' fingerprint is checked against ``meta.json`` (computed, and logged, for a
        directory packed before it was recorded): `megapack.data.packed_dir`.

        Raises:
            TypeError: a keyword that is no `LoadOptions` field (a `PackOptions` one: the folder
                records it), or a wrong type.
            ValueError: a bad option value; a folder of another format or changed since packing.
        """
        where = "PackedDataset.load"
        pack_keywords, load_keywords = split_shortcuts(shortcuts, where=where)
        if pack_keywords:
            name = sorted(pack_keywords)[0]
            raise TypeError(
                f"{where}: {name}= is how the folder was packed, which its meta.json records "
                f"(packing={{..., {name!r}: ...}}); pack it again to change it"
            )
        loading = with_shortcuts(LoadOptions, loading, load_keywords, where=where)
        packing, meta, arrays = read_packed_dir(directory)
        dataset = cls.__new__(cls)
        dataset.packing, dataset.loading = packing, loading
        dataset.meta, dataset._arrays = meta, arrays
        dataset._configure()
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
    log.warning(
        "megapack: PackedDataset: %s of the epoch's %s micro-batches (%.0f%%) are zero-loss "
        "filler: %s micro-batch%s of data padded to whole steps of dp_size %d x micro_batches %d "
        "= %s. Every filler micro-batch costs a forward and backward and trains nothing: use "
        "fewer micro-batches a step or fewer DP ranks for this data, or more data",
        f"{filler:,}",
        f"{padded:,}",
        100 * filler / padded,
        f"{real:,}",
        "es" if real != 1 else "",
        dp_size,
        micro_batches,
        f"{dp_size * micro_batches:,}",
        stacklevel=4,
    )


def _empty_message(documents: Iterable[Document]) -> str:
    """Why ``documents`` gave nothing, naming the usual cause: a one-pass iterator already consumed."""
    if iter(documents) is documents:
        return (
            f"documents is empty: the iterator ({type(documents).__name__}) yielded no documents. "
            "read_documents(...) returns a one-pass iterator: if an earlier PackedDataset or list() "
            "consumed it, call read_documents again, or keep docs = list(read_documents(...)) to reuse"
        )
    return "documents is empty: nothing to pack"
