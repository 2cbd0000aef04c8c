"""`get_batch_on_this_tp_rank`, megapack's front door: megapack's own form, or a caller's.

Which form a call is follows from its arguments alone: an iterator (or None) first with keyword
options is megapack's own, delivered by `megapack.delivery.deliver.deliver` (the one orchestrator);
a batch dict first, or a caller's own arguments (Megatron-LM's, its older and Megatron-Bridge's),
go through that caller's adapter (`megapack.delivery.callers`), which delivers through the same
`deliver` and lays the result out as the caller reads it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from megapack.core.cp_share import CpLayout
from megapack.core.fields import BatchField
from megapack.core.static import StaticShape
from megapack.delivery import callers
from megapack.delivery.deliver import deliver
from megapack.distributed.topology import Topology, resolve_topology

__all__ = ["get_batch_on_this_tp_rank"]


def get_batch_on_this_tp_rank(
    data_iterator: Iterator[Any] | Mapping[str, Any] | None,
    *caller_args: Any,
    topology: Topology | None = None,
    pg_collection: Any = None,
    timeout: float | None = None,
    cp_layout: CpLayout | None = None,
    sequence_parallel: bool = False,
    packed: bool | None = None,
    fields: Sequence[BatchField] = (),
    static: StaticShape | None = None,
    **caller_kwargs: Any,
) -> dict[str, Any]:
    """Drop-in for Megatron's ``get_batch_on_this_tp_rank``, correct on every pipeline stage.

    It also takes the calls of Megatron-LM (a batch dict first, then megatron-core 0.19's
    keywords: ``has_cu_seqlens``, ``is_hybrid_cp``, ...), of Megatron-LM before PR #4103
    (``(data_iterator, mtp_on_this_rank=...)``) and of Megatron-Bridge (``(data_iterator, cfg,
    use_mtp=False, *, pg_collection)``), and returns what each caller reads: which form a call
    is follows from its arguments alone (`megapack.delivery.callers`, where each form's keys,
    shapes and refusals are written). What follows is megapack's own form.

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
    full row and sends only its zigzag share of the per-token fields (`megapack.core.cp_share`):
    tokens, labels, loss_mask and position_ids hold T / cp positions (plain batches: s / cp per
    row, ``attention_mask`` [b, 1, s / cp, s]); ``cu_seqlens``, ``cu_seqlens_padded`` and
    ``max_seqlen`` stay the whole row's, and ``packed_seq_params.cp_group`` is the CP group.

    Args:
        data_iterator: the source's iterator; never read on the other TP ranks (pass None there;
            an iterator there is ignored with a warning, once per TP group).
        caller_args, caller_kwargs: a caller's own arguments (Megatron-LM's, Megatron-Bridge's:
            see above); none in megapack's form.
        topology: this rank's place in the grid; default: from megatron-core's ``parallel_state``.
        pg_collection: instead of ``topology``, megatron-core's ``ProcessGroupCollection`` (its
            ``tp``, ``pp``, ``cp`` groups: `Topology.from_pg_collection`, without virtual
            chunks; pass ``topology=`` for those).
        timeout: seconds a peer waits for the source (default: $MEGAPACK_TIMEOUT_S or 300).
        cp_layout: "document" or "row", how packed rows are split over CP ranks; default:
            ``topology.cp_layout``. Every CP rank must pass the same.
        sequence_parallel: True when the model uses sequence parallelism, so each CP rank's
            token count must also divide by tp (checked, with the padding that fixes it).
        packed: whether batches carry ``cu_seqlens`` (Megatron's ``has_cu_seqlens``: ``--sft`` or
            inter-document masking). None: each batch says. True/False: a batch of the other
            kind is an error, and a middle stage's source without an iterator is an error (True)
            or returns the all-None batch (False or None).
        fields: a trainer's own fields (`megapack.BatchField`: RL advantages and log-probs,
            images), the same on every TP rank; each arrives under its name, bit-exact.
        static: a `megapack.StaticShape`: every packed batch arrives with boundaries of
            ``max_segments + 1`` entries (padded with the final offset) and that ``max_seqlen``,
            the same shapes every call, as a CUDA graph needs (`megapack.core.static`); a batch
            over the cap is an error on the source naming it (and `RemoteDataError` on peers).

    Returns:
        A dict with exactly the keys `megapack.core.fields.OUTPUT_KEYS` (``tokens``,
        ``position_ids``, ``labels``, ``loss_mask``, ``attention_mask``, ``cu_seqlens``,
        ``cu_seqlens_padded``, ``dataset_id``, ``max_seqlen``, ``local_cp_size``,
        ``packed_seq_params``) and the declared names; a field this stage does not get is None.
        Packed batches give ``cu_seqlens`` 1-D int32, ``max_seqlen`` a Python int and
        ``attention_mask`` None, on every stage.

    Raises:
        StopIteration: on every TP rank, in the same call, when the source's iterator is exhausted.
        RemoteDataError: on TP ranks other than the source when the source failed; the source
            raises its own error (e.g. ValueError naming the bad field, row and value).
        CollectiveError: when a TP peer is stuck past the timeout or has crashed.
        TypeError: arguments that fit no form, or mix two (named).
    """
    if caller_args or caller_kwargs or isinstance(data_iterator, Mapping):
        return callers.get_batch_in_form(
            data_iterator, caller_args, caller_kwargs, topology=topology,
            pg_collection=pg_collection, timeout=timeout,
            options={"cp_layout": cp_layout, "sequence_parallel": sequence_parallel,
                     "packed": packed, "fields": fields, "static": static},
        )  # fmt: skip
    return deliver(
        data_iterator,
        topology=resolve_topology(topology, pg_collection),
        timeout=timeout,
        cp_layout=cp_layout,
        sequence_parallel=sequence_parallel,
        packed=packed,
        fields=fields,
        static=static,
    )
