"""get_batch_on_this_tp_rank in one process: the source and a peer of a TP group of two, each with
a fake transport that records the frame it is given (the peer receives the source's), every
verdict a peer reaches on a header, the source's errors and stops, and the argument checks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from megapack import PackedBatch, RemoteDataError, Topology, get_batch_on_this_tp_rank
from megapack.core.errors import CollectiveError, ProtocolError
from megapack.core.fields import OUTPUT_KEYS, BatchField, Stage, schema_of
from megapack.delivery import deliver as get_batch_module  # the orchestrator
from megapack.delivery.transport import Transport
from megapack.delivery.wire import Header, Status, header_bytes, payload_of, signal

SCHEMA = schema_of()
CPU = torch.device("cpu")


class Group:
    """Stands in for a TP process group."""


class Wire(Transport):
    """A fake transport: the source's frames are recorded (and may be made to fail); a peer
    receives the frame it is handed, as `Header.from_bytes` parses it."""

    name = "fake"

    def __init__(self) -> None:
        self.sent: list[tuple[Header, bytes, float | None]] = []
        self.received: list[tuple[int, float | None]] = []
        self.fail: list[BaseException] = []
        self.next: tuple[Header, torch.Tensor] | None = None

    def send(
        self, header: Header, pieces: list[torch.Tensor], timeout: float | None
    ) -> torch.Tensor:
        if self.fail:
            raise self.fail.pop(0)
        payload = payload_of(pieces, header.nbytes, CPU)
        self.sent.append((header, bytes(payload.numpy()), timeout))
        return payload

    def receive(self, header_bytes: int, timeout: float | None) -> tuple[Header, torch.Tensor]:
        self.received.append((header_bytes, timeout))
        assert self.next is not None
        return self.next

    def hand(self, header: Header, payload: bytes) -> None:
        """What the peer's next receive returns."""
        raw = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if payload
            else torch.empty(0, dtype=torch.uint8)
        )
        self.next = (Header.from_bytes(header.to_bytes()), raw)


def on(wire: Wire, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Topology, Any, float | None]]:
    """Every call's transport is ``wire``; returns the (topology, schema, timeout) it was asked for."""
    asked: list[tuple[Topology, Any, float | None]] = []

    def transport_for(topo: Topology, schema: Any, timeout: float | None) -> Wire:
        asked.append((topo, schema, timeout))
        return wire

    monkeypatch.setattr(get_batch_module, "transport_for", transport_for)
    return asked


def rank(tp_rank: int, pp_rank: int = 0, pp_size: int = 1, group: Any = None) -> Topology:
    return Topology(tp_group=group or Group(), tp_ranks=(4, 5), tp_rank=tp_rank, pp_rank=pp_rank,
                    pp_size=pp_size)  # fmt: skip


def sample() -> PackedBatch:
    return PackedBatch.from_documents([[5, 6, 7], [8, 9], [1, 2, 3, 4]])


def test_the_peer_returns_exactly_what_the_source_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    wire = Wire()
    asked = on(wire, monkeypatch)
    item = sample()
    source = rank(0, 1, 2)
    mine = get_batch_on_this_tp_rank(iter([item]), topology=source, timeout=3.0)
    assert asked == [(source, SCHEMA, 3.0)]  # the group's transport, for these fields
    ((header, payload, timeout),) = wire.sent
    assert timeout == 3.0 and header.stage == Stage.LAST and header.key == SCHEMA.key
    wire.hand(header, payload)
    theirs = get_batch_on_this_tp_rank(None, topology=rank(1, 1, 2), timeout=3.0)
    assert wire.received == [(header_bytes(SCHEMA), 3.0)]
    assert list(mine) == list(theirs) == list(OUTPUT_KEYS)
    for out in (mine, theirs):
        assert out["tokens"] is None and out["position_ids"] is None  # the last stage
        assert out["labels"].tolist() == item.labels.tolist()
        assert out["cu_seqlens"].tolist() == [0, 3, 5, 9] and out["max_seqlen"] == 4
        assert out["packed_seq_params"].cu_seqlens_q is out["cu_seqlens"]
    assert not np.shares_memory(mine["labels"].numpy(), item.labels.numpy())  # a copy


def test_a_peer_stops_when_the_source_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    wire = Wire()
    on(wire, monkeypatch)
    with pytest.raises(StopIteration):
        get_batch_on_this_tp_rank(iter([]), topology=rank(0))
    ((header, payload, _),) = wire.sent
    assert header == signal(Status.STOP, Stage.ONLY, SCHEMA) and payload == b""
    wire.hand(header, payload)
    with pytest.raises(StopIteration):
        get_batch_on_this_tp_rank(None, topology=rank(1))


