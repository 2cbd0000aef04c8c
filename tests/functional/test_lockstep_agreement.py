"""`megapack.lockstep_steps`' agreement across ranks, and its usage errors, on the gloo pool (issue 40).

Each check is a clear error on every rank, the same message everywhere, naming both ranks and both
values: datasets that disagree across DP ranks (rows per micro-batch, seed), a dataset whose loss
fields count other steps than the schedule's, ranks that state different schedule counts, and
(with megatron-core's parallel_state) a pipeline stage reading another DP rank's shard. A TP rank
other than the source that passes an iterator gets one warning and its batches are right. A
schedule that takes fewer or more items a step than stated is an error on every rank, and every
rank runs the same collectives of the same sizes. No megatron model is built here (fast): the
schedules themselves are in test_schedule_lockstep.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megapack
from megapack.data import Document, PackedDataset
from megapack.harness.grid import grid_topology

pytestmark = pytest.mark.distributed

TIMEOUT = 10.0


def documents(n: int) -> list[Document]:
    rng = np.random.default_rng(n)
    return [Document(tokens=rng.integers(1, 99, 8), loss_mask=np.ones(8, np.float32)) for _ in range(n)]  # fmt: skip


@contextlib.contextmanager
def logged() -> Iterator[list[str]]:
    """The messages megapack logs on this rank at WARNING and above (its "megapack" logger)."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("megapack").addHandler(handler)
    try:
        yield messages
    finally:
        logging.getLogger("megapack").removeHandler(handler)


def outcome(fn: Any) -> tuple[str, str, list[str]]:
    """(exception type or "ok", message or value, lockstep warnings) of ``fn()`` on this rank."""
    with logged() as caught:
        try:
            kind, text = "ok", repr(fn())
        except Exception as exc:
            kind, text = type(exc).__name__, str(exc)
    return kind, text, [m for m in caught if "lockstep_steps" in m and "stopped at step" not in m]


def ident(batch: dict[str, Any]) -> int:
    """A batch's second token, on any stage: the first stage's tokens[1], the last's labels[0]."""
    return int(batch["tokens"][0, 1] if batch["tokens"] is not None else batch["labels"][0, 0])


def run_steps(data: Iterator[Any] | None, topo: Any, micro_batches: int, takes: int) -> list[int]:
    """A schedule stand-in: each step takes ``takes`` batches; the `ident` of each."""
    firsts = []
    for step in megapack.lockstep_steps(data, micro_batches=micro_batches, topology=topo,
                                        timeout=TIMEOUT):  # fmt: skip
        for _ in range(takes):
            batch = megapack.get_batch_on_this_tp_rank(step, topology=topo, timeout=TIMEOUT)
            firsts.append(ident(batch))
    return firsts


# ------------------------------------------------------------------ settings that must agree


def run_disagreement(kind: str) -> Any:
    """Two ranks, tp 1 (each its own TP source), one DP shard each, one setting off on rank 1."""
    topo = megapack.Topology.from_groups(None)  # tp 1: this rank alone, its own source
    rank = dist.get_rank()
    settings: dict[str, Any] = {"dp_rank": rank, "dp_size": 2, "micro_batches": 2}
    schedule = 2
    if rank == 1:
        settings.update({"rows": {"rows_per_micro_batch": 2}, "seed": {"seed": 7},
                         "loss": {"loss_fields": True}, "schedule": {}}[kind])  # fmt: skip
        schedule = 3 if kind == "schedule" else 2
    if kind == "loss":
        settings.update({"loss_fields": True, "micro_batches": 3})
    ds = PackedDataset(documents(8), 8, **settings)
    return outcome(lambda: run_steps(ds.iterate(), topo, schedule, schedule))


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("rows", "the datasets disagree on rows_per_micro_batch: rank 0 has 1, rank 1 has 2"),
        ("seed", "the DP shards read different datasets, seed: rank 0 has 0, rank 1 has 7"),
        ("loss", "rank 0's dataset is built for micro_batches=3 a step but the schedule runs "
                 "micro_batches=2, and its loss fields count the dataset's steps"),
        ("schedule", "ranks disagree on the schedule's micro-batches a step, micro_batches: "
                     "rank 0 has 2, rank 1 has 3"),
    ],
    ids=["rows", "seed", "loss", "schedule"],
)  # fmt: skip
def test_agree_disagreeing_ranks_raise_the_same_error_everywhere(
    dist_pool: Any, kind: str, message: str
) -> None:
    results = dist_pool.run(run_disagreement, 2, kind, timeout=60)
    assert [r[0] for r in results] == ["ValueError", "ValueError"], results
    assert results[0][1] == results[1][1], "every rank must give the same error"
    assert results[0][1].startswith("lockstep_steps: " + message), results[0][1]


