"""A persistent pool of worker processes that runs one function on N gloo ranks (tests and ``megapack bench``).

Why persistent: a fresh Python process that imports torch (~0.9 s) and megatron-core (~2 s) costs
about 3 s of CPU, so spawning 8 of them on the 2-core dev machine took ~18 s (27 s while another
test suite ran alongside). Starting them once per test session and reusing them leaves a per-task
overhead of ~11 ms per participating rank (measured medians: 11 ms for 1 rank, 22 ms for 2, 44 ms
for 4, 93 ms for 8), spent in the ``init_process_group`` rendezvous and ``destroy_process_group``.

Why a fork server: workers are forks of one ``forkserver`` process that imported torch, megapack
and megatron-core's ``PackedSeqParams`` once (`megapack.harness.warm`; it starts no thread, so the
fork is safe). The first pool of a process waits for that import (~4.7 s here); every later start
or restart after a fault takes ~0.1-0.25 s for 4-8 workers where spawning took ~2 s (4 torch-only
workers) to ~18 s (8 with megatron-core). The fault-injection tests, which restart their pool after
every killed or stuck rank, went from 154 s to 81 s. ``close()`` takes ~0.2 s.

Design:
  * The parent hosts a ``torch.distributed.TCPStore`` server on 127.0.0.1 (port chosen by the OS)
    and ``size`` workers started with the ``forkserver`` context (``OMP_NUM_THREADS=1``,
    ``torch.set_num_threads(1)``) that connect to it once and import ``preload`` at start-up (what
    the fork server did not import already), all in parallel.
  * Each task gets a fresh key prefix. Ranks ``0..world_size-1`` build a process group of exactly
    ``world_size`` ranks on ``PrefixStore(prefix, store)``, call ``fn``, then destroy megatron's
    model-parallel state (if initialised) and the process group. Other workers stay idle.
  * Every message is ``pickle.dumps`` bytes, never torch's shared-memory reductions, so CPU
    tensors travel by value.
  * The parent waits on the workers' connections and process sentinels together, so a rank that
    dies is noticed at once while the others are still collected until the deadline.
  * A rank that died or did not answer leaves the pool in an unknown state (stuck collectives,
    half-destroyed groups): the pool kills every worker and the next task starts fresh ones. A rank
    that raised still answered after cleaning up, so the pool stays up.

The pool is not thread-safe: submit one task at a time.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Literal
from unittest import mock

from megapack.core.checks import check_int

_HOST = "127.0.0.1"
_START_TIMEOUT_S = 300.0  # 8 workers importing megatron on 2 busy cores; generous on purpose
_STOP_GRACE_S = 3.0


@dataclass(frozen=True)
class RankOutcome:
    """What one rank of a task produced.

    Attributes:
        rank: Rank of the worker in the task's process group.
        status: ``"ok"`` (fn returned), ``"error"`` (fn or the group set-up/cleanup raised),
            ``"died"`` (the worker process exited) or ``"no_answer"`` (deadline passed).
        value: Return value of ``fn`` when ``status == "ok"``, else ``None``.
        error: Formatted traceback or reason (e.g. ``"killed by signal SIGKILL"``); ``None`` if ok.
        seconds: Wall time in the parent from submitting the task until this rank's outcome.
    """

    rank: int
    status: Literal["ok", "error", "died", "no_answer"]
    value: Any = None
    error: str | None = None
    seconds: float = 0.0


class DistributedTestError(RuntimeError):
    """A task failed on at least one rank; ``outcomes`` holds every rank's outcome."""

    def __init__(self, name: str, outcomes: list[RankOutcome]) -> None:
        self.outcomes = outcomes
        bad = [o for o in outcomes if o.status != "ok"]
        lines = [f"distributed task {name} failed on {len(bad)} of {len(outcomes)} ranks"]
        lines.append(f"ok ranks: {[o.rank for o in outcomes if o.status == 'ok']}")
        for o in bad:
            lines.append(f"---- rank {o.rank}: {o.status} after {o.seconds:.2f} s ----")
            lines.append((o.error or "").rstrip())
        super().__init__("\n".join(lines))


