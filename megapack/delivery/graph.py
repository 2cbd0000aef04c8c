"""`GraphInputs`: the static buffers a captured training step reads, refilled from each batch.

A CUDA graph replays its kernels on the memory it was captured with. `GraphInputs` owns one
buffer per field of a static-shape batch (`megapack.StaticShape`: every packed micro-batch the
same shapes) and a ``packed_seq_params`` over those buffers, both made once from the first batch;
`load` copies each delivered batch into them (one device copy per field, no allocation, no host
read) and returns the same dict every time: capture the step on it once, then ``load`` and
``graph.replay()`` per micro-batch.

    inputs = GraphInputs(first)              # first: a get_batch_on_this_tp_rank / prefetch dict
    static = inputs.load(first)
    ... capture: output = model(static["tokens"], ..., packed_seq_params=static["packed_seq_params"])
    for batch in batches:                    # e.g. megapack.prefetch(..., static=shape)
        inputs.load(batch); graph.replay()

A batch whose field differs in shape, dtype or device (a batch not in the static shape), whose
``max_seqlen`` differs, or that carries a tensor where the first batch had None is a ValueError
naming the field and both sides, before anything is copied (`check` alone runs those checks:
`megapack.megatron.graph_step.GraphStep` checks every micro-batch of a step before loading any).
A whole captured step of M micro-batches reads M of these, one per micro-batch slot
(`megapack.megatron.graph_step`).

The bucket plan (``fields=megapack.BUCKET_FIELDS``, `megapack.core.buckets`) is kept, not made
static: its buckets' shapes change with every batch, so `load` hands the batch's own plan on (the
``attention_bucket_*`` entries and ``packed_seq_params``'s, where the attention reads it). The
static dict then brings a plan exactly when the delivered batches do, so ``backend="auto"`` picks
the same backend for a step run from the slots as for an eager step run on the batches as
delivered (on CUDA it takes ``bucketed`` only with a plan). No captured kernel reads the plan:
``bucketed`` refuses a capture, and `GraphStep` refuses it before capturing. Every batch must
bring a plan if the first did, and none if it did not.

Padded boundaries (a ``cu_seqlens_padded`` buffer): where megatron-core's ``PackedSeqParams``
has ``pad_between_seqs`` (0.19), the static one has it True (`make_packed_seq_params` sets it
whenever padded boundaries are given), whatever the first batch's padding: any later batch may be
padded, and Transformer Engine's THD attention otherwise compares the two boundaries on the host.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megapack.core.buckets import BUCKET_NAMES
from megapack.core.seq_params import BUCKETS_ATTR, make_packed_seq_params

_SCALARS = ("max_seqlen", "local_cp_size")


class GraphInputs:
    """Static device buffers for every tensor of a delivered static-shape batch (module docstring).

    Args:
        batch: a delivered batch (`megapack.get_batch_on_this_tp_rank`'s dict); the buffers take
            its shapes, dtypes and devices; its bucket plan, if it brings one, is kept.
    """

    def __init__(self, batch: Mapping[str, Any]) -> None:
        self.planned = BUCKET_NAMES[0] in batch
        """Whether the batches bring their bucket plan (kept, not static: module docstring)."""
        self._check_plan(batch)
        self.buffers: dict[str, torch.Tensor] = {
            k: torch.empty_like(v)
            for k, v in batch.items()
            if isinstance(v, torch.Tensor) and k not in BUCKET_NAMES
        }
        self.scalars = {k: batch.get(k) for k in _SCALARS}
        params = batch.get("packed_seq_params")
        self.batch: dict[str, Any] = {k: self.buffers.get(k) for k in batch}
        self.batch.update(self.scalars)
        if params is not None:
            self.batch["packed_seq_params"] = make_packed_seq_params(
                self.buffers["cu_seqlens"],
                self.buffers.get("cu_seqlens_padded"),
                int(batch["max_seqlen"]),
                cp_group=getattr(params, "cp_group", None),
                local_cp_size=getattr(params, "local_cp_size", None),
            )
        self._keep_plan(batch)

    def check(self, batch: Mapping[str, Any]) -> None:
        """Raise ValueError (naming the field, what it is and what the step reads) unless
        ``batch`` fits the buffers; copies nothing."""
        for name, buffer in self.buffers.items():
            value = batch.get(name)
            if (
                not isinstance(value, torch.Tensor)
                or value.shape != buffer.shape
                or value.dtype != buffer.dtype
                or value.device != buffer.device
            ):
                where = (  # the devices only when they differ
                    (f" on {value.device}", f" on {buffer.device}")
                    if isinstance(value, torch.Tensor) and value.device != buffer.device
                    else ("", "")
                )
                got = (
                    f"{tuple(value.shape)} {value.dtype}{where[0]}"
                    if isinstance(value, torch.Tensor)
                    else repr(value)
                )
                raise ValueError(
                    f"GraphInputs: batch[{name!r}] is {got} but the captured step reads "
                    f"{tuple(buffer.shape)} {buffer.dtype}{where[1]}: deliver every "
                    "batch in one static shape (get_batch_on_this_tp_rank(..., "
                    "static=megapack.StaticShape(...)))"
                )
        self._check_plan(batch)
        for name, value in batch.items():
            if (
                isinstance(value, torch.Tensor)
                and name not in self.buffers
                and name not in BUCKET_NAMES
            ):
                raise ValueError(
                    f"GraphInputs: batch[{name!r}] is a {tuple(value.shape)} tensor but the "
                    f"captured step was made from a batch whose {name!r} was None: it would never "
                    "be read; deliver every batch with the same fields"
                )
        for name, value in self.scalars.items():
            if batch.get(name) != value:
                raise ValueError(
                    f"GraphInputs: batch[{name!r}] is {batch.get(name)!r} but the captured step "
                    f"was made for {value!r}"
                )

    def load(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Copy ``batch`` into the buffers (stream-ordered) and return the static dict; `check`
        first, so a batch that does not fit changes nothing."""
        self.check(batch)
        for name, buffer in self.buffers.items():
            buffer.copy_(batch[name], non_blocking=True)
        self._keep_plan(batch)
        return self.batch

    def _check_plan(self, batch: Mapping[str, Any]) -> None:
        """A plan exactly when the first batch had one, each bucket None or an int32 [n, L]."""
        if (BUCKET_NAMES[0] in batch) != self.planned:
            has, had = ("brings a", "without") if not self.planned else ("has no", "with")
            raise ValueError(
                f"GraphInputs: the batch {has} bucket plan (fields=megapack.BUCKET_FIELDS) but "
                f"the captured step was made from a batch {had} one, so its attention would "
                "choose another backend; deliver every batch with the same fields"
            )
        for name in BUCKET_NAMES if self.planned else ():
            value = batch.get(name)
            if value is not None and not (
                isinstance(value, torch.Tensor) and value.dim() == 2 and value.dtype == torch.int32
            ):
                got = (
                    f"{tuple(value.shape)} {value.dtype}"
                    if isinstance(value, torch.Tensor)
                    else type(value).__name__
                )
                raise ValueError(
                    f"GraphInputs: batch[{name!r}] is {got}, not a bucket of the plan (None or "
                    "an int32 [n, L] index, megapack.core.buckets)"
                )

    def _keep_plan(self, batch: Mapping[str, Any]) -> None:
        """The batch's bucket plan onto the static dict and its ``packed_seq_params``."""
        if not self.planned:
            return
        for name in BUCKET_NAMES:
            self.batch[name] = batch.get(name)
        params = self.batch.get("packed_seq_params")
        if params is not None:
            plan = tuple(b for n in BUCKET_NAMES if (b := batch.get(n)) is not None)
            setattr(params, BUCKETS_ATTR, plan)
