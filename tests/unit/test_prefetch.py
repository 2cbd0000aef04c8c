"""megapack.prefetch in one process: the background thread, its read-ahead, failures and shutdown.

A topology without a TP group runs the thread with no collective at all (and the real
get_batch_on_this_tp_rank); a TP group of fakes (``Grid``: the data group's creation, its control
group and the per-batch agreement's all-gather, with what each peer says) covers the agreement,
a peer that closed and the reuse of data groups. CUDA streams are fakes too, so the stream path
runs on a CPU machine. The multi-process tests are in tests/functional/test_prefetch.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from megapack import (
    BatchField,
    PackedBatch,
    RemoteDataError,
    Topology,
    get_batch_on_this_tp_rank,
    prefetch,
)
from megapack.core.errors import CollectiveError, ProtocolError
from megapack.delivery import prefetch as prefetch_module
from megapack.delivery.deliver import deliver
from megapack.delivery.prefetch import Prefetcher
from megapack.distributed import comm

pytestmark = [
    pytest.mark.timeout(10),  # a thread that never delivers fails the test, not the session
    # close() warns only when a thread is stuck: an error anywhere else
    pytest.mark.filterwarnings("error:megapack prefetch thread on rank:UserWarning"),
]

SINGLE = Topology.single()
THREAD = "megapack-prefetch"


def my_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def wait_until(condition: Callable[[], bool], seconds: float = 3.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.001)


def settled(read: Callable[[], int], expected: int) -> int:
    """``read()`` once it reached ``expected`` and a little later (the thread had time to go on)."""
    wait_until(lambda: read() >= expected)
    time.sleep(0.05)
    return read()


class Counted:
    """An iterator of ``items`` that counts its ``next`` calls."""

    def __init__(self, items: list[Any]) -> None:
        self.items = list(items)
        self.reads = 0

    def __iter__(self) -> Counted:
        return self

    def __next__(self) -> Any:
        self.reads += 1
        if not self.items:
            raise StopIteration
        return self.items.pop(0)


@dataclasses.dataclass
class Call:
    """One call of the fake get_batch_on_this_tp_rank."""

    iterator: Any
    topology: Topology
    timeout: float | None
    options: dict[str, Any]
    thread: str
    nice: int


def fake_get_batch(
    monkeypatch: pytest.MonkeyPatch, before: Callable[[int], object] | None = None
) -> list[Call]:
    """`deliver` (megapack's form of get_batch_on_this_tp_rank) in the prefetch module becomes a
    fake with its signature: it
    returns ``{"item": next(iterator)}`` and raises an item that is an exception. ``before(n)``
    runs first in call ``n`` (0-based). Returns the calls."""
    calls: list[Call] = []

    @functools.wraps(deliver)  # the same signature: the same allowed options
    def fake(
        data_iterator: Any, *, topology: Topology, timeout: float | None, **options: Any
    ) -> dict[str, Any]:
        calls.append(Call(data_iterator, topology, timeout, options,
                          threading.current_thread().name, my_nice()))  # fmt: skip
        if before is not None:
            before(len(calls) - 1)
        item = next(data_iterator)
        if isinstance(item, BaseException):
            raise item
        return {"item": item}

    monkeypatch.setattr(prefetch_module, "deliver", fake)
    return calls


def take(batches: Prefetcher) -> Any:
    """What ``next(batches)`` returns, or the exception it raises."""
    try:
        return next(batches)
    except BaseException as exc:  # StopIteration and the thread's errors alike
        return exc


# ---- a TP group of fakes


class Group:
    """Stands in for a process group (weak-referenceable, equal only to itself)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Group({self.name!r})"


def fake_group(name: str) -> Any:
    """A `Group` where a process group is expected."""
    return Group(name)


@dataclasses.dataclass
class Gather:
    flag: list[int]
    dtype: torch.dtype
    group: Any
    what: str
    timeout: float | None


class Grid:
    """A TP group ``tp`` of ``ranks`` with this rank at ``tp_rank``; every collective the prefetcher
    makes is a fake. ``closed_at[rank]``: the batch from which that peer's thread says it closed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, ranks: tuple[int, ...] = (4, 5)) -> None:
        self.tp = fake_group("tp")
        self.topo = Topology(tp_group=self.tp, tp_ranks=ranks, tp_rank=0)
        self.new_groups: list[tuple[list[int], dict[str, Any]]] = []
        self.data: list[Any] = []
        self.controls: dict[int, Group] = {}
        self.gathers: list[Gather] = []
        self.closed_at: dict[int, int] = {}
        self.fail: BaseException | None = None
        self.extra_flags = 0
        monkeypatch.setattr(prefetch_module.dist, "new_group", self.new_group)
        monkeypatch.setattr(prefetch_module, "control_group", self.control_group)
        monkeypatch.setattr(prefetch_module.comm, "all_gather", self.all_gather)
        monkeypatch.setattr(prefetch_module.dist, "get_rank", lambda group=None: 7)

    def new_group(self, ranks: list[int], **kwargs: Any) -> Group:
        self.new_groups.append((ranks, kwargs))
        self.data.append(fake_group(f"data{len(self.data)}"))
        return self.data[-1]

    def control_group(self, group: Group) -> Group:
        return self.controls.setdefault(id(group), Group(f"control of {group.name}"))

    def control(self, data: int) -> Group:
        return self.controls[id(self.data[data])]

    def all_gather(
        self, tensor: torch.Tensor, *, group: Any, what: str, timeout: float | None = None
    ) -> list[torch.Tensor]:
        self.gathers.append(Gather(tensor.tolist(), tensor.dtype, group, what, timeout))
        if self.fail is not None:
            raise self.fail
        step = sum(g.group is group for g in self.gathers) - 1
        peers = [int(step < self.closed_at.get(r, step + 1)) for r in self.topo.tp_ranks[1:]]
        return (
            [tensor.clone()]
            + [torch.tensor([f], dtype=torch.int32) for f in peers]
            + [torch.tensor([1], dtype=torch.int32)] * self.extra_flags
        )

    def slots(self) -> list[tuple[Any, bool]]:
        return [(s.group, s.in_use) for s in prefetch_module._data_groups.get(self.tp, [])]


def agreement(step: int) -> str:
    return f"megapack prefetch agreement before batch {step}"


# ---- what next() returns


def rows() -> list[PackedBatch]:
    return [
        PackedBatch.from_documents([[1, 2, 3], [4, 5]]),
        PackedBatch.from_documents([[6, 7, 8, 9]]),
        PackedBatch.from_documents([[10], [11, 12], [13, 14, 15]]),
    ]


def test_batches_come_in_order_equal_to_get_batch() -> None:
    direct = [get_batch_on_this_tp_rank(iter([row]), topology=SINGLE) for row in rows()]
    with prefetch(iter(rows()), topology=SINGLE, depth=2) as batches:
        assert isinstance(batches, Prefetcher) and iter(batches) is batches
        got = list(batches)
        assert [type(take(batches)) for _ in range(2)] == [StopIteration] * 2
    assert len(got) == 3
    for mine, theirs in zip(got, direct, strict=True):
        assert list(mine) == list(theirs)
        assert {k: repr(v) for k, v in mine.items()} == {k: repr(v) for k, v in theirs.items()}
    assert got[2]["cu_seqlens"].tolist() == [0, 1, 3, 6]
    assert got[1]["tokens"].tolist() == [[6, 7, 8, 9]]


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_depth_bounds_how_many_items_are_read_ahead(
    monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    calls = fake_get_batch(monkeypatch)
    data = Counted(list(range(10)))
    with prefetch(data, topology=SINGLE, depth=depth) as batches:
        assert settled(lambda: data.reads, depth) == depth  # nothing taken: depth batches
        assert next(batches) == {"item": 0}
        assert settled(lambda: data.reads, depth + 1) == depth + 1  # one taken: one more
        assert next(batches) == {"item": 1}
        assert settled(lambda: data.reads, depth + 2) == depth + 2
    assert data.reads == depth + 2  # the read-ahead batches are dropped, nothing more is read
    assert {c.thread for c in calls} == {THREAD}
    assert not batches._thread.is_alive() and batches._thread.daemon


@pytest.mark.parametrize("make", [prefetch, Prefetcher], ids=["prefetch", "Prefetcher"])
def test_defaults_depth_1_nice_10_megapack_timeout(
    monkeypatch: pytest.MonkeyPatch, make: Callable[..., Prefetcher]
) -> None:
    monkeypatch.delenv(comm.TIMEOUT_ENV, raising=False)
    calls = fake_get_batch(monkeypatch)
    data = Counted([0, 1])
    with make(data, topology=SINGLE):
        assert settled(lambda: data.reads, 1) == 1
    (call,) = calls
    assert call.timeout == 300.0 and call.options == {}
    assert call.nice == min(19, my_nice() + 10)


def test_every_setting_is_passed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_get_batch(monkeypatch)
    field = BatchField("adv", per="sample", dtype=torch.float32, stages="all")
    options = {"cp_layout": "row", "sequence_parallel": True, "packed": True, "fields": (field,)}
    data = Counted([0, 1, 2, 3])
    with prefetch(data, topology=SINGLE, depth=2, timeout=0.5, nice=3, **options) as batches:
        assert settled(lambda: data.reads, 2) == 2
        assert [next(batches), next(batches)] == [{"item": 0}, {"item": 1}]
    assert len(calls) >= 2
    for call in calls:
        assert call.iterator is data and call.topology is SINGLE and call.timeout == 0.5
        assert call.options == options and call.nice == min(19, my_nice() + 3)


def test_the_topology_defaults_to_parallel_state(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = Topology(tp_group=None, tp_ranks=(3,), tp_rank=0, pp_rank=1, pp_size=2)
    monkeypatch.setattr(Topology, "from_parallel_state", classmethod(lambda cls: mine))
    calls = fake_get_batch(monkeypatch)
    default, given = iter([0]), iter([1])
    with prefetch(default, depth=1) as batches:
        assert next(batches) == {"item": 0}
    with prefetch(given, topology=SINGLE) as batches:  # a given one is used as it is
        assert next(batches) == {"item": 1}
    assert {id(c.topology) for c in calls if c.iterator is default} == {id(mine)}
    assert {id(c.topology) for c in calls if c.iterator is given} == {id(SINGLE)}


@pytest.mark.parametrize("layout", ["document", "row"])
def test_cp_layout_reaches_get_batch(layout: str) -> None:
    # A CP group of two (never talked to): each layout gives this CP rank other tokens.
    topo = Topology(tp_group=None, tp_ranks=(0,), tp_rank=0, cp_group=fake_group("cp"),
                    cp_ranks=(0, 1), cp_rank=0)  # fmt: skip
    row = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12]]
    with prefetch(iter([PackedBatch.from_documents(row)]), topology=topo, cp_layout=layout) as b:
        tokens = next(b)["tokens"].tolist()
    assert tokens == {"document": [[1, 4, 5, 6, 11, 12]], "row": [[1, 2, 3, 10, 11, 12]]}[layout]


def test_packed_and_fields_reach_get_batch() -> None:
    field = BatchField("adv", per="sample", dtype=torch.float32, stages="all")
    docs = [{"tokens": [1, 2, 3], "adv": 0.5}, {"tokens": [4, 5], "adv": -1.0}]
    data = [PackedBatch.from_documents(docs, fields=[field]) for _ in range(3)]
    with prefetch(iter(data), topology=SINGLE, depth=2, fields=[field], packed=True) as batches:
        assert next(batches)["adv"].tolist() == [0.5, -1.0]
    with prefetch(iter(data[1:]), topology=SINGLE, depth=2, fields=[field], packed=False) as b2:
        error = take(b2)
        assert type(error) is ValueError and str(error).startswith(
            "get_batch_on_this_tp_rank(packed=False) but the batch has cu_seqlens"
        )
    with prefetch(iter(data[2:]), topology=SINGLE) as b3:
        error = take(b3)
        assert type(error) is ValueError and str(error).startswith(
            "PackedBatch.extras has undeclared keys ['adv']"
        )


# ---- failures


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize(
    "error", [ValueError("bad row 3"), RemoteDataError(4, "ValueError: bad row 3")],
    ids=["source", "peer"],
)  # fmt: skip
def test_a_failed_batch_is_raised_in_its_place_and_the_next_goes_on(
    monkeypatch: pytest.MonkeyPatch, depth: int, error: Exception
) -> None:
    # At depth 1 the failed batch must give its slot back, or the next next() waits forever.
    fake_get_batch(monkeypatch)
    data = Counted([0, error, 2, 3])
    with prefetch(data, topology=SINGLE, depth=depth) as batches:
        got = [take(batches) for _ in range(6)]
    assert got[:4] == [{"item": 0}, error, {"item": 2}, {"item": 3}] and got[1] is error
    assert [type(e) for e in got[4:]] == [StopIteration, StopIteration]
    assert data.reads == 5


def test_stop_iteration_after_the_last_batch_and_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_get_batch(monkeypatch)
    batches = prefetch(Counted([0, 1]), topology=SINGLE, depth=3)
    assert [next(batches), next(batches)] == [{"item": 0}, {"item": 1}]
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(batches)
    batches._thread.join(timeout=2)
    assert not batches._thread.is_alive() and len(calls) == 3  # the thread ended at the stop
    batches.close()
    with pytest.raises(StopIteration):  # closing after the end keeps the end
        next(batches)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize(
    "error", [CollectiveError("rank 5 timed out"), ProtocolError("rank 5 is on another stage")],
    ids=["collective", "protocol"],
)  # fmt: skip
def test_collective_and_protocol_errors_are_final(
    monkeypatch: pytest.MonkeyPatch, depth: int, error: Exception
) -> None:
    calls = fake_get_batch(monkeypatch)
    data = Counted([0, error, 2, 3])
    with prefetch(data, topology=SINGLE, depth=depth) as batches:
        assert next(batches) == {"item": 0}
        got = [take(batches) for _ in range(3)]
        assert all(e is error for e in got)
        batches._thread.join(timeout=2)
        assert not batches._thread.is_alive()
    assert data.reads == 2 and len(calls) == 2  # nothing fetched after it


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_that_died_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def die(by: int) -> None:
        raise SystemExit  # ends the thread quietly, before its first batch

    monkeypatch.setattr(prefetch_module, "_lower_priority", die)
    calls = fake_get_batch(monkeypatch)
    batches = prefetch(iter([0]), topology=SINGLE)
    t0 = time.monotonic()
    error = take(batches)
    assert time.monotonic() - t0 < 1.6  # noticed at the first empty second
    assert type(error) is RuntimeError
    assert str(error) == "megapack prefetch thread ended unexpectedly"
    assert take(batches) is error and calls == []
    batches.close()


def test_a_slow_batch_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    # The thread is alive: next() waits past its 1 s polls instead of calling it dead.
    fake_get_batch(monkeypatch, before=lambda n: time.sleep(1.15))
    with prefetch(iter([0]), topology=SINGLE) as batches:
        assert next(batches) == {"item": 0}


# ---- closing


def test_close_twice_and_next_after_close(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_get_batch(monkeypatch)
    data = Counted(list(range(5)))
    batches = prefetch(data, topology=SINGLE, depth=1)
    assert next(batches) == {"item": 0}
    wait_until(lambda: data.reads == 2)  # the thread waits for room with batch 1
    t0 = time.monotonic()
    batches.close()
    assert time.monotonic() - t0 < 0.5 and not batches._thread.is_alive()
    batches.close()  # safe
    for _ in range(2):
        with pytest.raises(RuntimeError) as info:
            next(batches)
        assert str(info.value) == "this megapack prefetcher is closed; create a new one"
    assert data.reads == 2 and len(calls) == 2 and batches._slot is None


def test_leaving_the_with_block_on_an_exception_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_get_batch(monkeypatch)
    with pytest.raises(KeyError), prefetch(iter(range(5)), topology=SINGLE, depth=2) as batches:
        next(batches)
        raise KeyError("model failed")
    assert not batches._thread.is_alive()
    with pytest.raises(RuntimeError, match=r"^this megapack prefetcher is closed; create a new"):
        next(batches)


def test_the_agreement_on_the_data_group(monkeypatch: pytest.MonkeyPatch) -> None:
    grid = Grid(monkeypatch)
    calls = fake_get_batch(monkeypatch)
    with prefetch(iter([0, 1, 2]), topology=grid.topo, depth=1, timeout=0.5) as batches:
        assert grid.new_groups == [([4, 5], {"use_local_synchronization": True})]
        assert list(batches) == [{"item": 0}, {"item": 1}, {"item": 2}]
        assert grid.slots() == [(grid.data[0], True)]
    control = grid.control(0)
    assert grid.gathers == [Gather([1], torch.int32, control, agreement(s), 0.5) for s in range(4)]
    data_topo = dataclasses.replace(grid.topo, tp_group=grid.data[0])
    assert [c.topology for c in calls] == [data_topo] * 4
    assert calls[0].topology.tp_group is grid.data[0] and calls[0].timeout == 0.5
    assert grid.slots() == [(grid.data[0], False)]
    assert prefetch_module._data_groups[grid.tp][0].in_use is False and batches._slot is None


def test_close_tells_the_peers_at_the_next_agreement(monkeypatch: pytest.MonkeyPatch) -> None:
    grid = Grid(monkeypatch)
    calls = fake_get_batch(monkeypatch)
    batches = prefetch(iter(range(10)), topology=grid.topo, depth=1, timeout=0.5)
    assert next(batches) == {"item": 0}
    wait_until(lambda: len(calls) == 2)
    batches.close()
    control = grid.control(0)
    assert grid.gathers == [
        Gather([1], torch.int32, control, agreement(0), 0.5),
        Gather([1], torch.int32, control, agreement(1), 0.5),
        Gather([0], torch.int32, control, agreement(2), 0.5),  # this rank closed
    ]
    assert len(calls) == 2
    with pytest.raises(RuntimeError, match=r"^this megapack prefetcher is closed; create a new"):
        next(batches)


def test_a_closed_data_group_is_reused_and_an_open_one_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grid = Grid(monkeypatch)
    calls = fake_get_batch(monkeypatch)
    data = [iter([0]), iter([1]), iter([2])]
    with prefetch(data[0], topology=grid.topo) as first:
        assert next(first) == {"item": 0}
    with prefetch(data[1], topology=grid.topo) as second:  # takes the free one
        assert next(second) == {"item": 1}
        with prefetch(data[2], topology=grid.topo) as third:  # that one is in use: a new one
            assert next(third) == {"item": 2}
            assert grid.slots() == [(grid.data[0], True), (grid.data[1], True)]
        assert grid.slots() == [(grid.data[0], True), (grid.data[1], False)]
    assert grid.slots() == [(grid.data[0], False), (grid.data[1], False)]
    used = [{c.topology.tp_group for c in calls if c.iterator is it} for it in data]
    assert used == [{grid.data[0]}, {grid.data[0]}, {grid.data[1]}]
    assert grid.new_groups == [([4, 5], {"use_local_synchronization": True})] * 2
    assert {g.group for g in grid.gathers} == {grid.control(0), grid.control(1)}


@pytest.mark.parametrize(
    ("ranks", "closed_at", "message"),
    [((4, 5), {5: 1}, "before batch 1: rank(s) [5]"),
     ((4, 5, 6), {5: 2, 6: 2}, "before batch 2: rank(s) [5, 6]")],
    ids=["one", "two"],
)  # fmt: skip
def test_a_peer_that_closed_is_named_with_the_batch(
    monkeypatch: pytest.MonkeyPatch,
    ranks: tuple[int, ...],
    closed_at: dict[int, int],
    message: str,
) -> None:
    grid = Grid(monkeypatch, ranks)
    grid.closed_at = closed_at
    calls = fake_get_batch(monkeypatch)
    step = min(closed_at.values())
    with prefetch(iter(range(10)), topology=grid.topo, depth=2, timeout=0.5) as batches:
        got = [take(batches) for _ in range(step + 2)]
        assert got[:step] == [{"item": i} for i in range(step)]
        error = got[step]
        assert type(error) is CollectiveError and got[step + 1] is error
        assert str(error) == (
            f"megapack prefetch stopped {message} closed their prefetcher (e.g. after an "
            "exception); every TP rank must close it at the same point"
        )
        batches._thread.join(timeout=2)
        assert not batches._thread.is_alive() and len(calls) == step
    assert len(grid.gathers) == step + 1 and grid.gathers[-1].what == agreement(step)


@pytest.mark.parametrize("how", ["fails", "too-many"])
def test_a_failed_agreement_is_final(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    grid = Grid(monkeypatch)
    calls = fake_get_batch(monkeypatch)
    failure = CollectiveError("megapack prefetch agreement before batch 0: rank 5 timed out")
    if how == "fails":
        grid.fail = failure
    else:
        grid.extra_flags = 1  # more answers than the TP group has ranks
    with prefetch(iter(range(3)), topology=grid.topo, timeout=0.5) as batches:
        error = take(batches)
        assert take(batches) is error
    if how == "fails":
        assert error is failure
    else:
        assert type(error) is ValueError and "zip()" in str(error)
    assert calls == []


def test_a_stuck_thread_is_warned_about_and_its_data_group_kept(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    grid = Grid(monkeypatch)
    monkeypatch.setattr(prefetch_module.comm, "collective_timeout", lambda timeout: -4.8)
    release = threading.Event()
    calls = fake_get_batch(monkeypatch, before=lambda n: n == 1 and release.wait(5))
    batches = prefetch(iter(range(5)), topology=grid.topo, depth=1)
    try:
        assert next(batches) == {"item": 0}
        wait_until(lambda: len(calls) == 2)  # the thread is stuck in batch 1
        text = (
            "megapack: prefetch thread on rank 7 did not stop within 0.2 s (a peer is stuck); "
            "the data group is not reused"
        )
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="megapack"):
            batches.close()
        assert 0.19 < time.monotonic() - t0 < 0.7  # joined for timeout + 5 s
        assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
            ("megapack.delivery", logging.WARNING, text)
        ]
        assert caplog.records[0].pathname == __file__  # the line that called close()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megapack"):
            batches.close()  # again while it is still stuck
        assert [r.getMessage() for r in caplog.records] == [text]
        assert grid.slots() == [(grid.data[0], True)]
    finally:
        release.set()
    batches._thread.join(timeout=2)
    # the stuck batch finished after close(): closed is closed, and its group stays out of use
    with pytest.raises(
        RuntimeError, match=r"^this megapack prefetcher is closed; create a new one$"
    ):
        next(batches)
    batches.close()
    assert grid.slots() == [(grid.data[0], True)]
    with prefetch(iter([9]), topology=grid.topo) as other:
        assert list(other) == [{"item": 9}]
    assert [g for g, _ in grid.slots()] == grid.data and len(grid.data) == 2


# ---- CUDA streams, faked


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA and records the streams it is recorded on."""

    streams: list[Any]

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def record_stream(self, stream: Any) -> None:
        self.streams.append(stream)


def test_batches_travel_on_their_own_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[tuple[str, Any]] = []
    current: list[Any] = [None]

    class Stream:
        def __init__(self, device: torch.device) -> None:
            log.append(("stream", device))

        def wait_event(self, event: Any) -> None:
            log.append(("wait", event))

    class Event:
        def record(self, stream: Any) -> None:
            log.append(("record", stream))
            self.stream = stream

    @contextlib.contextmanager
    def on(stream: Any) -> Iterator[None]:
        current[0] = stream
        try:
            yield
        finally:
            current[0] = None

    main = object.__new__(Stream)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: main)
    tensor = torch.arange(3).as_subclass(FakeCuda)
    tensor.streams = []
    plain = torch.arange(2)
    seen: list[Any] = []

    @functools.wraps(get_batch_on_this_tp_rank)
    def fake(data_iterator: Any, **kwargs: Any) -> dict[str, Any]:
        seen.append(current[0])
        log.append(("batch", next(data_iterator)))
        return {"tokens": tensor, "cpu": plain, "max_seqlen": 3, "none": None}

    monkeypatch.setattr(prefetch_module, "deliver", fake)
    topo = Topology.single("cuda")
    with prefetch(iter([0]), topology=topo) as batches:
        stream = batches._stream
        assert isinstance(stream, Stream) and stream is not main
        batch = next(batches)
    assert batch["tokens"] is tensor and batch["cpu"] is plain
    event = log[3][1]
    assert log[3] == ("wait", event) and isinstance(event, Event) and event.stream is stream
    assert log == [("stream", torch.device("cuda")), ("batch", 0), ("record", stream),
                   ("wait", event)]  # fmt: skip
    assert seen and all(s is stream for s in seen) and tensor.streams == [main]


