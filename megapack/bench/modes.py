"""The benchmark's modes: one step's documents as packing and as the baselines a practitioner would
pick, and what each mode runs: one module for `megapack bench` and the GPU kit alike.

A step as a real run has it (`plan_step`): a real run packs a whole epoch, so its rows are nearly
full and no step ends in a half-empty row. Packing's rows for one step are therefore a window of a
BFD plan over a pool of documents (the GPU kit: >= 2,000), the plan's rows in a seeded data-loader
order (``balance="token"``), its least full row left out (the epoch's remainder: one row an
epoch, not one a step) and the first ``micro_batches x rows`` of them taken; the step's documents
are the ones those rows hold, and every mode lays out exactly those documents. Worked example,
pool lengths ``[5, 3, 7, 2, 8, 1, 1]``, rows of 10, 1 micro-batch of 2 rows: the plan's rows in
seeded order are ``[[0, 5, 6], [3, 4], [1, 2]]`` holding 7, 10 and 10 tokens; without the first,
the step holds documents ``[1, 2, 3, 4]`` (lengths ``[3, 7, 2, 8]``, in data order), packed as
``[[2, 3], [0, 1]]``.

Modes (`MODES`), each a list of micro-batches over the step's documents, ``rows`` rows of
``seq_len`` token slots per packed micro-batch (Megatron's micro-batch size: a packed row takes a
sequence's place); a micro-batch's token budget is ``rows x seq_len`` slots:

    packed          packing's rows, THD (`PackedBatch`), boundaries per document
    padded_fixed    one document per row padded to seq_len, rows per micro-batch (Megatron SFT)
    grouped         the step's documents sorted once by length, longest first, each micro-batch
                    as many of them as fit the token budget padded to its longest: HF Trainer's
                    ``group_by_length`` at a step's scope, filled greedily to packing's budget
    ceiling         packing's rows, each row's tokens one document, through packing's own THD
                    path: the same slots and kernel with the longest spans, so its executed
                    FLOP/s bounds packing's
    padded_longest  weak, kept by name: rows documents in data order padded to the longest

No filler rows: every mode runs only rows that hold documents. A mode's last micro-batch holds
what remains (fewer rows, or fewer documents, than the others); a step from `plan_step` fills
every packed micro-batch, since the plan has more rows than the window takes. (The filler row the
kit topped packing's last micro-batch up with was 11% of its attention spans: work no other mode
paid.)

Timed work (`timed`): packed, grouped and the ceiling (`FULL_MODES`, the modes the targets read)
always run every micro-batch of the step; the two context baselines (`SAMPLED_MODES`) run at most
a fixed number of theirs (the kit: as many as packing has), their first ones: every micro-batch of
padded_fixed has the same shape, and padded_longest's hold documents in data order, so those are a
sample of the step whose own tokens and FLOPs the rates count. Short SFT padded to seq would
otherwise take 10-16x packing's time and break the kit's budget.

FLOPs (`ModeCost`): ``executed`` is what the kernels run: every token slot through the matmuls,
and causal attention over every attention span (a packed buffer segment, a row's trailing
padding included, or a padded row whole). The executed-FLOP ideal of a baseline is its executed
FLOPs over packing's: what a step would gain if time followed executed FLOPs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from megapack.core.batch import PackedBatch
from megapack.core.checks import check_int

if TYPE_CHECKING:
    from megapack.bench.gpu.model import GptShape

MODES = ("packed", "padded_fixed", "grouped", "ceiling", "padded_longest")
LABELS = {
    "packed": "packed",
    "padded_fixed": "padded to seq",
    "grouped": "length-grouped padding, sorted step, token budget",
    "ceiling": "ceiling: one document per row, packing's THD path",
    "padded_longest": "weak: documents in order padded to the longest",
}
"""How reports name each mode."""
BASELINES = MODES[1:]
FULL_MODES = ("packed", "grouped", "ceiling")
"""Modes timed on every micro-batch of the step (the targets read them)."""
SAMPLED_MODES = ("padded_fixed", "padded_longest")
"""Context baselines: timed on their first micro-batches, at most as many as `timed` is told."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """One step's documents and packing's rows for them (`plan_step`)."""

    lengths: list[int]
    """The step's documents' lengths, in data order (their order in the pool)."""
    packing: list[list[int]]
    """Packing's rows: indices into ``lengths``, the plan's rows in its seeded order."""
    pool: list[int]
    """Each step document's index in the pool."""
    pool_size: int
    """Documents the plan was made over."""
    pool_rows: int
    """Rows of that plan."""

    def fill(self, seq_len: int) -> float:
        """Packing's fraction of token slots holding tokens, e.g. 0.99."""
        return sum(self.lengths) / (len(self.packing) * seq_len)


