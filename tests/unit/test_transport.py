"""megapack.delivery.transport in one process: each transport's frames (a socketpair link, and
fakes for the host collectives that record what they carry), the mode, and each group's choice."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from megapack.core.batch import PackedBatch
from megapack.core.errors import CollectiveError
from megapack.core.fields import BatchField, Stage, schema_of
from megapack.core.intake import Batch, BatchForm, to_batch
from megapack.delivery import transport as transport_module
from megapack.delivery.link import SHARED_OK, LocalLink
from megapack.delivery.transport import (
    BroadcastTransport,
    LinkTransport,
    SoloTransport,
    transport_for,
    transport_mode,
    use_transport,
)
from megapack.delivery.wire import Header, Status, encode, header_bytes, payload_of, signal
from megapack.distributed.topology import Topology

SCHEMA = schema_of()
HEADER = header_bytes(SCHEMA)
CPU = torch.device("cpu")
WHAT = "get_batch_on_this_tp_rank {} from TP source rank 0"


class Group:
    """Stands in for a TP process group (hashable, weakly referenced)."""


def control_of(group: Any) -> tuple[str, Any]:
    """What the fake `control_group` returns for ``group``: its control group."""
    return ("control group of", group)


class Fabric:
    """Fakes of megapack's host collectives: the source's tensors queue up in the order they are
    broadcast and each peer call takes the next; every call is recorded."""

    def __init__(self) -> None:
        self.source = True
        self.queue: list[torch.Tensor] = []
        self.calls: list[tuple[str, Any, int, str, float | None]] = []

    def _move(self, op: str, tensor: torch.Tensor, src: int, group: Any, what: str,
              timeout: float | None) -> None:  # fmt: skip
        assert src == 0
        self.calls.append((op, group, tensor.numel(), what, timeout))
        if self.source:
            self.queue.append(tensor.clone())
        else:
            tensor.copy_(self.queue.pop(0))

    def broadcast(self, tensor: torch.Tensor, src: int, *, group: Any, what: str,
                  timeout: float | None = None) -> None:  # fmt: skip
        self._move("broadcast", tensor, src, group, what, timeout)

    def broadcast_on_stream(self, tensor: torch.Tensor, src: int, *, group: Any, what: str,
                            timeout: float | None = None) -> None:  # fmt: skip
        self._move("payload", tensor, src, group, what, timeout)


@pytest.fixture
def fabric(monkeypatch: pytest.MonkeyPatch) -> Fabric:
    fake = Fabric()
    monkeypatch.setattr(transport_module.comm, "broadcast", fake.broadcast)
    monkeypatch.setattr(transport_module.comm, "broadcast_on_stream", fake.broadcast_on_stream)
    monkeypatch.setattr(transport_module, "control_group", control_of)
    return fake


@pytest.fixture
def links() -> Iterator[tuple[LocalLink, LocalLink]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    source, peer = LocalLink(src=0, rank=0, peers={1: a}), LocalLink(src=0, rank=1, peers={0: b})
    yield source, peer
    source.close()
    peer.close()


def topology(group: Any, tp_rank: int = 0, device: str = "cpu") -> Topology:
    return Topology(tp_group=group, tp_ranks=(0, 1), tp_rank=tp_rank, device=torch.device(device))


def frame(stage: Stage = Stage.ONLY) -> tuple[Header, list[torch.Tensor], bytes]:
    """A worked example's header and pieces (documents 3, 2, 4), and its payload's bytes."""
    header, pieces = encode(to_batch(PackedBatch.from_documents([[5, 6, 7], [8, 9], [1, 2, 3, 4]]),
                                      SCHEMA), SCHEMA, stage)  # fmt: skip
    return header, pieces, bytes(payload_of(pieces, header.nbytes, CPU).numpy())


def error_frame(text: bytes = b"ValueError: bad row") -> tuple[Header, list[torch.Tensor]]:
    message = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return signal(Status.ERROR, Stage.ONLY, SCHEMA, len(text)), [message]


# ---------------------------------------------------------------- header and payload broadcast


def test_collectives_carry_the_header_on_the_control_group_and_the_payload_on_the_tp_group(
    fabric: Fabric,
) -> None:
    group = Group()
    sender = BroadcastTransport(topology(group), None, "why")
    assert sender.name == "header over the gloo control group, payload broadcast on the TP group"
    header, pieces, payload = frame()
    sent = sender.send(header, pieces, 1.5)
    assert bytes(sent.numpy()) == payload
    fabric.source = False
    receiver = BroadcastTransport(topology(group, 1), None, "why")
    got_header, got = receiver.receive(HEADER, 1.5)
    assert got_header == header and bytes(got.numpy()) == payload and got.dtype == torch.uint8
    one_side = [("broadcast", control_of(group), HEADER, WHAT.format("header broadcast"), 1.5),
                ("payload", group, header.nbytes, WHAT.format("payload broadcast"), 1.5)]  # fmt: skip
    assert fabric.calls == one_side * 2  # the peer runs the source's collectives, same sizes


@pytest.mark.parametrize("status", [Status.STOP, Status.OK], ids=["stop", "empty-ok"])
def test_a_header_without_payload_is_one_collective(fabric: Fabric, status: Status) -> None:
    group = Group()
    header = signal(status, Stage.MIDDLE, SCHEMA)
    sent = BroadcastTransport(topology(group), None, "why").send(header, [], None)
    assert sent.numel() == 0
    fabric.source = False
    got_header, got = BroadcastTransport(topology(group, 1), None, "why").receive(HEADER, None)
    assert got_header == header and got.numel() == 0
    assert [c[0] for c in fabric.calls] == ["broadcast", "broadcast"]


def test_an_error_is_the_header_then_the_message_on_the_control_group(
    fabric: Fabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no CUDA here
    group = Group()
    header, pieces = error_frame()
    on_meta = topology(group, device="meta")  # a batch on a device: the message stays on the host
    sent = BroadcastTransport(on_meta, None, "why").send(header, pieces, 1.5)
    assert bytes(sent.numpy()) == b"ValueError: bad row" and sent.device == CPU
    fabric.source = False
    receiver = BroadcastTransport(topology(group, 1, device="meta"), None, "why")
    got_header, message = receiver.receive(HEADER, 1.5)
    assert got_header == header and bytes(message.numpy()) == b"ValueError: bad row"
    control = control_of(group)
    one_side = [("broadcast", control, HEADER, WHAT.format("header broadcast"), 1.5),
                ("broadcast", control, 19, WHAT.format("error message broadcast"), 1.5)]  # fmt: skip
    assert fabric.calls == one_side * 2


def test_a_payload_is_laid_out_and_received_on_the_batchs_device(
    fabric: Fabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no CUDA here
    group = Group()
    header, pieces, _ = frame()
    sent = BroadcastTransport(topology(group, device="meta"), None, "why").send(
        header, pieces, None
    )
    assert sent.device.type == "meta" and sent.numel() == header.nbytes
    fabric.source = False
    receiver = BroadcastTransport(topology(group, 1, device="meta"), None, "why")
    _, got = receiver.receive(HEADER, None)
    assert got.device.type == "meta" and got.numel() == header.nbytes


def test_with_a_link_the_header_goes_over_it_and_the_payload_by_collective(
    fabric: Fabric, links: tuple[LocalLink, LocalLink]
) -> None:
    group = Group()
    source_link, peer_link = links
    sender = BroadcastTransport(topology(group), source_link, "why")
    receiver = BroadcastTransport(topology(group, 1), peer_link, "why")
    assert sender.name == "header over the local link, payload broadcast on the TP group"
    header, pieces, payload = frame(Stage.LAST)
    assert bytes(sender.send(header, pieces, 5).numpy()) == payload
    error, message = error_frame(b"OSError: disk")
    fabric.source = False
    got_header, got = receiver.receive(HEADER, 5)
    assert got_header == header and bytes(got.numpy()) == payload
    fabric.source = True
    sender.send(error, message, 5)  # header and message in one link frame, no collective
    fabric.source = False
    got_error, text = receiver.receive(HEADER, 5)
    assert got_error == error and bytes(text.numpy()) == b"OSError: disk"
    payload_call = ("payload", group, header.nbytes, WHAT.format("payload broadcast"), 5)
    assert fabric.calls == [payload_call, payload_call]
    assert sender.usable and receiver.usable
    peer_link.close()
    assert not receiver.usable and BroadcastTransport(topology(group), None, "").usable


# ---------------------------------------------------------------- the whole frame over a link


@pytest.mark.parametrize("large", [False, True], ids=["socket", "shared-memory"])
def test_a_link_carries_header_and_payload_in_one_frame(
    links: tuple[LocalLink, LocalLink], large: bool
) -> None:
    if large and not SHARED_OK:
        pytest.skip("needs memfd_create and send_fds (Linux)")
    source_link, peer_link = links
    sender = LinkTransport(source_link, "frame", "why")
    receiver = LinkTransport(peer_link, "frame", "why")
    schema = schema_of((BatchField("x", "sample", torch.float32, "all"),))
    item = PackedBatch.from_documents([[1, 2, 3]])
    values = dict(to_batch(item, SCHEMA).values) | {"x": torch.arange(20_000.0)[None] if large
                                                         else torch.tensor([1.5])}  # fmt: skip
    header, pieces = encode(Batch(BatchForm.PACKED, values), schema, Stage.ONLY)
    sent = sender.send(header, pieces, 5)
    want = bytes(payload_of(pieces, header.nbytes, CPU).numpy())
    assert bytes(sent.numpy()) == want
    if large:  # the next frame overwrites the shared memory: the source keeps a copy
        assert source_link.shared is not None
        assert not np.shares_memory(sent.numpy(), source_link.shared)
    got_header, got = receiver.receive(header_bytes(schema), 5)
    assert got_header == header and bytes(got.numpy()) == want
    assert sender.usable
    source_link.close()
    assert not sender.usable


# ---------------------------------------------------------------- tp = 1


def test_a_single_rank_lays_its_payload_out_where_its_batch_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no CUDA here
    header, pieces, payload = frame()
    solo = SoloTransport(torch.device("meta"))
    on_meta = solo.send(header, pieces, None)
    assert on_meta.device.type == "meta" and on_meta.numel() == header.nbytes
    assert bytes(SoloTransport(CPU).send(header, pieces, None).numpy()) == payload
    error, message = error_frame()
    text = solo.send(error, message, None)  # an error's message stays on the host
    assert text.device == CPU and bytes(text.numpy()) == b"ValueError: bad row"
    with pytest.raises(RuntimeError) as info:
        solo.receive(HEADER, None)
    assert str(info.value) == "a TP group of one rank has no peer to receive a frame"


# ---------------------------------------------------------------- the mode


ENV = "MEGAPACK_TRANSPORT"
MODES = "('auto', 'collectives', 'split')"


def test_the_mode_is_read_from_the_environment_at_every_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert transport_mode() == "auto"
    for raw, mode in ((" Split ", "split"), ("", "auto"), ("  ", "auto"), ("COLLECTIVES", "collectives")):  # fmt: skip
        monkeypatch.setenv(ENV, raw)
        assert transport_mode() == mode, raw
    monkeypatch.setenv(ENV, "nccl")
    with pytest.raises(ValueError) as info:
        transport_mode()
    assert str(info.value) == f"$MEGAPACK_TRANSPORT='nccl'; expected one of {MODES}"


def test_use_transport_sets_the_mode_for_a_block_and_restores_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with use_transport("split"):
        assert os.environ[ENV] == "split" and transport_mode() == "split"
    assert ENV not in os.environ
    monkeypatch.setenv(ENV, "collectives")
    with pytest.raises(KeyError), use_transport("auto"):  # restored after an exception too
        assert transport_mode() == "auto"
        raise KeyError("inside")
    assert os.environ[ENV] == "collectives"
    with pytest.raises(ValueError) as info, use_transport("nccl"):
        pass
    assert str(info.value) == f"transport mode 'nccl'; expected one of {MODES}"
    assert os.environ[ENV] == "collectives"


# ---------------------------------------------------------------- each group's choice


class Setup:
    """Fakes of a group's set-up collectives and of `link_for`, recording their calls."""

    def __init__(self, link: LocalLink | None, keys: list[int] | None = None) -> None:
        self.link, self.keys = link, keys
        self.gathers: list[tuple[Any, list[int], str, float | None]] = []
        self.strings: list[tuple[str, Any, str, float | None]] = []
        self.links: list[tuple[Any, int, float | None]] = []

    def all_gather(self, tensor: torch.Tensor, *, group: Any, what: str,
                   timeout: float | None = None) -> list[torch.Tensor]:  # fmt: skip
        self.gathers.append((group, tensor.tolist(), what, timeout))
        keys = self.keys or [int(tensor[0])] * 2
        return [torch.tensor([k]) for k in keys]

    def all_gather_strings(self, text: str, *, group: Any, what: str,
                           timeout: float | None = None) -> list[str]:  # fmt: skip
        self.strings.append((text, group, what, timeout))
        return [text, "[]"]

    def link_for(self, group: Any, src: int, *, timeout: float | None = None) -> LocalLink | None:
        self.links.append((group, src, timeout))
        return self.link


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch, links: tuple[LocalLink, LocalLink]) -> Setup:
    fake = Setup(links[0])
    monkeypatch.setattr(transport_module.comm, "all_gather", fake.all_gather)
    monkeypatch.setattr(transport_module.comm, "all_gather_strings", fake.all_gather_strings)
    monkeypatch.setattr(transport_module, "link_for", fake.link_for)
    monkeypatch.setattr(transport_module, "control_group", control_of)
    monkeypatch.delenv(ENV, raising=False)
    return fake


