"""Packing documents into rows of ``seq_len`` tokens: options, plans, bounds, streaming.

    PackOptions(seq_len=..., algorithm=..., long_docs=..., ...)   what packing decides
    LoadOptions(rows_per_micro_batch=..., dp_rank=..., ...)         what loading decides
    plan(lengths, packing, loading=None) -> PackPlan                 (packing: PackOptions or seq_len)
    StreamingPacker(packing, loading=None, buffer_size=1000).pack(documents) -> iterator of bins

Example, lengths ``[3, 2, 4]`` at seq_len 5:

    >>> from megapack.packing import plan
    >>> p = plan([3, 2, 4], 5)
    >>> p.bins, p.num_bins, p.efficiency, p.lower_bound
    ([[(2, 0, 4)], [(0, 0, 3), (1, 0, 2)]], 2, 0.9, 2)

Modules: options.py (`PackOptions`, `LoadOptions`), planner.py (`plan`; ``max_documents`` caps a
row's pieces), pack_plan.py (`PackPlan`, the result), pieces.py (`Piece`, `Pieces`: documents into
packable pieces under the long-document policy), bfd.py and fit.py (greedy algorithms), search.py
and partial.py (the "best" local search), subset_sum.py, bounds.py (L1, L2), streaming.py
(`StreamingPacker`) and stream_state.py (its checked state), cost.py (row cost a * tokens + b *
sum(len^2)), balance.py, layers.py and dealing.py (compute-balanced dealing to data-parallel
ranks), compare.py (token vs compute plan), align.py (`align_by_kind`: the same kind of
micro-batch on every rank at each step), names.py (every choice list: algorithms, long-document
policies, balance modes).
"""

from typing import TYPE_CHECKING, Any

from megapack.packing.bounds import lower_bound
from megapack.packing.cost import CostModel
from megapack.packing.names import ALGORITHMS, LONG_DOC_POLICIES
from megapack.packing.options import LoadOptions, PackOptions
from megapack.packing.pack_plan import PackPlan
from megapack.packing.pieces import Piece
from megapack.packing.planner import plan
from megapack.packing.streaming import StreamingPacker

if TYPE_CHECKING:
    from megapack.packing.align import align_by_kind


def __getattr__(name: str) -> Any:
    """`align_by_kind` on first use: it imports torch, which nothing else here does (``megapack
    pack`` and ``--help`` never import it)."""
    if name == "align_by_kind":
        from megapack.packing.align import align_by_kind

        return align_by_kind
    raise AttributeError(f"module 'megapack.packing' has no attribute {name!r}")


__all__ = [
    "ALGORITHMS",
    "LONG_DOC_POLICIES",
    "CostModel",
    "LoadOptions",
    "PackOptions",
    "PackPlan",
    "Piece",
    "StreamingPacker",
    "align_by_kind",
    "lower_bound",
    "plan",
]
