"""Local links (`megapack.delivery.link`, `link_setup`): frames from a group's source to its peers.

Frames must arrive whole and in order on every peer (sizes from empty to larger than a socket
buffer), set-up must agree on all ranks (one rank that cannot connect makes every rank fall back
to collectives, and remembers it), only peers may join (an intruder that races to connect during
set-up, or connects and stays silent, receives no byte and the group trains on), a forked child
must not keep a link alive, and a link closes with its group.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megapack import PackedBatch, get_batch_on_this_tp_rank
from megapack.core.errors import CollectiveError
from megapack.delivery import link as link_module
from megapack.delivery import link_setup
from megapack.delivery.link_setup import link_for
from megapack.delivery.transport import use_transport
from megapack.harness.grid import grid_topology

pytestmark = pytest.mark.distributed

SIZES = [0, 1, 7, 192, 65_537, 3_000_001]  # the last one outgrows a Unix socket's buffer
COLLECTIVES = ("broadcast", "all_reduce", "all_gather")


def _frame(i: int, n: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)
    )


def run_frames(src: int, shared: bool = True) -> tuple[list[tuple[int, str]], int]:
    """Every rank: (bytes, sha256) of each frame, sent by ``src`` or received; and the size of
    the link's shared segment (bodies of 64 KiB or more go through it unless ``shared`` is off)."""
    ok = link_module.SHARED_OK
    link_module.SHARED_OK = ok and shared
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        link = link_for(group, src)
        assert link is not None and link is link_for(group, src)  # cached: set up once
        seen = []
        for i, n in enumerate(SIZES * 2):
            if dist.get_rank() == src:
                body = _frame(i, n)
                link.send([n.to_bytes(8, "little"), body], what="test frame", timeout=20)
                got = torch.cat(
                    [torch.tensor(list(n.to_bytes(8, "little")), dtype=torch.uint8), body]
                )
            else:
                got = torch.from_numpy(link.receive(what="test frame", timeout=20))
                assert int.from_bytes(bytes(got[:8].numpy()), "little") == n
            seen.append((got.numel() - 8, hashlib.sha256(got[8:].numpy().tobytes()).hexdigest()))
        dist.barrier()
        return seen, link.shared_bytes
    finally:
        link_module.SHARED_OK = ok  # the pool's worker processes live on


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "socket-only"])
def test_frames_arrive_whole_and_in_order(dist_pool: Any, shared: bool) -> None:
    results = dist_pool.run(run_frames, 3, 1, shared, timeout=60)
    frames = [seen for seen, _ in results]
    assert all(f == frames[0] for f in frames), "peers got other bytes than the source sent"
    assert [n for n, _ in frames[0]] == SIZES * 2
    segments = {size for _, size in results}
    if shared and link_module.SHARED_OK:  # grown past the 3 MB body, the same on every rank
        assert len(segments) == 1 and segments.pop() >= SIZES[-1] + 8, results
    else:
        assert segments == {0}, results


def _count(name_filter: tuple[str, ...] = COLLECTIVES) -> list[int]:
    count = [0]
    for name in name_filter:
        original = getattr(dist, name)

        def counting(*a: Any, _original: Any = original, **k: Any) -> Any:
            count[0] += 1
            return _original(*a, **k)

        setattr(dist, name, counting)
    return count


def run_fallback(refuse_on: int) -> tuple[bool, list[list[int]], list[int]]:
    """One rank cannot connect: every rank gets no link, remembers it, and get_batch still delivers."""
    dial = link_setup._dial
    if dist.get_rank() == refuse_on:
        link_setup._dial = lambda *args: None
    try:
        topo = grid_topology(dist.get_world_size(), 1)
        made = link_for(topo.tp_group, topo.src_rank) is not None
        count = _count()
        again = [link_for(topo.tp_group, topo.src_rank) is None for _ in range(3)]
        setup_collectives = count[0]
    finally:
        link_setup._dial = dial  # the pool's worker processes live on
    rows = [PackedBatch.from_documents([[5, 6, 7], [8, 9]]) for _ in range(2)]
    data = iter(rows) if topo.is_source else None
    got = [get_batch_on_this_tp_rank(data, topology=topo)["cu_seqlens"].tolist() for _ in rows]
    dist.barrier()
    return made, got, [setup_collectives, int(all(again))]


