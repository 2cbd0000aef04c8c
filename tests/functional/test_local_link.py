"""Local links (`megapack.local_link`, `megapack.link_setup`): frames from a group's source to its peers over Unix sockets.

Every frame must arrive whole and in order on every peer (sizes from empty to larger than a socket
buffer, so partial sends and receives happen), the set-up must agree on all ranks (a rank that
cannot connect makes every rank fall back to collectives, and `get_batch_on_this_tp_rank` still
works), and the switch must be read per call.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megapack import PackedBatch, get_batch_on_this_tp_rank, link_setup, local_link
from megapack.errors import CollectiveError
from megapack.link_setup import LINK_ENV, link_for, links_enabled, local_links
from megapack.testing.grids import grid_topology

pytestmark = pytest.mark.distributed

SIZES = [0, 1, 7, 192, 65_537, 3_000_001]  # the last one outgrows a Unix socket's buffer


def _frame(i: int, n: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)
    )


def run_frames(src: int, shared: bool = True) -> tuple[list[tuple[int, str]], int]:
    """Every rank: (bytes, sha256) of each frame, sent by ``src`` or received; and the size of
    the link's shared segment (bodies of 64 KiB or more go through it unless ``shared`` is off)."""
    ok = local_link._SHARED_OK
    local_link._SHARED_OK = ok and shared
    try:
        return _frames(src)
    finally:
        local_link._SHARED_OK = ok  # the pool's worker processes live on


def _frames(src: int) -> tuple[list[tuple[int, str]], int]:
    group = dist.new_group(list(range(dist.get_world_size())))
    link = link_for(group, src)
    assert link is not None and link is link_for(group, src)  # cached: set up once
    seen = []
    for i, n in enumerate(SIZES * 2):
        if dist.get_rank() == src:
            body = _frame(i, n)
            header = n.to_bytes(8, "little")
            link.send([header, body], what="test frame", timeout=20)
            got = torch.cat([torch.frombuffer(bytearray(header), dtype=torch.uint8), body])
        else:
            got = torch.from_numpy(link.receive(what="test frame", timeout=20))
            assert int.from_bytes(bytes(got[:8].tolist()), "little") == n
        seen.append((got.numel() - 8, hashlib.sha256(got[8:].numpy().tobytes()).hexdigest()))
    dist.barrier()
    return seen, link.shared_bytes


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "socket-only"])
def test_frames_arrive_whole_and_in_order(dist_pool: Any, shared: bool) -> None:
    results = dist_pool.run(run_frames, 3, 1, shared, timeout=60)
    frames = [seen for seen, _ in results]
    assert all(f == frames[0] for f in frames), "peers got other bytes than the source sent"
    assert [n for n, _ in frames[0]] == SIZES * 2
    segments = {size for _, size in results}
    if shared and local_link._SHARED_OK:  # grown past the 3 MB body, the same on every rank
        assert len(segments) == 1 and segments.pop() >= SIZES[-1] + 8, results
    else:
        assert segments == {0}, results


def run_fallback(refuse_on: int) -> tuple[bool, list[list[int]]]:
    """One rank cannot connect: every rank must get no link, and get_batch must still deliver."""
    dial = link_setup._dial
    if dist.get_rank() == refuse_on:
        link_setup._dial = lambda address, rank: None
    try:
        topo = grid_topology(dist.get_world_size(), 1)
        made = link_for(topo.tp_group, topo.src_rank) is not None
    finally:
        link_setup._dial = dial  # the pool's worker processes live on
    rows = [PackedBatch.from_documents([[5, 6, 7], [8, 9]]) for _ in range(2)]
    data = iter(rows) if topo.is_source else None
    got = [get_batch_on_this_tp_rank(data, topology=topo)["cu_seqlens"].tolist() for _ in rows]
    dist.barrier()
    return made, got


def test_a_rank_that_cannot_connect_makes_everyone_fall_back(dist_pool: Any) -> None:
    results = dist_pool.run(run_fallback, 3, 2, timeout=60)
    assert all(made is False for made, _ in results), results
    assert all(got == [[0, 3, 5], [0, 3, 5]] for _, got in results), results