class Failing:
    """An iterator that raises ``error`` at its first ``next``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __iter__(self) -> Failing:
        return self

    def __next__(self) -> Any:
        raise self.error


@pytest.mark.parametrize(
    ("source", "error", "text"),
    [
        (lambda: Failing(OSError("disk gone")), OSError, "OSError: disk gone"),
        (lambda: iter([[1, 2]]), TypeError,
         "TypeError: data_iterator yielded list; expected a megapack.PackedBatch or a dict of "
         "tensors (Megatron SFT-style with cu_seqlens, or a plain pretraining batch)"),
    ],
    ids=["iterator-raises", "bad-batch"],
)  # fmt: skip
def test_a_source_error_is_sent_as_its_message_and_raised_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, source: Any, error: type, text: str
) -> None:
    wire = Wire()
    on(wire, monkeypatch)
    with pytest.raises(error):
        get_batch_on_this_tp_rank(source(), topology=rank(0))
    ((header, payload, _),) = wire.sent
    assert header == signal(Status.ERROR, Stage.ONLY, SCHEMA, len(text.encode()))
    assert payload == text.encode()
    wire.hand(header, payload)
    with pytest.raises(RemoteDataError) as info:
        get_batch_on_this_tp_rank(None, topology=rank(1))
    assert (info.value.source_rank, info.value.remote_message) == (4, text)


def test_a_frame_that_cannot_be_laid_out_is_followed_by_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wire = Wire()
    on(wire, monkeypatch)
    wire.fail = [MemoryError("no room for the payload")]
    with pytest.raises(MemoryError, match="no room"):
        get_batch_on_this_tp_rank(iter([sample()]), topology=rank(0), timeout=2.0)
    ((header, payload, timeout),) = wire.sent  # the error frame, in place of the batch
    assert header.status == Status.ERROR and payload == b"MemoryError: no room for the payload"
    assert timeout == 2.0


def test_a_collective_failure_is_raised_as_is_with_nothing_more_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wire = Wire()
    on(wire, monkeypatch)
    wire.fail = [CollectiveError("peer 5 crashed")]
    with pytest.raises(CollectiveError, match="peer 5 crashed"):
        get_batch_on_this_tp_rank(iter([sample()]), topology=rank(0))
    assert wire.sent == []


def test_a_peer_refuses_a_frame_of_other_fields_or_another_stage_in_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wire = Wire()
    on(wire, monkeypatch)
    get_batch_on_this_tp_rank(iter([sample()]), topology=rank(0, 0, 2))  # the first stage's frame
    ((header, payload, _),) = wire.sent
    wire.hand(header, payload)
    with pytest.raises(ProtocolError) as info:
        get_batch_on_this_tp_rank(None, topology=rank(1, 1, 2))
    assert str(info.value) == (
        "TP source rank 4 serves pipeline stage 'first' but this rank is on stage 'last': TP peers "
        "must share a pipeline stage (check the Topology)"
    )
    fields = (BatchField("adv", "token", torch.float32, "last", at="label"),)
    with pytest.raises(ProtocolError) as info:
        get_batch_on_this_tp_rank(None, topology=rank(1, 0, 2), fields=fields)
    assert str(info.value) == (
        "TP source rank 4 sent a batch of other fields= than this rank declared: every TP rank "
        "must pass the same fields"
    )


def test_a_middle_stage_without_a_dataset_sends_the_all_none_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wire = Wire()
    on(wire, monkeypatch)
    for packed in (None, False):
        out = get_batch_on_this_tp_rank(None, topology=rank(0, 1, 3), packed=packed)
        assert list(out) == list(OUTPUT_KEYS) and all(v is None for v in out.values())
    header, payload, _ = wire.sent[-1]
    assert (header.status, header.stage, header.form, header.key, header.nbytes) == (
        Status.OK, Stage.MIDDLE, 1, SCHEMA.key, 0,
    )  # fmt: skip
    assert header.dims == (None,) * len(SCHEMA.fields) and payload == b""
    wire.hand(header, payload)
    assert all(v is None for v in get_batch_on_this_tp_rank(None, topology=rank(1, 1, 3)).values())


def test_a_source_without_an_iterator_elsewhere_is_an_error_in_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wire = Wire()
    on(wire, monkeypatch)
    with pytest.raises(ValueError) as info:
        get_batch_on_this_tp_rank(None, topology=rank(0, 1, 3), packed=True)
    assert str(info.value) == (
        "data_iterator is None on TP source rank 4 of a middle pipeline stage (pp_rank 1), but "
        "packed batches need cu_seqlens on every stage: build the dataset on TP rank 0 of every "
        "pipeline stage (Megatron: is_dataset_built_on_rank must return True there, e.g. "
        "is_dataset_built_on_rank(vp_stage, is_packed_sequence=True)) and pass its iterator"
    )
    for pp_rank, stage in ((0, "first"), (2, "last")):
        with pytest.raises(ValueError) as info:
            get_batch_on_this_tp_rank(None, topology=rank(0, pp_rank, 3))
        assert str(info.value) == (
            f"data_iterator is None on TP source rank 4 (pipeline stage '{stage}', pp_rank "
            f"{pp_rank}); this stage's TP rank 0 must get an iterator"
        )
    assert [h.status for h, _, _ in wire.sent] == [Status.ERROR] * 3  # the peers hear of it


def test_local_cp_size_must_be_this_ranks_cp_group_in_full() -> None:
    item = {"tokens": torch.ones(1, 8, dtype=torch.long), "labels": torch.ones(1, 8, dtype=torch.long),
            "loss_mask": torch.ones(1, 8), "position_ids": torch.arange(8)[None],
            "cu_seqlens": torch.tensor([[0, 8]], dtype=torch.int32), "local_cp_size": 2}  # fmt: skip
    with pytest.raises(ValueError) as info:
        get_batch_on_this_tp_rank(iter([item]), topology=Topology.single())
    assert str(info.value) == (
        "batch has local_cp_size=2 but this rank's CP group has 1 ranks (no CP group): for "
        "Megatron's hybrid CP build the Topology with this batch's group, "
        "Topology.from_groups(tp_group, cp_group=<the 2-rank hybrid CP group>, ...)"
    )
    cp = Topology(tp_group=None, tp_ranks=(0,), tp_rank=0, cp_group=object(), cp_ranks=(0, 1))
    assert get_batch_on_this_tp_rank(iter([item]), topology=cp)["local_cp_size"] == 2
    with pytest.raises(ValueError) as info:
        get_batch_on_this_tp_rank(iter([item | {"local_cp_size": 4}]), topology=cp)
    assert "has local_cp_size=4 but this rank's CP group has 2 ranks ((0, 1))" in str(info.value)


def test_cp_shares_follow_the_layout_asked_for_else_the_topologys() -> None:
    item = PackedBatch.from_documents([list(range(8)), list(range(8, 16))])
    group = object()
    for layout, asked, want in (("document", None, [2, 3, 4, 5, 10, 11, 12, 13]),
                                ("row", None, [4, 5, 6, 7, 8, 9, 10, 11]),
                                ("row", "document", [2, 3, 4, 5, 10, 11, 12, 13])):  # fmt: skip
        topo = Topology(tp_group=None, tp_ranks=(0,), tp_rank=0, cp_group=group, cp_ranks=(0, 1),
                        cp_rank=1, cp_layout=layout)  # type: ignore[arg-type]  # fmt: skip
        out = get_batch_on_this_tp_rank(iter([item]), topology=topo, cp_layout=asked)  # type: ignore[arg-type]
        assert out["tokens"].tolist() == [want], (layout, asked)
        assert out["packed_seq_params"].cp_group is group


def test_sequence_parallel_and_packed_reach_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    wire = Wire()
    on(wire, monkeypatch)
    cp = dict(cp_group=object(), cp_ranks=(0, 1))
    topo = Topology(tp_group=Group(), tp_ranks=(0, 1, 2, 3), tp_rank=0, **cp)  # type: ignore[arg-type]
    item = PackedBatch.from_documents([[1] * 4, [2] * 8])  # 6 tokens per CP rank
    with pytest.raises(ValueError, match="not a multiple of tp=4 as sequence parallelism needs"):
        get_batch_on_this_tp_rank(iter([item]), topology=topo, sequence_parallel=True)
    assert get_batch_on_this_tp_rank(iter([item]), topology=topo)["tokens"].shape == (1, 6)
    with pytest.raises(ValueError, match=r"packed=False\) but the batch has cu_seqlens"):
        get_batch_on_this_tp_rank(iter([item]), topology=topo, packed=False)


def test_argument_checks_in_full() -> None:
    with pytest.raises(ValueError) as info:
        get_batch_on_this_tp_rank(iter([]), topology=Topology.single(), cp_layout="zigzag")  # type: ignore[arg-type]
    assert str(info.value) == "cp_layout must be one of ('document', 'row') or None, got 'zigzag'"
    with pytest.raises(TypeError) as info:
        get_batch_on_this_tp_rank(iter([]), topology=Topology.single(), packed=1)  # type: ignore[arg-type]
    assert str(info.value) == "packed must be True, False or None, got 1"
    # checked before megatron-core's parallel_state is asked for a topology (none here)
    with pytest.raises(TypeError, match=r"static must be a megapack\.StaticShape or None, got 3"):
        get_batch_on_this_tp_rank(iter([]), static=3)  # type: ignore[arg-type]


def test_without_a_topology_megatrons_parallel_state_gives_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[int] = []

    def from_parallel_state(cls: type) -> Topology:
        asked.append(1)
        return Topology.single()

    monkeypatch.setattr(Topology, "from_parallel_state", classmethod(from_parallel_state))
    out = get_batch_on_this_tp_rank(iter([sample()]))
    assert asked == [1] and out["cu_seqlens"].tolist() == [0, 3, 5, 9]


def test_debug_sync_checks_every_call_of_a_group_in_step(monkeypatch: pytest.MonkeyPatch) -> None:
    wire = Wire()
    on(wire, monkeypatch)
    checks: list[tuple[str, int, Any, float | None]] = []
    monkeypatch.setattr(get_batch_module, "debug_sync_enabled", lambda: True)
    monkeypatch.setattr(get_batch_module, "control_group", lambda group: ("control", group))
    monkeypatch.setattr(
        get_batch_module, "check_in_sync",
        lambda tag, step, *, group, timeout: checks.append((tag, step, group, timeout)),
    )  # fmt: skip
    group, other = Group(), Group()
    data = iter([sample()] * 4)
    for topo in (rank(0, group=group), rank(0, group=group), rank(0, group=other),
                 rank(0, group=group)):  # fmt: skip
        get_batch_on_this_tp_rank(data, topology=topo, timeout=7.0)
    get_batch_on_this_tp_rank(iter([sample()]), topology=Topology.single())  # no group: no check
    tag = "megapack.get_batch_on_this_tp_rank"
    mine, theirs = ("control", group), ("control", other)
    assert checks == [(tag, 0, mine, 7.0), (tag, 1, mine, 7.0), (tag, 0, theirs, 7.0),
                      (tag, 2, mine, 7.0)]  # fmt: skip
    monkeypatch.setattr(get_batch_module, "debug_sync_enabled", lambda: False)
    get_batch_on_this_tp_rank(iter([sample()]), topology=rank(0, group=group))
    assert len(checks) == 4


def test_a_message_that_is_not_utf_8_still_reaches_the_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wire = Wire()
    on(wire, monkeypatch)
    text = b"OSError: caf\xc3"  # cut inside a character
    wire.hand(signal(Status.ERROR, Stage.ONLY, SCHEMA, len(text)), text)
    with pytest.raises(RemoteDataError) as info:
        get_batch_on_this_tp_rank(None, topology=rank(1))
    assert info.value.remote_message == "OSError: caf\ufffd"


def test_each_rank_returns_its_own_cp_group_in_packed_seq_params(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wire = Wire()
    on(wire, monkeypatch)
    group, source_cp, peer_cp = Group(), object(), object()

    def cp_rank(tp_rank: int, cp_group: object) -> Topology:
        return Topology(tp_group=group, tp_ranks=(4, 5), tp_rank=tp_rank, cp_group=cp_group,
                        cp_ranks=(4, 6) if tp_rank == 0 else (5, 7))  # fmt: skip

    item = PackedBatch.from_documents([list(range(8)), list(range(8, 16))])
    mine = get_batch_on_this_tp_rank(iter([item]), topology=cp_rank(0, source_cp))
    ((header, payload, _),) = wire.sent
    wire.hand(header, payload)
    theirs = get_batch_on_this_tp_rank(None, topology=cp_rank(1, peer_cp))
    assert mine["packed_seq_params"].cp_group is source_cp
    assert theirs["packed_seq_params"].cp_group is peer_cp
    assert theirs["tokens"].tolist() == mine["tokens"].tolist() == [[0, 1, 6, 7, 8, 9, 14, 15]]