def test_regression_a_rank_that_cannot_connect_makes_everyone_fall_back_once(
    dist_pool: Any,
) -> None:
    results = dist_pool.run(run_fallback, 3, 2, timeout=60)
    assert all(made is False for made, _, _ in results), results
    assert all(got == [[0, 3, 5], [0, 3, 5]] for _, got, _ in results), results
    # "no link for this group" is remembered: asking again runs no set-up collective
    assert all(counts == [0, 1] for _, _, counts in results), results


def run_source_gone() -> str:
    """The source closes its link: a peer waiting for a frame learns it at once, not at the timeout."""
    group = dist.new_group(list(range(dist.get_world_size())))
    link = link_for(group, 0)
    assert link is not None
    dist.barrier()
    if dist.get_rank() == 0:
        link.close()
        return "closed"
    try:
        link.receive(what="test frame", timeout=30)
    except CollectiveError as exc:
        return str(exc)
    return "no error"


def test_a_closed_source_ends_the_wait_at_once(dist_pool: Any) -> None:
    _, message = dist_pool.run(run_source_gone, 2, timeout=20)  # well under the 30 s timeout
    assert "rank 0 closed the link" in message and "over the local link" in message


def run_outputs_outlive_the_next_frame() -> list[bool]:
    """Frames of 64 KiB or more go through the link's shared memory: every rank's outputs must be
    its own copy, intact after the next frame overwrote that memory."""
    topo = grid_topology(dist.get_world_size(), 1)
    gen = torch.Generator().manual_seed(3)
    rows = [
        PackedBatch.from_documents([torch.randint(1, 30_000, (n,), generator=gen) for n in lens])
        for lens in ([3000, 1096], [100, 3996], [4096])  # 4,096 tokens: ~115 KB frames
    ]
    data = iter(rows) if topo.is_source else None
    kept = [get_batch_on_this_tp_rank(data, topology=topo) for _ in rows]
    dist.barrier()
    return [
        torch.equal(out["tokens"], row.tokens) and torch.equal(out["labels"], row.labels)
        for out, row in zip(kept, rows, strict=True)
    ]


def test_outputs_outlive_the_next_frame(dist_pool: Any) -> None:
    assert dist_pool.run(run_outputs_outlive_the_next_frame, 2, timeout=60) == [[True] * 3] * 2


INTRUDER = r"""
import socket, struct, sys, time
pid, mode, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
prefix = "@megapack-link-" + pid + "-"
deadline, seen, conns, got = time.time() + seconds, set(), [], 0
print("ready", flush=True)
while time.time() < deadline:
    with open("/proc/net/unix") as f:
        names = {line.split()[-1] for line in f if line.split()[-1].startswith(prefix)}
    for name in names - seen:
        seen.add(name)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(b"\0" + name[1:].encode())
        except OSError:
            continue
        if mode == "claim":  # says it is rank 1, with a guessed secret
            s.sendall(struct.pack("<q32s", 1, bytes(32)))
        s.setblocking(False)
        conns.append(s)
    for s in conns:
        try:
            got += len(s.recv(1 << 20))
        except (BlockingIOError, OSError):
            pass
    time.sleep(0.0005)
print(len(seen), len(conns), got, flush=True)
"""


