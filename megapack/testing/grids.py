"""The tp x pp (x cp) grids megapack is tested on, and topologies for them built from plain process groups.

Rank order follows Megatron's default (tensor-parallel fastest, then context-parallel, then
pipeline): rank = (pp_rank * cp + cp_rank) * tp + tp_rank. On tp=2 x pp=2, global ranks (0, 1)
form stage 0's TP group and (2, 3) stage 1's; on tp=2 x cp=2 x pp=2, ranks (0, 1) and (2, 3) are
stage 0's two CP ranks' TP groups, and (0, 2), (1, 3) its CP groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megapack.cp import CpLayout
from megapack.topology import Topology


@dataclass(frozen=True, slots=True)
class Grid:
    """A tensor x pipeline (x context) parallel layout with a readable id (``tp2-pp4``, ``tp2-pp1-cp2``)."""

    tp: int
    pp: int
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def id(self) -> str:
        return f"tp{self.tp}-pp{self.pp}" + (f"-cp{self.cp}" if self.cp > 1 else "")


# (tp, pp) in {1, 2, 4} x {1, 2, 3, 4} with tp * pp <= 8.
GRIDS: tuple[Grid, ...] = tuple(
    Grid(tp, pp) for tp in (1, 2, 4) for pp in (1, 2, 3, 4) if tp * pp <= 8
)

# Context-parallel grids (issue 10): cp 2 with every small tp x pp, and cp 4.
CP_GRIDS: tuple[Grid, ...] = (
    Grid(1, 1, 2),
    Grid(2, 1, 2),
    Grid(1, 2, 2),
    Grid(2, 2, 2),
    Grid(1, 1, 4),
    Grid(1, 3, 2),
)


def grid_topology(tp: int, pp: int, cp: int = 1, cp_layout: CpLayout = "document") -> Topology:
    """This rank's Topology on a tp x pp x cp grid spanning the whole default process group.

    Every rank of the default group must call it (``dist.new_group`` is collective), in the same
    order. Raises ValueError when the world size is not tp * pp * cp.
    """
    world = dist.get_world_size()
    if world != tp * pp * cp:
        raise ValueError(
            f"grid tp={tp} x pp={pp} x cp={cp} needs {tp * pp * cp} ranks, the process group has {world}"
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
