"""`plan()`: pack documents of given lengths into bins of ``capacity`` tokens.

The pipeline: validate the lengths, apply the long-document policy (items.py), run one algorithm
on the item sizes, then store the result as a `PackPlan` (pack_plan.py) with its lower bound
(bounds.py). Algorithms:

    "bfd"        best-fit decreasing (bfd.py), O(n log n); the default
    "ffd"        first-fit decreasing (fit.py)
    "first_fit"  first fit in input order, no sort (fit.py)
    "next_fit"   one open bin at a time, streaming (fit.py)
    "best"       BFD, then a local search under a step budget and a time limit (search.py); never
                 more bins than "bfd"

Measured here (2-core CPU) on the OpenChat V1 lengths (6,144 documents, capacity 2,048; lower
bound 4,663 bins), bins and efficiency:

    next_fit 5,544 (83.86%, 1 ms) | first_fit 4,723 (98.44%, 9 ms) | ffd 4,673 (99.49%, 12 ms)
    bfd 4,673 (99.49%, 7 ms) | best 4,667 (99.62%) within 1 s, 4,666 (99.64%) within 3 s for
    each of seeds 0-9; with the defaults the 20,000-step budget ends the search after ~6 s here

and on 1,000,000 lognormal lengths (``lognormal(6, 1)`` clipped to [1, 4096], capacity 4,096):
"bfd" 157,517 bins in 0.25-0.3 s end to end (0.11 s packing), traced peak 92 MiB; "best" reaches
the lower bound, 157,510 bins, in 2.8 s.

With ``balance="token"`` or ``"compute"`` the bins are listed in the order a data loader deals
them to data-parallel ranks (balance.py). Within a bin, slices are listed in document order. Bins are numbered in the order the algorithm
opened them (``balance=None``); for "best", bins the search did not touch come first, in BFD's
order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from megapack.core.checks import check_int
from megapack.packing.balance import check_balance, order_rows
from megapack.packing.bfd import best_fit_decreasing
from megapack.packing.bounds import lower_bound
from megapack.packing.cost import CostModel
from megapack.packing.fit import first_fit, first_fit_decreasing, next_fit
from megapack.packing.names import ALGORITHMS, LONG_DOC_POLICIES
from megapack.packing.pack_plan import PackPlan
from megapack.packing.pieces import Items, as_lengths, make_items
from megapack.packing.search import DEFAULT_MAX_STEPS, improve

"""Names accepted by ``plan(algorithm=...)``."""

_GREEDY: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "bfd": best_fit_decreasing,
    "ffd": first_fit_decreasing,
    "first_fit": first_fit,
    "next_fit": next_fit,
}


def plan(
    lengths: Sequence[int] | np.ndarray,
    capacity: int | np.integer,
    *,
    algorithm: str = "bfd",
    long_docs: str = "split",
    seed: int = 0,
    time_limit_s: float | None = 10.0,
    max_search_steps: int = DEFAULT_MAX_STEPS,
    balance: str | None = None,
    dp_size: int = 1,
    micro_batches: int = 1,
    rows_per_micro_batch: int = 1,
    cost: CostModel | None = None,
    max_documents: int | None = None,
) -> PackPlan:
    """Plan how to pack documents of the given lengths into bins of ``capacity`` tokens.

    Args:
        lengths: token count of every document: a sequence or 1-D array of positive integers.
        capacity: tokens per bin (the packed sequence length), a positive integer.
        algorithm: one of ``ALGORITHMS`` (see the module docstring).
        long_docs: what to do with documents longer than ``capacity``: "split" (chunks of at most
            ``capacity`` tokens, nothing lost), "truncate" (keep the first ``capacity`` tokens),
            "drop", or "error" (raise ValueError naming the first one).
        seed: seed for the randomness of "best" (the other algorithms are deterministic). The same
            inputs and seed give the same plan, subject to the time limit (next argument).
        time_limit_s: wall-clock limit for the search of "best" in seconds, or None. With None the
            plan depends only on the inputs, the seed and ``max_search_steps``; when the limit
            stops the search first, the plan is the best found by then (never worse than "bfd"),
            which can vary between runs.
        max_search_steps: step budget of the "best" search (about 3,300 steps per second on
            OpenChat V1 here; the default 20,000 binds before the default 10 s limit on this machine).
        balance: None keeps the bins in the algorithm's order; "token" shuffles them with
            ``seed``, as a data loader deals them; "compute" shuffles, then re-deals every global
            batch so that each data-parallel rank's step costs about the same (balance.py). With
            either, bin ``i`` is for micro-batch ``i // rows_per_micro_batch``, which goes to DP
            rank ``(i // rows_per_micro_batch) % dp_size``.
        dp_size, micro_batches, rows_per_micro_batch: data-parallel ranks, micro-batches per rank
            per optimizer step, rows per micro-batch: a global batch is their product of rows.
        cost: the `CostModel` of a row, required by ``balance="compute"``.
        max_documents: at most this many slices (documents, or pieces of a split one) per bin,
            for static shapes (`megapack.core.static`): the algorithm's bins that hold more give
            their shortest slices to bins with room and a free slot (best fit), else to new bins.

    Returns:
        The `PackPlan`.

    Raises:
        TypeError: ``lengths`` are not integers, or ``capacity``/``seed`` is not an int.
        ValueError: a bad argument value, an empty document (naming its index), or, with
            ``long_docs="error"``, a document longer than ``capacity`` (naming its index).

    Example:
        >>> plan([3, 2, 4], 5).bins
        [[(2, 0, 4)], [(0, 0, 3), (1, 0, 2)]]
        >>> plan([3, 2, 4], 5, algorithm="next_fit").bins
        [[(0, 0, 3), (1, 0, 2)], [(2, 0, 4)]]
        >>> plan([12], 5).bins
        [[(0, 0, 5)], [(0, 5, 10)], [(0, 10, 12)]]
        >>> lengths, squares = [4, 4, 2, 2, 1, 1, 1, 1], CostModel(a=0, b=1)
        >>> p = plan(lengths, 4, balance="compute", dp_size=2, micro_batches=2, cost=squares)
        >>> [[stop - start for _, start, stop in b] for b in p.bins]  # ranks 0, 1, 0, 1: 24, 20
        [[2, 2], [1, 1, 1, 1], [4], [4]]
    """
    _check_int("capacity", capacity, minimum=1)
    _check_int("seed", seed, minimum=0)
    _check_int("max_search_steps", max_search_steps, minimum=0)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if long_docs not in LONG_DOC_POLICIES:
        raise ValueError(f"long_docs must be one of {LONG_DOC_POLICIES}, got {long_docs!r}")
    layout = {"dp_size": dp_size, "micro_batches": micro_batches}
    layout["rows_per_micro_batch"] = rows_per_micro_batch
    check_balance(balance, **layout, cost=cost)
    if time_limit_s is not None and (
        isinstance(time_limit_s, bool)
        or not isinstance(time_limit_s, int | float)
        or not math.isfinite(time_limit_s)
        or time_limit_s < 0
    ):
        raise ValueError(f"time_limit_s must be None or a finite number >= 0, got {time_limit_s!r}")
    capacity = int(capacity)
    items = make_items(as_lengths(lengths), capacity, long_docs)
    sizes = items.sizes
    bound = lower_bound(sizes, capacity)
    bin_of = _GREEDY["bfd" if algorithm == "best" else algorithm](sizes, capacity)
    if algorithm == "best":
        bin_of = improve(
            sizes,
            bin_of,
            capacity,
            seed=int(seed),
            time_limit_s=time_limit_s,
            max_steps=int(max_search_steps),
            lower_bound=bound,
        )
    if max_documents is not None:
        _check_int("max_documents", max_documents, minimum=1)
        bin_of = cap_documents(sizes, bin_of, capacity, int(max_documents))
    result = _to_plan(items, bin_of, capacity, algorithm, bound)
    if balance is None:
        return result
    costs = (cost or CostModel.tokens()).bin_costs(result.slices, result.bin_offsets)
    order = order_rows(costs, balance=balance, **layout, seed=int(seed), pad=False)
    return result.reordered(order)


def cap_documents(
    sizes: np.ndarray, bin_of: np.ndarray, capacity: int, max_documents: int
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
        fits = np.flatnonzero((counts < max_documents) & (loads + size <= capacity))
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
                if c < max_documents and load + size <= capacity
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


def _to_plan(
    items: Items, bin_of: np.ndarray, capacity: int, algorithm: str, bound: int
) -> PackPlan:
    """Group items by bin (stable, so document order within a bin) into a `PackPlan`."""
    num_bins = int(bin_of.max()) + 1 if len(bin_of) else 0
    order = np.argsort(bin_of, kind="stable")
    slices = np.stack((items.doc_index[order], items.start[order], items.stop[order]), axis=1)
    counts = np.bincount(bin_of, minlength=num_bins)
    return PackPlan(
        capacity=capacity,
        algorithm=algorithm,
        bin_offsets=np.concatenate(([0], np.cumsum(counts))),
        slices=slices,
        lower_bound=bound,
        num_docs=items.num_docs,
        num_split_docs=items.num_split_docs,
        split_tokens=items.split_tokens,
        num_truncated_docs=items.num_truncated_docs,
        truncated_tokens=items.truncated_tokens,
        num_dropped_docs=items.num_dropped_docs,
        dropped_tokens=items.dropped_tokens,
    )


def _check_int(name: str, value: object, *, minimum: int | None) -> None:
    check_int(name, value, minimum=minimum)