def run_pipeline_shards(mistake: bool) -> Any:
    """tp 1 x pp 2 x dp 2 under megatron-core's parallel_state (no model): ranks 0, 1 are stage 0
    of DP ranks 0, 1, ranks 2, 3 stage 1; with ``mistake`` rank 3 reads DP shard 0."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 2)
    topo = megapack.Topology.from_parallel_state()
    dp_rank = ps.get_data_parallel_rank()
    shard = 0 if mistake and dist.get_rank() == 3 else dp_rank
    ds = PackedDataset(documents(8), 8, dp_rank=shard, dp_size=2, micro_batches=2)
    return outcome(lambda: run_steps(ds.iterate(), topo, 2, 2))


def test_agree_pipeline_stages_read_their_own_dp_shard(dist_pool: Any) -> None:
    results = dist_pool.run(run_pipeline_shards, 4, True, timeout=90)
    assert {r[0] for r in results} == {"ValueError"} and len({r[1] for r in results}) == 1, results
    assert ("rank 3's dataset is DP shard 0 of 2 but megatron-core's parallel_state puts rank 3 at "
            "DP rank 1 of 2") in results[0][1]  # fmt: skip
    assert ("the pipeline stages and CP ranks of DP rank 1 read different data, dp_rank: rank 1 "
            "has 1, rank 3 has 0") in results[0][1]  # fmt: skip
    good = dist_pool.run(run_pipeline_shards, 4, False, timeout=90)
    # 8 rows over 2 DP ranks, 2 a step: 2 steps; both stages of a DP rank see the same batches
    assert [r[0] for r in good] == ["ok"] * 4 and good[0][1] == good[2][1] != good[1][1], good


def run_same_data_everywhere() -> Any:
    """tp 1 x dp 2 under parallel_state: both DP ranks read the whole dataset (dp_size=1)."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    ds = PackedDataset(documents(4), 8, micro_batches=2)
    return outcome(lambda: run_steps(ds.iterate(), megapack.Topology.from_parallel_state(), 2, 2))


def test_agree_warns_when_every_dp_rank_trains_the_same_data(dist_pool: Any) -> None:
    for kind, _, warned in dist_pool.run(run_same_data_everywhere, 2, timeout=90):
        assert kind == "ok" and len(warned) == 1, warned
        assert "ranks [0, 1] are on different DP ranks but read the same dataset" in warned[0]


# ------------------------------------------------------------------ TP peers, the schedule's count


def run_peer_iterator(through: str) -> Any:
    """tp 2: the peer passes an iterator too (as scripts that build data on every TP rank do)."""
    topo = grid_topology(2, 1)
    rank = dist.get_rank()
    batches = [megapack.PackedBatch.from_documents([[10 * i + 1, 10 * i + 2, 3]], seq_len=4) for i in range(4)]  # fmt: skip
    mine = iter(batches if rank == 0 else list(reversed(batches)))
    if through == "get_batch":
        return outcome(lambda: [int(ident(megapack.get_batch_on_this_tp_rank(mine, topology=topo))) for _ in range(3)])  # fmt: skip
    return outcome(lambda: run_steps(mine, topo, 2, 2))


@pytest.mark.parametrize("through", ["get_batch", "lockstep_steps"])
def test_agree_peer_iterator_is_ignored_with_one_warning(dist_pool: Any, through: str) -> None:
    results = dist_pool.run(run_peer_iterator, 2, through, timeout=60)
    want = "[2, 12, 22]" if through == "get_batch" else "[2, 12, 22, 32]"
    assert [r[:2] for r in results] == [("ok", want)] * 2, results  # the source's batches
    if through == "lockstep_steps":
        assert len(results[1][2]) == 1 and results[0][2] == [], results
        assert results[1][2][0].startswith("megapack: lockstep_steps: rank 1 is TP rank 1, not its group's TP source (global rank 0): its data_iterator is ignored")  # fmt: skip