def test_tp_1_needs_no_transport_but_its_device(setup: Setup) -> None:
    solo = transport_for(Topology.single(), SCHEMA, None)
    assert isinstance(solo, SoloTransport) and solo.device == CPU
    assert transport_for(Topology.single(), schema_of((BatchField("x", "sample", torch.float32, "all"),)), None) is solo  # fmt: skip
    meta = transport_for(Topology.single("meta"), SCHEMA, None)
    assert meta is not solo and meta.device == torch.device("meta")
    assert setup.gathers == [] and setup.links == []


def test_a_group_checks_each_declaration_once_and_keeps_its_transport_per_mode(
    setup: Setup, links: tuple[LocalLink, LocalLink], caplog: pytest.LogCaptureFixture
) -> None:
    group = Group()
    topo = topology(group)
    with caplog.at_level(logging.INFO, logger="megapack.delivery"):
        first = transport_for(topo, SCHEMA, 2.0)
    assert isinstance(first, LinkTransport) and first.link is links[0]
    assert first.what == "get_batch_on_this_tp_rank frame from TP source rank 0"
    assert first.why == "the TP ranks share a host and the batch stays on the CPU"
    assert caplog.messages == [
        "megapack: TP group (0, 1) sends batches by local link (the TP ranks share a host and "
        "the batch stays on the CPU)"
    ]
    assert transport_for(topo, SCHEMA, 2.0) is first
    what = "megapack fields= check over TP ranks (0, 1)"
    assert setup.gathers == [(control_of(group), [SCHEMA.key], what, 2.0)]
    assert setup.links == [(group, 0, 2.0)]
    other = schema_of((BatchField("x", "sample", torch.float32, "all"),))
    assert transport_for(topo, other, None) is first
    assert setup.gathers[1:] == [(control_of(group), [other.key], what, None)]
    with use_transport("collectives"):
        collectives = transport_for(topo, SCHEMA, None)
    assert isinstance(collectives, BroadcastTransport) and collectives.link is None
    assert collectives.why == "$MEGAPACK_TRANSPORT=collectives"
    assert transport_for(topo, SCHEMA, None) is first and len(setup.links) == 1
    links[0].close()  # a failure closed the link: the group sets up anew
    again = transport_for(topo, SCHEMA, None)
    assert again is not first and len(setup.links) == 2 and len(setup.gathers) == 2


