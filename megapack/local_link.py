"""Local links: a group's source hands frames to its peers on the same host over Unix sockets.

Tensor-parallel groups live inside one node, so the TP source and its peers share a kernel. A gloo
broadcast between them still costs ~0.25 ms for any small message on CPU (tp=2; ~0.6 ms at tp=4),
nearly all of it thread hand-offs inside gloo (work queue, transport loop, completion), not
bytes. A local link sends the same frame from the caller's own thread with one ``sendmsg`` per
peer into a connected Unix stream socket, and the peer's blocking ``recv_into`` wakes once:
~0.05 ms for a 17 KB frame at tp=2 on the 2-core CPU that measured the numbers above.

Per frame, each peer gets a prefix ``[magic, sequence, nbytes, where, segment bytes]`` (5 x int64)
and the body: on the socket after the prefix when it is small, else in the link's shared memory
(a memfd segment every end maps, its descriptor passed over the socket when it is new or grows):
written once by the source for all peers, copied out once by each, with the socket messages
ordering the writes and reads on every architecture. A source that lays a frame out itself
builds it in place there (`open_frame`, then `send_frame`): no copy on the way to the peers.
A peer answers with one byte once it holds its copy of the whole frame. The source sends frame ``i`` only when every peer has
acknowledged frame ``i - 1``, so it runs at most one frame ahead: in a training loop the ack has
long arrived (no wait), and a peer that stopped taking frames is found at the next call, within
the timeout, as with a collective. Failures keep megapack's promises:

    a peer crashed or closed        the other side's send/recv fails at once -> CollectiveError
    the source is stuck             a peer's recv passes the timeout         -> CollectiveError
    a peer is stuck or failed       the source's ack wait passes the timeout -> CollectiveError

After a failure the link is closed (peers blocked on it see the end of the stream at once) and
forgotten; like a collective group after a timeout, the group is unusable for the step.

Links are made and cached per group by `megapack.link_setup.link_for`.

Example (every rank of ``group``; source global rank 0)::

    link = link_for(group, src=0)           # collective the first time, then cached
    if link is not None and rank == 0:
        link.send([header_bytes, payload], what="frame", timeout=None)
    elif link is not None:
        body = link.receive(what="frame", timeout=None)   # uint8 array, header + payload
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megapack import comm
from megapack.errors import CollectiveError

_PREFIX = struct.Struct("<qqqqq")  # magic, sequence, body bytes, where the body is, segment bytes
_INLINE, _SHARED, _NEW_SEGMENT = 0, 1, 2  # body on the socket / in the segment / in a new segment
_SHARED_OK = hasattr(os, "memfd_create") and hasattr(socket, "send_fds")  # Linux
SHARED_MIN_BYTES = 64 * 1024
"""Bodies from this size on go through shared memory (where `os.memfd_create` exists): written
once for every peer and copied out once by each, instead of twice through the kernel per peer."""
_MAGIC = 0x4D50_4C4B  # "MPLK"


@dataclass(eq=False)
class LocalLink:
    """One source's connected sockets to its peers (on the source), or to the source (on a peer)."""

    src: int
    """Global rank of the sending rank."""
    rank: int
    """This process's global rank."""
    peers: dict[int, socket.socket]
    """On the source: every peer's global rank -> its socket; on a peer: {src: socket}."""
    sent: int = 0
    """Frames sent (source) or received (peer) so far: the sequence number of the next frame."""
    closed: bool = field(default=False)
    shared: np.ndarray | None = field(default=None, repr=False)
    """The link's shared memory segment (a memfd every end maps), once a body needed it."""
    shared_bytes: int = 0
    """Its size."""
    _acked: bool = field(default=False, repr=False)
    """Source: every peer has acknowledged the last frame sent (`_take_acks`)."""
    _staged: tuple[int, int | None, float, float] | None = field(default=None, repr=False)
    """Source: (bytes, new segment's descriptor or None, timeout seconds, deadline) of a frame
    `open_frame` handed out; `send_frame` waits by the same deadline."""

    @property
    def is_source(self) -> bool:
        return self.rank == self.src

    def send(self, parts: Sequence[Any], *, what: str, timeout: float | None) -> None:
        """Source: send one frame made of ``parts`` (buffers: bytes or contiguous CPU tensors) to every peer.

        Bodies of `SHARED_MIN_BYTES` or more go through the link's shared memory (written once for
        all peers, each peer copies it out once); smaller ones follow the prefix on the socket.
        """
        self._drop_staged()  # a frame opened in shared memory and not sent: this one replaces it
        seconds = comm.collective_timeout(timeout)
        buffers = [_buffer(p) for p in parts]
        nbytes = sum(len(b) for b in buffers)
        deadline = time.monotonic() + seconds
        self._take_acks(deadline, what, seconds)
        mode, fd = _INLINE, None
        if nbytes >= SHARED_MIN_BYTES and _SHARED_OK:
            try:
                fd = self._reserve(nbytes)
                mode = _SHARED if fd is None else _NEW_SEGMENT
            except OSError:  # no shared memory to be had: this body goes on the socket
                mode = _INLINE
        if mode != _INLINE:
            assert self.shared is not None
            offset, shared = 0, self.shared.data
            for b in buffers:
                shared[offset : offset + len(b)] = b
                offset += len(b)
        self._announce(
            nbytes, mode, fd, buffers if mode == _INLINE else [], what, seconds, deadline
        )

    def open_frame(
        self, nbytes: int, *, what: str, timeout: float | None
    ) -> tuple[np.ndarray, bool]:
        """Source: where to build the next frame of ``nbytes``: (uint8 array, in shared memory).

        A frame of `SHARED_MIN_BYTES` or more is built in place in the link's shared memory,
        handed out once every peer has taken the previous frame, so `send_frame` copies nothing;
        a smaller one (or one without shared memory) in a fresh array. Either way send it with
        `send_frame`. The shared memory takes the next frame: keep a copy of what must live on.
        """
        if nbytes < SHARED_MIN_BYTES or not _SHARED_OK:
            return np.empty(nbytes, dtype=np.uint8), False
        if self._staged is not None:
            self._drop_staged()
        seconds = comm.collective_timeout(timeout)
        deadline = time.monotonic() + seconds
        self._take_acks(deadline, what, seconds)
        try:
            fd = self._reserve(nbytes)
        except OSError:  # no shared memory to be had: this frame goes on the socket
            return np.empty(nbytes, dtype=np.uint8), False
        assert self.shared is not None
        self._staged = (nbytes, fd, seconds, deadline)  # send_frame's wait counts from here
        return self.shared[:nbytes], True

    def send_frame(self, frame: np.ndarray, *, what: str, timeout: float | None) -> None:
        """Source: send a frame built where `open_frame` said."""
        staged, self._staged = self._staged, None
        if staged is None:
            self.send([frame], what=what, timeout=timeout)
            return
        nbytes, fd, seconds, deadline = staged
        if len(frame) != nbytes:
            raise ValueError(f"send_frame got {len(frame)} bytes; open_frame gave {nbytes}")
        mode = _SHARED if fd is None else _NEW_SEGMENT
        self._announce(nbytes, mode, fd, [], what, seconds, deadline)

    def _take_acks(self, deadline: float, what: str, seconds: float) -> None:
        """Wait until every peer has taken the previous frame (and so left the shared memory)."""
        if not self.sent or self._acked:
            return
        for peer, sock in self.peers.items():
            try:
                recv_exact(sock, memoryview(bytearray(1)), deadline)
            except (OSError, EOFError) as exc:
                self._fail(exc, what, seconds, peer, "sending to")
        self._acked = True

    def _announce(
        self,
        nbytes: int,
        mode: int,
        fd: int | None,
        body: list[memoryview],
        what: str,
        seconds: float,
        deadline: float,
    ) -> None:
        """Send a frame's prefix (with a new segment's descriptor) and its inline body to every peer."""
        prefix = _PREFIX.pack(_MAGIC, self.sent, nbytes, mode, self.shared_bytes)
        for peer, sock in self.peers.items():
            try:
                if fd is not None:  # the new segment's descriptor rides on the prefix
                    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                    socket.send_fds(sock, [prefix], [fd])
                    _send_all(sock, body, deadline)
                else:
                    _send_all(sock, [memoryview(prefix), *body], deadline)
            except (OSError, EOFError) as exc:
                self._fail(exc, what, seconds, peer, "sending to")
        if fd is not None:
            os.close(fd)  # the peers hold their own descriptors now; the mapping stays
        self.sent += 1
        self._acked = False

    def _drop_staged(self) -> None:
        """Forget a frame opened in shared memory and never sent (its new segment, if any: the
        peers never got its descriptor, so the next shared frame makes another)."""
        staged, self._staged = self._staged, None
        if staged is not None and staged[1] is not None:
            os.close(staged[1])
            self.shared, self.shared_bytes = None, 0

    def receive(
        self, *, what: str, timeout: float | None, into: np.ndarray | None = None
    ) -> np.ndarray:
        """Peer: the next frame's body as a uint8 array (then acknowledge it).

        The body lands at the front of ``into`` (a uint8 array the caller prepared) when it
        fits, else in a fresh array; either way nothing else holds the memory.
        """
        seconds = comm.collective_timeout(timeout)
        sock = self.peers[self.src]
        deadline = time.monotonic() + seconds
        try:
            prefix, fd = _recv_prefix(sock, deadline)
            magic, sequence, nbytes, mode, segment = _PREFIX.unpack(prefix)
            if (
                magic != _MAGIC
                or sequence != self.sent
                or (mode == _NEW_SEGMENT) != (fd is not None)
            ):
                if fd is not None:
                    os.close(fd)
                self.close()
                raise CollectiveError(
                    f"{what} on rank {self.rank}: local link from rank {self.src} is out of step "
                    f"(frame {sequence}, magic {magic:#x}; expected frame {self.sent}); end the job"
                )
            if fd is not None:
                self._map(fd, segment)
            fits = into is not None and len(into) >= nbytes
            body = into[:nbytes] if fits else np.empty(nbytes, dtype=np.uint8)  # type: ignore[index]
            if mode == _INLINE and nbytes:
                recv_exact(sock, body.data, deadline)
            elif nbytes:
                assert self.shared is not None  # mapped at this frame or an earlier one
                body.data[:] = self.shared.data[:nbytes]  # one memcpy
            sock.sendall(b"\1")
        except (OSError, EOFError) as exc:
            self._fail(exc, what, seconds, self.src, "receiving from")
        self.sent += 1
        return body

    def _reserve(self, nbytes: int) -> int | None:
        """Make the shared segment hold ``nbytes`` (a larger new one when it does not).

        Returns the new segment's descriptor to hand to the peers, or None when the current one
        holds it. Only called once every peer acknowledged the previous frame.
        """
        fd = None
        if self.shared is None or nbytes > self.shared_bytes:
            size = max(nbytes + nbytes // 4, 2 * self.shared_bytes, 1 << 20)
            fd = os.memfd_create(f"megapack-link-{self.src}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                self._map(fd, size, close=False)
            except OSError:
                os.close(fd)
                raise
        return fd

    def _map(self, fd: int, size: int, *, close: bool = True) -> None:
        """Map segment ``fd`` of ``size`` bytes as this link's shared memory (dropping the old one)."""
        try:
            self.shared = np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
            self.shared_bytes = size
        finally:
            if close:
                os.close(fd)

    def close(self) -> None:
        """Close every socket (peers blocked on them see the end of the stream at once)."""
        self.closed = True
        self._drop_staged()
        for sock in self.peers.values():
            sock.close()

    def _fail(self, exc: BaseException, what: str, seconds: float, peer: int, doing: str) -> None:
        self.close()
        if isinstance(exc, TimeoutError | socket.timeout):
            reason = f"timed out (timeout {seconds:g} s, set by timeout= or ${comm.TIMEOUT_ENV})"
        elif isinstance(exc, EOFError):
            reason = f"failed: rank {peer} closed the link (it exited, crashed or failed)"
        else:
            reason = f"failed: {type(exc).__name__}: {exc}"
        raise CollectiveError(
            f"{what} {reason} on rank {self.rank} {doing} rank {peer} over the local link. "
            "A peer is stuck, has crashed, or is not calling the same step; the group is now unusable"
        ) from exc


def _buffer(part: Any) -> memoryview:
    """A flat byte view of ``part`` (bytes-like, a numpy array, or a CPU tensor), without a copy where it can."""
    if isinstance(part, np.ndarray) and part.dtype == np.uint8 and part.flags.c_contiguous:
        return part.data  # a frame (`megapack.frame`)
    if isinstance(part, torch.Tensor):
        if part.dtype == torch.uint8 and part.dim() == 1 and part.is_contiguous():
            return part.numpy().data  # the pieces `encode_fields` gives: no reshaping needed
        return part.contiguous().view(torch.uint8).numpy().reshape(-1).data
    return memoryview(part).cast("B")


def _send_all(sock: socket.socket, buffers: list[memoryview], deadline: float) -> None:
    views = [v for v in buffers if len(v)]
    while views:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        sent = sock.sendmsg(views)
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def _recv_prefix(sock: socket.socket, deadline: float) -> tuple[bytes, int | None]:
    """A frame's prefix and the segment descriptor that may ride on it (SCM_RIGHTS)."""
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    data, fds, _flags, _addr = socket.recv_fds(sock, _PREFIX.size, 1)
    if not data:
        raise EOFError("end of stream")
    if (
        len(data) < _PREFIX.size
    ):  # the rest of a split prefix (ancillary data came with the first byte)
        rest = bytearray(_PREFIX.size - len(data))
        recv_exact(sock, memoryview(rest), deadline)
        data += bytes(rest)
    return data, (fds[0] if fds else None)


def recv_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill ``view`` from ``sock`` by ``deadline`` (time.monotonic); EOFError at the end of stream."""
    got = 0
    while got < len(view):
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("end of stream")
        got += n
