"""`deliver`: one micro-batch from the TP source to its peers, in one direction, in megapack's own
form (what `megapack.get_batch_on_this_tp_rank` runs: its front door, `megapack.delivery.get_batch`,
calls it directly or through a caller's adapter, `megapack.delivery.callers`).

The whole delivery, orchestrated here and nowhere else:

    source: item -> intake (`megapack.core.intake`) -> CP share (`megapack.core.cp_share.take_share`)
            -> encode (`megapack.delivery.wire`) -> transport send (`megapack.delivery.transport`)
    peers:  transport receive -> decode (`megapack.delivery.wire`)

Each step is one module and none calls back up. Every rank's outputs, the source's included, are
views of the same frame's payload (a copy: nothing aliases the data iterator's batch), so every
TP rank returns identical values, shapes, dtypes and None-ness.

A failure on the source while fetching or checking is sent in place of a batch: the source
re-raises its own error and every peer raises `RemoteDataError` within one transfer's latency;
the next call delivers the next batch. A data iterator that ends stops every TP rank in the same
call. Megapack's collectives and links wait at most the megapack timeout (`megapack.distributed.comm`) and
then raise `CollectiveError` naming the ranks.

An iterator passed on a TP rank other than the source is never read (Megatron's own function
ignores it too, and scripts often pass the same iterator on every TP rank): a warning says so,
once per TP group, so a script that meant each TP rank to read its own data learns it did not.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megapack.core.buckets import BUCKET_NAMES, with_bucket_plan
from megapack.core.cp_share import CP_LAYOUTS, CpLayout, take_share
from megapack.core.errors import CollectiveError, ProtocolError, RemoteDataError
from megapack.core.fields import BatchField, Schema, Stage, schema_of
from megapack.core.intake import Batch, BatchForm, to_batch
from megapack.core.static import StaticShape, pad_static
from megapack.delivery.transport import Transport, transport_for
from megapack.delivery.wire import Header, Status, decode, encode, header_bytes, signal
from megapack.distributed.groups import control_group
from megapack.distributed.sync import check_in_sync, debug_sync_enabled
from megapack.distributed.topology import Topology

__all__ = ["SourceOptions", "deliver", "source_batch", "source_options", "warn_ignored_iterator"]

# Calls so far per TP group, the step $MEGAPACK_DEBUG_SYNC's check compares (same on all ranks).
_calls: weakref.WeakKeyDictionary[dist.ProcessGroup, list[int]] = weakref.WeakKeyDictionary()
# TP groups whose non-source rank was warned that its data_iterator is ignored (once a group).
_warned_ignored: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceOptions:
    """How the TP source turns an item into what it sends (see get_batch_on_this_tp_rank's Args)."""

    cp_layout: CpLayout
    sequence_parallel: bool
    packed: bool | None
    static: StaticShape | None


def deliver(
    data_iterator: Iterator[Any] | None,
    *,
    topology: Topology | None = None,
    timeout: float | None = None,
    cp_layout: CpLayout | None = None,
    sequence_parallel: bool = False,
    packed: bool | None = None,
    fields: Sequence[BatchField] = (),
    static: StaticShape | None = None,
) -> dict[str, Any]:
    """`megapack.get_batch_on_this_tp_rank` in megapack's own form (its arguments and what it
    returns are written there): this rank's topology (default: megatron-core's), the options
    checked, then the source's send or a peer's receive."""
    topo, schema, options = source_options(
        topology,
        cp_layout=cp_layout,
        sequence_parallel=sequence_parallel,
        packed=packed,
        fields=fields,
        static=static,
    )
    if topo.tp_group is not None and debug_sync_enabled():
        calls = _calls.setdefault(topo.tp_group, [0])
        check_in_sync(
            "megapack.get_batch_on_this_tp_rank",
            calls[0],
            group=control_group(topo.tp_group),
            timeout=timeout,
        )
        calls[0] += 1
    transport = transport_for(topo, schema, timeout)
    if data_iterator is not None and not topo.is_source:
        warn_ignored_iterator(topo, "get_batch_on_this_tp_rank")
    if topo.is_source:
        return _send(data_iterator, topo, schema, transport, timeout, options)
    return _receive(topo, schema, transport, timeout)


def source_options(
    topology: Topology | None,
    *,
    cp_layout: CpLayout | None = None,
    sequence_parallel: bool = False,
    packed: bool | None = None,
    fields: Sequence[BatchField] = (),
    static: StaticShape | None = None,
) -> tuple[Topology, Schema, SourceOptions]:
    """The topology (default: megatron-core's), schema and source options of
    `deliver`'s keyword arguments, each checked before the topology is looked up.

    Raises:
        ValueError, TypeError: an argument of the wrong value or type, named.
    """
    if cp_layout is not None and cp_layout not in CP_LAYOUTS:
        raise ValueError(f"cp_layout must be one of {CP_LAYOUTS} or None, got {cp_layout!r}")
    if packed is not None and not isinstance(packed, bool):
        raise TypeError(f"packed must be True, False or None, got {packed!r}")
    if static is not None and not isinstance(static, StaticShape):
        raise TypeError(f"static must be a megapack.StaticShape or None, got {static!r}")
    schema = schema_of(fields)
    topo = topology if topology is not None else Topology.from_parallel_state()
    options = SourceOptions(
        cp_layout=topo.cp_layout if cp_layout is None else cp_layout,
        sequence_parallel=sequence_parallel,
        packed=packed,
        static=static,
    )
    return topo, schema, options


def source_batch(item: Any, topo: Topology, schema: Schema, options: SourceOptions) -> Batch:
    """What the TP source sends of one data-iterator item: checked (`to_batch`), padded to the
    static shape, bucket-planned where declared, and this CP rank's share of it.

    `megapack.lockstep_steps` runs it on each item it reads ahead, so that a bad batch stops every
    rank before the step instead of inside the schedule.

    Raises:
        TypeError, ValueError: the item breaks the batch contract (field, row and value named).
    """
    batch = to_batch(item, schema, packed=options.packed)
    if options.static is not None and batch.form == BatchForm.PACKED:
        batch = Batch(batch.form, pad_static(batch.values, options.static))
    if _plans_buckets(schema, batch):
        batch = Batch(batch.form, with_bucket_plan(batch.values))
    _check_hybrid_cp(batch, topo)
    values = take_share(
        batch.values,
        schema.by_stage[topo.stage],
        packed=batch.form == BatchForm.PACKED,
        cp_size=topo.cp_size,
        cp_rank=topo.cp_rank,
        layout=options.cp_layout,
        tp_size=topo.tp_size,
        sequence_parallel=options.sequence_parallel,
    )
    return Batch(batch.form, values)


def warn_ignored_iterator(topo: Topology, caller: str) -> None:
    """Warn, once per TP group, that this non-source TP rank's data iterator is never read
    (logger ``megapack.delivery``)."""
    if topo.tp_group is None or topo.tp_group in _warned_ignored:
        return
    _warned_ignored.add(topo.tp_group)
    logging.getLogger("megapack.delivery").warning(
        "megapack: %s: rank %d is TP rank %d, not its group's TP source (global rank %d): its "
        "data_iterator is ignored. Only the TP source reads data and sends every TP rank the "
        "same batch; pass data_iterator=None on the other TP ranks (as Megatron builds the data "
        "iterator only on TP rank 0)",
        caller,
        topo.tp_ranks[topo.tp_rank],
        topo.tp_rank,
        topo.src_rank,
        stacklevel=3,
    )


def _send(
    data_iterator: Iterator[Any] | None,
    topo: Topology,
    schema: Schema,
    transport: Transport,
    timeout: float | None,
    options: SourceOptions,
) -> dict[str, Any]:
    error: Exception | None = None
    pieces: list[torch.Tensor] = []
    try:
        if data_iterator is None:
            header = _without_iterator(topo, schema, options)
        else:
            batch = source_batch(next(data_iterator), topo, schema, options)
            header, pieces = encode(batch, schema, topo.stage)
    except StopIteration:
        header = signal(Status.STOP, topo.stage, schema)
    except Exception as exc:
        header, pieces, error = *_error(exc, topo, schema), exc
    try:
        payload = transport.send(header, pieces, timeout)
    except CollectiveError:
        raise
    except Exception as exc:  # laying the frame out failed, before anything was sent
        transport.send(*_error(exc, topo, schema), timeout)
        raise
    if header.status == Status.STOP:
        raise StopIteration
    if error is not None:
        raise error
    return decode(header, payload, schema, cp_group=topo.cp_group)


def _error(exc: BaseException, topo: Topology, schema: Schema) -> tuple[Header, list[torch.Tensor]]:
    """The frame that carries the source's error to its peers: a header and the message."""
    message = torch.frombuffer(
        bytearray(f"{type(exc).__name__}: {exc}".encode()), dtype=torch.uint8
    )
    return signal(Status.ERROR, topo.stage, schema, message.numel()), [message]


def _receive(
    topo: Topology, schema: Schema, transport: Transport, timeout: float | None
) -> dict[str, Any]:
    header, payload = transport.receive(header_bytes(schema), timeout)
    _check(header, payload, topo, schema)
    return decode(header, payload, schema, cp_group=topo.cp_group)


def _check(header: Header, payload: torch.Tensor, topo: Topology, schema: Schema) -> None:
    """A peer's verdict on a header: StopIteration, the source's error, or a mismatch."""
    if header.status == Status.STOP:
        raise StopIteration
    if header.status == Status.ERROR:
        raise RemoteDataError(topo.src_rank, bytes(payload.numpy()).decode(errors="replace"))
    if header.key != schema.key:
        raise ProtocolError(
            f"TP source rank {topo.src_rank} sent a batch of other fields= than this rank "
            "declared: every TP rank must pass the same fields"
        )
    if header.stage != topo.stage:
        raise ProtocolError(
            f"TP source rank {topo.src_rank} serves pipeline stage {header.stage.value!r} but this "
            f"rank is on stage {topo.stage.value!r}: TP peers must share a pipeline stage (check "
            "the Topology)"
        )


def _without_iterator(topo: Topology, schema: Schema, options: SourceOptions) -> Header:
    """A middle stage of plain pretraining has no dataset: the all-None batch, with a warning
    once per TP group when the data may be packed (``packed=None``: the other stages cannot be
    seen from here; `megapack.lockstep_steps` checks it and silences it). Anything else is an
    error."""
    if topo.stage == Stage.MIDDLE and not options.packed:
        if options.packed is None:
            from megapack.delivery.agreement import warn_middle_without_data

            warn_middle_without_data(topo)
        return Header(
            status=Status.OK,
            stage=topo.stage,
            form=BatchForm.PLAIN,
            key=schema.key,
            dims=(None,) * len(schema.fields),
        )
    if topo.stage == Stage.MIDDLE:
        raise ValueError(
            f"data_iterator is None on TP source rank {topo.src_rank} of a middle pipeline stage "
            f"(pp_rank {topo.pp_rank}), but packed batches need cu_seqlens on every stage: build "
            "the dataset on TP rank 0 of every pipeline stage (Megatron: is_dataset_built_on_rank "
            "must return True there, e.g. is_dataset_built_on_rank(vp_stage, "
            "is_packed_sequence=True)) and pass its iterator"
        )
    raise ValueError(
        f"data_iterator is None on TP source rank {topo.src_rank} (pipeline stage "
        f"{topo.stage.value!r}, pp_rank {topo.pp_rank}); this stage's TP rank 0 must get an iterator"
    )


def _plans_buckets(schema: Schema, batch: Batch) -> bool:
    """Whether the source plans the attention buckets (`megapack.BUCKET_FIELDS` declared, a packed
    batch that does not bring its own plan)."""
    return (
        batch.form == BatchForm.PACKED
        and BUCKET_NAMES[0] in schema.names
        and batch.values.get(BUCKET_NAMES[0]) is None
    )


def _check_hybrid_cp(batch: Batch, topo: Topology) -> None:
    hybrid = batch.values.get("local_cp_size")
    if hybrid is not None and hybrid != topo.cp_size:
        raise ValueError(
            f"batch has local_cp_size={hybrid} but this rank's CP group has {topo.cp_size} ranks "
            f"({topo.cp_ranks or 'no CP group'}): for Megatron's hybrid CP build the Topology with "
            f"this batch's group, Topology.from_groups(tp_group, cp_group=<the {hybrid}-rank "
            "hybrid CP group>, ...)"
        )
