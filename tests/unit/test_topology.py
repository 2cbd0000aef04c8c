"""Topology: stage roles (including virtual pipeline chunks) and constructor checks."""

from __future__ import annotations

import pytest

from megapack import Topology
from megapack.core.fields import Stage


def topo(
    pp_rank: int, pp_size: int, vp_stage: int | None = None, vp_size: int | None = None
) -> Topology:
    return Topology(tp_group=None, tp_ranks=(0,), tp_rank=0, pp_rank=pp_rank, pp_size=pp_size,
                    vp_stage=vp_stage, vp_size=vp_size)  # fmt: skip


def test_stages_without_virtual_pipeline() -> None:
    assert topo(0, 1).stage is Stage.ONLY
    assert [topo(r, 4).stage for r in range(4)] == [
        Stage.FIRST,
        Stage.MIDDLE,
        Stage.MIDDLE,
        Stage.LAST,
    ]


def test_virtual_chunks_decide_first_and_last() -> None:
    # pp=2 with 2 virtual chunks: only chunk 0 on rank 0 embeds, only chunk 1 on rank 1 computes loss.
    assert topo(0, 2, 0, 2).stage is Stage.FIRST
    assert topo(0, 2, 1, 2).stage is Stage.MIDDLE
    assert topo(1, 2, 0, 2).stage is Stage.MIDDLE
    assert topo(1, 2, 1, 2).stage is Stage.LAST
    assert topo(0, 1, 0, 2).stage is Stage.FIRST and topo(0, 1, 1, 2).stage is Stage.LAST


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp_ranks": ()}, "tp_ranks is empty"),
        ({"tp_ranks": (0, 1), "tp_rank": 2}, r"tp_rank=2 is outside tp_ranks=\(0, 1\)"),
        ({"tp_ranks": (0, 1), "tp_rank": 0}, "tp_group is None but tp_ranks"),
        ({"pp_rank": 2, "pp_size": 2}, "pp_rank=2 is outside pp_size=2"),
        ({"vp_stage": 0}, "give both or neither"),
        ({"vp_stage": 2, "vp_size": 2}, "vp_stage=2 is outside vp_size=2"),
    ],
)
def test_invalid_topologies_are_rejected(kwargs: dict, match: str) -> None:
    base = {"tp_group": None, "tp_ranks": (0,), "tp_rank": 0}
    with pytest.raises(ValueError, match=match):
        Topology(**{**base, **kwargs})


def test_single_is_its_own_source() -> None:
    t = Topology.single()
    assert t.is_source and t.tp_size == 1 and t.src_rank == 0 and t.stage is Stage.ONLY


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cp_ranks": (0, 1), "cp_rank": 2}, r"cp_rank=2 is outside cp_ranks=\(0, 1\)"),
        ({"cp_ranks": (0, 1), "cp_rank": 0}, "cp_group is None but cp_ranks"),
        ({"cp_layout": "zigzag"}, "cp_layout='zigzag' is not one of"),
    ],
)
def test_invalid_cp_settings_are_rejected(kwargs: dict, match: str) -> None:
    base = {"tp_group": None, "tp_ranks": (0,), "tp_rank": 0}
    with pytest.raises(ValueError, match=match):
        Topology(**{**base, **kwargs})


def test_cp_size_defaults_to_one() -> None:
    t = Topology.single()
    assert t.cp_size == 1 and t.cp_rank == 0 and t.cp_group is None and t.cp_layout == "document"
