"""The transports of get_batch_on_this_tp_rank that carry the payload on the TP group, on gloo.

NCCL TP groups take this path: the header on the host (a gloo control group, or the local link),
the payload broadcast on the TP group. Here it runs on gloo with a second gloo group registered as
the TP group's control group, as an NCCL group gets one. Every rank records every collective it
runs (op, group, bytes, device): TP peers must run the same sequence with the same sizes (gloo
would accept a shorter sender; NCCL would not), and the fields must equal `test_tp_pp_grid`'s
expectations. The error a peer receives must be exactly the source's, with nothing in front.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megapack import get_batch_on_this_tp_rank, lockstep
from megapack.core.fields import schema_of
from megapack.delivery.transport import use_transport
from megapack.delivery.wire import header_bytes
from megapack.distributed.groups import control_group, set_control_group
from megapack.harness.grid import grid_topology
from megapack.testing.grids import Grid
from tests.functional.test_tp_pp_grid import FailingIterator, _summary, check_rank, stream

pytestmark = pytest.mark.distributed
HEADER = header_bytes(schema_of())


def _record(groups: dict[str, Any]) -> list[list[tuple[str, str, int, str]]]:
    """Wraps dist.broadcast / all_reduce / all_gather; appends (op, group name, bytes, device) per call."""
    log: list[list[tuple[str, str, int, str]]] = [[]]
    for name in ("broadcast", "all_reduce", "all_gather"):
        original = getattr(dist, name)

        def recording(*args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            tensor = args[1] if _name == "all_gather" else args[0]
            group = kw.get("group")
            label = next((k for k, g in groups.items() if g is group), repr(group))
            nbytes = tensor.numel() * tensor.element_size()
            log[-1].append((_name, label, nbytes, tensor.device.type))
            return _original(*args, **kw)

        setattr(dist, name, recording)
    return log


def _with_control(tp: int, pp: int) -> tuple[Any, Any]:
    """This rank's topology and its TP group's separate gloo control group (None without peers)."""
    topo = grid_topology(tp, pp)
    if topo.tp_group is None:
        return topo, None
    twin = dist.new_group(list(topo.tp_ranks), backend="gloo", use_local_synchronization=True)
    set_control_group(topo.tp_group, twin)
    return topo, twin


def run_stream(tp: int, pp: int, mbs: int, mode: str) -> dict[str, Any]:
    with use_transport(mode):
        topo, control = _with_control(tp, pp)
        log = _record({"tp": topo.tp_group, "control": control})
        data = iter(stream(mbs)) if topo.is_source else None
        steps = []
        while True:
            try:
                steps.append(_summary(get_batch_on_this_tp_rank(data, topology=topo)))
            except StopIteration:
                break
            finally:
                log.append([])
    return {"stage": topo.stage.value, "tp_rank": topo.tp_rank, "pp_rank": topo.pp_rank,
            "steps": steps, "collectives": [len(c) for c in log[:-1]], "log": log[:-1]}  # fmt: skip


@pytest.mark.parametrize("grid", [Grid(2, 1), Grid(2, 3), Grid(4, 2)], ids=lambda g: g.id)
def test_header_on_the_control_group_payload_on_the_tp_group(dist_pool: Any, grid: Grid) -> None:
    mbs = 3
    results = dist_pool.run(run_stream, grid.world_size, grid.tp, grid.pp, mbs, "collectives",
                            timeout=60)  # fmt: skip
    for r in results:
        check_rank(r, mbs, grid.tp)  # the same fields as the local link's frames
        calls = r["log"]
        assert calls[0][0] == ("all_gather", "control", 8, "cpu"), calls[0]  # the fields check
        for call in [calls[0][1:], *calls[1:-1]]:  # a batch: header (control), payload (TP group)
            kinds = [c[:2] for c in call]
            assert kinds in ([("broadcast", "control"), ("broadcast", "tp")],
                             [("broadcast", "control")]), call  # fmt: skip  # no bytes: no payload
            assert call[0][2] == HEADER and (len(call) == 1 or call[1][2] > 0), call
        assert calls[-1] == [("broadcast", "control", HEADER, "cpu")], calls[-1]  # the stop
    for stage in range(grid.pp):  # every TP peer ran exactly the same collectives, same sizes
        logs = [r["log"] for r in results if r["pp_rank"] == stage]
        assert all(log == logs[0] for log in logs), stage


@pytest.mark.parametrize("grid", [Grid(2, 1), Grid(4, 2)], ids=lambda g: g.id)
def test_header_over_a_local_link_payload_on_the_tp_group(dist_pool: Any, grid: Grid) -> None:
    # After the set-up on the first call (the fields check, the link's all-gather and two
    # all-reduces on the control group) a batch is its payload broadcast alone.
    mbs = 3
    results = dist_pool.run(run_stream, grid.world_size, grid.tp, grid.pp, mbs, "split", timeout=60)
    for r in results:
        check_rank(r, mbs, grid.tp)
        calls = r["log"]
        setup = [("all_gather", "control"), ("all_gather", "control"), ("all_reduce", "control"),
                 ("all_reduce", "control")]  # fmt: skip
        assert [c[:2] for c in calls[0]] == [*setup, ("broadcast", "tp")], calls[0]
        for call in calls[1:-1]:
            assert [c[:2] for c in call] in ([("broadcast", "tp")], []), call
        assert calls[-1] == [], calls[-1]  # the stop is a link frame
    for stage in range(grid.pp):
        logs = [r["log"] for r in results if r["pp_rank"] == stage]
        assert all(log == logs[0] for log in logs), stage


def run_failure(tp: int, fault: str, mode: str) -> dict[str, Any]:
    with use_transport(mode):
        topo, control = _with_control(tp, 1)
        log = _record({"tp": topo.tp_group, "control": control})
        data = FailingIterator(2, fault) if topo.is_source else None
        events: list[tuple[str, str, float]] = []
        for _ in range(4):
            t0 = time.perf_counter()
            try:
                out = get_batch_on_this_tp_rank(data, topology=topo)
                events.append(("ok", str(out["cu_seqlens"].tolist()), time.perf_counter() - t0))
            except Exception as exc:
                events.append((type(exc).__name__, str(exc), time.perf_counter() - t0))
            log.append([])
    return {"tp_rank": topo.tp_rank, "src": topo.src_rank, "events": events, "log": log[:-1]}


@pytest.mark.parametrize("mode", ["collectives", "split", "auto"])
@pytest.mark.parametrize("fault", ["raise", "bad"])
def test_regression_peers_get_exactly_the_sources_error(
    dist_pool: Any, fault: str, mode: str
) -> None:
    results = dist_pool.run(run_failure, 3, 3, fault, mode, timeout=30)
    source = results[0]
    name, text, _ = source["events"][2]
    assert name == ("ValueError" if fault == "bad" else "OSError"), source
    for r in results:
        assert [e[0] for e in r["events"]] == (
            ["ok", "ok", name, "ok"] if r["tp_rank"] == 0 else ["ok", "ok", "RemoteDataError", "ok"]
        ), r
        if r["tp_rank"]:  # the message, exactly: no header bytes or padding in front or behind
            assert r["events"][2][1] == f"TP source rank {r['src']} failed: {name}: {text}", r
        assert r["events"][3][1] == str(stream(1)[0].cu_seqlens.tolist())
        error_call = r["log"][2]
        if mode == "collectives":  # header then message on the control group
            assert [c[:2] for c in error_call] == [("broadcast", "control")] * 2, error_call
            assert error_call[1][2] == len(f"{name}: {text}".encode()), error_call
        else:  # one link frame
            assert error_call == [], error_call
    assert all(r["log"] == results[0]["log"] for r in results)


def run_empty_then_lockstep(tp: int) -> tuple[list[str], int, bool]:
    """Empty iterator, then lockstep on the same group reuses the registered control group."""
    with use_transport("collectives"):
        topo, control = _with_control(tp, 1)
        data = iter([]) if topo.is_source else None
        outcomes = []
        for _ in range(2):
            try:
                get_batch_on_this_tp_rank(data, topology=topo)
                outcomes.append("ok")
            except StopIteration:
                outcomes.append("StopIteration")
        created = []
        original = dist.new_group
        dist.new_group = lambda *a, **k: created.append(a) or original(*a, **k)  # type: ignore[assignment]
        try:
            steps = sum(len(list(lockstep(range(3), group=topo.tp_group))) for _ in range(3))
        finally:
            dist.new_group = original  # type: ignore[assignment]
    return outcomes, steps + len(created), control_group(topo.tp_group) is control


def test_stops_cleanly_and_lockstep_reuses_the_control_group(dist_pool: Any) -> None:
    for outcomes, steps_plus_new_groups, cached in dist_pool.run(run_empty_then_lockstep, 4, 4):
        assert outcomes == ["StopIteration"] * 2
        assert steps_plus_new_groups == 9  # 3 x 3 steps, and no group created
        assert cached


def _tensors_of(item: Any) -> list[Any]:
    return [getattr(item, f.name) for f in dataclasses.fields(item)]


def run_copies(mode: str) -> list[bool]:
    """The source edits its batch in place after each call: nothing any rank got may change."""
    with use_transport(mode):
        topo = grid_topology(dist.get_world_size(), 1)
        items = stream(2)
        got = []
        for item in items:
            data = iter([item]) if topo.is_source else None
            out = get_batch_on_this_tp_rank(data, topology=topo)
            got.append({k: out[k].clone() for k in ("tokens", "labels", "loss_mask", "cu_seqlens")
                        if out[k] is not None} | {"out": out})  # fmt: skip
            if topo.is_source:  # the trainer reuses its buffers for the next batch
                for value in item.values() if isinstance(item, dict) else _tensors_of(item):
                    if isinstance(value, torch.Tensor) and value.is_floating_point():
                        value.fill_(-7.0)
                    elif isinstance(value, torch.Tensor):
                        value.fill_(-7)
        dist.barrier()
    return [all(torch.equal(g[k], g["out"][k]) for k in g if k != "out") for g in got]


@pytest.mark.parametrize("mode", ["auto", "collectives", "split"])
@pytest.mark.parametrize("tp", [1, 2], ids=lambda t: f"tp{t}")
def test_regression_delivered_tensors_are_copies_on_every_path(
    dist_pool: Any, tp: int, mode: str
) -> None:
    if tp == 1 and mode != "auto":
        pytest.skip("one rank has one path")
    assert dist_pool.run(run_copies, tp, mode, timeout=60) == [[True] * len(stream(2))] * tp