# ---- arguments and priority


@pytest.mark.parametrize("depth", [0, -1, True, "2", 1.0])
def test_depth_is_checked(depth: Any) -> None:
    wrong_type = not isinstance(depth, int) or isinstance(depth, bool)
    with pytest.raises(TypeError if wrong_type else ValueError) as info:
        prefetch(iter([]), topology=SINGLE, depth=depth)
    got = f"{type(depth).__name__} {depth!r}" if wrong_type else repr(depth)
    assert str(info.value) == f"prefetch depth must be an int >= 1, got {got}"


@pytest.mark.parametrize("nice", [-1, 20, True, 2.5, "3"])
def test_nice_is_checked(nice: Any) -> None:
    wrong_type = not isinstance(nice, int) or isinstance(nice, bool)
    with pytest.raises(TypeError if wrong_type else ValueError) as info:
        prefetch(iter([]), topology=SINGLE, nice=nice)
    got = f"{type(nice).__name__} {nice!r}" if wrong_type else repr(nice)
    assert str(info.value) == f"prefetch nice must be an int from 0 to 19, got {got}"


def test_unknown_options_are_listed() -> None:
    with pytest.raises(TypeError) as info:
        prefetch(iter([]), topology=SINGLE, zz=1, cp_layuot="row", packed=True)
    assert str(info.value) == (
        "prefetch got unknown options ['cp_layuot', 'zz']; it passes on ['cp_layout', 'fields', "
        "'packed', 'sequence_parallel', 'static'] to get_batch_on_this_tp_rank"
    )


