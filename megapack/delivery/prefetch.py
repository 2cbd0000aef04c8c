"""`prefetch`: the next micro-batches travel in a background thread while the current step computes.

Without prefetch a training step waits in `get_batch_on_this_tp_rank` for the source to read,
validate and encode the batch and for the broadcast. With ``prefetch(data_iterator, depth=k)``
every TP rank runs those calls in a background thread, up to ``k`` batches ahead, on a dedicated
*data group* (same ranks as the TP group, so the model's own TP collectives never interleave with
the transfer; on NCCL also a dedicated CUDA stream), and ``next()`` only takes a finished batch.

Semantics are those of calling `get_batch_on_this_tp_rank` once per step:

* batches come in the same order, with the same values, shapes and dtypes;
* a batch that failed (the source's own exception there, `RemoteDataError` on its peers) is
  raised by the ``next()`` that would have returned it, and the following ``next()`` goes on;
* StopIteration comes from the ``next()`` after the last batch, never earlier, and again after;
* a stuck or crashed peer surfaces as `CollectiveError` within megapack's timeout.

Shutdown: ``close()`` (or leaving the ``with`` block, e.g. on an exception) stops every TP rank's
thread at the same batch, because before each transfer the threads agree to go on with one tiny
all-gather on the data group's CPU control group (which also names a rank that closed early). It
joins the thread, so no thread and no pending collective is left; the data group is reused by the
next prefetcher of the group. Batches already read ahead from ``data_iterator`` are dropped.

Example (every TP rank, at the same point; only the source's iterator is read)::

    with megapack.prefetch(train_iter if is_tp_source else None, topology=topo, depth=2) as batches:
        for _ in range(steps):
            batch = next(batches)          # usually ready: no wait
            loss = model(batch["tokens"], ...)

Pass ``batches`` to Megatron's schedule as the data iterator; a ``forward_step`` then takes
``next(data_iterator)`` instead of calling `get_batch_on_this_tp_rank`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megapack.core.checks import check_int
from megapack.core.errors import CollectiveError, ProtocolError
from megapack.delivery.deliver import deliver
from megapack.distributed import comm
from megapack.distributed.groups import control_group
from megapack.distributed.topology import Topology, resolve_topology


@dataclasses.dataclass(slots=True)
class _DataGroup:
    """A process group with the TP group's ranks that carries prefetch transfers."""

    group: dist.ProcessGroup
    """The group itself (the TP group's backend)."""
    in_use: bool
    """Whether an open prefetcher is using it."""


# Per TP group, the data groups made so far. Every TP rank creates and closes prefetchers in the
# same order, so all of them pick the same data group.
_data_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, list[_DataGroup]] = (
    weakref.WeakKeyDictionary()
)
_FATAL = (CollectiveError, ProtocolError)
log = logging.getLogger("megapack.delivery")


def prefetch(
    data_iterator: Iterator[Any] | None,
    *,
    topology: Topology | None = None,
    pg_collection: Any = None,
    depth: int = 1,
    timeout: float | None = None,
    nice: int = 10,
    state: Callable[[], Any] | None = None,
    **options: Any,
) -> Prefetcher:
    """Start prefetching ``depth`` micro-batches ahead; see `Prefetcher` and the module docstring."""
    return Prefetcher(
        data_iterator,
        topology=topology,
        pg_collection=pg_collection,
        depth=depth,
        timeout=timeout,
        nice=nice,
        state=state,
        **options,
    )