def test_the_choice_by_mode_device_and_link(
    setup: Setup, links: tuple[LocalLink, LocalLink]
) -> None:
    def choose(device: str, link: LocalLink | None) -> Any:
        setup.link = link
        topo = Topology(tp_group=Group(), tp_ranks=(0, 1), tp_rank=0, device=torch.device(device))
        return transport_for(topo, SCHEMA, None)

    no_link = "; no local link (ranks on several hosts or namespaces, or set-up refused)"
    with use_transport("split"):
        split = choose("cpu", links[0])
        assert isinstance(split, BroadcastTransport) and split.link is links[0]
        assert split.why == "$MEGAPACK_TRANSPORT=split"
        assert choose("cpu", None).why == f"$MEGAPACK_TRANSPORT=split{no_link}"
    on_gpu = choose("cuda", links[0])
    assert isinstance(on_gpu, BroadcastTransport) and on_gpu.link is links[0]
    assert on_gpu.why == "the batch lives on cuda: the payload goes by its collective"
    apart = choose("cpu", None)
    assert isinstance(apart, BroadcastTransport) and apart.link is None
    assert apart.why == f"the batch lives on cpu: the payload goes by its collective{no_link}"


def test_ranks_that_declare_different_fields_all_fail_naming_each_ranks(
    setup: Setup,
) -> None:
    schema = schema_of((BatchField("x", "sample", torch.float32, "all"),))
    setup.keys = [schema.key, SCHEMA.key]
    group = Group()
    with pytest.raises(ValueError) as info:
        transport_for(topology(group), schema, 2.5)
    declared = "[('x', 'sample', 'torch.float32', 'all')]"
    what = "megapack fields= check over TP ranks (0, 1)"
    assert setup.strings == [(declared, control_of(group), what, 2.5)]
    assert str(info.value) == (
        f"TP ranks passed different fields= to get_batch_on_this_tp_rank: rank 0: {declared}; "
        "rank 1: []. Every TP rank must declare the same fields, in the same order"
    )
    assert setup.links == []  # no transport for a group that disagrees


