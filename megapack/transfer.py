"""`get_batch_on_this_tp_rank`: one micro-batch from the TP source to its peers, usually in one broadcast.

Megatron's ``get_batch_on_this_tp_rank`` broadcasts each tensor separately (5-12 collectives a
micro-batch, plus a size broadcast and a host sync for ``cu_seqlens``). Here a call is one frame,

    [ 192-byte header | payload (the stage's fields, `megapack.wire`) | slack ]

broadcast from the TP source. Receivers must allocate the frame before they know the batch, so
every TP group keeps a payload *capacity* that all its ranks derive from the same headers without
talking: a payload that fits travels inside the frame (1 collective); one that does not follows in
a second broadcast (2 collectives) and the capacity grows to it plus 1/8 slack (and shrinks again
when payloads fall under a quarter of it). With a fixed sequence length only the first call, and
a call with unusually many documents, take two. A clean stop is one collective; tp=1 none.

TP ranks on one host skip the collective: the source hands the frame to its peers over a local
link (`megapack.local_link`, Unix sockets and shared memory), the header followed by the fields
in full (`megapack.frame`), and keeps its own outputs as views of the same frame; each peer
prepares the buffer for the next frame while it waits. `MEGAPACK_LOCAL_LINK=0` turns links off.

With context parallelism the source first cuts the normalized batch to its CP rank's share
(`megapack.cp_share`), so the payload holds 1/cp of the token bytes; the encoding never sees more.

A failure on the source while fetching or validating is sent in place of a batch: the source
re-raises its own error and every peer raises `RemoteDataError` within one collective's latency.
On NCCL groups the header instead travels on a CPU gloo control group and the payload on
the device stream (`megapack.split_transfer`): no host wait, no device-to-host copy.
Collectives on the host wait at most the megapack timeout (`megapack.comm`) and then raise
`CollectiveError`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megapack import comm
from megapack.codec import Share
from megapack.cp import CP_LAYOUTS, CpLayout
from megapack.cp_share import take_cp_share
from megapack.errors import ProtocolError, RemoteDataError
from megapack.frame import frame_outputs, plan_frame, prepare, send_link_frame
from megapack.header import HEADER_BYTES, Header, Status
from megapack.inputs import Layout, Scalars, normalize
from megapack.link_setup import link_for
from megapack.local_link import LocalLink
from megapack.side_groups import control_group
from megapack.split_transfer import receive_split, send_split, split_control
from megapack.sync import check_in_sync, debug_sync_enabled
from megapack.topology import Stage, Topology
from megapack.wire import (
    FIELDS,
    OUTPUT_KEYS,
    decode,
    encode_fields,
    full_outputs,
    join,
    source_outputs,
)

__all__ = ["FIELDS", "OUTPUT_KEYS", "get_batch_on_this_tp_rank"]


@dataclass(slots=True)
class _GroupState:
    """Per TP group, identical on all its ranks: every field changes only on what all ranks saw."""

    capacity: int = 0
    """Payload bytes the next frame carries inline."""
    calls: int = 0
    """Calls so far, the step $MEGAPACK_DEBUG_SYNC's check compares."""
    last: Header | None = None
    """A peer's last local-link frame header, the layout it prepares the next buffer for."""


# Keyed weakly by the TP process group: the state lives exactly as long as the group.
_states: weakref.WeakKeyDictionary[dist.ProcessGroup, _GroupState] = weakref.WeakKeyDictionary()