def run_switch() -> tuple[bool, bool, int]:
    """The switch is read per call: off gives no link (and no set-up), on gives one."""
    group = dist.new_group(list(range(dist.get_world_size())))
    with local_links(False):
        off = link_for(group, 0) is None
    with local_links(True):
        link = link_for(group, 0)
    on = link is not None
    if link is not None and dist.get_rank() == 0:
        link.send([b"x"], what="switch", timeout=20)
    elif link is not None:
        link.receive(what="switch", timeout=20)
    dist.barrier()
    return off, on, link.sent if link is not None else -1


def test_switch_is_read_per_call(dist_pool: Any) -> None:
    assert dist_pool.run(run_switch, 2, timeout=60) == [(True, True, 1), (True, True, 1)]


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


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("1", True), ("", True)])
def test_links_enabled_reads_the_switch(
    monkeypatch: pytest.MonkeyPatch, value: str, on: bool
) -> None:
    monkeypatch.setenv(LINK_ENV, value)
    assert links_enabled() is on


# (bytes, how the source sends it): built in place via open_frame / opened, dropped, then sent
# by send() instead (as when a batch fails after its frame was opened) / plain send()
OPENED = [
    (70_000, "open"),  # the first shared segment
    (10, "open"),  # small: a fresh array on the socket
    (3_000_001, "drop"),  # opens a larger new segment the peers never hear of ...
    (100, "send"),
    (2_000_000, "open"),  # ... so this one must hand out a new segment again
    (70_000, "open"),
    (90_000, "drop"),  # opened in the current segment, replaced by a shared send()
]


def run_opened_frames() -> list[tuple[int, str]]:
    group = dist.new_group(list(range(dist.get_world_size())))
    link = link_for(group, 0)
    assert link is not None
    seen = []
    for i, (n, how) in enumerate(OPENED):
        body = _frame(i, n).numpy()
        if dist.get_rank() == 0:
            if how == "send":
                link.send([body], what="test frame", timeout=20)
            else:
                frame, _shared = link.open_frame(n, what="test frame", timeout=20)
                frame[:] = body if how == "open" else 0  # "drop": written, then abandoned
                if how == "open":
                    link.send_frame(frame, what="test frame", timeout=20)
                else:
                    link.send([body], what="test frame", timeout=20)
            got = body
        else:
            got = link.receive(what="test frame", timeout=20)
        seen.append((len(got), hashlib.sha256(got.tobytes()).hexdigest()))
    dist.barrier()
    return seen


def test_frames_built_in_shared_memory_arrive_whole(dist_pool: Any) -> None:
    results = dist_pool.run(run_opened_frames, 3, timeout=60)
    want = [
        (n, hashlib.sha256(_frame(i, n).numpy().tobytes()).hexdigest())
        for i, (n, _) in enumerate(OPENED)
    ]
    assert all(seen == want for seen in results), results


def run_outputs_outlive_the_next_frame() -> list[bool]:
    """Frames of 64 KiB or more are built in the link's shared memory: the source's outputs must
    be its own copy, intact after the next frame overwrote that memory (peers' likewise)."""
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


def run_frame_fails_while_written() -> str:
    """The source opened a frame in shared memory and failed to fill it: its peers must get the
    error (RemoteDataError), not wait for a frame that never comes."""
    from megapack import frame

    topo = grid_topology(dist.get_world_size(), 1)
    rows = [PackedBatch.from_documents([list(range(1, 4097))]) for _ in range(2)]  # ~115 KB
    data = iter(rows) if topo.is_source else None
    get_batch_on_this_tp_rank(data, topology=topo, timeout=20)  # a good frame first
    write = frame.write_frame
    if topo.is_source:
        frame.write_frame = lambda *args: (_ for _ in ()).throw(MemoryError("no room"))
    try:
        get_batch_on_this_tp_rank(data, topology=topo, timeout=20)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        frame.write_frame = write  # the pool's worker processes live on
    return "no error"


def test_a_frame_that_fails_while_written_reaches_the_peers_as_an_error(dist_pool: Any) -> None:
    source, peer = dist_pool.run(
        run_frame_fails_while_written, 2, timeout=15
    )  # << the 20 s timeout
    assert source == "MemoryError: no room"
    assert peer.startswith("RemoteDataError") and "MemoryError: no room" in peer
