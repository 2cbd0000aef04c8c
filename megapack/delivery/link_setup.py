"""Which groups get a local link (private to `megapack.delivery`), and a set-up only peers can join.

A local link listens on an abstract Unix socket, whose name every process of the network
namespace can read in /proc/net/unix and connect to (abstract sockets have no permissions). So a
connection proves membership before it is trusted:

1. Every rank of the group all-gathers, over the group's CPU control group, its pid and uid; the
   source adds the socket's name and a fresh secret (32 random bytes).
2. Each peer connects, checks with SO_PEERCRED that the listener is the source's pid and uid,
   and sends its rank and the secret. Every rank then agrees (one MIN all-reduce) that each peer
   reached the socket; if any did not (ranks on several hosts or namespaces), no link is made.
3. The source accepts until every peer is in or the deadline: a connection whose SO_PEERCRED pid
   is not a not-yet-accepted peer's reported pid, or whose uid is not the source's, is closed
   without a byte read or sent; one that then gives a wrong rank or secret (constant-time
   compare) or stays silent past a short deadline is closed too. Each is logged and accepting
   goes on. Every rank then agrees (a second MIN all-reduce) that all peers were accepted.

Set-up failing anywhere is a shared fallback to collectives on every rank, never a hang. Shared
memory goes only to accepted peers (over their sockets), sealed against shrinking and growing and
mapped read-only by them (`megapack.delivery.link`). A forked child closes its copies of every
link at once and never uses them, so a crashed source's peer sees the end of the stream even
while the source's children live; a link is closed when its group is garbage-collected.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import struct
import sys
import time
import uuid
import weakref

import torch
import torch.distributed as dist

from megapack.delivery.link import LocalLink, recv_exact
from megapack.distributed import comm
from megapack.distributed.groups import control_group

logger = logging.getLogger("megapack.delivery")

SECRET_BYTES = 32
_ADDRESS_BYTES = 108  # sun_path
_RECORD = struct.Struct(f"<qqq{_ADDRESS_BYTES}s{SECRET_BYTES}s")  # pid, uid, address length, ...
_HELLO = struct.Struct(f"<q{SECRET_BYTES}s")  # a peer's global rank and the secret
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
CONNECT_TIMEOUT_S = 10.0
HELLO_TIMEOUT_S = 2.0
"""How long a connection from a peer's pid may take to say its rank and the secret."""

# Keyed weakly by the group: {src: link or None (no link for this group)}.
_links: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[int, LocalLink | None]] = (
    weakref.WeakKeyDictionary()
)


def link_for(
    group: dist.ProcessGroup | None, src: int, *, timeout: float | None = None
) -> LocalLink | None:
    """The local link from global rank ``src`` to the other ranks of ``group``, or None.

    None when the group has one rank or its ranks cannot reach each other through an
    authenticated Unix socket; that answer is remembered, so set-up runs once per (group, src).
    The first call is collective over the group's control group: every rank of ``group`` must
    make it at the same point.
    """
    if group is None:
        return None
    by_src = _links.get(group)  # not setdefault: that builds a weakref and a dict every call
    if by_src is not None and src in by_src:
        link = by_src[src]
        if link is None or (not link.closed and link.pid == os.getpid()):
            return link
    link = _connect(group, src, timeout)
    _links.setdefault(group, {})[src] = link
    if link is not None:
        weakref.finalize(group, link.close)
    return link


