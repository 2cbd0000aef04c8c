"""`get_batch_on_this_tp_rank`: one micro-batch from the TP source to its peers, usually in one broadcast.

Megatron's ``get_batch_on_this_tp_rank`` broadcasts each tensor separately (5-12 collectives a
micro-batch, plus a size broadcast and a host sync for ``cu_seqlens``). Here a call is one frame,

    [ 128-byte header | payload (the stage's fields, `megapack.wire`) | slack ]

broadcast from the TP source. Receivers must allocate the frame before they know the batch, so
every TP group keeps a payload *capacity* that all its ranks derive from the same headers without
talking: a payload that fits travels inside the frame (1 collective); one that does not follows in
a second broadcast (2 collectives) and the capacity grows to it plus 1/8 slack (and shrinks again
when payloads fall under a quarter of it). With a fixed sequence length only the first call, and
a call with unusually many documents, take two. A clean stop is one collective; tp=1 none.

A failure on the source while fetching or validating is sent in place of a batch: the source
re-raises its own error and every peer raises `RemoteDataError` within one collective's latency.
On NCCL groups the header instead travels on a CPU gloo control group and the payload on
the device stream (`megapack.split_transfer`): no host wait, no device-to-host copy.
Collectives on the host wait at most the megapack timeout (`megapack.comm`) and then raise
`CollectiveError`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megapack import comm
from megapack.errors import ProtocolError, RemoteDataError
from megapack.side_groups import control_group
from megapack.split_transfer import receive_split, send_split, split_control
from megapack.sync import check_in_sync, debug_sync_enabled
from megapack.topology import Topology
from megapack.wire import (
    FIELDS,
    HEADER_BYTES,
    OUTPUT_KEYS,
    Header,
    Status,
    decode,
    encode_chunks,
    join,
)

__all__ = ["FIELDS", "OUTPUT_KEYS", "get_batch_on_this_tp_rank"]


@dataclass(slots=True)
class _GroupState:
    """Per TP group, identical on all its ranks: every field changes only on what all ranks saw."""

    capacity: int = 0
    """Payload bytes the next frame carries inline."""
    calls: int = 0
    """Calls so far, the step $MEGAPACK_DEBUG_SYNC's check compares."""


# Keyed weakly by the TP process group: the state lives exactly as long as the group.
_states: weakref.WeakKeyDictionary[dist.ProcessGroup, _GroupState] = weakref.WeakKeyDictionary()


