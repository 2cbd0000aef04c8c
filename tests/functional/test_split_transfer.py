"""The split path of get_batch_on_this_tp_rank (header on a control group, payload on the TP group), on gloo.

NCCL TP groups always take this path; here it is forced on gloo with a second gloo group as the
control group (`megapack.testing.split_path`). Every rank records every collective it runs (op,
group, bytes, device): TP peers must run the same sequence, the header on the control group with
the fixed-size header and the payload on the TP group, and the fields must equal the one-frame
path's expectations (`test_tp_pp_grid`).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch.distributed as dist

from megapack import get_batch_on_this_tp_rank, lockstep
from megapack.header import HEADER_BYTES
from megapack.link_setup import local_links
from megapack.side_groups import control_group
from megapack.testing.grids import Grid, grid_topology
from megapack.testing.split_path import force_split_path
from tests.functional.test_tp_pp_grid import FailingIterator, _summary, check_rank, stream

pytestmark = pytest.mark.distributed


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


def run_split_stream(tp: int, pp: int, mbs: int, links: bool = False) -> dict[str, Any]:
    with local_links(links):
        return _split_stream(tp, pp, mbs)


def _split_stream(tp: int, pp: int, mbs: int) -> dict[str, Any]:
    topo = grid_topology(tp, pp)
    control = force_split_path(topo)
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
    return {
        "stage": topo.stage.value,
        "tp_rank": topo.tp_rank,
        "pp_rank": topo.pp_rank,
        "steps": steps,
        "collectives": [len(c) for c in log[:-1]],
        "log": log[:-1],
    }


@pytest.mark.parametrize("grid", [Grid(2, 1), Grid(2, 3), Grid(4, 2)], ids=lambda g: g.id)
def test_split_path_delivers_the_same_fields(dist_pool: Any, grid: Grid) -> None:
    mbs = 3
    results = dist_pool.run(run_split_stream, grid.world_size, grid.tp, grid.pp, mbs, timeout=60)
    for r in results:
        check_rank(r, mbs, grid.tp)  # same fields as the one-frame path
        calls = r["log"]
        for call in calls[:-1]:  # a batch: header (control group), payload (TP group)
            assert [c[:2] for c in call] == [("broadcast", "control"), ("broadcast", "tp")], call
            assert call[0][2] == HEADER_BYTES and call[1][2] > 0, call
        assert calls[-1] == [("broadcast", "control", HEADER_BYTES, "cpu")], calls[-1]  # stop
    for stage in range(grid.pp):  # every TP peer ran exactly the same collectives, same sizes
        logs = [r["log"] for r in results if r["pp_rank"] == stage]
        assert all(log == logs[0] for log in logs), stage


@pytest.mark.parametrize("grid", [Grid(2, 1), Grid(4, 2)], ids=lambda g: g.id)
def test_split_path_headers_over_a_local_link(dist_pool: Any, grid: Grid) -> None:
    # Headers go over the TP group's local link: after the link's set-up on the first call (a
    # broadcast and an all-reduce on the control group) a batch is its payload broadcast alone.
    mbs = 3
    results = dist_pool.run(
        run_split_stream, grid.world_size, grid.tp, grid.pp, mbs, True, timeout=60
    )
    for r in results:
        check_rank({**r, "collectives": [0, *r["collectives"][1:]]}, mbs, grid.tp)  # set-up: below
        calls = r["log"]
        setup = [("broadcast", "control"), ("all_reduce", "control")]
        assert [c[:2] for c in calls[0]] == [*setup, ("broadcast", "tp")], calls[0]
        for call in calls[1:-1]:
            assert [c[:2] for c in call] == [("broadcast", "tp")] and call[0][2] > 0, call
        assert calls[-1] == [], calls[-1]  # the stop is a link frame
    for stage in range(grid.pp):
        logs = [r["log"] for r in results if r["pp_rank"] == stage]
        assert all(log == logs[0] for log in logs), stage


def run_split_failure(tp: int, mode: str, links: bool = False) -> dict[str, Any]:
    with local_links(links):
        return _split_failure(tp, mode)


def _split_failure(tp: int, mode: str) -> dict[str, Any]:
    topo = grid_topology(tp, 1)
    control = force_split_path(topo)
    log = _record({"tp": topo.tp_group, "control": control})
    data = FailingIterator(2, mode) if topo.is_source else None
    events: list[tuple[str, str, float]] = []
    for _ in range(4):
        t0 = time.perf_counter()
        try:
            out = get_batch_on_this_tp_rank(data, topology=topo)
            events.append(("ok", str(out["cu_seqlens"].tolist()), time.perf_counter() - t0))
        except Exception as exc:
            events.append((type(exc).__name__, str(exc), time.perf_counter() - t0))
        log.append([])
    return {"tp_rank": topo.tp_rank, "events": events, "log": log[:-1]}


@pytest.mark.parametrize("links", [False, True], ids=["control", "link"])
@pytest.mark.parametrize("mode", ["raise", "bad"])
def test_split_path_source_failure_reaches_every_rank(
    dist_pool: Any, mode: str, links: bool
) -> None:
    results = dist_pool.run(run_split_failure, 3, 3, mode, links, timeout=30)
    for r in results:
        kinds = [e[0] for e in r["events"]]
        failed = (
            ("ValueError" if mode == "bad" else "OSError")
            if r["tp_rank"] == 0
            else "RemoteDataError"
        )
        assert kinds == ["ok", "ok", failed, "ok"], r
        message = r["events"][2][1]
        assert (
            "is not strictly increasing" if mode == "bad" else "part-7.jsonl vanished"
        ) in message
        assert r["events"][3][1] == str(stream(1)[0].cu_seqlens.tolist())
        # The error travels on the control group only, header then message; or in one link frame.
        error_call = r["log"][2]
        if links:
            assert error_call == [], error_call
            continue
        assert [c[:2] for c in error_call] == [("broadcast", "control")] * 2, error_call
        if r["tp_rank"] == 0:
            assert error_call[1][2] == len(f"{failed}: {message}".encode()), error_call
    assert all(r["log"] == results[0]["log"] for r in results)


def run_split_empty_then_lockstep(tp: int) -> tuple[list[str], int, bool]:
    """Empty iterator on the split path, then lockstep on the same group uses the cached control group."""
    with local_links(False):
        return _split_empty_then_lockstep(tp)


def _split_empty_then_lockstep(tp: int) -> tuple[list[str], int, bool]:
    topo = grid_topology(tp, 1)
    control = force_split_path(topo)
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


def test_split_path_stops_cleanly_and_lockstep_reuses_the_control_group(dist_pool: Any) -> None:
    for outcomes, steps_plus_new_groups, cached in dist_pool.run(
        run_split_empty_then_lockstep, 4, 4
    ):
        assert outcomes == ["StopIteration"] * 2
        assert steps_plus_new_groups == 9  # 3 x 3 steps, and no group created
        assert cached