def plan_step(
    lengths: Sequence[int], seq_len: int, rows: int, micro_batches: int, *, seed: int = 0
) -> Step:
    """A step of ``micro_batches`` packed micro-batches from a BFD plan over every length (module
    docstring); fewer when the plan has fewer rows.

    Raises:
        TypeError: ``seq_len``, ``rows`` or ``micro_batches`` is not an int.
        ValueError: a length above ``seq_len`` (documents are never split here), or a count < 1.

    Example:
        >>> step = plan_step([5, 3, 7, 2, 8, 1, 1], 10, 2, 1)
        >>> step.lengths, step.packing, step.pool, step.pool_rows
        ([3, 7, 2, 8], [[2, 3], [0, 1]], [1, 2, 3, 4], 3)
    """
    from megapack.packing import LoadOptions, plan

    for name, value in (("seq_len", seq_len), ("rows", rows), ("micro_batches", micro_batches)):
        check_int(name, value, minimum=1)
    if not lengths:
        raise ValueError("lengths is empty: a step needs documents")
    longest = max(lengths)
    if longest > seq_len:
        raise ValueError(
            f"lengths: document {list(lengths).index(longest)} has {longest} tokens, above "
            f"seq_len={seq_len}; clip the mix to the row (documents are not split here)"
        )
    bins = plan(list(lengths), seq_len, algorithm="bfd", seed=seed, loading=LoadOptions()).bins
    rows_of = [[i for i, _, _ in row] for row in bins]
    if len(rows_of) > micro_batches * rows:  # the epoch's remainder row: once an epoch, not a step
        loads = [sum(lengths[i] for i in row) for row in rows_of]
        del rows_of[loads.index(min(loads))]
    taken = rows_of[: micro_batches * rows]
    pool = sorted(i for row in taken for i in row)
    where = {doc: k for k, doc in enumerate(pool)}
    return Step(
        lengths=[int(lengths[i]) for i in pool],
        packing=[[where[i] for i in row] for row in taken],
        pool=pool,
        pool_size=len(lengths),
        pool_rows=len(bins),
    )