# ---------------------------------------------------------------- what goes on a link, and its failures


def _spy_link(link: LocalLink) -> list[Any]:
    """Records each `LocalLink.send`'s parts and each `send_frame`'s returned frame."""
    seen: list[Any] = []
    send, send_frame = link.send, link.send_frame

    def spy_send(parts: Any, **kw: Any) -> None:
        seen.append(("send", len(parts), kw["what"]))
        send(parts, **kw)

    def spy_send_frame(*args: Any, **kw: Any) -> Any:
        out = send_frame(*args, **kw)
        seen.append(("frame", out, kw["what"]))
        return out

    link.send, link.send_frame = spy_send, spy_send_frame  # type: ignore[method-assign]
    return seen


def test_a_link_frame_holds_the_header_alone_or_with_an_error_message(
    fabric: Fabric, links: tuple[LocalLink, LocalLink]
) -> None:
    group = Group()
    source_link, peer_link = links
    seen = _spy_link(source_link)
    sender = BroadcastTransport(topology(group), source_link, "why")
    receiver = BroadcastTransport(topology(group, 1), peer_link, "why")
    header, pieces, _ = frame()
    sender.send(header, pieces, 5)
    fabric.source = False
    receiver.receive(HEADER, 5)
    error, message = error_frame()
    sender.send(error, message, 5)
    receiver.receive(HEADER, 5)
    what = WHAT.format("header")
    assert [s for s in seen if s[0] == "send"] == [("send", 1, what), ("send", 2, what)]


