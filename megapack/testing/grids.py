"""The tp x pp (x cp) grids megapack is tested on; `grid_topology` (from `megapack.grid`) builds them.

Rank order follows Megatron's default (tensor-parallel fastest, then context-parallel, then
pipeline): rank = (pp_rank * cp + cp_rank) * tp + tp_rank. On tp=2 x pp=2, global ranks (0, 1)
form stage 0's TP group and (2, 3) stage 1's; on tp=2 x cp=2 x pp=2, ranks (0, 1) and (2, 3) are
stage 0's two CP ranks' TP groups, and (0, 2), (1, 3) its CP groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapack.grid import grid_topology


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

__all__ = ["CP_GRIDS", "GRIDS", "Grid", "grid_topology"]
