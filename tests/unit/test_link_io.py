"""A local link's I/O on its own (a socketpair, no process group): bodies larger than the socket
buffer, sealed read-only shared memory, the frame sequence check, and deadlines that end every wait."""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from megapack.core.errors import CollectiveError
from megapack.delivery import link as link_module
from megapack.delivery.link import LocalLink


@pytest.fixture
def pair() -> Iterator[tuple[LocalLink, LocalLink]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    source = LocalLink(src=0, rank=0, peers={1: a})
    peer = LocalLink(src=0, rank=1, peers={0: b})
    yield source, peer
    source.close()
    peer.close()


def _threaded_send(source: LocalLink, body: object) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def send() -> None:
        try:
            source.send([body], what="frame", timeout=30)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    return sender, errors


def test_an_inline_frame_larger_than_the_socket_buffer_arrives_whole(
    pair: tuple[LocalLink, LocalLink], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender fills the peer's socket buffer many times over while the peer reads."""
    monkeypatch.setattr(link_module, "SHARED_OK", False)  # the whole body on the socket
    source, peer = pair
    body = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
    sender, errors = _threaded_send(source, body)
    got = peer.receive(what="frame", timeout=30)
    sender.join(30)
    assert not errors and not sender.is_alive()
    assert np.array_equal(got, body)


@pytest.mark.skipif(not link_module.SHARED_OK, reason="needs memfd_create and send_fds (Linux)")
def test_large_frames_go_through_sealed_shared_memory_the_peer_maps_read_only(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    source, peer = pair
    bodies = [np.full(n, i + 1, dtype=np.uint8) for i, n in enumerate((70_000, 90_000, 3_000_000))]
    for body in bodies:
        source.send([body], what="frame", timeout=10)
        got = peer.receive(what="frame", timeout=10)
        assert np.array_equal(got, body)
        assert not np.shares_memory(got, peer.shared)  # the peer's own copy
    assert source.shared_bytes >= 3_000_000 and peer.shared_bytes == source.shared_bytes
    assert source.shared is not None and peer.shared is not None
    assert source.shared.flags.writeable and not peer.shared.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        peer.shared[0] = 1


@pytest.mark.skipif(not link_module.SHARED_OK, reason="needs memfd_create and send_fds (Linux)")
def test_a_segment_that_is_not_sealed_is_refused(pair: tuple[LocalLink, LocalLink]) -> None:
    source, peer = pair
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 1 << 20)
    prefix = struct.pack("<qqqqq", link_module._MAGIC, 0, 100, link_module._NEW_SEGMENT, 1 << 20)
    socket.send_fds(source.peers[1], [prefix], [fd])
    os.close(fd)
    with pytest.raises(CollectiveError, match="not sealed at its size"):
        peer.receive(what="frame", timeout=5)
    assert peer.closed


def test_regression_a_replayed_or_skipped_frame_is_refused(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    source, peer = pair
    source.send([b"first"], what="frame", timeout=5)
    assert bytes(peer.receive(what="frame", timeout=5)) == b"first"
    source.sent = 0  # the source replays frame 0 (a stale frame) where frame 1 is due
    source._acked = True
    source.send([b"stale"], what="frame", timeout=5)
    with pytest.raises(CollectiveError, match=r"out of step \(frame 0, .*expected frame 1\)"):
        peer.receive(what="frame", timeout=5)
    assert peer.closed


def test_regression_a_frame_from_the_future_is_refused(pair: tuple[LocalLink, LocalLink]) -> None:
    source, peer = pair
    source.sent, source._acked = 5, True
    source.send([b"x"], what="frame", timeout=5)
    with pytest.raises(CollectiveError, match=r"frame 5, .*expected frame 0"):
        peer.receive(what="frame", timeout=5)


def test_a_peer_that_never_acknowledges_fails_the_next_send_within_the_timeout(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    source, peer = pair
    source.send([b"first"], what="frame", timeout=5)
    assert bytes(peer.receive(what="frame", timeout=5)) == b"first"  # acknowledged
    source.send([b"second"], what="frame", timeout=5)  # the peer never takes this one
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=r"timed out .* on rank 0 sending to rank 1"):
        source.send([b"third"], what="frame", timeout=0.3)
    assert time.monotonic() - start < 3


def test_a_peer_waiting_for_a_source_that_never_sends_times_out(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    _, peer = pair
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=r"timed out .* on rank 1 receiving from rank 0"):
        peer.receive(what="frame", timeout=0.3)
    assert 0.25 < time.monotonic() - start < 3


def test_a_source_that_closes_ends_the_peers_wait_at_once(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    source, peer = pair
    threading.Timer(0.1, source.close).start()
    start = time.monotonic()
    with pytest.raises(CollectiveError, match="rank 0 closed the link"):
        peer.receive(what="frame", timeout=30)
    assert time.monotonic() - start < 3


def test_the_source_segment_cannot_be_shrunk(pair: tuple[LocalLink, LocalLink]) -> None:
    source, _peer = pair
    if not link_module.SHARED_OK:
        pytest.skip("needs memfd_create (Linux)")
    fd = source._reserve(100_000)
    assert fd is not None
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert (
            seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        )
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 10)
        mmap.mmap(fd, 4096, prot=mmap.PROT_READ).close()
    finally:
        os.close(fd)