class Prefetcher:
    """An iterator of `get_batch_on_this_tp_rank` results, fetched ``depth`` ahead in a thread.

    Args:
        data_iterator: the TP source's iterator; ignored (may be None) on the other TP ranks.
        topology: this rank's place in the grid; default: from megatron-core's ``parallel_state``.
        pg_collection: megatron-core's ``ProcessGroupCollection`` (Megatron-Bridge, megatron-core's
            explicit groups) instead of ``topology`` (`Topology.from_pg_collection`).
        depth: how many batches may be fetched ahead, 1 or more.
        timeout: seconds a collective waits for a peer (default: $MEGAPACK_TIMEOUT_S or 300).
        nice: how much lower the thread's CPU priority is than the caller's, 0-19 (Linux; default
            10, so that waking it never preempts the training loop's thread; 0: the same).
        state: what `state_dict` reports of the data position, read right after each fetch
            (default: ``data_iterator.state_dict`` where it has one, e.g. a
            `megapack.data.resume.DatasetIterator`; pass ``packer.state_dict`` for a StreamingPacker fed
            through a generator).
        **options: passed on to every `get_batch_on_this_tp_rank` call (``cp_layout``,
            ``sequence_parallel``, ``packed``, ``fields``).

    Every rank of the TP group must create it at the same point (the first prefetcher of a TP
    group creates its data group, collectively over the TP ranks) and close it at the same point.

    Resume: ``state_dict()`` counts the batches ``next()`` returned (used), not those fetched
    ahead, and gives the data position as of the last one used (``state`` read after that
    batch's fetch): checkpoint it, and on restart load it into a new iterator
    (`DatasetIterator.load_state_dict` takes it whole) before prefetching from it again. Under
    `megapack.lockstep_steps`, which reads a step ahead from the prefetcher, checkpoint the
    lockstep's ``state_dict()`` instead: it counts what the schedule took.
    """

    def __init__(
        self,
        data_iterator: Iterator[Any] | None,
        *,
        topology: Topology | None = None,
        pg_collection: Any = None,
        depth: int = 1,
        timeout: float | None = None,
        nice: int = 10,
        state: Callable[[], Any] | None = None,
        **options: Any,
    ) -> None:
        depth = check_int("prefetch depth", depth, minimum=1)
        nice = check_int("prefetch nice", nice, minimum=0, maximum=19)
        self._nice = nice
        # megapack's own form's options (`deliver`'s); the topology (or pg_collection) and the
        # timeout are the prefetcher's, and a Megatron caller's form does not travel through it
        allowed = set(inspect.signature(deliver).parameters) - {
            "data_iterator",
            "topology",
            "timeout",
        }
        if unknown := sorted(set(options) - allowed):
            raise TypeError(
                f"prefetch got unknown options {unknown}; it passes on {sorted(allowed)} to "
                "get_batch_on_this_tp_rank"
            )
        topo = resolve_topology(topology, pg_collection) or Topology.from_parallel_state()
        self._timeout = comm.collective_timeout(timeout)
        self._iterator = data_iterator
        self._state = state if state is not None else getattr(data_iterator, "state_dict", None)
        self._used = 0
        self._position = self._state() if self._state is not None else None
        self._options = options
        self._slot: _DataGroup | None = None
        self._control: dist.ProcessGroup | None = None
        if topo.tp_group is not None:
            self._slot = _take_data_group(topo)
            data_group = self._slot.group
            topo = dataclasses.replace(topo, tp_group=data_group)
            self._control = control_group(data_group)
        self._topo = topo
        self._stream = torch.cuda.Stream(topo.device) if topo.device.type == "cuda" else None
        # Room for batches ahead, as tickets: SimpleQueue's put/get are C calls, so next() wakes
        # the thread for ~1 us of its own time (a threading.Semaphore's release is Python code).
        self._slots: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(depth):
            self._slots.put(None)
        self._items: queue.SimpleQueue[tuple[str, Any, Any, Any]] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._finished: BaseException | None = None  # raised again by every later next()
        self._thread = threading.Thread(target=self._run, name="megapack-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._finished is not None:
            raise self._finished
        kind, value, event, position = self._take()
        if kind in ("batch", "error"):  # a failed batch is used too: it raises in its place
            self._used += 1
            self._position = position
        if kind == "batch":
            self._slots.put(None)
            if event is not None:
                _adopt(value, event)
            return value
        if kind == "error":
            self._slots.put(None)
            raise value
        self._finished = StopIteration() if kind == "stop" else value
        raise self._finished

    def state_dict(self) -> dict[str, Any]:
        """``{"used": batches next() returned, "iterator": the data position after the last of
        them}`` (None on a rank without an iterator, or without ``state``)."""
        return {"used": self._used, "iterator": self._position}

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the thread at the same batch on every TP rank and join it. Safe to call twice."""
        if self._closing.is_set() and not self._thread.is_alive():
            return
        self._closing.set()
        self._slots.put(None)  # wake a thread waiting for room
        self._thread.join(timeout=self._timeout + 5.0)
        if self._finished is None:  # closed: a batch the thread still finishes is not returned
            self._finished = RuntimeError("this megapack prefetcher is closed; create a new one")
        if self._thread.is_alive():
            log.warning(
                "megapack: prefetch thread on rank %d did not stop within %g s (a peer is "
                "stuck); the data group is not reused",
                dist.get_rank(),
                self._timeout + 5,
                stacklevel=2,
            )
            return
        if self._slot is not None:
            self._slot.in_use = False
            self._slot = None

    # ---- the background thread

    def _run(self) -> None:
        _lower_priority(self._nice)
        step = 0
        while True:
            self._slots.get()
            try:
                if not self._agree(step):
                    return
            except BaseException as exc:  # the agreement's collective failed
                self._items.put(("fatal", exc, None, None))
                return
            try:
                with torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext():
                    batch = deliver(
                        self._iterator, topology=self._topo, timeout=self._timeout, **self._options
                    )
                    event = None
                    if self._stream is not None:
                        event = torch.cuda.Event()
                        event.record(self._stream)
                self._items.put(("batch", batch, event, self._snapshot()))
            except StopIteration:
                self._items.put(("stop", None, None, None))
                return
            except _FATAL as exc:
                self._items.put(("fatal", exc, None, None))
                return
            except BaseException as exc:  # a data error: the protocol stayed in step, go on
                self._items.put(("error", exc, None, self._snapshot()))
            step += 1

    def _snapshot(self) -> Any:
        """The data position right after a fetch (in the thread: it alone moves the iterator)."""
        return self._state() if self._state is not None else None

    def _agree(self, step: int) -> bool:
        """True when every TP rank's thread goes on to transfer batch ``step`` (one CPU all-gather)."""
        going = not self._closing.is_set()
        if self._control is None:
            return going
        what = f"megapack prefetch agreement before batch {step}"
        flag = torch.tensor([1 if going else 0], dtype=torch.int32)
        flags = comm.all_gather(flag, group=self._control, what=what, timeout=self._timeout)
        closed = [r for r, f in zip(self._topo.tp_ranks, flags, strict=True) if int(f) == 0]
        if not closed:
            return True
        if going:  # a peer closed while this rank still wants batches: tell this rank's caller
            self._items.put(("fatal", _closed_by(closed, step), None, None))
        return False

    def _take(self) -> tuple[str, Any, Any, Any]:
        while True:
            try:
                return self._items.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._items.empty():
                    return (
                        "fatal",
                        RuntimeError("megapack prefetch thread ended unexpectedly"),
                        None,
                        None,
                    )


def _take_data_group(topo: Topology) -> _DataGroup:
    """A free data group (same ranks as the TP group) for a new prefetcher, created when none is free."""
    assert topo.tp_group is not None
    slots = _data_groups.get(topo.tp_group)
    if slots is None:
        slots = _data_groups[topo.tp_group] = []
        weakref.finalize(topo.tp_group, _release, slots)  # data groups go with their TP group
    for slot in slots:
        if not slot.in_use:
            slot.in_use = True
            return slot
    group = dist.new_group(list(topo.tp_ranks), use_local_synchronization=True)
    slot = _DataGroup(group=group, in_use=True)
    slots.append(slot)
    return slot


def _release(slots: list[_DataGroup]) -> None:
    """Destroy a gone TP group's data groups (their sockets and threads), where they still live."""
    for slot in slots:
        with contextlib.suppress(Exception):  # already destroyed, or the default group is gone
            if dist.is_initialized():
                dist.destroy_process_group(slot.group)
    slots.clear()


def _adopt(batch: dict[str, Any], event: Any) -> None:
    """Make the current stream wait for the prefetch stream's copy, and keep the memory alive for it."""
    stream = torch.cuda.current_stream()
    stream.wait_event(event)
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.is_cuda:
            value.record_stream(stream)


def _lower_priority(by: int) -> None:
    """Raise the calling thread's nice value by ``by`` (Linux schedules each thread on its own).

    The prefetch thread is woken by every ``next()``; at the caller's priority the kernel often
    lets it preempt the training loop's thread right there, which then waits for a core while
    holding nothing but a finished batch (measured on 2 cores, tp=2: median time in ``next()``
    160-200 us at equal priority, 45-65 us with the thread at nice +10). Elsewhere: no change.
    """
    if by == 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # e.g. a sandbox refusing setpriority: keep the priority
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))


def _closed_by(ranks: list[int], step: int) -> CollectiveError:
    return CollectiveError(
        f"megapack prefetch stopped before batch {step}: rank(s) {ranks} closed their prefetcher "
        "(e.g. after an exception); every TP rank must close it at the same point"
    )
