"""A local link's socket I/O on its own (a socketpair, no process group): bodies larger than the
socket buffer, and deadlines that end every wait."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from megapack import local_link
from megapack.errors import CollectiveError
from megapack.local_link import LocalLink


@pytest.fixture
def pair() -> Iterator[tuple[LocalLink, LocalLink]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    source = LocalLink(src=0, rank=0, peers={1: a})
    peer = LocalLink(src=0, rank=1, peers={0: b})
    yield source, peer
    source.close()
    peer.close()


def test_an_inline_frame_larger_than_the_socket_buffer_arrives_whole(
    pair: tuple[LocalLink, LocalLink], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender fills the peer's socket buffer many times over while the peer reads, and the
    peer's reads of the body outrun the sender: both wait and resume."""
    monkeypatch.setattr(local_link, "_SHARED_OK", False)  # the whole body on the socket
    source, peer = pair
    body = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            source.send([body], what="frame", timeout=30)
        except BaseException as exc:  # reported below
            errors.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    got = peer.receive(what="frame", timeout=30)
    sender.join(30)
    assert not errors and not sender.is_alive()
    assert np.array_equal(got, body)


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