def get_batch_on_this_tp_rank(
    data_iterator: Iterator[Any] | None,
    *,
    topology: Topology | None = None,
    timeout: float | None = None,
    cp_layout: CpLayout | None = None,
    sequence_parallel: bool = False,
    packed: bool | None = None,
) -> dict[str, Any]:
    """Drop-in for Megatron's ``get_batch_on_this_tp_rank``, correct on every pipeline stage.

    Call it on every rank of a TP group once per micro-step. Only the TP source (TP rank 0) calls
    ``next(data_iterator)``; other ranks may pass None and their iterator is never touched.
    Megatron builds no dataset on middle pipeline stages for plain pretraining: a middle stage
    whose source passes None returns the all-None batch on every TP rank. Packed batches need
    ``cu_seqlens`` there too; with ``packed=True`` a middle source without an iterator is an error
    saying how to build one (Megatron's ``is_dataset_built_on_rank``).

    The source accepts a `PackedBatch`, a Megatron SFT-style dict with ``cu_seqlens`` [b, k]
    (rows merged into THD [1, b*s]), or a plain pretraining dict without ``cu_seqlens`` (kept as
    [b, s], with its optional ``attention_mask``).

    With context parallelism (``topology.cp_size > 1``) every CP rank's TP source reads the same
    full row and sends only its zigzag share of the per-token fields (`megapack.cp_share`):
    tokens, labels, loss_mask and position_ids hold T / cp positions (plain batches: s / cp per
    row, ``attention_mask`` [b, 1, s / cp, s]); ``cu_seqlens``, ``cu_seqlens_padded`` and
    ``max_seqlen`` stay the whole row's, and ``packed_seq_params.cp_group`` is the CP group.

    Args:
        data_iterator: the source's iterator; ignored on the other TP ranks.
        topology: this rank's place in the grid; default: from megatron-core's ``parallel_state``.
        timeout: seconds a peer waits for the source (default: $MEGAPACK_TIMEOUT_S or 300).
        cp_layout: "document" or "row", how packed rows are split over CP ranks; default:
            ``topology.cp_layout``. Every CP rank must pass the same.
        sequence_parallel: True when the model uses sequence parallelism, so each CP rank's
            token count must also divide by tp (checked, with the padding that fixes it).
        packed: whether batches carry ``cu_seqlens`` (Megatron's ``has_cu_seqlens``: ``--sft`` or
            inter-document masking). None: each batch says. True/False: a batch of the other
            kind is an error, and a middle stage's source without an iterator is an error (True)
            or returns the all-None batch (False or None).

    Returns:
        A dict with exactly the keys `megapack.wire.OUTPUT_KEYS`: one per field of
        `megapack.wire.FIELDS` (``tokens``, ``position_ids``, ``labels``, ``loss_mask``,
        ``attention_mask``, ``cu_seqlens``, ``cu_seqlens_padded``, ``dataset_id``), then
        ``max_seqlen``, ``local_cp_size`` and ``packed_seq_params``; a field this stage does not
        need is None. Packed batches give ``cu_seqlens`` 1-D int32, ``max_seqlen`` a Python int
        and ``attention_mask`` None, on every stage.

    Raises:
        StopIteration: on every TP rank, in the same call, when the source's iterator is exhausted.
        RemoteDataError: on TP ranks other than the source when the source failed; the source
            raises its own error (e.g. ValueError naming the bad field, row and value).
        CollectiveError: when a TP peer is stuck past the timeout or has crashed.
    """
    if cp_layout is not None and cp_layout not in CP_LAYOUTS:
        raise ValueError(f"cp_layout must be one of {CP_LAYOUTS} or None, got {cp_layout!r}")
    if packed is not None and not isinstance(packed, bool):
        raise TypeError(f"packed must be True, False or None, got {packed!r}")
    topo = topology if topology is not None else Topology.from_parallel_state()
    state = _group_state(topo.tp_group)
    state.calls += 1
    if topo.tp_size > 1 and debug_sync_enabled():
        check_in_sync(
            "megapack.get_batch_on_this_tp_rank",
            state.calls - 1,
            group=control_group(topo.tp_group),
            timeout=timeout,
        )
    if topo.is_source:
        options = _SourceOptions(
            cp_layout=topo.cp_layout if cp_layout is None else cp_layout,
            sequence_parallel=sequence_parallel,
            packed=packed,
        )
        return _send(data_iterator, topo, state, timeout, options)
    return _receive(topo, state, timeout)


def _group_state(group: dist.ProcessGroup | None) -> _GroupState:
    if group is None:
        return _GroupState()
    state = _states.get(group)  # not setdefault: that builds a weakref and a state every call
    if state is None:
        state = _states[group] = _GroupState()
    return state


@dataclass(frozen=True, kw_only=True, slots=True)
class _SourceOptions:
    """How the TP source turns an item into what it sends (see get_batch_on_this_tp_rank's Args)."""

    cp_layout: CpLayout
    sequence_parallel: bool
    packed: bool | None


