"""Tests of megapack.harness.grid.grid_topology: rank layout of tp x pp x cp grids and its argument checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from megapack.harness.grid import grid_topology


def _layout(tp: int, pp: int, cp: int) -> dict[str, Any]:
    topo = grid_topology(tp, pp, cp)
    return {
        "rank": dist.get_rank(),
        "tp_ranks": topo.tp_ranks,
        "tp_rank": topo.tp_rank,
        "pp_rank": topo.pp_rank,
        "cp_ranks": topo.cp_ranks,
        "cp_rank": topo.cp_rank,
        "stage": topo.stage.value,
    }


def _bad(tp: Any, pp: Any, cp: Any) -> str:
    try:
        grid_topology(tp, pp, cp)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.distributed
@pytest.mark.parametrize(("tp", "pp", "cp"), [(2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)])
def test_rank_layout_is_megatron_order(dist_pool: Any, tp: int, pp: int, cp: int) -> None:
    results = dist_pool.run(_layout, tp * pp * cp, tp, pp, cp, timeout=60)
    for r in results:
        rank = r["rank"]
        tp_rank, cp_rank, pp_rank = rank % tp, rank // tp % cp, rank // (tp * cp)
        base = (pp_rank * cp + cp_rank) * tp
        assert r["tp_ranks"] == tuple(range(base, base + tp)), r
        assert (r["tp_rank"], r["pp_rank"], r["cp_rank"]) == (tp_rank, pp_rank, cp_rank), r
        expected_cp = tuple((pp_rank * cp + c) * tp + tp_rank for c in range(cp)) if cp > 1 else ()
        assert r["cp_ranks"] == expected_cp, r
    stages = {r["stage"] for r in results}
    assert stages == ({"only"} if pp == 1 else {"first", "last"})


@pytest.mark.distributed
def test_bad_sizes_name_the_argument(dist_pool: Any) -> None:
    assert "needs 4 ranks, the process group has 2" in dist_pool.run(_bad, 2, 2, 2, 1)[0]
    assert (
        "ValueError: grid_topology: tp must be an int >= 1, got 0"
        in dist_pool.run(_bad, 1, 0, 1, 1)[0]
    )
    assert (
        "TypeError: grid_topology: cp must be an int >= 1, got bool True"
        in dist_pool.run(_bad, 1, 1, 1, True)[0]
    )
