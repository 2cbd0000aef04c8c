"""Process groups and this rank's `Topology` for a tp x pp (x cp) grid over the whole default group.

For benchmarks, tests and scripts that run without megatron-core's ``parallel_state``. Rank order
follows Megatron's default (tensor-parallel fastest, then context-parallel, then pipeline):

    rank = (pp_rank * cp + cp_rank) * tp + tp_rank

Example: tp=2 x pp=2 on 4 ranks: ranks (0, 1) form stage 0's TP group and (2, 3) stage 1's; on
tp=2 x cp=2 x pp=2, ranks (0, 1) and (2, 3) are stage 0's two CP ranks' TP groups and (0, 2),
(1, 3) its CP groups.
"""

from __future__ import annotations

import torch.distributed as dist

from megapack.core.checks import check_int
from megapack.core.cp_share import CpLayout
from megapack.distributed.topology import Topology


def grid_topology(tp: int, pp: int, cp: int = 1, cp_layout: CpLayout = "document") -> Topology:
    """This rank's Topology on a tp x pp x cp grid spanning the whole default process group.

    Every rank of the default group must call it, in the same order (``dist.new_group`` is
    collective over the default group).

    Args:
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        cp: context-parallel size.
        cp_layout: "document" or "row" (`megapack.core.cp_share`), used when ``cp > 1``.

    Raises:
        TypeError: a size is not an int.
        ValueError: a size is below 1, or the world size is not tp * pp * cp.
    """
    tp, pp, cp = (
        check_int(f"grid_topology: {n}", v, minimum=1)
        for n, v in (("tp", tp), ("pp", pp), ("cp", cp))
    )
    world = dist.get_world_size()
    if world != tp * pp * cp:
        raise ValueError(
            f"grid tp={tp} x pp={pp} x cp={cp} needs {tp * pp * cp} ranks, the process group has "
            f"{world}: launch {tp * pp * cp} ranks or change the sizes"
        )
    rank = dist.get_rank()
    tp_mine = cp_mine = None
    for stage in range(pp):
        for c in range(cp):
            ranks = [(stage * cp + c) * tp + t for t in range(tp)]
            group = dist.new_group(ranks) if tp > 1 else None
            if rank in ranks:
                tp_mine = group
    if cp > 1:
        for stage in range(pp):
            for t in range(tp):
                ranks = [(stage * cp + c) * tp + t for c in range(cp)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    cp_mine = group
    return Topology.from_groups(
        tp_mine, pp_rank=rank // (tp * cp), pp_size=pp, cp_group=cp_mine, cp_layout=cp_layout
    )