def _send(
    data_iterator: Iterator[Any] | None,
    topo: Topology,
    state: _GroupState,
    timeout: float | None,
    options: _SourceOptions,
) -> dict[str, Any]:
    error: Exception | None = None
    chunks: list[torch.Tensor] = []
    fields: dict[str, torch.Tensor | None] = {}
    arrays: list[np.ndarray] | None = None  # on a link: the frame's fields (`plan_frame`)
    control = split_control(topo)
    link = _link(topo, timeout) if control is None else None
    try:
        if data_iterator is None:
            header = _without_iterator(topo, options)
        else:
            layout, fields, scalars, share = _take_item(next(data_iterator), topo, options)
            if link is not None:
                header, arrays = plan_frame(layout, fields, scalars, topo.stage, share)
            else:
                header, chunks = encode_fields(
                    layout, fields, scalars, topo.stage, topo.device, share=share
                )
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
    frame: np.ndarray | None = None  # the source's copy of a link frame
    if control is not None:
        payload = send_split(header, chunks, topo, control, timeout)
    elif link is not None and arrays is not None:
        frame = send_link_frame(link, header, arrays, what=_what(topo, "frame"), timeout=timeout)
        payload = None
    elif link is not None:
        link.send([header.to_bytes(), *chunks], what=_what(topo, "frame"), timeout=timeout)
        payload = None
    else:
        payload = _send_frame(header, chunks, topo, state, timeout)
    _settle(state, header)
    if header.status == Status.STOP:
        raise StopIteration
    if error is not None:
        raise error
    if frame is not None:  # the bytes its peers decode: their outputs and its own are the same
        return full_outputs(header, frame[HEADER_BYTES:], cp_group=topo.cp_group)
    if payload is None or topo.device.type == "cpu":
        # a lean CPU frame: what it encoded is what peers decode (no lean forms to rebuild)
        return source_outputs(header, fields, cp_group=topo.cp_group)
    return decode(
        header, payload, cp_group=topo.cp_group, cp_size=topo.cp_size, cp_rank=topo.cp_rank
    )


def _take_item(
    item: Any, topo: Topology, options: _SourceOptions
) -> tuple[Layout, dict[str, torch.Tensor | None], Scalars, Share]:
    """Normalize (validate) an item and take this CP rank's share: what the source encodes.

    On a local link that is one frame (`megapack.frame`) with the per-token fields in full: the
    link moves bytes with a memcpy (shared memory for large bodies), which costs less than the
    lean forms' encoding and rebuilding (2-core CPU, tp=2: about 0.1 ms a call at 4,096 tokens,
    0.5 ms at 32,768), and the frame is also where the source's own outputs live. Gloo and NCCL
    frames cross a wire: always lean (`megapack.wire.encode_fields`).
    """
    layout, tensors, scalars = normalize(item)
    if options.packed is not None and (layout == Layout.PACKED) != options.packed:
        raise ValueError(
            f"get_batch_on_this_tp_rank(packed={options.packed}) but the batch "
            + ("has cu_seqlens" if layout == Layout.PACKED else "has no cu_seqlens")
            + ": pass packed= matching the data (Megatron: --sft or inter-document masking)"
        )
    hybrid = scalars.local_cp_size
    if hybrid is not None and hybrid != topo.cp_size:
        raise ValueError(
            f"batch has local_cp_size={hybrid} but this rank's CP group has {topo.cp_size} ranks "
            f"({topo.cp_ranks or 'no CP group'}): for Megatron's hybrid CP build the Topology with this "
            f"batch's group, Topology.from_groups(tp_group, cp_group=<the {hybrid}-rank hybrid CP group>, ...)"
        )
    tensors = take_cp_share(
        layout, tensors, cp_size=topo.cp_size, cp_rank=topo.cp_rank, cp_layout=options.cp_layout,
        tp_size=topo.tp_size, sequence_parallel=options.sequence_parallel, stage=topo.stage,
    )  # fmt: skip
    return layout, tensors, scalars, Share(topo.cp_size, topo.cp_rank, options.cp_layout)