def run_peer_warning_count() -> int:
    """How many warnings get_batch gives a peer that passes an iterator on every call."""
    topo = grid_topology(2, 1)
    data = iter([megapack.PackedBatch.from_documents([[1, 2]], seq_len=4)] * 3)
    with logged() as caught:
        for _ in range(3):
            megapack.get_batch_on_this_tp_rank(data, topology=topo)
    return sum("its data_iterator is ignored" in m for m in caught)


def test_agree_peer_iterator_warning_comes_once_per_tp_group(dist_pool: Any) -> None:
    assert dist_pool.run(run_peer_warning_count, 2, timeout=60) == [0, 1]


def run_schedule_count(takes: int) -> Any:
    """tp 2: the stand-in schedule takes ``takes`` batches of steps stated as 2."""
    topo = grid_topology(2, 1)
    data = iter([megapack.PackedBatch.from_documents([[i + 1, 2]], seq_len=4) for i in range(6)])
    return outcome(lambda: run_steps(data if topo.is_source else None, topo, 2, takes))


def test_lockstep_steps_schedule_taking_another_count_fails_on_every_rank(dist_pool: Any) -> None:
    fewer = dist_pool.run(run_schedule_count, 2, 1, timeout=60)
    assert (
        fewer[0][0] == "ValueError"
        and "took 1 of step 0's 2 micro-batches on rank 0" in fewer[0][1]
    )
    assert fewer[1][0] == "RemoteDataError" and fewer[1][1].startswith(
        "TP source rank 0 failed at step 1: ValueError: lockstep_steps(micro_batches=2): the schedule took 1"
    )  # fmt: skip
    more = dist_pool.run(run_schedule_count, 2, 3, timeout=60)
    assert more[0][0] == "ValueError" and "asked for micro-batch 3 of step 0" in more[0][1]
    assert more[1][0] == "RemoteDataError" and "asked for micro-batch 3 of step 0" in more[1][1]


# ------------------------------------------------------------------ the collectives every rank runs


@contextlib.contextmanager
def recorded() -> Iterator[list[tuple[str, int, tuple[int, ...]]]]:
    """Every all_reduce / all_gather this rank starts: (name, bytes, the group's ranks)."""
    log: list[tuple[str, int, tuple[int, ...]]] = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def wrap(name: str) -> Any:
        def call(*args: Any, group: Any = None, **kwargs: Any) -> Any:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a]
            size = sum(t.numel() * t.element_size() for t in tensors)
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
            log.append((name, size, ranks))
            return originals[name](*args, group=group, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        for name in originals:
            stack.enter_context(mock.patch.object(dist, name, wrap(name)))
        yield log


def run_collectives(lengths: list[int]) -> Any:
    """tp 2 x pp 2 (links: no collective per batch), sources of ``lengths[pp_rank]`` batches."""
    topo = grid_topology(2, 2)
    data = iter([megapack.PackedBatch.from_documents([[i, i + 1]], seq_len=4) for i in range(lengths[topo.pp_rank])])  # fmt: skip
    with recorded() as log:
        result = outcome(lambda: run_steps(data if topo.is_source else None, topo, 2, 2))
    return result, [entry for entry in log if entry[2] in ((), (0, 1, 2, 3))]


def test_lockstep_steps_every_rank_runs_the_same_collectives(dist_pool: Any) -> None:
    results = dist_pool.run(run_collectives, 4, [7, 4], timeout=60)
    logs = [log for _, log in results]
    assert all(log == logs[0] for log in logs), logs
    # step 0 read, then the agreement (lengths, then bytes), then one 4-byte flag a step: 3 steps
    # (2 run, 1 stops); then the end's report (steps and tokens), one 3 x int64 all-gather
    assert [name for name, _, _ in logs[0]] == ["all_gather"] * 2 + ["all_reduce"] * 3 + ["all_gather"]  # fmt: skip
    assert [size for name, size, _ in logs[0] if name == "all_reduce"] == [4, 4, 4]
    assert logs[0][-1][1] == 24 * (4 + 1)  # [status, items left, tokens] in, 4 ranks' out
    for rank, ((kind, value, warned), _) in enumerate(results):
        assert (kind, value) == ("ok", "[1, 2, 3, 4]"), (rank, kind, value)  # 2 steps everywhere
        assert bool(warned) == (rank == 0), (rank, warned)  # stage 0's source still had step 2
