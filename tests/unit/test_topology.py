"""Topology: stage roles (including virtual pipeline chunks), constructor checks, and a topology
from megatron-core's ProcessGroupCollection (or an object like it) and `resolve_topology`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from megapack import PackedBatch, Topology, get_batch_on_this_tp_rank
from megapack.core.fields import Stage
from megapack.distributed.topology import resolve_topology


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


# -- from a ProcessGroupCollection ------------------------------------------------------------------


def test_from_pg_collection_reads_tp_pp_cp(world: Any) -> None:
    t = Topology.from_pg_collection(SimpleNamespace(tp=world, pp=world, cp=world), mtp=True)
    assert (t.tp_ranks, t.tp_rank, t.tp_group, t.pp_rank, t.pp_size) == ((0,), 0, None, 0, 1)
    assert t.cp_size == 1 and t.cp_group is None and t.stage is Stage.ONLY and t.mtp
    assert Topology.from_pg_collection(SimpleNamespace(tp=world)) == Topology.from_groups(world)
    chunk = Topology.from_pg_collection(SimpleNamespace(tp=world), vp_stage=1, vp_size=2)
    assert chunk.stage is Stage.LAST and not chunk.is_first_stage


def test_from_pg_collection_takes_megatron_cores_own_collection(world: Any) -> None:
    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection

    ps.initialize_model_parallel(1, 1)
    try:
        pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "cp"])
        assert Topology.from_pg_collection(pg) == Topology.from_parallel_state()
        partial = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])  # no pp, cp
        assert Topology.from_pg_collection(partial) == Topology.from_parallel_state()
    finally:
        ps.destroy_model_parallel()


def test_from_pg_collection_takes_a_multi_module_collections_language_model(world: Any) -> None:
    language_model = SimpleNamespace(tp=world, pp=world, cp=None)
    multi = SimpleNamespace(language_model_module_name="llm",
                            get_language_model_collection=lambda: language_model)  # fmt: skip
    assert Topology.from_pg_collection(multi) == Topology.from_pg_collection(language_model)


@pytest.mark.parametrize(
    ("collection", "error", "message"),
    [
        (SimpleNamespace(pp=None), TypeError,
         "pg_collection (SimpleNamespace) has no tp group: pass megatron-core's "
         "ProcessGroupCollection (e.g. ProcessGroupCollection.use_mpu_process_groups()) or an "
         "object whose .tp is this rank's tensor-parallel group"),
        (SimpleNamespace(tp=[0, 1]), TypeError,
         "pg_collection.tp must be a torch.distributed.ProcessGroup or None, got list"),
        (SimpleNamespace(tp="world", cp=None), TypeError, "pg_collection.tp must be"),
    ],
)  # fmt: skip
def test_from_pg_collection_names_what_is_wrong(
    world: Any, collection: Any, error: type, message: str
) -> None:
    with pytest.raises(error) as info:
        Topology.from_pg_collection(collection)
    assert str(info.value) == message or str(info.value).startswith(message)


def test_from_pg_collection_needs_both_vp_numbers(world: Any) -> None:
    with pytest.raises(ValueError) as info:
        Topology.from_pg_collection(SimpleNamespace(tp=world), vp_stage=0)
    assert str(info.value) == (
        "Topology.from_pg_collection: vp_stage=0 and vp_size=None: give both (the chunk this call "
        "serves and the number of chunks) or neither"
    )


def test_resolve_topology(world: Any) -> None:
    pg = SimpleNamespace(tp=world)
    single = Topology.single()
    assert resolve_topology(None, None) is None
    assert resolve_topology(single, None) is single
    assert resolve_topology(None, pg) == Topology.from_pg_collection(pg)
    assert resolve_topology(None, pg, vp_stage=0, vp_size=2).vp_size == 2  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="got both topology= and pg_collection=: pass one"):
        resolve_topology(single, pg)
    with pytest.raises(ValueError, match="vp_stage=0, vp_size=2 go with pg_collection="):
        resolve_topology(single, None, vp_stage=0, vp_size=2)
    with pytest.raises(TypeError, match=r"topology must be a megapack\.Topology or None, got dict"):
        resolve_topology({}, None)  # type: ignore[arg-type]


def test_get_batch_takes_a_pg_collection(world: Any) -> None:
    batch = PackedBatch.from_documents([[5, 6, 7], [8, 9]], seq_len=8)
    pg = SimpleNamespace(tp=world, pp=world, cp=world)
    out = get_batch_on_this_tp_rank(iter([batch]), pg_collection=pg)
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 8]
    with pytest.raises(ValueError, match="got both topology= and pg_collection="):
        get_batch_on_this_tp_rank(iter([batch]), pg_collection=pg, topology=Topology.single())


def test_lockstep_steps_and_prefetch_take_a_pg_collection(world: Any) -> None:
    import megapack

    batch = PackedBatch.from_documents([[5, 6, 7], [8, 9]], seq_len=8)
    pg = SimpleNamespace(tp=world, pp=world, cp=world)
    steps = megapack.lockstep_steps(iter([batch, batch]), micro_batches=2, pg_collection=pg)
    assert steps._topo == Topology.from_pg_collection(pg)
    taken = [[next(step), next(step)] for step in steps]  # the schedule takes both
    assert len(taken) == 1
    with pytest.raises(ValueError, match="got both topology= and pg_collection="):
        megapack.lockstep_steps(None, micro_batches=1, pg_collection=pg, topology=Topology.single())
    # one iterator per virtual chunk: the collection's topology is chunk 0's of that many
    chunks = megapack.lockstep_steps([None, None], micro_batches=1, pg_collection=pg)
    assert (chunks._topo.vp_stage, chunks._topo.vp_size) == (0, 2)
    with megapack.prefetch(iter([batch]), pg_collection=pg) as batches:
        assert next(batches)["cu_seqlens"].tolist() == [0, 3, 5, 8]
    with pytest.raises(ValueError, match="got both topology= and pg_collection="):
        megapack.prefetch(None, pg_collection=pg, topology=Topology.single())