def _after_fork_in_child() -> None:
    """A forked child drops its copies of every link: it must neither use nor keep them."""
    for by_src in list(_links.values()):
        for link in by_src.values():
            if link is not None and not link.closed:
                link.close()
    _links.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _connect(group: dist.ProcessGroup, src: int, timeout: float | None) -> LocalLink | None:
    ranks = comm.group_ranks(group)
    if len(ranks) < 2:
        return None
    control = control_group(group)
    rank = dist.get_rank()
    what = f"megapack local link set-up from rank {src}"
    listener, address, secret = None, b"", b""
    if rank == src:
        listener, address = _listen(len(ranks))
        secret = secrets.token_bytes(SECRET_BYTES)
    mine = _RECORD.pack(os.getpid(), os.getuid(), len(address), address, secret)
    records = comm.all_gather(
        torch.frombuffer(bytearray(mine), dtype=torch.uint8),
        group=control,
        what=what,
        timeout=timeout,
    )
    peers = {r: _RECORD.unpack(bytes(rec.numpy())) for r, rec in zip(ranks, records, strict=True)}
    src_pid, src_uid, n, src_address, src_secret = peers[src]
    sock = None
    if rank != src and n:
        sock = _dial(src_address[:n], rank, src_secret, src_pid, src_uid)
    reached = torch.tensor([int(listener is not None if rank == src else sock is not None)])
    comm.all_reduce_min(reached, group=control, what=what, timeout=timeout)
    accepted: dict[int, socket.socket] = {}
    if int(reached[0]) and listener is not None:
        expected = {r: record[0] for r, record in peers.items() if r != src}
        accepted = _accept(listener, expected, secret, what)
    ok = torch.tensor([int(len(accepted) == len(ranks) - 1 if rank == src else sock is not None)])
    if int(reached[0]):
        comm.all_reduce_min(ok, group=control, what=what, timeout=timeout)
    if listener is not None:
        listener.close()
    if not int(reached[0]) or not int(ok[0]):
        for s in (*accepted.values(), sock):
            if s is not None:
                s.close()
        logger.info("%s: no local link (a peer could not connect or prove membership)", what)
        return None
    if rank != src:
        assert sock is not None
        return LocalLink(src=src, rank=rank, peers={src: sock})
    return LocalLink(src=src, rank=rank, peers=dict(sorted(accepted.items())))


def _listen(peers: int) -> tuple[socket.socket | None, bytes]:
    """A listening Unix socket on a fresh abstract name (Linux: nothing on disk); None elsewhere,
    where SO_PEERCRED cannot tell who connected."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "SO_PEERCRED"):
        return None, b""
    address = f"\0megapack-link-{os.getpid()}-{uuid.uuid4().hex}".encode()
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(peers + 64)  # room for strays queued in front of the peers
    except OSError:
        return None, b""
    return listener, address


def _dial(address: bytes, rank: int, secret: bytes, pid: int, uid: int) -> socket.socket | None:
    """Connect to the source, check it is the source's process, and say this rank and the secret."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.connect(address)
        if _credentials(sock)[:2] != (pid, uid):
            sock.close()
            return None
        sock.sendall(_HELLO.pack(rank, secret))
    except OSError:
        return None
    return sock


def _accept(
    listener: socket.socket, expected: dict[int, int], secret: bytes, what: str
) -> dict[int, socket.socket]:
    """Accept each expected peer (rank -> pid) once, by the deadline; close and log every stray."""
    pending = dict(expected)
    peers: dict[int, socket.socket] = {}
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        listener.settimeout(left)
        try:
            sock, _ = listener.accept()
        except OSError:
            break
        pid, uid, _gid = _credentials(sock)
        if uid != os.getuid() or pid not in pending.values():
            logger.warning(
                "%s: refused a connection from pid %d uid %d: not a peer of this group",
                what,
                pid,
                uid,
            )
            sock.close()
            continue
        hello = bytearray(_HELLO.size)
        try:
            recv_exact(sock, memoryview(hello), min(deadline, time.monotonic() + HELLO_TIMEOUT_S))
            rank, given = _HELLO.unpack(hello)
        except (OSError, EOFError):
            rank, given = -1, b""
        if pending.get(rank) != pid or not hmac.compare_digest(given, secret):
            logger.warning(
                "%s: refused a connection from pid %d: it did not prove membership (rank %d)",
                what,
                pid,
                rank,
            )
            sock.close()
            continue
        del pending[rank]
        sock.settimeout(None)
        peers[rank] = sock
    return peers


def _credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket (Linux)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid
