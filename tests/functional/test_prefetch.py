"""megapack.prefetch on gloo: same batches as get_batch_on_this_tp_rank, same failures, clean shutdown.

Every test here has "prefetch" in its name (``pytest -k prefetch``). The fault-injection cases
with prefetch live in test_fault_injection.py (path ids ``prefetch`` and ``prefetch-split``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

import megapack
from megapack.delivery import prefetch as prefetch_module
from megapack.delivery.transport import use_transport
from megapack.harness.grid import grid_topology
from megapack.testing.grids import Grid
from tests.functional.test_tp_pp_grid import FailingIterator, _summary, check_rank, stream

pytestmark = pytest.mark.distributed


def _record_by_thread() -> dict[str, list[tuple[str, int]]]:
    """Wraps the collectives megapack uses; records (op, bytes) per thread name."""
    log: dict[str, list[tuple[str, int]]] = {}
    for name in ("broadcast", "all_reduce", "all_gather"):
        original = getattr(dist, name)

        def recording(*args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            tensor = args[1] if _name == "all_gather" else args[0]
            entry = (_name, tensor.numel() * tensor.element_size())
            log.setdefault(threading.current_thread().name, []).append(entry)
            return _original(*args, **kw)

        setattr(dist, name, recording)
    return log


def run_prefetch_stream(tp: int, pp: int, mbs: int, depth: int, split: bool) -> dict[str, Any]:
    with use_transport("split" if split else "auto"):
        return _prefetch_stream(tp, pp, mbs, depth)


def _prefetch_stream(tp: int, pp: int, mbs: int, depth: int) -> dict[str, Any]:
    topo = grid_topology(tp, pp)
    threads_before = threading.active_count()
    log = _record_by_thread()
    source_reads = [0]

    def counted(items: list[Any]) -> Iterator[Any]:
        for item in items:
            source_reads[0] += 1
            yield item

    data = counted(stream(mbs)) if topo.is_source else None
    steps, ends = [], []
    with megapack.prefetch(data, topology=topo, depth=depth) as batches:
        while True:
            try:
                steps.append(_summary(next(batches)))
            except StopIteration:
                break
        for _ in range(2):  # StopIteration again, like get_batch_on_this_tp_rank
            try:
                next(batches)
                ends.append("ok")
            except StopIteration:
                ends.append("StopIteration")
    return {
        "stage": topo.stage.value,
        "tp_rank": topo.tp_rank,
        "pp_rank": topo.pp_rank,
        "steps": steps,
        "collectives": [0] * (len(steps) + 1),  # per-call counts are the thread's, checked below
        "ends": ends,
        "main_thread_collectives": len(log.get("MainThread", [])),
        "thread_log": log.get("megapack-prefetch", []),
        "threads_left": threading.active_count() - threads_before,
        "source_reads": source_reads[0],
    }


@pytest.mark.parametrize(
    ("grid", "depth", "split"),
    [(Grid(2, 2), 1, False), (Grid(4, 1), 2, False), (Grid(2, 3), 3, True), (Grid(1, 2), 2, False)],
    ids=["tp2-pp2-depth1", "tp4-pp1-depth2", "tp2-pp3-depth3-split", "tp1-pp2-depth2"],
)
def test_prefetch_delivers_the_same_batches(
    dist_pool: Any, grid: Grid, depth: int, split: bool
) -> None:
    mbs = 3
    results = dist_pool.run(
        run_prefetch_stream, grid.world_size, grid.tp, grid.pp, mbs, depth, split, timeout=60
    )
    for r in results:
        check_rank(r, mbs, grid.tp)
        assert r["ends"] == ["StopIteration"] * 2, r["ends"]
        assert r["main_thread_collectives"] == 0  # every transfer ran in the prefetch thread
        assert r["threads_left"] == 0
        if r["tp_rank"] == 0:
            assert r["source_reads"] == len(stream(mbs))
    for stage in range(grid.pp):  # TP peers ran the same collectives with the same sizes
        logs = [r["thread_log"] for r in results if r["pp_rank"] == stage]
        assert all(log == logs[0] for log in logs), stage
        if grid.tp > 1:
            assert logs[0], "the thread ran no collective"


def run_prefetch_failure_then_fresh(tp: int, mode: str, depth: int) -> dict[str, Any]:
    topo = grid_topology(tp, 1)
    threads_before = threading.active_count()
    data = FailingIterator(2, mode) if topo.is_source else None
    events: list[tuple[str, str]] = []
    with megapack.prefetch(data, topology=topo, depth=depth) as batches:
        for _ in range(4):
            try:
                events.append(("ok", str(next(batches)["cu_seqlens"].tolist())))
            except Exception as exc:
                events.append((type(exc).__name__, str(exc)))
    after_close = threading.active_count() - threads_before
    closed = ""
    try:
        next(batches)
    except RuntimeError as exc:
        closed = str(exc)
    # A fresh prefetcher on the same TP group: reuses the data group, nothing pending on it.
    fresh = iter(stream(1)[:2]) if topo.is_source else None
    with megapack.prefetch(fresh, topology=topo, depth=depth) as again:
        got = [str(b["cu_seqlens"].tolist()) for b in again]
    data_groups = len(prefetch_module._data_groups.get(topo.tp_group, []))
    return {
        "tp_rank": topo.tp_rank,
        "events": events,
        "threads_after_close": after_close,
        "closed": closed,
        "fresh": got,
        "data_groups": data_groups,
        "threads_at_end": threading.active_count() - threads_before,
    }


@pytest.mark.parametrize("depth", [1, 2], ids=lambda d: f"depth{d}")
@pytest.mark.parametrize("mode", ["raise", "bad"])
def test_prefetch_error_at_batch_k_then_close_then_fresh_iterator(
    dist_pool: Any, mode: str, depth: int
) -> None:
    # At depth 1 a batch that failed must give its slot back, or the next next() waits forever
    # (regression: tests at depth 2 alone never saw it).
    results = dist_pool.run(run_prefetch_failure_then_fresh, 3, 3, mode, depth, timeout=60)
    good = stream(1)
    for r in results:
        kinds = [e[0] for e in r["events"]]
        failed = (
            ("ValueError" if mode == "bad" else "OSError")
            if r["tp_rank"] == 0
            else "RemoteDataError"
        )
        assert kinds == ["ok", "ok", failed, "ok"], r  # raised by the call that would return it
        assert ("is not strictly increasing" if mode == "bad" else "part-7.jsonl vanished") in r[
            "events"
        ][2][1]
        assert r["events"][3][1] == str(good[0].cu_seqlens.tolist())
        assert r["threads_after_close"] == 0 and r["threads_at_end"] == 0
        assert "prefetcher is closed" in r["closed"]
        assert r["fresh"] == [r["events"][0][1], r["events"][1][1]]  # same two batches again
        assert r["data_groups"] == 1


def run_prefetch_early_close(tp: int, closer: int) -> tuple[str, str, float]:
    topo = grid_topology(tp, 1)
    data = iter(stream(3) * 3) if topo.is_source else None
    t0 = time.perf_counter()
    with megapack.prefetch(data, topology=topo, depth=1, timeout=5.0) as batches:
        try:
            for i in range(100):
                next(batches)
                if i == 1 and topo.tp_rank == closer:
                    return ("closed", "", 0.0)
                t0 = time.perf_counter()
        except Exception as exc:
            return (type(exc).__name__, str(exc), time.perf_counter() - t0)
    return ("ok", "", 0.0)


def test_prefetch_peer_closing_early_is_reported_on_every_rank(dist_pool: Any) -> None:
    results = dist_pool.run(run_prefetch_early_close, 3, 3, 1, timeout=60)
    assert results[1][0] == "closed"
    for kind, message, seconds in (results[0], results[2]):
        assert kind == "CollectiveError", (kind, message)
        assert "rank(s) [1] closed their prefetcher" in message
        assert seconds < 5.0


def test_prefetch_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="prefetch depth must be an int >= 1, got 0"):
        megapack.prefetch(iter([]), depth=0)
    with pytest.raises(TypeError, match=r"prefetch got unknown options \['cp_layuot'\]"):
        megapack.prefetch(iter([]), depth=1, cp_layuot="row")
    for nice, error in ((-1, ValueError), (20, ValueError), (True, TypeError), (2.5, TypeError)):
        with pytest.raises(error, match=f"prefetch nice must be an int from 0 to 19, got .*{nice}"):
            megapack.prefetch(iter([]), nice=nice)  # type: ignore[arg-type]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
@pytest.mark.parametrize("nice", [0, 10, 19])
def test_prefetch_thread_runs_at_lower_priority(nice: int) -> None:
    # The thread lowers only its own priority (by `nice`, capped at 19); the caller keeps its own.
    rows = [megapack.PackedBatch.from_documents([[1, 2, 3]]) for _ in range(3)]
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with megapack.prefetch(
        iter(rows), topology=megapack.Topology.single(), depth=1, nice=nice
    ) as it:
        first = next(it)  # the thread has started and set its priority before this batch
        tid = it._thread.native_id
        assert tid is not None
        assert os.getpriority(os.PRIO_PROCESS, tid) == min(19, mine + nice)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
        assert first["cu_seqlens"].tolist() == [0, 3] and len(list(it)) == 2


def run_prefetch_options(tp: int) -> list[str]:
    topo = grid_topology(tp, 1)
    data = iter([megapack.PackedBatch.from_documents([[1, 2, 3]])]) if topo.is_source else None
    kinds = []
    with megapack.prefetch(data, topology=topo, depth=2, packed=False) as batches:
        for _ in range(2):
            try:
                next(batches)
                kinds.append("ok")
            except StopIteration:
                kinds.append("StopIteration")
            except Exception as exc:
                kinds.append(f"{type(exc).__name__}: {exc}"[:80])
    return kinds


def test_prefetch_passes_options_to_get_batch(dist_pool: Any) -> None:
    source, peer = dist_pool.run(run_prefetch_options, 2, 2, timeout=60)
    assert source[0].startswith("ValueError: get_batch_on_this_tp_rank(packed=False)"), source
    assert peer[0].startswith("RemoteDataError"), peer
    assert source[1] == peer[1] == "StopIteration"
