"""Packing documents into fixed-size bins (rows of ``capacity`` tokens): plans, bounds, streaming.

    plan(lengths, capacity, algorithm="bfd" | "ffd" | "first_fit" | "next_fit" | "best",
         long_docs="split" | "truncate" | "drop" | "error", seed=0, time_limit_s=10.0) -> PackPlan
    StreamingPacker(capacity, buffer_size=1000, ...).pack(documents) -> iterator of bins

Example, lengths ``[3, 2, 4]`` at capacity 5:

    >>> from megapack.packing import plan
    >>> p = plan([3, 2, 4], 5)
    >>> p.bins, p.num_bins, p.efficiency, p.lower_bound
    ([[(2, 0, 4)], [(0, 0, 3), (1, 0, 2)]], 2, 0.9, 2)

Files: plan.py (entry point; ``max_documents`` caps a row's documents), pack_plan.py (the
result), items.py (long documents into packable pieces), bfd.py and fit.py (greedy algorithms),
search.py and partial.py (the "best" local search), subset_sum.py, bounds.py (L1, L2),
streaming.py, cost.py (row cost a * tokens + b * sum(len^2)), balance.py, layers.py and
dealing.py (compute-balanced dealing to data-parallel ranks), compare.py (token vs compute plan),
align.py (`align_by_kind`: the same kind of micro-batch on every rank at each step), names.py
(every choice list: algorithms, long-document policies, balance modes).
"""

from megapack.packing.bounds import l1_bound, l2_bound, lower_bound
from megapack.packing.cost import CostModel
from megapack.packing.names import ALGORITHMS, LONG_DOC_POLICIES
from megapack.packing.pack_plan import PackPlan, Slice
from megapack.packing.plan import plan
from megapack.packing.streaming import Piece, StreamingPacker

__all__ = [
    "ALGORITHMS",
    "LONG_DOC_POLICIES",
    "CostModel",
    "PackPlan",
    "Piece",
    "Slice",
    "StreamingPacker",
    "l1_bound",
    "l2_bound",
    "lower_bound",
    "plan",
]