def micro_batches(
    mode: str,
    docs: Sequence[np.ndarray],
    seq_len: int,
    rows: int,
    *,
    packing: Sequence[Sequence[int]] | None = None,
) -> list[Any]:
    """The documents laid out for ``mode`` (module docstring): a list of micro-batches.

    ``packing``: packing's rows as indices into ``docs`` (`Step.packing`); None packs ``docs``
    with BFD (packed and ceiling only). No mode adds a filler row.

    Example:
        >>> docs = [np.arange(1, n + 1) for n in (3, 5, 2, 6)]
        >>> [tuple(b["tokens"].shape) for b in micro_batches("grouped", docs, 8, 1)]
        [(1, 6), (1, 5), (2, 3)]
        >>> [b.cu_seqlens.tolist() for b in micro_batches("packed", docs, 8, 2)]
        [[0, 2, 8, 11, 16]]
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose one of {MODES}")
    if mode in ("packed", "ceiling"):
        rows_of = [list(r) for r in packing] if packing is not None else _bins(docs, seq_len)
        if mode == "ceiling":  # each row's tokens as one document, through the THD path
            lines = [[np.concatenate([docs[i] for i in row])] for row in rows_of]
        else:
            lines = [[docs[i] for i in row] for row in rows_of]
        packed = [PackedBatch.from_documents(line, seq_len=seq_len) for line in lines]
        return [PackedBatch.concat(packed[i : i + rows]) for i in range(0, len(packed), rows)]
    if mode == "padded_fixed":
        return [_plain(docs[i : i + rows], seq_len) for i in range(0, len(docs), rows)]
    if mode == "padded_longest":
        groups = [docs[i : i + rows] for i in range(0, len(docs), rows)]
        return [_plain(g, max(len(d) for d in g)) for g in groups]
    return [_plain(g, len(g[0])) for g in grouped(docs, seq_len, rows)]


def grouped(docs: Sequence[np.ndarray], seq_len: int, rows: int) -> list[list[np.ndarray]]:
    """``grouped``'s micro-batches: the documents sorted once by length, longest first (ties in
    data order), each micro-batch the next ``k`` of them with ``k x`` its longest at most
    ``rows * seq_len`` token slots (greedy: for a sorted order no partition has fewer groups).

    Example:
        >>> [[len(d) for d in g] for g in grouped([np.ones(n) for n in (3, 5, 2, 6, 1)], 6, 2)]
        [[6, 5], [3, 2, 1]]
    """
    budget = rows * seq_len
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i]))
    out: list[list[np.ndarray]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * len(out[-1][0]) <= budget:
            out[-1].append(docs[i])
        else:
            out.append([docs[i]])
    return out


def timed(mode: str, batches: list[Any], limit: int) -> list[Any]:
    """The micro-batches of ``mode`` a step runs: all of them for `FULL_MODES`, else the first
    ``limit`` (module docstring)."""
    return batches if mode in FULL_MODES else batches[:limit]


def timed_lengths(mode: str, lengths: Sequence[int], rows: int, limit: int) -> list[int]:
    """The lengths of the documents `timed` keeps: every one for `FULL_MODES`; for the sampled
    modes the first ``limit x rows`` (their micro-batch ``j`` holds documents ``j*rows`` on)."""
    return list(lengths) if mode in FULL_MODES else list(lengths[: limit * rows])


@dataclass(frozen=True, kw_only=True, slots=True)
class ModeCost:
    """What micro-batches hold and cost."""

    slots: int
    """Token positions the micro-batches hold, padding included."""
    spans: list[int]
    """Every attention span: a packed buffer segment, or a padded row whole."""

    def executed_flops(self, shape: GptShape) -> int:
        """Training FLOPs the kernels run: every slot through the matmuls, causal attention over
        every span (`GptShape.training_flops` over the spans)."""
        return shape.training_flops(self.spans)


def mode_cost(batches: Sequence[Any]) -> ModeCost:
    """The `ModeCost` of a list of micro-batches (PackedBatch or plain [b, s] dicts)."""
    spans: list[int] = []
    for b in batches:
        if isinstance(b, PackedBatch):
            cu = b.cu_seqlens_padded if b.cu_seqlens_padded is not None else b.cu_seqlens
            spans += torch.diff(cu).tolist()
        else:
            n, width = (int(x) for x in b["tokens"].shape)
            spans += [width] * n
    return ModeCost(slots=sum(spans), spans=spans)


def schedule_shape(batch: Any) -> tuple[int, int]:
    """(micro_batch_size, seq_length) megatron-core's schedule is told for a micro-batch: THD
    batches are one row of every token."""
    if isinstance(batch, PackedBatch):
        return 1, int(batch.tokens.shape[1])
    n, width = (int(x) for x in batch["tokens"].shape)
    return n, width


def _bins(docs: Sequence[np.ndarray], seq_len: int) -> list[list[int]]:
    from megapack.packing import plan

    bins = plan([len(d) for d in docs], seq_len, algorithm="bfd", long_docs="error").bins
    return [[i for i, _, _ in row] for row in bins]


def _plain(docs: Sequence[np.ndarray], width: int) -> dict[str, torch.Tensor]:
    rows = [PackedBatch.from_documents([d], seq_len=width) for d in docs]
    out = {k: torch.cat([getattr(r, k) for r in rows]) for k in ("tokens", "labels", "loss_mask")}
    return {**out, "position_ids": torch.arange(width).expand(len(docs), width).contiguous()}