def _send(conn: Connection, msg: tuple[Any, ...]) -> None:
    conn.send_bytes(pickle.dumps(msg))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _run_task(
    store: Any, msg: tuple[Any, ...], backend: str, pg_timeout_s: float
) -> tuple[bytes, bool]:
    """Runs one task on this rank; returns the pickled reply and whether the worker is reusable."""
    import torch.distributed as dist

    _, task_id, prefix, rank, world_size, payload = msg
    status, value, error, healthy = "ok", None, None, True
    try:
        fn, args, kwargs = pickle.loads(payload)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(prefix, store),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        value = fn(*args, **kwargs)
    except BaseException:  # SystemExit from fn is a failure of the task, not of the worker
        status, value, error = "error", None, traceback.format_exc()
    try:
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is not None and ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        status, value, healthy = "error", None, False
        error = (error or "") + "cleanup after the task failed:\n" + traceback.format_exc()
    try:
        return pickle.dumps(("done", task_id, status, value, error)), healthy
    except BaseException:
        error = f"result could not be pickled: {value!r:.2000}\n{traceback.format_exc()}"
        return pickle.dumps(("done", task_id, "error", None, error)), healthy


def _worker_main(
    conn: Connection, port: int, backend: str, preload: Sequence[str], pg_timeout_s: float
) -> None:
    """Entry point of a worker: preload, connect to the store, then serve tasks until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    os.environ["OMP_NUM_THREADS"] = "1"
    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():  # megatron warns about missing apex/TE once per process
        for name in preload:
            with contextlib.suppress(Exception):  # a missing optional module is not fatal
                module = importlib.import_module(name)
                for attr in getattr(module, "__all__", ()):  # a lazy package (megapack) loads
                    getattr(module, attr, None)  # its names now, not inside a timed collective
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=timedelta(seconds=pg_timeout_s))
    _send(conn, ("ready",))
    while True:
        try:
            msg = _recv(conn)
        except (EOFError, OSError):  # the parent is gone
            return
        if msg[0] == "stop":  # skip the slow interpreter shutdown: there is no state to save
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        reply, healthy = _run_task(store, msg, backend, pg_timeout_s)
        try:
            conn.send_bytes(reply)
        except OSError:  # the parent is gone
            return
        if not healthy:
            os._exit(3)  # the parent sees a dead worker before the next task and restarts the pool


def _death_reason(proc: Any) -> str:
    proc.join(timeout=1.0)
    code = proc.exitcode
    if code is None:
        return "connection closed but the process is still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class WorkerPool:
    """``size`` persistent worker processes; each task runs ``fn`` on a fresh gloo group.

    Args:
        size: Number of worker processes, i.e. the largest ``world_size`` a task may use.
        backend: ``torch.distributed`` backend for the per-task groups.
        preload: Modules every worker imports at start-up; missing ones are skipped.
        pg_timeout_s: Timeout of each task's process group and of the store clients.

    Example:
        In a test module (``fn`` must be module-level so workers import it by reference)::

            def total() -> float:
                t = torch.ones(1)
                dist.all_reduce(t)
                return t.item()

            with WorkerPool(size=4) as pool:
                assert pool.run(total, world_size=3) == [3.0, 3.0, 3.0]
    """

    def __init__(
        self,
        size: int = 8,
        *,
        backend: str = "gloo",
        preload: Sequence[str] = ("torch", "megatron.core.packed_seq_params"),
        pg_timeout_s: float = 60.0,
    ) -> None:
        size = check_int("size", size, minimum=1)
        if pg_timeout_s <= 0:
            raise ValueError(f"pg_timeout_s must be > 0, got {pg_timeout_s!r}")
        self.size = size
        self.backend = backend
        self.preload = tuple(preload)
        self.pg_timeout_s = pg_timeout_s
        self._ctx = mp.get_context("forkserver")
        # the server imports megapack.harness.warm once; workers fork from it warm (no-op once
        # the server runs: it is one per process)
        self._ctx.set_forkserver_preload(["megapack.harness.warm"])
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._store: Any = None
        self._task_id = 0
        self._closed = False
        self.start_seconds: float | None = None  # wall time of the last worker start-up
        atexit.register(self.close)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *args: Any,
        timeout: float = 60.0,
        **kwargs: Any,
    ) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on ranks ``0..world_size-1``; returns values in rank order.

        Raises:
            DistributedTestError: Some rank raised, died or did not answer within ``timeout``.
            ValueError: ``world_size`` is not in ``1..size`` or ``fn``/arguments do not pickle.
        """
        outcomes = self.run_outcomes(fn, world_size, *args, timeout=timeout, **kwargs)
        if any(o.status != "ok" for o in outcomes):
            name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
            raise DistributedTestError(name, outcomes)
        return [o.value for o in outcomes]

    def run_outcomes(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *args: Any,
        timeout: float = 60.0,
        **kwargs: Any,
    ) -> list[RankOutcome]:
        """Like :meth:`run`, but returns every rank's :class:`RankOutcome` instead of raising."""
        if self._closed:
            raise RuntimeError("WorkerPool is closed")
        world_size = check_int("world_size", world_size, minimum=1, maximum=self.size)
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as e:
            raise ValueError(
                f"fn and its arguments must pickle by reference (define fn at module level): {e}"
            ) from e
        if any(not p.is_alive() for p in self._procs):
            self._teardown()
        if not self._procs:
            self._start()
        self._task_id += 1
        start = time.monotonic()
        done: dict[int, RankOutcome] = {}
        for rank in range(world_size):
            msg = ("task", self._task_id, f"task{self._task_id}/", rank, world_size, payload)
            try:
                _send(self._conns[rank], msg)
            except OSError:
                done[rank] = RankOutcome(rank, "died", error=_death_reason(self._procs[rank]))
        pending = [r for r in range(world_size) if r not in done]
        while pending and (ready := self._wait(pending, start + timeout)):
            for r in ready:
                done[r] = self._collect(r, time.monotonic() - start)
            pending = [r for r in pending if r not in done]
        for r in range(world_size):
            if r not in done:
                done[r] = RankOutcome(
                    r, "no_answer", error=f"no answer within {timeout} s", seconds=timeout
                )
        outcomes = [done[r] for r in range(world_size)]
        if any(o.status in ("died", "no_answer") for o in outcomes):
            self._teardown()
        return outcomes

    def close(self) -> None:
        """Stops the workers (stop message, short join, then kill). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            with contextlib.suppress(OSError):
                _send(conn, ("stop",))
        deadline = time.monotonic() + _STOP_GRACE_S
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._teardown()
        atexit.unregister(self.close)

    def _wait(self, ranks: list[int], deadline: float) -> list[int]:
        """Blocks until some of ``ranks`` answered or died; returns them ([] at the deadline)."""
        left = deadline - time.monotonic()
        if left <= 0:
            return []
        conns, procs = self._conns, self._procs
        ready = set(wait([conns[r] for r in ranks] + [procs[r].sentinel for r in ranks], left))
        return [r for r in ranks if conns[r] in ready or procs[r].sentinel in ready]

    def _collect(self, rank: int, seconds: float) -> RankOutcome:
        """Reads rank's answer if it sent one, else reports how its process ended."""
        conn = self._conns[rank]
        try:
            if conn.poll():
                kind, task_id, status, value, error = _recv(conn)
                if kind == "done" and task_id == self._task_id:
                    return RankOutcome(rank, status, value, error, seconds)
                error = f"protocol error: got {kind!r} for task {task_id}, expected {self._task_id}"
                return RankOutcome(rank, "error", error=error, seconds=seconds)
        except (EOFError, OSError):
            pass
        except Exception:
            error = f"answer could not be unpickled in the parent:\n{traceback.format_exc()}"
            return RankOutcome(rank, "error", error=error, seconds=seconds)
        return RankOutcome(rank, "died", error=_death_reason(self._procs[rank]), seconds=seconds)

    def _start(self) -> None:
        """Starts the store and ``size`` workers, and waits until every worker is ready."""
        import torch.distributed as dist

        t0 = time.monotonic()
        self._store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)
        # Children inherit the environment at exec, before any import of torch can read it.
        with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
            for _ in range(self.size):
                parent_end, child_end = self._ctx.Pipe()
                args = (child_end, self._store.port, self.backend, self.preload, self.pg_timeout_s)
                proc = self._ctx.Process(target=_worker_main, args=args, daemon=True)
                proc.start()
                child_end.close()
                self._procs.append(proc)
                self._conns.append(parent_end)
        waiting = list(range(self.size))
        while waiting and (ready := self._wait(waiting, t0 + _START_TIMEOUT_S)):
            for r in ready:
                try:
                    _recv(self._conns[r])
                except (EOFError, OSError):
                    reason = _death_reason(self._procs[r])
                    self._teardown()
                    raise RuntimeError(f"worker {r} failed to start: {reason}") from None
            waiting = [r for r in waiting if r not in ready]
        if waiting:
            self._teardown()
            raise RuntimeError(f"workers {sorted(waiting)} not ready after {_START_TIMEOUT_S} s")
        self.start_seconds = time.monotonic() - t0

    def _teardown(self) -> None:
        """Kills every worker (SIGKILL), joins them and drops the store; the next task restarts."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._store = [], [], None