def test_link_failures_name_the_header_and_keep_the_timeout(
    fabric: Fabric, links: tuple[LocalLink, LocalLink]
) -> None:
    group = Group()
    _, peer_link = links
    receiver = BroadcastTransport(topology(group, 1), peer_link, "why")
    with pytest.raises(CollectiveError) as info:
        receiver.receive(HEADER, 0.05)  # the source sends nothing
    assert str(info.value).startswith(
        f"{WHAT.format('header')} timed out (timeout 0.05 s, set by timeout= or "
        "$MEGAPACK_TIMEOUT_S) on rank 1 receiving from rank 0"
    )
    other_a, other_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = BroadcastTransport(topology(group), LocalLink(src=0, rank=0, peers={1: other_a}), "")
    header = signal(Status.STOP, Stage.ONLY, SCHEMA)
    sender.send(header, [], 5)  # the peer (other_b) never acknowledges
    with pytest.raises(CollectiveError) as info:
        sender.send(header, [], 0.05)
    other_b.close()
    assert str(info.value).startswith(
        f"{WHAT.format('header')} timed out (timeout 0.05 s, set by timeout= or "
        "$MEGAPACK_TIMEOUT_S) on rank 0 sending to rank 1"
    )


def test_a_link_transports_failures_name_its_frame_and_keep_the_timeout(
    links: tuple[LocalLink, LocalLink],
) -> None:
    source_link, peer_link = links
    sender = LinkTransport(source_link, "the frame", "why")
    receiver = LinkTransport(peer_link, "the frame", "why")
    with pytest.raises(CollectiveError) as info:
        receiver.receive(HEADER, 0.05)
    assert str(info.value).startswith(
        "the frame timed out (timeout 0.05 s, set by timeout= or $MEGAPACK_TIMEOUT_S) on rank 1 "
        "receiving from rank 0"
    )
    other_a, other_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = LinkTransport(LocalLink(src=0, rank=0, peers={1: other_a}), "the frame", "why")
    header = signal(Status.STOP, Stage.ONLY, SCHEMA)
    sender.send(header, [], 5)  # the peer (other_b) never acknowledges
    with pytest.raises(CollectiveError) as info:
        sender.send(header, [], 0.05)
    other_b.close()
    assert str(info.value).startswith(
        "the frame timed out (timeout 0.05 s, set by timeout= or $MEGAPACK_TIMEOUT_S) on rank 0 "
        "sending to rank 1"
    )