def get_batch_on_this_tp_rank(
    data_iterator: Iterator[Any] | None,
    *,
    topology: Topology | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Drop-in for Megatron's ``get_batch_on_this_tp_rank``, correct on every pipeline stage.

    Call it on every rank of a TP group once per micro-step. Only the TP source (TP rank 0) calls
    ``next(data_iterator)``; other ranks may pass None and their iterator is never touched.

    The source accepts a `PackedBatch`, a Megatron SFT-style dict with ``cu_seqlens`` [b, k]
    (rows merged into THD [1, b*s]), or a plain pretraining dict without ``cu_seqlens`` (kept as
    [b, s], with its optional ``attention_mask``).

    Args:
        data_iterator: the source's iterator; ignored on the other TP ranks.
        topology: this rank's place in the grid; default: from megatron-core's ``parallel_state``.
        timeout: seconds a peer waits for the source (default: $MEGAPACK_TIMEOUT_S or 300).

    Returns:
        A dict with exactly the keys ``tokens``, ``labels``, ``loss_mask``, ``attention_mask``,
        ``position_ids``, ``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen`` and
        ``packed_seq_params``; a field this stage does not need is None (`megapack.wire.FIELDS`).
        Packed batches give ``cu_seqlens`` 1-D int32, ``max_seqlen`` a Python int and
        ``attention_mask`` None, on every stage.

    Raises:
        StopIteration: on every TP rank, in the same call, when the source's iterator is exhausted.
        RemoteDataError: on TP ranks other than the source when the source failed; the source
            raises its own error (e.g. ValueError naming the bad field, row and value).
        CollectiveError: when a TP peer is stuck past the timeout or has crashed.
    """
    topo = topology if topology is not None else Topology.from_parallel_state()
    state = (
        _GroupState() if topo.tp_group is None else _states.setdefault(topo.tp_group, _GroupState())
    )
    state.calls += 1
    if topo.tp_size > 1 and debug_sync_enabled():
        check_in_sync(
            "megapack.get_batch_on_this_tp_rank",
            state.calls - 1,
            group=control_group(topo.tp_group),
            timeout=timeout,
        )
    if topo.is_source:
        return _send(data_iterator, topo, state, timeout)
    return _receive(topo, state, timeout)


def _send(
    data_iterator: Iterator[Any] | None, topo: Topology, state: _GroupState, timeout: float | None
) -> dict[str, Any]:
    error: Exception | None = None
    try:
        if data_iterator is None:
            raise ValueError(
                f"data_iterator is None on TP source rank {topo.src_rank}; the source must get an iterator"
            )
        header, chunks = encode_chunks(next(data_iterator), topo.stage, topo.device)
    except StopIteration:
        header, chunks = Header(status=Status.STOP, stage=topo.stage), []
    except Exception as exc:
        message = torch.frombuffer(
            bytearray(f"{type(exc).__name__}: {exc}".encode()), dtype=torch.uint8
        )
        header, chunks, error = (
            Header(status=Status.ERROR, stage=topo.stage, nbytes=message.numel()),
            [message.to(topo.device)],
            exc,
        )
    if (control := split_control(topo)) is not None:
        payload = send_split(header, chunks, topo, control, timeout)
    else:
        payload = _send_frame(header, chunks, topo, state, timeout)
    _settle(state, header)
    if header.status == Status.STOP:
        raise StopIteration
    if error is not None:
        raise error
    return decode(header, payload)


def _receive(topo: Topology, state: _GroupState, timeout: float | None) -> dict[str, Any]:
    if (control := split_control(topo)) is not None:
        header, payload = receive_split(topo, control, timeout)
    else:
        header, payload = _receive_frame(topo, state, timeout)
    _settle(state, header)
    if header.status == Status.STOP:
        raise StopIteration
    if header.status == Status.ERROR:
        raise RemoteDataError(topo.src_rank, bytes(payload.cpu().tolist()).decode(errors="replace"))
    if header.stage != topo.stage:
        raise ProtocolError(
            f"TP source rank {topo.src_rank} serves pipeline stage {header.stage.value!r} but this rank "
            f"is on stage {topo.stage.value!r}: TP peers must share a pipeline stage (check the Topology)"
        )
    return decode(header, payload)


def _send_frame(
    header: Header,
    chunks: list[torch.Tensor],
    topo: Topology,
    state: _GroupState,
    timeout: float | None,
) -> torch.Tensor:
    """One frame (header + inline payload + slack); the payload follows when it outgrew the capacity."""
    capacity = state.capacity
    inline = header.nbytes <= capacity
    slack = capacity - header.nbytes if inline else capacity
    frame = join([header.to_tensor(topo.device).view(torch.uint8), *(chunks if inline else []),
                  torch.zeros(slack, dtype=torch.uint8, device=topo.device)], topo.device)  # fmt: skip
    _broadcast(frame, topo, timeout, "frame")
    payload = (
        frame[HEADER_BYTES : HEADER_BYTES + header.nbytes] if inline else join(chunks, topo.device)
    )
    if not inline:
        _broadcast(payload, topo, timeout, "payload")
    return payload


def _receive_frame(
    topo: Topology, state: _GroupState, timeout: float | None
) -> tuple[Header, torch.Tensor]:
    frame = torch.empty(HEADER_BYTES + state.capacity, dtype=torch.uint8, device=topo.device)
    _broadcast(frame, topo, timeout, "frame")
    header = Header.from_tensor(frame[:HEADER_BYTES].view(torch.int64))
    if header.nbytes <= state.capacity:
        payload = frame[HEADER_BYTES : HEADER_BYTES + header.nbytes]
    else:
        payload = torch.empty(header.nbytes, dtype=torch.uint8, device=topo.device)
        _broadcast(payload, topo, timeout, "payload")
    return header, payload


def _settle(state: _GroupState, header: Header) -> None:
    """Resize the inline capacity from a batch header: the same rule, from the same bytes, on every rank."""
    if header.status != Status.OK:
        return
    n = header.nbytes
    if n > state.capacity or n < state.capacity // 4:
        state.capacity = -(-(n + n // 8 + 256) // 1024) * 1024


def _broadcast(tensor: torch.Tensor, topo: Topology, timeout: float | None, part: str) -> None:
    if topo.tp_size > 1:
        what = f"get_batch_on_this_tp_rank {part} broadcast from TP source rank {topo.src_rank}"
        comm.broadcast(tensor, topo.src_rank, group=topo.tp_group, what=what, timeout=timeout)
