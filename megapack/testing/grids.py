"""The tp x pp grids megapack is tested on, and topologies for them built from plain process groups.

Rank order follows Megatron's default (tensor-parallel fastest): on tp=2 x pp=2,
global ranks (0, 1) form stage 0's TP group and (2, 3) stage 1's; rank = pp_rank * tp + tp_rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megapack.topology import Topology


@dataclass(frozen=True, slots=True)
class Grid:
    """A tensor x pipeline parallel layout with a readable id (``tp2-pp4``)."""

    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def id(self) -> str:
        return f"tp{self.tp}-pp{self.pp}"


# (tp, pp) in {1, 2, 4} x {1, 2, 3, 4} with tp * pp <= 8.
GRIDS: tuple[Grid, ...] = tuple(
    Grid(tp, pp) for tp in (1, 2, 4) for pp in (1, 2, 3, 4) if tp * pp <= 8
)


def grid_topology(tp: int, pp: int) -> Topology:
    """This rank's Topology on a tp x pp grid spanning the whole default process group.

    Every rank of the default group must call it (``dist.new_group`` is collective), in the same
    order. Raises ValueError when the world size is not tp * pp.
    """
    world = dist.get_world_size()
    if world != tp * pp:
        raise ValueError(
            f"grid tp={tp} x pp={pp} needs {tp * pp} ranks, the process group has {world}"
        )
    rank = dist.get_rank()
    mine = None
    for stage in range(pp):
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks) if tp > 1 else None
        if rank in ranks:
            mine = group
    return Topology.from_groups(mine, pp_rank=rank // tp, pp_size=pp)
