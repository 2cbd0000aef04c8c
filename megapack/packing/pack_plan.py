"""`PackPlan`: which pieces of which documents go into which bin (row), and how well.

A plan is stored compactly, in CSR form, so that it costs O(number of pieces) memory even for
millions of documents: ``slices`` is an ``[S, 3]`` int64 array of pieces ``(doc_index, start,
stop)`` (`megapack.packing.pieces`), bin after bin, and ``bin_offsets`` (``[B + 1]``, from 0) says
where each bin's pieces begin.

Worked example, lengths ``[3, 2, 4]`` at seq_len 5 with best-fit decreasing:

    bins         [[(2, 0, 4)], [(0, 0, 3), (1, 0, 2)]]     bin 0: document 2; bin 1: documents 0, 1
    slices       [[2, 0, 4], [0, 0, 3], [1, 0, 2]]
    bin_offsets  [0, 1, 3]
    bin_loads    [4, 5]          efficiency 9 / (2 x 5) = 90%, lower bound 2 (gap 0)

A document split at seq_len 5 (length 12) appears as ``(i, 0, 5), (i, 5, 10), (i, 10, 12)``. With
a padding ``multiple`` above 1 each piece takes ``ceil(size / multiple) * multiple`` slots of its
row; the pieces hold the real tokens, so ``efficiency`` counts real tokens and ``padding_tokens``
the alignment padding. ``bins`` builds the nested Python lists on first access (about 1 s per
million pieces) and caches them; ``bin(i)`` and ``to_arrays()`` give array views without that cost.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megapack.packing.bounds import lower_bound as bins_lower_bound
from megapack.packing.pieces import LongDocCounts


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class PackPlan(LongDocCounts):
    """Bins of pieces, with the quality measures and what the long-document policy did
    (`LongDocCounts`); see the module docstring for an example."""

    seq_len: int
    """Tokens a bin (row)."""
    algorithm: str
    """The algorithm that made the plan ("bfd", "ffd", "first_fit", "next_fit", "best", ...)."""
    bin_offsets: np.ndarray = field(repr=False)
    """[num_bins + 1] int64, read-only: bin b holds ``slices[bin_offsets[b]:bin_offsets[b + 1]]``."""
    slices: np.ndarray = field(repr=False)
    """[num_slices, 3] int64, read-only: pieces ``(doc_index, start, stop)``, bin after bin."""
    lower_bound: int
    """No packing of these pieces uses fewer bins: ``max(L1, L2)`` (see bounds.py)."""
    multiple: int = 1
    """Every piece is padded to a multiple of this in its row (`PackOptions.multiple`)."""
    _bins: list[list[tuple[int, int, int]]] | None = field(default=None, init=False, repr=False)
    """Cache of `bins`."""

    def __post_init__(self) -> None:
        offsets = np.ascontiguousarray(self.bin_offsets, dtype=np.int64)
        slices = np.ascontiguousarray(self.slices, dtype=np.int64).reshape(-1, 3)
        if offsets.ndim != 1 or len(offsets) == 0 or offsets[0] != 0:
            raise ValueError(f"PackPlan.bin_offsets must be 1-D and start at 0, got {offsets[:5]}")
        if offsets[-1] != len(slices):
            raise ValueError(
                f"PackPlan.bin_offsets ends at {int(offsets[-1])} but there are {len(slices)} slices"
            )
        offsets.flags.writeable = False
        slices.flags.writeable = False
        object.__setattr__(self, "bin_offsets", offsets)
        object.__setattr__(self, "slices", slices)

    @classmethod
    def from_bins(
        cls,
        bins: list[list[tuple[int, int, int]]],
        seq_len: int,
        *,
        algorithm: str = "custom",
        num_docs: int | None = None,
    ) -> PackPlan:
        """Build a plan from nested lists, e.g. one made by hand or by another tool.

        Args:
            bins: each bin a list of ``(doc_index, start, stop)``.
            seq_len: tokens a bin.
            algorithm: a label for reports.
            num_docs: number of input documents; default ``1 + the largest doc_index``.

        Returns:
            The plan, with ``lower_bound`` computed from the slice sizes.

        Example:
            >>> PackPlan.from_bins([[(2, 0, 4)], [(0, 0, 3), (1, 0, 2)]], 5).efficiency
            0.9
        """
        counts = [len(b) for b in bins]
        rows = np.array([s for b in bins for s in b], dtype=np.int64).reshape(-1, 3)
        sizes = rows[:, 2] - rows[:, 1]
        return cls(
            seq_len=seq_len,
            algorithm=algorithm,
            bin_offsets=np.concatenate(([0], np.cumsum(counts, dtype=np.int64))),
            slices=rows,
            lower_bound=bins_lower_bound(sizes, seq_len) if len(sizes) else 0,
            num_docs=num_docs if num_docs is not None else int(rows[:, 0].max(initial=-1)) + 1,
        )

    @property
    def num_bins(self) -> int:
        """Number of bins (rows of ``seq_len`` tokens)."""
        return len(self.bin_offsets) - 1

    @property
    def bins(self) -> list[list[tuple[int, int, int]]]:
        """Each bin as a list of ``(doc_index, start, stop)`` tuples (built once, then cached)."""
        if self._bins is None:
            rows = list(map(tuple, self.slices.tolist()))
            bounds = self.bin_offsets.tolist()
            built = [rows[a:b] for a, b in itertools.pairwise(bounds)]
            object.__setattr__(self, "_bins", built)
        return self._bins  # type: ignore[return-value]

    def bin(self, b: int) -> np.ndarray:
        """Return bin ``b``'s slices as a read-only ``[k, 3]`` int64 view, without building `bins`."""
        if not -self.num_bins <= b < self.num_bins:
            raise IndexError(f"bin {b} out of range for a plan with {self.num_bins} bins")
        b %= self.num_bins
        return self.slices[self.bin_offsets[b] : self.bin_offsets[b + 1]]

    @property
    def bin_loads(self) -> np.ndarray:
        """[num_bins] int64 tokens in each bin."""
        sizes = self.slices[:, 2] - self.slices[:, 1]
        totals = np.concatenate(([0], np.cumsum(sizes)))
        return totals[self.bin_offsets[1:]] - totals[self.bin_offsets[:-1]]

    @property
    def bin_slots(self) -> np.ndarray:
        """[num_bins] int64 slots each bin fills: its tokens plus their alignment padding (at most
        ``seq_len``)."""
        sizes = self.slices[:, 2] - self.slices[:, 1]
        totals = np.concatenate(([0], np.cumsum(sizes + -sizes % self.multiple)))
        return totals[self.bin_offsets[1:]] - totals[self.bin_offsets[:-1]]

    @property
    def packed_tokens(self) -> int:
        """Tokens placed in bins."""
        return int((self.slices[:, 2] - self.slices[:, 1]).sum())

    @property
    def efficiency(self) -> float:
        """``packed_tokens / (num_bins * seq_len)``: real tokens, alignment padding not counted;
        0.0 for a plan with no bins."""
        if self.num_bins == 0:
            return 0.0
        return self.packed_tokens / (self.num_bins * self.seq_len)

    @property
    def padding_tokens(self) -> int:
        """Slots of alignment padding: each piece padded to a multiple of ``multiple``."""
        sizes = self.slices[:, 2] - self.slices[:, 1]
        return int((-sizes % self.multiple).sum())

    @property
    def gap(self) -> int:
        """``num_bins - lower_bound``: at most this many bins could still be saved."""
        return self.num_bins - self.lower_bound

    def reordered(self, order: np.ndarray | list[int]) -> PackPlan:
        """The same plan with its bins in ``order`` (a permutation of the bin indices).

        Example:
            >>> PackPlan.from_bins([[(2, 0, 4)], [(0, 0, 3), (1, 0, 2)]], 5).reordered([1, 0]).bins
            [[(0, 0, 3), (1, 0, 2)], [(2, 0, 4)]]
        """
        order = np.asarray(order, dtype=np.int64)
        if order.ndim != 1 or not np.array_equal(np.sort(order), np.arange(self.num_bins)):
            raise ValueError(
                f"order must be a permutation of range({self.num_bins}), got {order[:8].tolist()}..."
            )
        counts = np.diff(self.bin_offsets)[order]
        offsets = np.concatenate(([0], np.cumsum(counts)))
        take = np.repeat(self.bin_offsets[order] - offsets[:-1], counts) + np.arange(offsets[-1])
        return PackPlan(
            seq_len=self.seq_len,
            algorithm=self.algorithm,
            bin_offsets=offsets,
            slices=self.slices[take],
            lower_bound=self.lower_bound,
            multiple=self.multiple,
            **self.counts(),
        )

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Return the compact form: ``bin_offsets``, ``doc_index``, ``start``, ``stop`` (views).

        ``np.savez(path, **plan.to_arrays())`` stores a plan in 8 bytes per bin plus 24 per slice.
        """
        return {
            "bin_offsets": self.bin_offsets,
            "doc_index": self.slices[:, 0],
            "start": self.slices[:, 1],
            "stop": self.slices[:, 2],
        }

    def validate(self) -> PackPlan:
        """Check that no bin is empty or over ``seq_len`` (padding included) and every piece is
        non-empty.

        Returns:
            self.

        Raises:
            ValueError: naming the first offending bin or piece.
        """
        counts = np.diff(self.bin_offsets)
        if len(counts) and counts.min() <= 0:
            raise ValueError(f"bin {int(np.argmin(counts))} of the plan is empty")
        sizes = self.slices[:, 2] - self.slices[:, 1]
        bad = np.flatnonzero((sizes <= 0) | (self.slices[:, 1] < 0))
        if len(bad):
            raise ValueError(
                f"piece {int(bad[0])} {self.slices[bad[0]].tolist()} is empty or negative"
            )
        slots = self.bin_slots
        over = np.flatnonzero(slots > self.seq_len)
        if len(over):
            b = int(over[0])
            raise ValueError(f"bin {b} holds {int(slots[b])} tokens > seq_len={self.seq_len}")
        return self

    def report(self) -> str:
        """A few lines for people: bins, efficiency, bound and gap, losses, fill levels."""
        loads = self.bin_loads
        fill = (
            f"min {int(loads.min()):,}, median {int(np.median(loads)):,}, max {int(loads.max()):,}"
            if len(loads)
            else "no bins"
        )
        gap_pct = 100.0 * self.gap / self.num_bins if self.num_bins else 0.0
        return "\n".join(
            [
                f"PackPlan ({self.algorithm}, seq_len {self.seq_len:,})",
                f"  documents    {self.num_docs:,} -> {len(self.slices):,} pieces in {self.num_bins:,} bins",
                f"  tokens       {self.packed_tokens:,} packed in {self.num_bins * self.seq_len:,}"
                f" slots: efficiency {100.0 * self.efficiency:.3f}%",
                f"  lower bound  {self.lower_bound:,} bins: gap {self.gap:,} bins ({gap_pct:.2f}%)",
                f"  long docs    {self.num_split_docs:,} split ({self.split_tokens:,} tokens, all packed),"
                f" {self.num_truncated_docs:,} truncated ({self.truncated_tokens:,} tokens lost),"
                f" {self.num_dropped_docs:,} dropped ({self.dropped_tokens:,} tokens lost)",
                f"  bin fill     {fill}",
            ]
        )

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, PackPlan):
            return NotImplemented
        scalars = ("seq_len", "algorithm", "lower_bound", "multiple")
        return (
            all(getattr(self, a) == getattr(other, a) for a in scalars)
            and self.counts() == other.counts()
        ) and (
            np.array_equal(self.bin_offsets, other.bin_offsets)
            and np.array_equal(self.slices, other.slices)
        )

    __hash__ = None  # type: ignore[assignment]
