"""`plan()`: pack documents of given lengths into rows of ``seq_len`` tokens (the planner).

The pipeline, every setting read from one `PackOptions`: validate the lengths, apply the
long-document policy (`megapack.packing.pieces`), pad each piece's size to the options'
``multiple``, run one algorithm on those sizes, cap the pieces a row (``max_documents``), then store
the result as a `PackPlan` (pack_plan.py) with its lower bound (bounds.py), and, given
`LoadOptions`, put the rows in the order a data loader deals them (balance.py). Algorithms:

    "bfd"        best-fit decreasing (bfd.py), O(n log n); the default
    "ffd"        first-fit decreasing (fit.py)
    "first_fit"  first fit in input order, no sort (fit.py)
    "next_fit"   one open bin at a time, streaming (fit.py)
    "best"       BFD, then a local search under the step budget ``search_steps`` (search.py);
                 never more bins than "bfd"

Measured here (2-core CPU) on the OpenChat V1 lengths (6,144 documents, seq_len 2,048; lower
bound 4,663 bins), bins and efficiency:

    next_fit 5,544 (83.86%, 1 ms) | first_fit 4,723 (98.44%, 9 ms) | ffd 4,673 (99.49%, 12 ms)
    bfd 4,673 (99.49%, 7 ms) | best 4,666-4,667 (99.62-99.64%) with 3,300 search steps (1.0 s),
    4,666 (99.64%) with 10,000 (3.1 s) for each of seeds 0-9; the default 20,000 take 6.2 s

and on 1,000,000 lognormal lengths (``lognormal(6, 1)`` clipped to [1, 4096], seq_len 4,096):
"bfd" 157,517 bins in 0.25-0.3 s end to end (0.11 s packing), traced peak 92 MiB; "best" reaches
the lower bound, 157,510 bins, in 2.8 s.

Given `LoadOptions`, the bins are listed in the order a data loader deals them to data-parallel
ranks (balance.py). Within a bin, pieces are listed in document order. Without, bins are numbered
in the order the algorithm opened them; for "best", bins the search did not touch come first, in
BFD's order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from megapack.packing.balance import order_rows
from megapack.packing.bfd import best_fit_decreasing
from megapack.packing.bounds import lower_bound
from megapack.packing.cost import CostModel
from megapack.packing.fit import first_fit, first_fit_decreasing, next_fit
from megapack.packing.options import LoadOptions, PackOptions, pack_options, with_shortcuts
from megapack.packing.pack_plan import PackPlan
from megapack.packing.pieces import Pieces, as_lengths, make_pieces
from megapack.packing.search import improve

_GREEDY: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "bfd": best_fit_decreasing,
    "ffd": first_fit_decreasing,
    "first_fit": first_fit,
    "next_fit": next_fit,
}


def plan(
    lengths: Sequence[int] | np.ndarray,
    packing: PackOptions | int,
    *,
    loading: LoadOptions | None = None,
    **shortcuts: Any,
) -> PackPlan:
    """Plan how to pack documents of the given lengths into rows of ``seq_len`` tokens.

    Args:
        lengths: token count of every document: a sequence or 1-D array of positive integers.
        packing: the `PackOptions` (seq_len, algorithm, long_docs, padding, max_documents, seed,
            search_steps), or the ``seq_len`` alone (an int; the rest their defaults).
        loading: deal the rows as a data loader with these `LoadOptions` would (their
            ``balance``, ``cost``, ``dp_size``, ``micro_batches``, ``rows_per_micro_batch``;
            shuffled with the options' ``seed``): bin ``i`` is for micro-batch ``i //
            rows_per_micro_batch``, which goes to DP rank ``(i // rows_per_micro_batch) %
            dp_size``. None: the algorithm's order.
        **shortcuts: fields of `PackOptions` (``plan(lengths, 4096, algorithm="best")``), set in
            ``packing``.

    Returns:
        The `PackPlan`: pieces hold real tokens; with a padding multiple above 1 each takes its
        padded size in its row (``PackPlan.padding_tokens``).

    Raises:
        TypeError: ``lengths`` are not integers, or an option of the wrong type.
        ValueError: a bad option value, an empty document (naming its index), or, with
            ``long_docs="error"``, a document longer than ``seq_len`` (naming its index).

    Example:
        >>> plan([3, 2, 4], 5).bins
        [[(2, 0, 4)], [(0, 0, 3), (1, 0, 2)]]
        >>> plan([3, 2, 4], 5, algorithm="next_fit").bins
        [[(0, 0, 3), (1, 0, 2)], [(2, 0, 4)]]
        >>> plan([12], 5).bins
        [[(0, 0, 5)], [(0, 5, 10)], [(0, 10, 12)]]
        >>> plan([3, 5], PackOptions(seq_len=8, pad_to_multiple_of=2)).padding_tokens  # 4 + 6 > 8
        2
        >>> lengths, squares = [4, 4, 2, 2, 1, 1, 1, 1], CostModel(a=0, b=1)
        >>> deal = LoadOptions(balance="compute", dp_size=2, micro_batches=2, cost=squares)
        >>> p = plan(lengths, 4, loading=deal)
        >>> [[stop - start for _, start, stop in b] for b in p.bins]  # ranks 0, 1, 0, 1: 24, 20
        [[2, 2], [1, 1, 1, 1], [4], [4]]
    """
    options = pack_options(packing, shortcuts, where="plan()")
    if loading is not None:
        loading = with_shortcuts(LoadOptions, loading, {}, where="plan(loading=...)")
    seq_len, multiple = options.seq_len, options.multiple
    pieces = make_pieces(as_lengths(lengths), seq_len, options.long_docs)
    sizes = -(-pieces.sizes // multiple) * multiple  # the slots each piece takes in its row
    bound = lower_bound(sizes, seq_len)
    bin_of = _GREEDY["bfd" if options.algorithm == "best" else options.algorithm](sizes, seq_len)
    if options.algorithm == "best":
        steps, seed = options.search_steps, options.seed
        bin_of = improve(sizes, bin_of, seq_len, seed=seed, max_steps=steps, lower_bound=bound)
    if options.max_documents is not None:
        bin_of = cap_documents(sizes, bin_of, seq_len, options.max_documents)
    result = _to_plan(pieces, bin_of, options, bound)
    if loading is None:
        return result
    costs = (loading.cost or CostModel.tokens()).bin_costs(result.slices, result.bin_offsets)
    return result.reordered(order_rows(costs, loading, seed=options.seed, pad=False))


def cap_documents(
    sizes: np.ndarray, bin_of: np.ndarray, seq_len: int, max_documents: int
) -> np.ndarray:
    """``bin_of`` with no bin holding more than ``max_documents`` items: every bin over the cap
    gives up its shortest items, which go, longest first, to the fullest bin with room for them
    and a free slot, else to a new bin (numbered after the others).

    Example:
        >>> cap_documents(np.array([1, 1, 1, 5, 3]), np.array([0, 0, 0, 1, 1]), 8, 2).tolist()
        [2, 0, 0, 1, 1]
    """
    bin_of = bin_of.copy()
    num_bins = int(bin_of.max()) + 1 if len(bin_of) else 0
    counts = np.bincount(bin_of, minlength=num_bins)
    loads = np.bincount(bin_of, weights=sizes, minlength=num_bins).astype(np.int64)
    moved: list[int] = []
    for b in np.flatnonzero(counts > max_documents).tolist():
        members = np.flatnonzero(bin_of == b)
        shortest = members[np.argsort(sizes[members], kind="stable")][: counts[b] - max_documents]
        moved += shortest.tolist()
        counts[b] -= len(shortest)
        loads[b] -= int(sizes[shortest].sum())
    extra_counts: list[int] = []
    extra_loads: list[int] = []
    for i in sorted(moved, key=lambda i: (-int(sizes[i]), i)):
        size = int(sizes[i])
        fits = np.flatnonzero((counts < max_documents) & (loads + size <= seq_len))
        if len(fits):
            b = int(fits[np.argmax(loads[fits])])
            counts[b] += 1
            loads[b] += size
            bin_of[i] = b
            continue
        new = next(
            (
                j
                for j, (c, load) in enumerate(zip(extra_counts, extra_loads, strict=True))
                if c < max_documents and load + size <= seq_len
            ),
            None,
        )
        if new is None:
            new = len(extra_counts)
            extra_counts.append(0)
            extra_loads.append(0)
        extra_counts[new] += 1
        extra_loads[new] += size
        bin_of[i] = num_bins + new
    return bin_of


def _to_plan(pieces: Pieces, bin_of: np.ndarray, options: PackOptions, bound: int) -> PackPlan:
    """Group pieces by bin (stable, so document order within a bin) into a `PackPlan`."""
    num_bins = int(bin_of.max()) + 1 if len(bin_of) else 0
    order = np.argsort(bin_of, kind="stable")
    slices = np.stack((pieces.doc_index[order], pieces.start[order], pieces.stop[order]), axis=1)
    counts = np.bincount(bin_of, minlength=num_bins)
    return PackPlan(
        seq_len=options.seq_len,
        algorithm=options.algorithm,
        bin_offsets=np.concatenate(([0], np.cumsum(counts))),
        slices=slices,
        lower_bound=bound,
        multiple=options.multiple,
        **pieces.counts(),
    )
