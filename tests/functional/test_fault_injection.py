"""Fault injection on CPU/gloo: every surviving rank ends with the specified clean stop or exception.

Each case runs under a hard wall clock on a small private worker pool (cases that kill or stall a
rank restart it: ~0.1 s, its workers being forks of the pool's warm fork server).
megapack's collective timeout is TIMEOUT seconds here, so "within timeout + 5 s" is checked per rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import megapack
from megapack.delivery.transport import use_transport
from megapack.distributed.groups import set_control_group
from megapack.harness.grid import grid_topology
from megapack.harness.pool import WorkerPool

pytestmark = pytest.mark.distributed

TIMEOUT = 2.0


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(size=4, preload=("torch", "megapack")) as p:
        yield p


def outcome(fn: Any, *args: Any, clock: list[float] | None = None) -> tuple[str, str, float]:
    """(exception type or "ok", message or value, seconds) of ``fn(*args)`` on this rank.

    Seconds count from ``clock[0]`` when given (the body resets it before the call under test).
    """
    clock = clock if clock is not None else [time.perf_counter()]
    try:
        value = fn(*args)
        return ("ok", repr(value), time.perf_counter() - clock[0])
    except BaseException as exc:  # StopIteration included: it is an expected outcome here
        return (type(exc).__name__, str(exc), time.perf_counter() - clock[0])


# ------------------------------------------------------------------ lockstep


def items(n: int, fail_at: int | None = None) -> Iterator[int]:
    for i in range(n):
        if i == fail_at:
            raise OSError(f"shard of rank {dist.get_rank()} is corrupt at item {i}")
        yield i


def run_lockstep(
    lengths: list[int], fail_rank: int | None = None, fail_at: int | None = None
) -> Any:
    rank = dist.get_rank()
    caught: list[str] = []  # what megapack logs here at WARNING and above
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: caught.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("megapack").addHandler(handler)
    try:
        result = outcome(
            lambda: list(
                megapack.lockstep(
                    items(lengths[rank], fail_at if rank == fail_rank else None), timeout=TIMEOUT
                )
            )
        )
    finally:
        logging.getLogger("megapack").removeHandler(handler)
    return result, caught


def test_uneven_lengths_stop_together(pool: WorkerPool) -> None:
    results = pool.run(run_lockstep, 4, [3, 5, 4, 3], timeout=30)
    for rank, ((kind, value, _), warned) in enumerate(results):
        assert (kind, value) == ("ok", "[0, 1, 2]"), rank
        assert bool(warned) == (rank in (1, 2)), (rank, warned)  # they still had data at step 3
        if warned:
            assert warned == [f"megapack: lockstep: rank {rank} still had data at step 3 but another rank ran out; all ranks stop here (balance the shards, e.g. with PackedDataset sharding)"]  # fmt: skip


def test_rank_failing_in_lockstep_reaches_every_rank(pool: WorkerPool) -> None:
    results = pool.run(run_lockstep, 4, [5, 5, 5, 5], 2, 1, timeout=30)
    for rank, ((kind, message, seconds), _) in enumerate(results):
        if rank == 2:
            assert kind == "OSError" and "corrupt at item 1" in message
        else:
            assert kind == "RemoteRankError", (rank, kind, message)
            assert message.startswith(
                "rank 2 failed at step 1: OSError: shard of rank 2 is corrupt at item 1"
            )
        assert seconds < TIMEOUT + 5


def run_lockstep_killed(victim: int) -> Any:
    def body() -> list[int]:
        out = []
        for i in megapack.lockstep(items(10), timeout=TIMEOUT):
            if i == 2 and dist.get_rank() == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            out.append(i)
        return out

    return outcome(body)


def test_killed_rank_ends_lockstep_on_survivors(pool: WorkerPool) -> None:
    outcomes = pool.run_outcomes(run_lockstep_killed, 3, 1, timeout=30)
    assert outcomes[1].status == "died" and "SIGKILL" in (outcomes[1].error or "")
    for o in (outcomes[0], outcomes[2]):
        kind, message, seconds = o.value
        assert kind == "CollectiveError", o
        assert "lockstep step 3" in message and "over ranks [0, 1, 2]" in message
        assert seconds < TIMEOUT + 5


def run_lockstep_stuck(victim: int) -> Any:
    def body() -> list[int]:
        out = []
        for i in megapack.lockstep(items(10), timeout=TIMEOUT):
            if i == 1 and dist.get_rank() == victim:
                time.sleep(TIMEOUT + 1.5)
            out.append(i)
        return out

    return outcome(body)


def test_stuck_rank_times_out_everyone(pool: WorkerPool) -> None:
    results = pool.run(run_lockstep_stuck, 3, 0, timeout=40)
    for rank, (kind, message, seconds) in enumerate(results):
        assert kind == "CollectiveError", (rank, kind, message)
        # survivors time out; the stuck rank wakes to find its peers gone ("failed") or times out too
        assert "timed out" in message if rank != 0 else "lockstep step" in message
        # survivors: within the timeout (+5 s); the stuck rank: its own wait after it wakes up
        limit = TIMEOUT + 5 if rank != 0 else TIMEOUT + 1.5 + TIMEOUT + 5
        assert seconds < limit, (rank, seconds)


# ------------------------------------------------------------------ get_batch_on_this_tp_rank


def batches(n: int) -> Iterator[megapack.PackedBatch]:
    for i in range(n):
        yield megapack.PackedBatch.from_documents([[1, 2, 3], [4, 5 + i]])


# "link": the default on one host, frames over a local link (megapack.delivery.link); "frame":
# links off, header and payload broadcast on the TP group; "split": header on a separate gloo
# control group, payload on the TP group, the path NCCL groups take, links off; "split-link": its
# header over the local link; "prefetch...": through megapack.prefetch(depth=2), batches fetched
# ahead in a thread.
PATHS = ["link", "frame", "split", "split-link", "prefetch", "prefetch-split"]
_MODES = {"link": "auto", "frame": "collectives", "split": "collectives", "split-link": "split",
          "prefetch": "auto", "prefetch-split": "split"}  # fmt: skip


def run_get_batch_fault(fault: str, path: str = "link") -> Any:
    with use_transport(_MODES[path]):
        return _get_batch_fault(fault, path)


def bad_batches(n: int, bad_at: int) -> Iterator[megapack.PackedBatch]:
    """``n`` batches, the one at ``bad_at`` with non-monotonic cu_seqlens (the source's error)."""
    for i, batch in enumerate(batches(n)):
        if i == bad_at:
            batch = dataclasses.replace(
                batch, cu_seqlens=torch.tensor([0, 4, 3, 5], dtype=torch.int32)
            )
        yield batch


def exit_now() -> None:
    """The process ends at once, as a script does when its data ends or an error kills it."""
    os._exit(0)


def leftovers(box: list[Any]) -> dict[str, int]:
    """What this rank still holds of megapack's delivery once its TP group is gone (destroyed and
    dropped, as ``destroy_model_parallel`` does): mapped link segments, megapack threads, open
    descriptors (the caller compares with its count before). ``box`` holds the only reference."""
    import gc
    import threading

    group = box.pop().tp_group
    if group is not None:
        dist.destroy_process_group(group)  # links and prefetch's data groups go with it
    del group
    gc.collect()
    with open("/proc/self/maps") as f:
        maps = f.read()
    return {
        "segments": maps.count("megapack-link"),
        "threads": sum(
            t.name.startswith("megapack") and t.is_alive() for t in threading.enumerate()
        ),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def stand_in_packed_seq_params() -> None:
    """A stand-in for ``megatron.core.packed_seq_params`` (the one megatron name a batch needs):
    these cases restart their workers after every exit, and importing megatron-core (~4 s on 2
    busy cores) would be most of each case's time; the transports under test never touch it."""
    import sys
    import types

    if "megatron.core.packed_seq_params" in sys.modules:
        return
    names = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
             "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv", "cp_group", "local_cp_size")  # fmt: skip
    module = types.ModuleType("megatron.core.packed_seq_params")
    module.PackedSeqParams = dataclasses.make_dataclass(
        "PackedSeqParams", [(n, Any, None) for n in names]
    )  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module


def run_exit_fault(fault: str, path: str, world: int) -> Any:
    """One exit or stuck case on ``world`` ranks (see the exit tests below)."""
    with use_transport(_MODES[path]):
        stand_in_packed_seq_params()
        dist.barrier()
        topo = grid_topology(world, 1)
        if "split" in path and topo.tp_group is not None:
            twin = dist.new_group(
                list(topo.tp_ranks), backend="gloo", use_local_synchronization=True
            )
            set_control_group(topo.tp_group, twin)
        fds_before = len(os.listdir("/proc/self/fd"))
        data: Any = None
        if topo.is_source:
            data = (
                bad_batches(5, bad_at=2)
                if fault == "exit-after-error"
                else batches(2 if fault == "exit-after-stop" else 5)
            )
            if fault == "exit-mid-frame":
                _exit_mid_frame()
        clock = [time.perf_counter()]
        with contextlib.ExitStack() as stack:
            fetch = _fetcher(stack, path, data, topo)
            body = functools.partial(_exit_body, fault, topo.tp_rank, topo.is_source, fetch, clock)
            result = outcome(body, clock=clock)
        # the last references to a closed prefetcher and its data group
        del fetch, body, data, stack
        box = [topo]
        del topo
        return result, leftovers(box), fds_before


def _exit_body(fault: str, tp_rank: int, is_source: bool, fetch: Any, clock: list[float]) -> int:
    """Fetch until an outcome; the faulty rank does its fault at the third call."""
    calls = 0
    while True:
        clock[0] = time.perf_counter()
        if calls == 2 and fault == "peer-stuck" and tp_rank == 1:
            time.sleep(TIMEOUT + 1.5)
        if calls == 2 and fault == "peer-exits" and tp_rank == 1:
            exit_now()
        try:
            fetch()
        except BaseException:
            if is_source and fault in ("exit-after-stop", "exit-after-error"):
                exit_now()  # the stop or the error is the source's last word
            raise
        calls += 1


def _exit_mid_frame() -> None:
    """Patch this (source) process to die half-way through its third frame, on every transport."""
    import megapack.delivery.link as link
    import megapack.delivery.transport as transport

    frames = {"n": 0}
    real_send, real_payload = link._send_all, transport.BroadcastTransport._payload

    def send_all(sock: Any, buffers: list[memoryview], deadline: float) -> None:
        frames["n"] += 1
        if frames["n"] >= 3:  # frames 1, 2 whole; the third cut after half its bytes
            total = b"".join(bytes(b) for b in buffers)
            sock.sendall(total[: max(len(total) // 2, 1)])
            exit_now()
        real_send(sock, buffers, deadline)

    def payload(self: Any, tensor: Any, timeout: Any) -> None:
        frames["n"] += 1
        if frames["n"] >= 3:  # the header went, the payload never does
            exit_now()
        real_payload(self, tensor, timeout)

    link._send_all = send_all
    transport.BroadcastTransport._payload = payload  # type: ignore[method-assign]


def _get_batch_fault(fault: str, path: str) -> Any:
    # Every rank imports megatron (~5 s on a busy machine; get_batch's first decode needs it)
    # before the timed calls, so a rank still importing is not mistaken for a stuck peer.
    importlib.import_module("megatron.core.packed_seq_params")
    dist.barrier()
    topo = grid_topology(dist.get_world_size(), 1)
    if "split" in path and topo.tp_group is not None:  # a separate gloo group for the header
        twin = dist.new_group(list(topo.tp_ranks), backend="gloo", use_local_synchronization=True)
        set_control_group(topo.tp_group, twin)
    data = batches(5) if topo.is_source else None
    clock = [time.perf_counter()]
    with contextlib.ExitStack() as stack:
        fetch = _fetcher(stack, path, data, topo)
        return _fault_body(fault, topo, fetch, clock)


def _fault_body(fault: str, topo: Any, fetch: Any, clock: list[float]) -> Any:

    def body() -> int:
        calls = 0
        while True:
            clock[0] = time.perf_counter()  # time the call that fails, not the first call's imports
            if calls == 2 and fault == "kill-receiver" and topo.tp_rank == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            if calls == 2 and fault == "stuck-source" and topo.is_source:
                time.sleep(TIMEOUT + 1.5)
                return calls
            if calls == 2 and fault == "receiver-raises" and topo.tp_rank == 1:
                raise ValueError("receiver's own training code failed")
            fetch()
            calls += 1

    return outcome(body, clock=clock)


@pytest.mark.parametrize(
    "path", PATHS[:4]
)  # each case restarts the pool: prefetch-split adds little
def test_get_batch_killed_receiver(pool: WorkerPool, path: str) -> None:
    outcomes = pool.run_outcomes(run_get_batch_fault, 3, "kill-receiver", path, timeout=30)
    assert outcomes[2].status == "died", outcomes[2]
    for o in outcomes[:2]:
        kind, _, seconds = o.value
        assert kind == "CollectiveError", o  # measured: ~0.04 s, gloo sees the connection close
        assert seconds < TIMEOUT + 5


@pytest.mark.parametrize("path", PATHS)
def test_get_batch_stuck_source(pool: WorkerPool, path: str) -> None:
    results = pool.run(run_get_batch_fault, 3, "stuck-source", path, timeout=30)
    assert results[0][0] == "ok"  # the source itself just returned after its sleep
    parts = {"link": "frame from", "frame": "header broadcast", "split": "header broadcast"}
    part = (parts | {"split-link": "header from"}).get(path, "prefetch agreement")
    for kind, message, seconds in results[1:]:
        assert kind == "CollectiveError" and f"{part} " in message and "timed out" in message
        assert seconds < TIMEOUT + 5


@pytest.mark.parametrize("path", PATHS)
def test_get_batch_receiver_raises(pool: WorkerPool, path: str) -> None:
    results = pool.run(run_get_batch_fault, 3, "receiver-raises", path, timeout=30)
    assert results[1][0] == "ValueError"
    for kind, message, seconds in (results[0], results[2]):
        assert kind == "CollectiveError", (kind, message)
        assert seconds < TIMEOUT + 5


# ------------------------------------------------------------------ check_in_sync, debug switch, long_operation


def run_tags(tags: list[str]) -> Any:
    return outcome(lambda: megapack.check_in_sync(tags[dist.get_rank()], 7, timeout=TIMEOUT))


def test_different_tags_raise_desync_on_every_rank(pool: WorkerPool) -> None:
    results = pool.run(run_tags, 3, ["save/exp_avg", "save/exp_avg", "save/exp_avg_sq"], timeout=30)
    for kind, message, _ in results:
        assert kind == "DesyncError"
        assert (
            "rank 2: tag 'save/exp_avg_sq' step 7" in message
            and "rank 0: tag 'save/exp_avg' step 7" in message
        )
    assert [r[0] for r in pool.run(run_tags, 3, ["same"] * 3, timeout=30)] == ["ok"] * 3


def run_debug_mixed_calls() -> Any:
    os.environ["MEGAPACK_DEBUG_SYNC"] = "1"
    try:
        topo = grid_topology(2, 1)
        if dist.get_rank() == 0:
            return outcome(
                lambda: megapack.get_batch_on_this_tp_rank(
                    batches(1), topology=topo, timeout=TIMEOUT
                )
            )
        return outcome(
            lambda: list(megapack.lockstep(items(1), group=topo.tp_group, timeout=TIMEOUT))
        )
    finally:
        del os.environ["MEGAPACK_DEBUG_SYNC"]


def test_debug_switch_catches_ranks_in_different_calls(pool: WorkerPool) -> None:
    for kind, message, _ in pool.run(run_debug_mixed_calls, 2, timeout=30):
        assert kind == "DesyncError"
        assert "megapack.get_batch_on_this_tp_rank" in message and "megapack.lockstep" in message


def run_export(work_s: float, extend: bool) -> Any:
    """Rank 0 works ``work_s`` seconds (a checkpoint export) while the others wait in a collective."""
    os.environ["MEGAPACK_TIMEOUT_S"] = "1"
    before = megapack.distributed.comm.group_timeout(None)

    def body() -> str:
        context = (
            megapack.long_operation(None, timeout=work_s + 10)
            if extend
            else contextlib.nullcontext()
        )
        with context:
            inside = megapack.distributed.comm.group_timeout(None).total_seconds()
            if dist.get_rank() == 0:
                time.sleep(work_s)
            megapack.check_in_sync("after-export", 1)
        return f"{inside:g}"

    try:
        return (
            outcome(body),
            megapack.distributed.comm.group_timeout(None) == before,
            megapack.distributed.comm.collective_timeout(),
        )
    finally:
        del os.environ["MEGAPACK_TIMEOUT_S"]


def test_long_operation_lengthens_then_restores(pool: WorkerPool) -> None:
    # megapack's short timeout is 1 s in the workers; rank 0 works 2.5 s.
    for (kind, inside, _), restored, short in pool.run(run_export, 3, 2.5, True, timeout=30):
        assert (kind, inside) == ("ok", "'12.5'")
        assert restored and short == 1.0
    without = pool.run(run_export, 3, 2.5, False, timeout=30)
    for rank, ((kind, message, _), _, _) in enumerate(without[1:], start=1):
        assert kind == "CollectiveError" and "timed out" in message, (rank, message)


def test_timeout_setting_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGAPACK_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match=r"\$MEGAPACK_TIMEOUT_S='soon' is not a number"):
        megapack.distributed.comm.collective_timeout()
    monkeypatch.setenv("MEGAPACK_TIMEOUT_S", "-3")
    with pytest.raises(
        ValueError, match=r"\$MEGAPACK_TIMEOUT_S must be a positive number of seconds, got -3.0"
    ):
        megapack.distributed.comm.collective_timeout()
    assert megapack.distributed.comm.collective_timeout(7) == 7.0
    monkeypatch.delenv("MEGAPACK_TIMEOUT_S")
    assert megapack.distributed.comm.collective_timeout() == 300.0


def run_dataset_lockstep(sizes: list[int]) -> Any:
    import numpy as np

    from megapack.data import Document, PackedDataset

    rank = dist.get_rank()
    docs = [Document(tokens=np.arange(1, 33), loss_mask=np.ones(32, dtype=np.float32))] * sizes[
        rank
    ]
    dataset = PackedDataset(docs, 32)  # one document per row: sizes[rank] micro-batches
    quiet = logging.getLogger("megapack.distributed")  # ranks that still had data say so
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return len(dataset), sum(1 for _ in dataset.iterate(lockstep=True))
    finally:
        quiet.setLevel(level)


def test_packed_dataset_iterates_in_lockstep(pool: WorkerPool) -> None:
    # e.g. evaluation sets built per rank with different lengths (prime-rl: 327 vs 338 batches)
    assert pool.run(run_dataset_lockstep, 3, [5, 3, 4], timeout=30) == [(5, 3), (3, 3), (4, 3)]


# ------------------------------------------------------------------ exits: the source's last word, and every other fault

EXIT_PATHS = ["link", "frame", "split", "split-link", "prefetch", "prefetch-split"]
"""Every transport: the local link, collectives ("frame"), header and payload apart ("split", its
header on a gloo twin; "split-link", over the link), and each through prefetch."""
TRIALS = int(os.environ.get("MEGAPACK_FAULT_TRIALS", "1"))
"""Trials of each exit-after case: 1 in the suite (at tp 4 or 2, alternating by transport); with
``MEGAPACK_FAULT_TRIALS=20 pytest -k exit_source``, 20 at each of tp 2 and 4 (each trial restarts
the 4 workers: ~2.7 s on 2 cores)."""


def _clean(result: Any, world: int) -> None:
    """On a survivor whose TP group is gone: no segment mapped, no megapack thread alive; after a
    clean outcome (the job may go on) no descriptor more than before. After a CollectiveError the
    job must end (the group is unusable): its gloo sockets go with the process."""
    (kind, _, _), left, fds_before = result
    assert left["segments"] == 0 and left["threads"] == 0, left
    if kind != "CollectiveError":
        assert left["fds"] <= fds_before, (left, fds_before)


@pytest.mark.parametrize("path", EXIT_PATHS)
@pytest.mark.parametrize("fault", ["exit-after-stop", "exit-after-error"])
def test_exit_source_last_word_reaches_every_peer(pool: WorkerPool, fault: str, path: str) -> None:
    want = "StopIteration" if fault == "exit-after-stop" else "RemoteDataError"
    worlds = [2, 4] * TRIALS if TRIALS > 1 else [4 if EXIT_PATHS.index(path) % 2 == 0 else 2]
    for world in worlds:
        outcomes = pool.run_outcomes(run_exit_fault, world, fault, path, world, timeout=40)
        assert outcomes[0].status == "died", outcomes[0]  # the source exited, as scripts do
        for o in outcomes[1:]:
            assert o.status == "ok", o
            kind, message, seconds = o.value[0]
            assert kind == want, (world, o.rank, kind, message)
            if want == "RemoteDataError":
                assert "cu_seqlens is not strictly increasing" in message, message
            assert seconds < TIMEOUT + 5
            _clean(o.value, world)


# The documented outcome of each fault on every other rank (the faulty rank itself: died or stuck),
# a covering subset: every fault on three transports, every transport under one or two faults.
MATRIX = [("exit-mid-frame", "link", 4), ("exit-mid-frame", "frame", 2), ("exit-mid-frame", "split-link", 4),
          ("peer-exits", "split", 4), ("peer-exits", "prefetch", 2), ("peer-exits", "link", 2),
          ("peer-stuck", "prefetch-split", 2), ("peer-stuck", "frame", 4), ("peer-stuck", "link", 4)]  # fmt: skip


@pytest.mark.parametrize(("fault", "path", "world"), MATRIX, ids=lambda v: str(v))
def test_fault_matrix_ends_every_rank_within_the_timeout(
    pool: WorkerPool, fault: str, path: str, world: int
) -> None:
    outcomes = pool.run_outcomes(run_exit_fault, world, fault, path, world, timeout=40)
    faulty = 0 if fault == "exit-mid-frame" else 1
    if fault != "peer-stuck":
        assert outcomes[faulty].status == "died", outcomes[faulty]
    for o in outcomes:
        if o.rank == faulty and fault != "peer-stuck":
            continue
        assert o.status == "ok", o
        kind, message, seconds = o.value[0]
        assert kind == "CollectiveError", (fault, path, o.rank, kind, message)
        assert seconds < 2 * TIMEOUT + 5, (o.rank, seconds)
        _clean(o.value, world)


def _fetcher(stack: contextlib.ExitStack, path: str, data: Any, topo: Any) -> Any:
    """The call that fetches one batch on ``path``: `next` on a prefetcher (closed with
    ``stack``) or `megapack.get_batch_on_this_tp_rank`."""
    if path.startswith("prefetch"):
        ahead = stack.enter_context(
            megapack.prefetch(data, topology=topo, depth=2, timeout=TIMEOUT)
        )
        return functools.partial(next, ahead)
    return functools.partial(
        megapack.get_batch_on_this_tp_rank, data, topology=topo, timeout=TIMEOUT
    )
