"""Exact subset sums on small item sets, with Python integers as bitsets.

The local search (search.py) repeatedly asks "which of these few items fill this bin as tightly as
possible?" and "do these leftover items fit into two bins?". Both are subset-sum questions over a
dozen or so items with capacities of a few thousand tokens, answered exactly by dynamic programming
over reachable sums. Bit ``t`` of ``reach[j]`` says whether some subset of the first ``j`` items sums
to ``t``; adding item ``w`` is ``reach | (reach << w)``, one big-integer shift and or, so a whole
row of the DP table costs a few machine words per 64 tokens of the limit.

Worked example, items ``[5, 4, 3]`` and limit 8: the reachable sums are {0, 3, 4, 5, 7, 8}, the
best is 8 = 5 + 3, and the reconstruction walks back from the last item: 8 is not reachable with
``[5, 4]`` alone, so 3 is taken; 5 is reachable with ``[5]``, so 4 is skipped; 5 is not reachable
with no items, so 5 is taken.

Cost: O(items x limit / 64) word operations; 15 items at limit 2,048 take about 10 µs.
"""

from __future__ import annotations


def reachable_sums(weights: list[int], limit: int) -> list[int]:
    """Return the DP rows: bit ``t`` of row ``j`` is set when a subset of ``weights[:j]`` sums to t.

    Args:
        weights: positive item sizes.
        limit: sums above it are dropped.

    Returns:
        ``len(weights) + 1`` bitsets as Python ints; row 0 is ``1`` (the empty sum).

    Example:
        >>> bin(reachable_sums([5, 4, 3], 8)[-1])
        '0b110111001'
    """
    mask = (1 << (limit + 1)) - 1
    rows = [1]
    reach = 1
    for w in weights:
        reach = (reach | (reach << w)) & mask
        rows.append(reach)
    return rows


def best_subset(weights: list[int], limit: int) -> tuple[int, list[int]]:
    """Return the largest subset sum ``<= limit`` and the positions of one subset reaching it.

    Among subsets with the best sum, the reconstruction prefers earlier items: pass the weights
    largest first to keep large items together.

    Args:
        weights: positive item sizes.
        limit: the limit, ``>= 0``.

    Returns:
        ``(best_sum, positions)`` with positions in decreasing order.

    Example:
        >>> best_subset([5, 4, 3], 8)
        (8, [2, 0])
    """
    rows = reachable_sums(weights, limit)
    best = rows[-1].bit_length() - 1
    return best, subset_reaching(rows, weights, best)


def subset_reaching(rows: list[int], weights: list[int], target: int) -> list[int]:
    """Walk the DP rows back from ``target`` (which must be reachable) to the items that make it.

    Args:
        rows: the output of `reachable_sums` for ``weights``.
        weights: the same weights.
        target: a sum whose bit is set in ``rows[-1]``.

    Returns:
        Positions of the chosen items, in decreasing order.

    Example:
        >>> w = [5, 4, 3]
        >>> subset_reaching(reachable_sums(w, 8), w, 7)
        [2, 1]
    """
    chosen = []
    t = target
    for j in range(len(weights), 0, -1):
        if not (rows[j - 1] >> t) & 1:
            chosen.append(j - 1)
            t -= weights[j - 1]
    return chosen


def split_in_two(weights: list[int], limit: int) -> list[int] | None:
    """Split items into two bins of ``limit`` if possible; return the first bin's positions.

    Two bins suffice exactly when some subset sums to a value in ``[total - limit, limit]``;
    the fullest first bin is taken.

    Args:
        weights: positive item sizes.
        limit: bin limit.

    Returns:
        Positions of the items of the first bin (the rest form the second), or None when the items
        need more than two bins.

    Example:
        >>> split_in_two([5, 4, 3, 3], 8)  # 5 + 3 | 4 + 3
        [2, 0]
        >>> split_in_two([5, 5, 5], 8) is None
        True
    """
    total = sum(weights)
    if total > 2 * limit:
        return None
    rows = reachable_sums(weights, limit)
    best = rows[-1].bit_length() - 1
    if best < total - limit:
        return None
    return subset_reaching(rows, weights, best)