def run_with_intruder(mode: str) -> dict[str, Any]:
    """An intruder polls /proc/net/unix for the source's link and connects during set-up."""
    src_pid = [os.getpid()]
    dist.broadcast_object_list(src_pid, src=0)
    refused: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: refused.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("megapack.delivery").addHandler(handler)
    intruder = None
    if dist.get_rank() == 0:
        intruder = subprocess.Popen(
            [sys.executable, "-c", INTRUDER, str(src_pid[0]), mode, "4"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert intruder.stdout is not None and intruder.stdout.readline().strip() == "ready"
    dial = link_setup._dial
    if dist.get_rank() != 0:  # the peers come late: the intruder is first in the queue

        def slow_dial(*args: Any) -> Any:
            time.sleep(0.5)
            return dial(*args)

        link_setup._dial = slow_dial
    try:
        topo = grid_topology(dist.get_world_size(), 1)
        link = link_for(topo.tp_group, topo.src_rank)
    finally:
        link_setup._dial = dial
        logging.getLogger("megapack.delivery").removeHandler(handler)
    gen = torch.Generator().manual_seed(5)
    rows = [PackedBatch.from_documents([torch.randint(1, 99, (n,), generator=gen) for n in (300, 20_000)])
            for _ in range(3)]  # fmt: skip  # ~560 KB frames: through shared memory
    data = iter(rows) if topo.is_source else None
    good = [
        torch.equal(get_batch_on_this_tp_rank(data, topology=topo)["tokens"], r.tokens)
        for r in rows
    ]
    dist.barrier()
    report = None
    if intruder is not None:
        out, _ = intruder.communicate(timeout=30)
        report = [int(x) for x in out.split()]
    return {"link": link is not None, "good": good, "intruder": report, "refused": refused}


@pytest.mark.parametrize("mode", ["claim", "silent"])
@pytest.mark.parametrize("tp", [2, 3], ids=lambda t: f"tp{t}")
def test_an_intruder_gets_no_byte_and_the_group_trains_on(
    dist_pool: Any, tp: int, mode: str
) -> None:
    results = dist_pool.run(run_with_intruder, tp, mode, timeout=60)
    source = results[0]
    seen, connected, received = source["intruder"]
    assert seen >= 1 and connected >= 1, source  # it did find the socket and connect
    assert received == 0, source  # not one byte: no frame, no shared-memory descriptor
    assert any("refused a connection" in m and "not a peer" in m for m in source["refused"]), source
    for r in results:
        assert r["link"] is True and r["good"] == [True] * 3, r


def run_fork_then_close() -> float:
    """The source forks a child that lives on, then closes its link: the peer must see the end of
    the stream at once (the child dropped its copies at the fork), not when the child exits."""
    group = dist.new_group(list(range(dist.get_world_size())))
    link = link_for(group, 0)
    assert link is not None
    dist.barrier()
    if dist.get_rank() == 0:
        child = os.fork()
        if child == 0:  # the child: holds whatever the fork left it, for 5 s
            time.sleep(5)
            os._exit(0)
        link.close()
        dist.barrier()
        os.waitpid(child, 0)
        return 0.0
    start = time.monotonic()
    with pytest.raises(CollectiveError, match="closed the link"):
        link.receive(what="test frame", timeout=20)
    waited = time.monotonic() - start
    dist.barrier()
    return waited


def test_a_forked_child_does_not_keep_the_link_alive(dist_pool: Any) -> None:
    _, waited = dist_pool.run(run_fork_then_close, 2, timeout=60)
    assert waited < 2.5, waited  # the child lives 5 s


def run_link_goes_with_its_group() -> bool:
    group = dist.new_group(list(range(dist.get_world_size())))
    link = link_for(group, 0)
    assert link is not None and not link.closed
    dist.barrier()
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return link.closed


def test_a_link_is_closed_when_its_group_goes(dist_pool: Any) -> None:
    assert dist_pool.run(run_link_goes_with_its_group, 2, timeout=30) == [True, True]


def run_modes_per_call() -> list[str]:
    """$MEGAPACK_TRANSPORT is read per call: each mode's transport, the link set up once."""
    from megapack.core.fields import schema_of
    from megapack.delivery.transport import transport_for

    topo = grid_topology(dist.get_world_size(), 1)
    names = []
    for mode in ("collectives", "auto", "split", "auto"):
        with use_transport(mode):
            names.append(transport_for(topo, schema_of(), None).name)
    dist.barrier()
    return names


def test_transport_mode_is_read_per_call(dist_pool: Any) -> None:
    want = ["header over the gloo control group, payload broadcast on the TP group", "local link",
            "header over the local link, payload broadcast on the TP group", "local link"]  # fmt: skip
    assert dist_pool.run(run_modes_per_call, 2, timeout=30) == [want, want]