def _without_iterator(topo: Topology, options: _SourceOptions) -> Header:
    """A middle stage of plain pretraining has no dataset: the all-None batch. Anything else is an error."""
    if topo.stage == Stage.MIDDLE and not options.packed:
        return Header(status=Status.OK, stage=topo.stage, layout=Layout.PLAIN)
    if topo.stage == Stage.MIDDLE:
        raise ValueError(
            f"data_iterator is None on TP source rank {topo.src_rank} of a middle pipeline stage "
            f"(pp_rank {topo.pp_rank}), but packed batches need cu_seqlens on every stage: build the "
            "dataset on TP rank 0 of every pipeline stage (Megatron: is_dataset_built_on_rank must "
            "return True there, e.g. is_dataset_built_on_rank(vp_stage, is_packed_sequence=True)) "
            "and pass its iterator"
        )
    raise ValueError(
        f"data_iterator is None on TP source rank {topo.src_rank} (pipeline stage "
        f"{topo.stage.value!r}, pp_rank {topo.pp_rank}); this stage's TP rank 0 must get an iterator"
    )


def _receive(topo: Topology, state: _GroupState, timeout: float | None) -> dict[str, Any]:
    if (control := split_control(topo)) is not None:
        header, payload = receive_split(topo, control, timeout)
    elif (link := _link(topo, timeout)) is not None:
        return _receive_link(link, topo, state, timeout)
    else:
        header, payload = _receive_frame(topo, state, timeout)
    _settle(state, header)
    _check(header, topo, lambda: payload.cpu().numpy().tobytes())
    return decode(
        header, payload, cp_group=topo.cp_group, cp_size=topo.cp_size, cp_rank=topo.cp_rank
    )


def _receive_link(
    link: LocalLink, topo: Topology, state: _GroupState, timeout: float | None
) -> dict[str, Any]:
    """A peer's frame over the local link, into the buffer it prepares while it waits."""
    prepared = prepare(state.last)
    into = None if prepared is None else prepared.buffer
    body = link.receive(what=_what(topo, "frame"), timeout=timeout, into=into)
    header = Header.from_bytes(body)
    state.last = header
    _settle(state, header)
    _check(header, topo, lambda: body[HEADER_BYTES:].tobytes())
    return frame_outputs(header, body, prepared, cp_group=topo.cp_group, cp_size=topo.cp_size,
                         cp_rank=topo.cp_rank)  # fmt: skip


def _check(header: Header, topo: Topology, message: Callable[[], bytes]) -> None:
    """A peer's verdict on a header: StopIteration, the source's error, or a stage mismatch."""
    if header.status == Status.STOP:
        raise StopIteration
    if header.status == Status.ERROR:
        raise RemoteDataError(topo.src_rank, message().decode(errors="replace"))
    if header.stage != topo.stage:
        raise ProtocolError(
            f"TP source rank {topo.src_rank} serves pipeline stage {header.stage.value!r} but this rank "
            f"is on stage {topo.stage.value!r}: TP peers must share a pipeline stage (check the Topology)"
        )


def _send_frame(
    header: Header,
    chunks: list[torch.Tensor],
    topo: Topology,
    state: _GroupState,
    timeout: float | None,
) -> torch.Tensor:
    """One frame (header + inline payload + slack); the payload follows when it outgrew the capacity."""
    if topo.tp_size == 1:  # nobody to send to: no frame to build
        return join(chunks, topo.device)
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


def _link(topo: Topology, timeout: float | None) -> LocalLink | None:
    """The TP group's local link (frames over Unix sockets, `megapack.local_link`) when it has one."""
    if topo.tp_size == 1 or topo.device.type != "cpu":
        return None
    return link_for(topo.tp_group, topo.src_rank, timeout=timeout)


def _what(topo: Topology, part: str) -> str:
    return f"get_batch_on_this_tp_rank {part} from TP source rank {topo.src_rank}"


def _broadcast(tensor: torch.Tensor, topo: Topology, timeout: float | None, part: str) -> None:
    if topo.tp_size > 1:
        what = _what(topo, f"{part} broadcast")
        comm.broadcast(tensor, topo.src_rank, group=topo.tp_group, what=what, timeout=timeout)