def test_a_small_frames_payload_is_the_frame_itself_not_a_copy(
    links: tuple[LocalLink, LocalLink],
) -> None:
    source_link, peer_link = links
    seen = _spy_link(source_link)
    header, pieces, payload = frame()
    sent = LinkTransport(source_link, "the frame", "why").send(header, pieces, 5)
    ((_, (sent_frame, shared), what),) = seen
    assert not shared and what == "the frame"
    assert np.shares_memory(sent.numpy(), sent_frame) and bytes(sent.numpy()) == payload
    assert bytes(peer_link.receive(what="x", timeout=5)[HEADER:]) == payload


def test_align_ranks_that_declare_another_alignment_fail_naming_it(setup: Setup) -> None:
    """Two ranks whose only difference is a per-token field's ``at``: the keys differ, and the
    error shows each rank's alignment."""
    token = schema_of((BatchField("lp", "token", torch.float32, "last", at="token"),))
    label = schema_of((BatchField("lp", "token", torch.float32, "last", at="label"),))
    setup.keys = [token.key, label.key]
    group = Group()
    with pytest.raises(ValueError) as info:
        transport_for(topology(group), token, 2.5)
    declared = "[('lp', 'token', 'torch.float32', 'last', 'at=token')]"
    assert setup.strings[0][0] == declared
    assert str(info.value).startswith(
        f"TP ranks passed different fields= to get_batch_on_this_tp_rank: rank 0: {declared}"
    )
