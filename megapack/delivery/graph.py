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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megapack.core.seq_params import make_packed_seq_params

_SCALARS = ("max_seqlen", "local_cp_size")


class GraphInputs:
    """Static device buffers for every tensor of a delivered static-shape batch (module docstring).

    Args:
        batch: a delivered batch (`megapack.get_batch_on_this_tp_rank`'s dict); the buffers take
            its shapes, dtypes and devices.
    """

    def __init__(self, batch: Mapping[str, Any]) -> None:
        self.buffers: dict[str, torch.Tensor] = {
            k: torch.empty_like(v) for k, v in batch.items() if isinstance(v, torch.Tensor)
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
        for name, value in batch.items():
            if isinstance(value, torch.Tensor) and name not in self.buffers:
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
        return self.batch
