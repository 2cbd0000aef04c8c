"""Which groups get a local link (`megapack.local_link`): the switch, the per-group cache, the set-up.

Set-up is collective over the group's control group (`megapack.side_groups`), on the first call
that needs the link: the source listens on a fresh abstract socket name (a private path in the
temp directory off Linux), broadcasts it, the peers connect and say their rank, and all agree
(one all-reduce) that everyone connected. When they do not (ranks on several hosts or network
namespaces), no link is made and megapack keeps to collectives for that group. $MEGAPACK_LOCAL_LINK=0
turns links off (read at every call, so it can differ per phase of a job, but every rank of a
group must see the same value).

Example (every rank of ``group``, at the same point the first time)::

    with local_links(False):                # this block keeps to collectives
        ...
    link = link_for(group, src=0)           # collective the first time, then cached; None: no link
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import tempfile
import time
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megapack import comm
from megapack.errors import CollectiveError
from megapack.local_link import LocalLink, recv_exact
from megapack.side_groups import control_group

LINK_ENV = "MEGAPACK_LOCAL_LINK"
_HELLO = struct.Struct("<q")  # a peer's global rank
_ADDRESS_BYTES = 256
_CONNECT_TIMEOUT_S = 10.0


def links_enabled() -> bool:
    """False when $MEGAPACK_LOCAL_LINK is 0/false/off/no; links are on by default."""
    return os.environ.get(LINK_ENV, "1").strip().lower() not in {"0", "false", "off", "no"}


@contextmanager
def local_links(enabled: bool) -> Iterator[None]:
    """Within the block, groups on one host use local links (True) or collectives (False).

    Sets $MEGAPACK_LOCAL_LINK in this process and restores it after; every rank of a group must
    enter it alike (the bench times both transports this way, the tests test both).
    """
    before = os.environ.get(LINK_ENV)
    os.environ[LINK_ENV] = "1" if enabled else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LINK_ENV, None)
        else:
            os.environ[LINK_ENV] = before


# Keyed weakly by the group: a link lives as long as its group; value: {src: link or None}.
_links: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[int, LocalLink | None]] = (
    weakref.WeakKeyDictionary()
)


def link_for(
    group: dist.ProcessGroup | None, src: int, *, timeout: float | None = None
) -> LocalLink | None:
    """The local link from global rank ``src`` to the other ranks of ``group``, or None.

    None when links are off ($MEGAPACK_LOCAL_LINK=0), the group has one rank, or its ranks cannot
    reach each other through a Unix socket. The first call for a (group, src) is collective over
    the group's control group: every rank of ``group`` must make it at the same point.
    """
    if not links_enabled() or group is None:
        return None
    by_src = _links.get(group)  # not setdefault: that builds a weakref and a dict every call
    if by_src is not None and src in by_src:
        link = by_src[src]
        if link is None or not link.closed:
            return link
    link = _connect(group, src, timeout)
    _links.setdefault(group, {})[src] = link
    return link


def _connect(group: dist.ProcessGroup, src: int, timeout: float | None) -> LocalLink | None:
    ranks = comm.group_ranks(group)
    if len(ranks) < 2:
        return None
    control = control_group(group)
    rank = dist.get_rank()
    what = f"megapack local link set-up from rank {src}"
    listener, address = _listen(len(ranks)) if rank == src else (None, b"")
    message = torch.zeros(_ADDRESS_BYTES + 1, dtype=torch.uint8)
    if rank == src:
        message[0] = len(address)
        message[1 : 1 + len(address)] = torch.frombuffer(bytearray(address), dtype=torch.uint8)
    comm.broadcast(message, src, group=control, what=what, timeout=timeout)
    address = bytes(message[1 : 1 + int(message[0])].tolist())
    sock = None if rank == src or not address else _dial(address, rank)
    ok = torch.tensor([int((rank == src and listener is not None) or sock is not None)])
    comm.all_reduce_min(ok, group=control, what=what, timeout=timeout)
    if not int(ok[0]):
        for s in (listener, sock):
            if s is not None:
                s.close()
        return None
    if rank != src:
        assert sock is not None  # ok: this rank connected
        return LocalLink(src=src, rank=rank, peers={src: sock})
    assert listener is not None
    peers = _accept(listener, len(ranks) - 1, what)
    listener.close()
    return LocalLink(src=src, rank=rank, peers=dict(sorted(peers.items())))


def _listen(backlog: int) -> tuple[socket.socket | None, bytes]:
    """A listening Unix socket on a fresh name: abstract on Linux (nothing on disk), else a temp path."""
    name = f"megapack-link-{os.getpid()}-{uuid.uuid4().hex}"
    address = (
        b"\0" + name.encode()
        if sys.platform.startswith("linux")
        else os.path.join(tempfile.mkdtemp(prefix="megapack-"), "link").encode()
    )
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(backlog)
    except OSError:
        return None, b""
    return listener, address if len(address) <= _ADDRESS_BYTES else b""


def _dial(address: bytes, rank: int) -> socket.socket | None:
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(_CONNECT_TIMEOUT_S)
        sock.connect(address)
        sock.sendall(_HELLO.pack(rank))
    except OSError:
        return None
    return sock


def _accept(listener: socket.socket, count: int, what: str) -> dict[int, socket.socket]:
    peers: dict[int, socket.socket] = {}
    listener.settimeout(_CONNECT_TIMEOUT_S)
    deadline = time.monotonic() + _CONNECT_TIMEOUT_S
    try:
        for _ in range(count):
            sock, _ = listener.accept()
            hello = bytearray(_HELLO.size)
            recv_exact(sock, memoryview(hello), deadline)
            peers[_HELLO.unpack(hello)[0]] = sock
    except (OSError, EOFError) as exc:
        for s in peers.values():
            s.close()
        raise CollectiveError(f"{what}: a peer connected but did not say its rank ({exc})") from exc
    if isinstance(name := listener.getsockname(), str) and name:  # a path (off Linux): remove it
        os.unlink(name)
    return peers