@pytest.mark.parametrize("nice", [0, 1, 19])
def test_the_thread_lowers_its_own_priority(monkeypatch: pytest.MonkeyPatch, nice: int) -> None:
    calls = fake_get_batch(monkeypatch)
    mine = my_nice()
    with prefetch(iter([0]), topology=SINGLE, nice=nice) as batches:
        assert next(batches) == {"item": 0}
    assert calls[0].thread == THREAD and calls[0].nice == min(19, mine + nice)
    assert my_nice() == mine  # the caller's stays


def fake_os(monkeypatch: pytest.MonkeyPatch, now: int, error: bool = False) -> list[Any]:
    log: list[Any] = []

    def getpriority(which: int, who: int) -> int:
        log.append(("get", which, who))
        return now

    def setpriority(which: int, who: int, value: int) -> None:
        log.append(("set", which, who, value))
        if error:
            raise PermissionError("not allowed")

    fake = types.SimpleNamespace(PRIO_PROCESS=os.PRIO_PROCESS, getpriority=getpriority,
                                 setpriority=setpriority)  # fmt: skip
    monkeypatch.setattr(prefetch_module, "os", fake)
    return log


@pytest.mark.parametrize(("now", "by", "then"), [(3, 5, 8), (15, 10, 19), (0, 19, 19)])
def test_lower_priority_adds_up_to_19(
    monkeypatch: pytest.MonkeyPatch, now: int, by: int, then: int
) -> None:
    log = fake_os(monkeypatch, now)
    prefetch_module._lower_priority(by)
    tid = threading.get_native_id()
    assert log == [("get", os.PRIO_PROCESS, tid), ("set", os.PRIO_PROCESS, tid, then)]


def test_lower_priority_by_0_or_off_linux_or_refused_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = fake_os(monkeypatch, 2, error=True)
    prefetch_module._lower_priority(0)
    assert log == []
    prefetch_module._lower_priority(4)  # refused: no error
    assert [entry[0] for entry in log] == ["get", "set"]
    monkeypatch.setattr(prefetch_module, "sys", types.SimpleNamespace(platform="darwin"))
    prefetch_module._lower_priority(4)
    assert len(log) == 2
