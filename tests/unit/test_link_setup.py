"""Local-link set-up (`megapack.delivery.link_setup`) in one process: the ranks of a group are
threads whose set-up collectives meet at a barrier, so the whole handshake runs for real (an
abstract socket, SO_PEERCRED, the secret); strays, silent and lying connections, fallbacks that
every rank agrees on, the cache per group, and forked children."""

from __future__ import annotations

import gc
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from megapack.delivery import link_setup
from megapack.delivery.link import LocalLink

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="abstract sockets and SO_PEERCRED are Linux's"
)
WHAT = "megapack local link set-up from rank 0"


class Threads:
    """A process group whose ranks are threads of this process (hashable, weakly referenced)."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks
        self.barrier = threading.Barrier(len(ranks))
        self.slots: dict[int, torch.Tensor] = {}
        self.calls: list[tuple[str, int, str, float | None]] = []

    def meet(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.clone()
        self.barrier.wait(20)
        out = [self.slots[r] for r in self.ranks]
        self.barrier.wait(20)
        return out


_me = threading.local()


class PerRank:
    """`link_setup._links` as each rank, a process of its own, sees it: its own weak cache."""

    def __init__(self) -> None:
        self.by_rank: dict[int, weakref.WeakKeyDictionary[Any, Any]] = {}

    def _mine(self) -> weakref.WeakKeyDictionary[Any, Any]:
        return self.by_rank.setdefault(_me.rank, weakref.WeakKeyDictionary())

    def get(self, key: Any, default: Any = None) -> Any:
        return self._mine().get(key, default)

    def setdefault(self, key: Any, default: Any) -> Any:
        return self._mine().setdefault(key, default)


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> Callable[..., dict[int, Any]]:
    """``run(group, fn)``: ``fn(rank)`` on a thread per rank of ``group``; rank -> result or error."""

    def all_gather(tensor: torch.Tensor, *, group: Threads, what: str,
                   timeout: float | None = None) -> list[torch.Tensor]:  # fmt: skip
        group.calls.append(("all_gather", _me.rank, what, timeout))
        return group.meet(_me.rank, tensor)

    def all_reduce_min(tensor: torch.Tensor, *, group: Threads, what: str,
                       timeout: float | None = None) -> None:  # fmt: skip
        group.calls.append(("all_reduce_min", _me.rank, what, timeout))
        tensor.copy_(torch.stack(group.meet(_me.rank, tensor)).min(dim=0).values)

    monkeypatch.setattr(link_setup.comm, "all_gather", all_gather)
    monkeypatch.setattr(link_setup.comm, "all_reduce_min", all_reduce_min)
    monkeypatch.setattr(link_setup.comm, "group_ranks", lambda group: list(group.ranks))
    monkeypatch.setattr(link_setup, "control_group", lambda group: group)
    monkeypatch.setattr(link_setup.dist, "get_rank", lambda: _me.rank)
    monkeypatch.setattr(link_setup, "_links", PerRank())  # each rank (process) has its own cache

    def run(group: Threads, fn: Callable[[int], Any]) -> dict[int, Any]:
        results: dict[int, Any] = {}

        def body(rank: int) -> None:
            _me.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as exc:
                results[rank] = exc

        workers = [threading.Thread(target=body, args=(r,), daemon=True) for r in group.ranks]
        for w in workers:
            w.start()
        for w in workers:
            w.join(30)
        assert not any(w.is_alive() for w in workers), "a rank is stuck in set-up"
        return results

    return run


@pytest.fixture
def made() -> Iterator[list[LocalLink]]:
    """Links a test made, closed after it."""
    links: list[LocalLink] = []
    yield links
    for link in links:
        link.close()


def connect(run: Callable[..., dict[int, Any]], group: Threads, made: list[LocalLink],
            timeout: float | None = 4.0) -> dict[int, Any]:  # fmt: skip
    out = run(group, lambda rank: link_setup.link_for(group, 0, timeout=timeout))
    made += [v for v in out.values() if isinstance(v, LocalLink)]
    return out


def test_every_peer_gets_a_link_to_the_source_and_frames_flow(
    threads: Callable[..., dict[int, Any]],
    made: list[LocalLink],
    caplog: pytest.LogCaptureFixture,
) -> None:
    group = Threads((0, 1, 2))
    with caplog.at_level(logging.INFO, logger="megapack.delivery"):
        links = connect(threads, group, made)
    assert caplog.messages == []  # nothing refused (the source does not dial itself)
    source = links[0]
    assert isinstance(source, LocalLink) and (source.src, source.rank) == (0, 0)
    assert list(source.peers) == [1, 2] and source.is_source and source.pid == os.getpid()
    for r in (1, 2):
        assert (links[r].src, links[r].rank, list(links[r].peers)) == (0, r, [0])
    source.send([b"hello"], what="frame", timeout=5)
    assert [bytes(links[r].receive(what="frame", timeout=5)) for r in (1, 2)] == [b"hello"] * 2
    # one gather of the records, then two MIN reductions (reached, accepted), on every rank
    ops = sorted((op, rank) for op, rank, _, _ in group.calls)
    assert ops == sorted([(op, r) for r in (0, 1, 2) for op in ("all_gather", "all_reduce_min", "all_reduce_min")])  # fmt: skip
    assert {(what, timeout) for _, _, what, timeout in group.calls} == {(WHAT, 4.0)}


def test_a_groups_link_is_set_up_once_and_again_after_a_failure_or_a_fork(
    threads: Callable[..., dict[int, Any]], made: list[LocalLink]
) -> None:
    group = Threads((0, 1))
    first = connect(threads, group, made)
    calls = len(group.calls)
    again = connect(threads, group, made)
    assert again[0] is first[0] and again[1] is first[1] and len(group.calls) == calls
    first[1].close()  # a failure closed the peer's link: that rank's next call sets up anew
    first[0].close()
    fresh = connect(threads, group, made)
    assert fresh[0] is not first[0] and len(group.calls) == 2 * calls
    fresh[0].pid = fresh[1].pid = -1  # as in a forked child: never reuse the parent's link
    forked = connect(threads, group, made)
    assert forked[0] is not fresh[0] and forked[1] is not fresh[1]


def test_a_group_of_one_or_none_has_no_link(
    threads: Callable[..., dict[int, Any]],
) -> None:
    assert link_setup.link_for(None, 0) is None
    alone = Threads((0,))
    assert threads(alone, lambda rank: link_setup.link_for(alone, 0)) == {0: None}
    assert alone.calls == []


def test_without_a_listener_no_rank_links_and_every_rank_remembers(
    threads: Callable[..., dict[int, Any]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(link_setup, "_listen", lambda peers: (None, b""))  # e.g. not Linux
    group = Threads((0, 1, 2))
    with caplog.at_level(logging.INFO, logger="megapack.delivery"):
        assert threads(group, lambda r: link_setup.link_for(group, 0)) == {
            0: None,
            1: None,
            2: None,
        }
    assert (
        caplog.messages.count(
            f"{WHAT}: no local link (a peer could not connect or prove membership)"
        )
        == 3
    )
    calls = len(group.calls)
    assert threads(group, lambda r: link_setup.link_for(group, 0)) == {0: None, 1: None, 2: None}
    assert len(group.calls) == calls  # the answer is remembered: no second set-up
    assert [op for op, rank, _, _ in group.calls if rank == 0] == ["all_gather", "all_reduce_min"]


def test_one_peer_that_cannot_connect_makes_every_rank_fall_back(
    threads: Callable[..., dict[int, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    dial = link_setup._dial
    monkeypatch.setattr(link_setup, "_dial",
                        lambda address, rank, *a: None if rank == 2 else dial(address, rank, *a))  # fmt: skip
    group = Threads((0, 1, 2))
    assert threads(group, lambda r: link_setup.link_for(group, 0)) == {0: None, 1: None, 2: None}


def test_a_peer_refused_at_accept_makes_every_rank_fall_back(
    threads: Callable[..., dict[int, Any]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    hello = link_setup._HELLO

    class Liar:  # rank 2 says the wrong secret
        size = hello.size

        @staticmethod
        def pack(rank: int, secret: bytes) -> bytes:
            return hello.pack(rank, bytes(len(secret)) if rank == 2 else secret)

        unpack = staticmethod(hello.unpack)

    monkeypatch.setattr(link_setup, "_HELLO", Liar)
    monkeypatch.setattr(link_setup, "CONNECT_TIMEOUT_S", 0.5)  # the source waits for rank 2
    group = Threads((0, 1, 2))
    with caplog.at_level(logging.WARNING, logger="megapack.delivery"):
        out = threads(group, lambda r: link_setup.link_for(group, 0, timeout=4.0))
    assert out == {0: None, 1: None, 2: None}
    assert caplog.messages == [
        f"{WHAT}: refused a connection from pid {os.getpid()}: it did not prove membership (rank 2)"
    ]
    assert [op for op, rank, _, _ in group.calls if rank == 1] == [
        "all_gather", "all_reduce_min", "all_reduce_min"
    ]  # fmt: skip


# ---------------------------------------------------------------- accepting only peers


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, bytes]]:
    sock, address = link_setup._listen(4)
    assert sock is not None and address.startswith(b"\0megapack-link-")
    yield sock, address
    sock.close()


def _dial_later(address: bytes, rank: int, secret: bytes, delay: float = 0.0) -> list[Any]:
    out: list[Any] = []

    def go() -> None:
        time.sleep(delay)
        out.append(link_setup._dial(address, rank, secret, os.getpid(), os.getuid()))

    threading.Thread(target=go, daemon=True).start()
    return out


def test_accept_takes_each_peer_once_and_refuses_a_wrong_secret_or_a_silent_one(
    listener: tuple[socket.socket, bytes],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(link_setup, "HELLO_TIMEOUT_S", 0.2)
    sock, address = listener
    secret = os.urandom(link_setup.SECRET_BYTES)
    pid = os.getpid()
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(address)  # connects and says nothing
    wrong = _dial_later(address, 1, bytes(link_setup.SECRET_BYTES), 0.05)
    good = _dial_later(address, 1, secret, 0.35)
    twice = _dial_later(address, 1, secret, 0.5)  # rank 1 again, after it was accepted
    other = _dial_later(address, 2, secret, 0.7)
    with caplog.at_level(logging.WARNING, logger="megapack.delivery"):
        peers = link_setup._accept(sock, {1: pid, 2: pid}, secret, "set-up")
    try:
        assert sorted(peers) == [1, 2] and all(p.gettimeout() is None for p in peers.values())
        refused = f"set-up: refused a connection from pid {pid}: it did not prove membership"
        assert caplog.messages == [
            f"{refused} (rank -1)",  # silent past HELLO_TIMEOUT_S
            f"{refused} (rank 1)",  # the wrong secret
            f"{refused} (rank 1)",  # rank 1 again, once it was in
        ]
        assert all(d[0] is not None for d in (wrong, good, twice, other))  # each one connected
    finally:
        silent.close()
        for p in peers.values():
            p.close()


def test_accept_gives_up_at_its_deadline(
    listener: tuple[socket.socket, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(link_setup, "CONNECT_TIMEOUT_S", 0.3)
    sock, address = listener
    secret = os.urandom(link_setup.SECRET_BYTES)
    _dial_later(address, 1, secret)
    start = time.monotonic()
    peers = link_setup._accept(sock, {1: os.getpid(), 2: os.getpid()}, secret, "set-up")
    assert list(peers) == [1] and time.monotonic() - start < 1.5
    peers[1].close()


def test_a_stray_process_is_closed_before_a_byte_is_read_or_sent(
    listener: tuple[socket.socket, bytes],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sock, address = listener
    secret = os.urandom(link_setup.SECRET_BYTES)
    stray = subprocess.Popen(  # connects first, claims rank 1 with the secret, reports what it got
        [sys.executable, "-c", (
            "import socket, struct, sys\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            f"s.connect({address!r})\n"
            f"s.sendall(struct.pack('<q', 1) + {secret!r})\n"
            "s.settimeout(10)\n"
            "try:\n"
            "    print(len(s.recv(100)))\n"
            "except ConnectionResetError:\n"  # closed with its bytes unread
            "    print(0)\n"
        )], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(0.5)  # its connection waits in the queue first
    good = _dial_later(address, 1, secret, 0.1)
    with caplog.at_level(logging.WARNING, logger="megapack.delivery"):
        peers = link_setup._accept(sock, {1: os.getpid()}, secret, "set-up")
    out, _ = stray.communicate(timeout=20)
    deadline = time.monotonic() + 10  # the dialer's own side may finish just after the accept
    while not good and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(peers) == [1] and good and good[0] is not None
    assert out.strip() == "0"  # closed on it: it received nothing
    assert caplog.messages == [
        f"set-up: refused a connection from pid {stray.pid} uid {os.getuid()}: not a peer of "
        "this group"
    ]
    peers[1].close()


def test_a_peer_refuses_a_listener_that_is_not_the_sources_process(
    listener: tuple[socket.socket, bytes],
) -> None:
    _, address = listener
    secret = os.urandom(link_setup.SECRET_BYTES)
    assert link_setup._dial(address, 1, secret, os.getpid() + 1, os.getuid()) is None
    assert link_setup._dial(address, 1, secret, os.getpid(), os.getuid() + 1) is None
    assert link_setup._dial(b"\0megapack-link-nobody", 1, secret, os.getpid(), os.getuid()) is None
    sock = link_setup._dial(address, 1, secret, os.getpid(), os.getuid())
    assert sock is not None
    sock.close()


def test_credentials_name_this_process() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    assert link_setup._credentials(a) == (os.getpid(), os.getuid(), os.getgid())
    a.close()
    b.close()


# ---------------------------------------------------------------- forks and garbage


def test_a_forked_child_closes_every_link_it_inherited() -> None:
    class Group:
        pass

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    group, other = Group(), Group()
    link = LocalLink(src=0, rank=0, peers={1: a})
    link_setup._links[group] = {0: link, 3: None}
    closed_before = LocalLink(src=0, rank=0, peers={1: b})
    closed_before.close()
    link_setup._links[other] = {0: closed_before}
    link_setup._after_fork_in_child()
    assert link.closed and len(link_setup._links) == 0
    assert b.fileno() == -1


def test_a_link_closes_when_its_group_is_collected(
    threads: Callable[..., dict[int, Any]], made: list[LocalLink]
) -> None:
    group = Threads((0, 1))
    links = connect(threads, group, made)
    assert not links[0].closed
    del group
    gc.collect()
    assert links[0].closed and links[1].closed


def test_accept_ends_at_its_deadline_even_while_a_connection_stays_silent(
    listener: tuple[socket.socket, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(link_setup, "CONNECT_TIMEOUT_S", 0.3)  # shorter than HELLO_TIMEOUT_S
    sock, address = listener
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(address)
    start = time.monotonic()
    assert link_setup._accept(sock, {1: os.getpid()}, b"s" * 32, "set-up") == {}
    assert time.monotonic() - start < 1.5
    silent.close()


def test_a_peer_may_take_a_moment_to_say_its_rank(listener: tuple[socket.socket, bytes]) -> None:
    sock, address = listener
    secret = os.urandom(link_setup.SECRET_BYTES)
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.connect(address)
    threading.Timer(0.2, lambda: slow.sendall(link_setup._HELLO.pack(1, secret))).start()
    peers = link_setup._accept(sock, {1: os.getpid()}, secret, "set-up")
    assert list(peers) == [1]
    peers[1].close()
    slow.close()


def test_a_peer_gives_up_on_a_source_that_does_not_accept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link_setup, "CONNECT_TIMEOUT_S", 0.2)
    address = f"\0megapack-test-{os.getpid()}-full".encode()
    full = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    full.bind(address)
    full.listen(0)
    queued = []
    with pytest.raises(BlockingIOError):  # fill the listener's queue: a connect would now wait
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            queued.append(s)
            s.setblocking(False)
            s.connect(address)
    got: list[Any] = []
    dialer = threading.Thread(
        target=lambda: got.append(
            link_setup._dial(address, 1, b"s" * 32, os.getpid(), os.getuid())
        ),
        daemon=True,
    )
    dialer.start()
    dialer.join(3)
    alive = dialer.is_alive()
    full.close()  # unblocks a stuck dial
    for s in queued:
        s.close()
    dialer.join(3)
    assert not alive and got == [None]


def test_no_listener_where_so_peercred_cannot_name_the_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with monkeypatch.context() as m:
        m.setattr(link_setup.sys, "platform", "darwin")
        assert link_setup._listen(2) == (None, b"")
    with monkeypatch.context() as m:
        m.delattr(link_setup.socket, "SO_PEERCRED")
        assert link_setup._listen(2) == (None, b"")


def test_no_listener_when_its_name_cannot_be_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    fixed = uuid.uuid4()
    monkeypatch.setattr(link_setup.uuid, "uuid4", lambda: fixed)
    first, address = link_setup._listen(2)  # the name is taken now
    assert first is not None and address
    try:
        assert link_setup._listen(2) == (None, b"")
    finally:
        first.close()
