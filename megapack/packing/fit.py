"""The greedy bin-packing algorithms besides best fit: next fit, first fit, first-fit decreasing.

Each takes item sizes (1-D int64, every size in ``[1, seq_len]``) and returns the bin of every item,
bins numbered in the order they were opened. Worked example, sizes ``[3, 2, 4]`` at seq_len 5:

    next_fit / first_fit (input order): 3 and 2 share bin 0, 4 opens bin 1  -> [0, 0, 1]
    first_fit_decreasing (4, 3, 2):     4 opens bin 0, 3 opens bin 1, 2 joins bin 1 -> [1, 1, 0]

* ``next_fit`` keeps one open bin and opens a new one when the next item does not fit: streaming,
  O(n), no memory of earlier bins (83.7% efficient on OpenChat V1, see ``megapack/bench/data/README.md``).
* ``first_fit`` puts each item, in input order, into the lowest-numbered bin with room.
* ``first_fit_decreasing`` does the same after sorting by size, largest first (stable), and moves
  groups of equal items at once: the first bin with room takes ``free // size`` of them in a row.

"Lowest-numbered bin with room" is a max-segment-tree over bins, kept in a Python list: leaf ``b``
holds the free space of bin ``b``; leaves of bins not yet opened hold the full seq_len, so the
search opens the next new bin by itself. A query or update walks one root-to-leaf path, O(log n).

Measured here (2-core CPU) on 1,000,000 lognormal sizes (``lognormal(6, 1)`` clipped to [1, 4096],
seq_len 4,096), the function alone: next_fit 0.11 s (186,543 bins), first_fit_decreasing 0.7 s
(157,517), first_fit 1.5 s (157,898; one tree walk per item in Python). ``best_fit_decreasing``
(bfd.py) takes 0.11 s on the same input; the lower bound is 157,510.
"""

from __future__ import annotations

import numpy as np


def next_fit(sizes: np.ndarray, seq_len: int) -> np.ndarray:
    """Pack items in input order, opening a new bin whenever the current one cannot take the next.

    Args:
        sizes: 1-D int64 array, every size in ``[1, seq_len]``.
        seq_len: tokens a bin (row), positive.

    Returns:
        [n] int64 bin ids, non-decreasing.

    Example:
        >>> next_fit(np.array([3, 2, 4]), 5).tolist()
        [0, 0, 1]
    """
    bin_of = np.empty(len(sizes), dtype=np.int64)
    current, free = -1, 0
    for i, s in enumerate(sizes.tolist()):
        if s > free:
            current += 1
            free = seq_len
        free -= s
        bin_of[i] = current
    return bin_of


class _FirstFitTree:
    """Max segment tree over the free space of bins; unopened bins hold ``seq_len``."""

    __slots__ = ("leaves", "tree")

    def __init__(self, num_leaves: int, seq_len: int) -> None:
        size = 1
        while size < max(num_leaves, 1):
            size *= 2
        self.leaves = size
        self.tree = [seq_len] * (2 * size)

    def first_with(self, need: int) -> int:
        """Return the lowest bin with at least ``need`` free (the root always qualifies)."""
        tree, node, leaves = self.tree, 1, self.leaves
        while node < leaves:
            node *= 2
            if tree[node] < need:
                node += 1
        return node - leaves

    def free(self, b: int) -> int:
        """Free space of bin ``b``."""
        return self.tree[self.leaves + b]

    def use(self, b: int, amount: int) -> None:
        """Take ``amount`` tokens of bin ``b``'s free space."""
        tree = self.tree
        node = self.leaves + b
        tree[node] -= amount
        node //= 2
        while node:
            best = max(tree[2 * node], tree[2 * node + 1])
            if tree[node] == best:
                break
            tree[node] = best
            node //= 2


def first_fit(sizes: np.ndarray, seq_len: int) -> np.ndarray:
    """Pack items in input order, each into the lowest-numbered bin with room.

    Args:
        sizes: 1-D int64 array, every size in ``[1, seq_len]``.
        seq_len: tokens a bin (row), positive.

    Returns:
        [n] int64 bin ids in opening order.

    Example:
        >>> first_fit(np.array([4, 3, 1, 2]), 5).tolist()
        [0, 1, 0, 1]
    """
    tree = _FirstFitTree(len(sizes), seq_len)
    out = [0] * len(sizes)
    for i, s in enumerate(sizes.tolist()):
        b = tree.first_with(s)
        tree.use(b, s)
        out[i] = b
    return np.asarray(out, dtype=np.int64).reshape(len(sizes))


def first_fit_decreasing(sizes: np.ndarray, seq_len: int) -> np.ndarray:
    """Sort items by size, largest first (stable), then pack them with first fit.

    Args:
        sizes: 1-D int64 array, every size in ``[1, seq_len]``.
        seq_len: tokens a bin (row), positive.

    Returns:
        [n] int64 bin ids in opening order (bin 0 holds the largest item).

    Example:
        >>> first_fit_decreasing(np.array([3, 2, 4]), 5).tolist()
        [1, 1, 0]
    """
    n = len(sizes)
    bin_of = np.empty(n, dtype=np.int64)
    if n == 0:
        return bin_of
    order = np.argsort(-sizes, kind="stable")
    sorted_sizes = sizes[order]
    starts = np.flatnonzero(np.diff(sorted_sizes, prepend=sorted_sizes[0] + 1))
    counts = np.diff(np.append(starts, n))
    tree = _FirstFitTree(n, seq_len)
    targets = np.empty(n, dtype=np.int64)  # bin of the k-th item in sorted order
    for pos, left, s in zip(
        starts.tolist(), counts.tolist(), sorted_sizes[starts].tolist(), strict=True
    ):
        while left:
            b = tree.first_with(s)
            q = min(tree.free(b) // s, left)
            tree.use(b, q * s)
            targets[pos : pos + q] = b
            pos += q
            left -= q
    bin_of[order] = targets
    return bin_of
