"""The tp x pp (x cp) grids megapack is tested on; `megapack.harness.grid.grid_topology` builds them.

Rank order follows Megatron's default (tensor-parallel fastest, then context-parallel, then
pipeline): rank = (pp_rank * cp + cp_rank) * tp + tp_rank (see `megapack.harness.grid`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CP_GRIDS", "GRIDS", "Grid"]


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

# Context-parallel grids: cp 2 with every tp x pp of at most 2 x 2, pp 3, and cp 4.
CP_GRIDS: tuple[Grid, ...] = (
    Grid(1, 1, 2),
    Grid(2, 1, 2),
    Grid(1, 2, 2),
    Grid(2, 2, 2),
    Grid(1, 1, 4),
    Grid(1, 3, 2),
)
