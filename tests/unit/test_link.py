"""A local link's I/O on its own (a socketpair, no process group): bodies larger than the socket
buffer, sealed read-only shared memory, the frame sequence check, and deadlines that end every wait."""

from __future__ import annotations

import fcntl
import gc
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

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


# ---------------------------------------------------------------- frames, segments, failures in full

UNUSABLE = (
    "over the local link. A peer is stuck, has crashed, or is not calling the same step; the group "
    "is now unusable"
)
needs_shared = pytest.mark.skipif(
    not link_module.SHARED_OK, reason="needs memfd_create and send_fds (Linux)"
)


def open_fds() -> int:
    """This process's open descriptors, once collected garbage (an old link's) let go of its own."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def fill(n: int, value: int) -> object:
    """A ``write`` for `LocalLink.send_frame` that fills the frame with ``value``."""

    def write(frame: np.ndarray) -> None:
        assert len(frame) == n
        frame[:] = value

    return write


def test_parts_of_every_kind_go_back_to_back(pair: tuple[LocalLink, LocalLink]) -> None:
    source, peer = pair
    parts = [torch.tensor([1, -2], dtype=torch.int64), np.array([[1.5, 2.0]], dtype=np.float32),
             b"xyz", bytearray(b"\x00\xff")]  # fmt: skip
    source.send(parts, what="frame", timeout=5)
    want = parts[0].numpy().tobytes() + parts[1].tobytes() + b"xyz" + b"\x00\xff"
    assert bytes(peer.receive(what="frame", timeout=5)) == want


@needs_shared
def test_frames_from_64_kib_go_through_shared_memory_smaller_ones_on_the_socket(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    source, peer = pair
    small = link_module.SHARED_MIN_BYTES - 1
    for n, value, through_shared in ((small, 1, False), (small + 1, 2, True), (100, 3, False)):
        _, shared = source.send_frame(n, fill(n, value), what="frame", timeout=5)  # type: ignore[arg-type]
        got = peer.receive(what="frame", timeout=5)
        assert shared is through_shared and len(got) == n and set(got.tolist()) == {value}, n
        if not through_shared and source.shared is None:
            assert peer.shared is None  # no segment until a frame needs one


@needs_shared
def test_the_segment_is_kept_while_frames_fit_and_grows_by_a_quarter_or_doubles(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    source, peer = pair
    mib = 1 << 20
    sizes = [(70_000, mib), (mib, mib), (3 * mib // 2, 2 * mib), (4 * mib, 5 * mib)]
    mapped = None
    for i, (n, segment) in enumerate(sizes):
        _, shared = source.send_frame(n, fill(n, i), what="frame", timeout=5)  # type: ignore[arg-type]
        got = peer.receive(what="frame", timeout=5)
        assert shared and len(got) == n and got[0] == got[-1] == i
        assert source.shared_bytes == peer.shared_bytes == segment, n
        if n == mib:  # exactly the segment's size: the same mapping, no new descriptor
            assert peer.shared is mapped
        mapped = peer.shared


@needs_shared
def test_without_shared_memory_to_be_had_a_large_frame_goes_on_the_socket(
    pair: tuple[LocalLink, LocalLink], monkeypatch: pytest.MonkeyPatch
) -> None:
    source, peer = pair

    def no_memory(fd: int, size: int) -> None:
        raise OSError(12, "Cannot allocate memory")

    before = open_fds()
    monkeypatch.setattr(os, "ftruncate", no_memory)
    _, shared = source.send_frame(100_000, fill(100_000, 7), what="frame", timeout=5)  # type: ignore[arg-type]
    got = peer.receive(what="frame", timeout=5)
    assert not shared and len(got) == 100_000 and set(got.tolist()) == {7}
    assert source.shared is None and peer.shared is None and open_fds() == before


@needs_shared
def test_a_write_that_fails_sends_nothing_and_leaves_the_link_in_step(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    source, peer = pair

    def boom(frame: np.ndarray) -> None:
        raise RuntimeError("boom")

    source.send([b"first"], what="frame", timeout=5)
    assert bytes(peer.receive(what="frame", timeout=5)) == b"first"
    before = open_fds()
    with pytest.raises(RuntimeError, match="boom"):  # a new segment the peer never hears of
        source.send_frame(100_000, boom, what="frame", timeout=5)
    assert (source.shared, source.shared_bytes) == (None, 0) and open_fds() == before
    with pytest.raises(RuntimeError, match="boom"):  # and a small frame
        source.send_frame(10, boom, what="frame", timeout=5)
    source.send([np.full(100_000, 9, dtype=np.uint8)], what="frame", timeout=0.5)  # no ack due
    got = peer.receive(what="frame", timeout=5)
    assert len(got) == 100_000 and set(got.tolist()) == {9} and peer.shared is not None


def test_a_peer_waiting_past_its_timeout_fails_at_once_in_full(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    _, peer = pair
    start = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        peer.receive(what="frame", timeout=0.05)
    assert time.monotonic() - start < 0.5
    assert str(info.value) == (
        "frame timed out (timeout 0.05 s, set by timeout= or $MEGAPACK_TIMEOUT_S) on rank 1 "
        f"receiving from rank 0 {UNUSABLE}"
    )
    assert peer.closed


def test_a_source_waiting_for_an_ack_past_its_timeout_fails_at_once_in_full(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    source, _ = pair
    source.send([b"never acknowledged"], what="frame", timeout=5)
    start = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        source.send([b"next"], what="frame", timeout=0.05)
    assert time.monotonic() - start < 0.5
    assert str(info.value) == (
        "frame timed out (timeout 0.05 s, set by timeout= or $MEGAPACK_TIMEOUT_S) on rank 0 "
        f"sending to rank 1 {UNUSABLE}"
    )


def _send_in_thread(send: object) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            send()  # type: ignore[operator]
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def _stuck_send_fails(
    pair: tuple[LocalLink, LocalLink], send: object, timeout: float
) -> CollectiveError:
    """``send`` (blocked on a peer that does not read) must fail by itself within its timeout."""
    _, peer = pair
    start = time.monotonic()
    thread, errors = _send_in_thread(send)
    thread.join(timeout + 2)
    if thread.is_alive():
        peer.close()  # unblock the sender before failing
        thread.join(5)
        pytest.fail(f"the send was still blocked {timeout + 2} s after a {timeout} s timeout")
    assert time.monotonic() - start < timeout + 0.6  # (not a second more: the wait is bounded)
    assert len(errors) == 1 and isinstance(errors[0], CollectiveError), errors
    return errors[0]


def test_a_source_blocked_on_a_peer_that_stopped_reading_times_out(
    pair: tuple[LocalLink, LocalLink], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(link_module, "SHARED_OK", False)
    source, _ = pair
    body = np.zeros(8 << 20, dtype=np.uint8)
    error = _stuck_send_fails(
        pair, lambda: source.send([body], what="frame", timeout=0.2), timeout=0.2
    )
    assert str(error) == (
        "frame timed out (timeout 0.2 s, set by timeout= or $MEGAPACK_TIMEOUT_S) on rank 0 "
        f"sending to rank 1 {UNUSABLE}"
    )


@needs_shared
def test_a_new_segment_announced_to_a_peer_that_stopped_reading_times_out(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    source, _ = pair
    sock = source.peers[1]
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):  # the peer's socket buffer, full of unread bytes
        while True:
            sock.send(bytes(65536))
    sock.setblocking(True)
    error = _stuck_send_fails(
        pair, lambda: source.send_frame(100_000, fill(100_000, 1), what="frame", timeout=0.2),  # type: ignore[arg-type]
        timeout=0.2,
    )  # fmt: skip
    assert "timed out (timeout 0.2 s" in str(error) and "sending to rank 1" in str(error)


def test_a_slow_peer_is_waited_for_within_the_timeout(
    pair: tuple[LocalLink, LocalLink], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(link_module, "SHARED_OK", False)  # 8 MiB on the socket: it fills up
    source, peer = pair
    got: list[np.ndarray] = []
    reader = threading.Timer(0.3, lambda: got.append(peer.receive(what="frame", timeout=10)))
    reader.start()
    body = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)
    source.send([body], what="frame", timeout=10)
    reader.join(10)
    assert len(got) == 1 and np.array_equal(got[0], body)


def test_sending_to_a_closed_peer_fails_naming_the_error(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    source, peer = pair
    peer.close()
    with pytest.raises(CollectiveError) as info:
        source.send([b"x" * 100], what="frame", timeout=5)
    assert str(info.value) == (
        f"frame failed: BrokenPipeError: [Errno 32] Broken pipe on rank 0 sending to rank 1 {UNUSABLE}"
    )
    assert source.closed


@needs_shared
def test_a_prefix_split_after_its_descriptor_is_read_whole(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    # A read stops at the message that carries descriptors: the peer gets 10 bytes and the
    # segment, then must read the prefix's other 30.
    source, peer = pair
    fd = source._reserve(1000)
    assert fd is not None and source.shared is not None
    source.shared[:1000] = np.arange(1000) % 251
    prefix = link_module._PREFIX.pack(link_module._MAGIC, 0, 1000, link_module._NEW_SEGMENT,
                                      source.shared_bytes)  # fmt: skip
    socket.send_fds(source.peers[1], [prefix[:10]], [fd])
    os.close(fd)
    source.peers[1].sendall(prefix[10:])
    got = peer.receive(what="frame", timeout=5)
    assert got.tolist() == (np.arange(1000) % 251).tolist()
    assert peer.shared_bytes == source.shared_bytes == 1 << 20


@needs_shared
def test_a_peer_keeps_no_descriptor_beyond_the_segments(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    source, peer = pair
    fd = source._reserve(1000)
    assert fd is not None
    extra = os.open(os.devnull, os.O_RDONLY)
    prefix = link_module._PREFIX.pack(link_module._MAGIC, 0, 1000, link_module._NEW_SEGMENT,
                                      source.shared_bytes)  # fmt: skip
    socket.send_fds(source.peers[1], [prefix], [fd, extra])
    os.close(fd)
    os.close(extra)
    before = open_fds()
    assert len(peer.receive(what="frame", timeout=5)) == 1000
    # The mapping holds one descriptor (Python's mmap keeps a dup); the one received was closed
    # once mapped, and the extra was never installed.
    assert open_fds() == before + 1


@needs_shared
def test_an_out_of_step_frame_with_a_segment_is_refused_in_full_and_its_descriptor_closed(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    source, peer = pair
    fd = source._reserve(1000)
    assert fd is not None
    prefix = link_module._PREFIX.pack(link_module._MAGIC, 5, 1000, link_module._NEW_SEGMENT,
                                      source.shared_bytes)  # fmt: skip
    socket.send_fds(source.peers[1], [prefix], [fd])
    os.close(fd)
    before = open_fds()
    with pytest.raises(CollectiveError) as info:
        peer.receive(what="frame", timeout=5)
    assert str(info.value) == (
        "frame on rank 1: the local link from rank 0 is out of step (frame 5, magic 0x4d504c4b; "
        "expected frame 0); end the job"
    )
    assert open_fds() == before - 1 and peer.closed  # its socket closed, no descriptor kept


@needs_shared
def test_an_unsealed_segment_is_refused_in_full(pair: tuple[LocalLink, LocalLink]) -> None:
    source, peer = pair
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 1 << 20)
    prefix = link_module._PREFIX.pack(link_module._MAGIC, 0, 100, link_module._NEW_SEGMENT, 1 << 20)
    socket.send_fds(source.peers[1], [prefix], [fd])
    os.close(fd)
    with pytest.raises(CollectiveError) as info:
        peer.receive(what="frame", timeout=5)
    assert str(info.value) == (
        "frame on rank 1: the shared memory from rank 0 is not sealed at its size; refusing to "
        "map it"
    )
    assert (peer.shared, peer.shared_bytes, peer.closed) == (None, 0, True)


@pytest.mark.parametrize("size", [40, 200_000], ids=["inline", "shared"])
def test_exit_a_frame_held_whole_is_delivered_when_the_source_is_gone_before_the_ack(
    pair: tuple[LocalLink, LocalLink], size: int
) -> None:
    # The source sends its last frame (a stop, an error) and exits: the peer's acknowledgement
    # fails, but the frame is whole, so it is returned; the next call names the source's exit.
    source, peer = pair
    body = np.arange(size, dtype=np.uint8)
    source.send([body], what="frame", timeout=30)
    source.close()  # gone before the peer reads: its ack has nobody to go to
    assert np.array_equal(peer.receive(what="frame", timeout=30), body)
    assert not peer.closed  # still usable until the next call reports the exit
    with pytest.raises(CollectiveError, match=r"TP source rank 0 exited \(or closed the local link\) "
                                              r"after its last frame, which was delivered; "
                                              r"acknowledging it failed with BrokenPipeError"):  # fmt: skip
        peer.receive(what="frame", timeout=30)
    assert peer.closed


def test_exit_a_source_gone_mid_frame_is_an_error_not_a_frame(
    pair: tuple[LocalLink, LocalLink],
) -> None:
    source, peer = pair
    sock = source.peers[1]
    sock.sendall(link_module._PREFIX.pack(link_module._MAGIC, 0, 100, link_module._INLINE, 0))
    sock.sendall(b"x" * 10)  # 10 of the body's 100 bytes, then the source is gone
    source.close()
    with pytest.raises(CollectiveError, match="rank 0 closed the link"):
        peer.receive(what="frame", timeout=30)
