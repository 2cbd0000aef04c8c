"""`PackedAttention`: causal attention within each document of a THD batch, as megatron-core's core_attention.

megatron-core's local ``DotProductAttention`` refuses ``packed_seq_params``, and its fused THD path
needs Transformer Engine. This module takes the same constructor arguments, so it drops into a
layer spec (`megapack.megatron.packed_gpt_layer_spec`), and dispatches to a kernel that takes the
inputs (`megapack.attention.choice`: ``backend="auto"`` chooses by device, dtype and training).

Shapes (per tensor-parallel partition; np query heads, ng key/value groups, hn head dim):

    THD (packed_seq_params.qkv_format == "thd"):  q [T, np, hn], k/v [T, ng, hn]  ->  [T, np * hn]
    SBHD (no packed_seq_params, padded batches):  q [s, b, np, hn], k/v [s, b, ng, hn] -> [s, b, np * hn]

Document boundaries come from ``cu_seqlens_q`` (real lengths) and, when documents are padded for
alignment, ``cu_seqlens_q_padded`` (buffer offsets). Each query attends to the keys of its own
document at positions <= its own. Outputs at alignment-padding positions are zero. What is derived
from the boundaries (positions, masks, the flex block mask, RoPE's cos/sin) is computed once per
micro-batch and cached on ``packed_seq_params`` (`megapack.attention.documents`), and so is the
backend ``"auto"`` resolves to: the first layer of a micro-batch chooses, the others reuse it.

RoPE: for THD batches `megapack.megatron`'s self-attention hands megatron-core's table over
(`megapack.attention.rope`) and the query and key are rotated here, by each token's position in its
document, before attention, with no host read.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from megapack.attention.choice import BACKENDS, NO_CONTEXT_PARALLEL, resolve_backend
from megapack.attention.cp_attention import cp_attention, sbhd_cp_attention
from megapack.attention.cp_plan import plan_for
from megapack.attention.documents import Documents
from megapack.attention.kernels import attend, sbhd_attention
from megapack.attention.rope import RopeTables, apply_rope, handed_over
from megapack.attention.te import te_attention
from megapack.core.cp_share import CP_LAYOUTS, CpLayout


class PackedAttention(torch.nn.Module):
    """Causal attention within each ``cu_seqlens`` document, usable as megatron-core's ``core_attention``.

    Args:
        config: megatron-core ``TransformerConfig`` (heads, kv_channels, query groups, dropout).
        layer_number, attn_mask_type, attention_type, cp_comm_type, pg_collection: as megatron-core
            passes them; ``pg_collection.tp`` gives the tensor-parallel size.
        attention_dropout: overrides ``config.attention_dropout``.
        softmax_scale: defaults to 1 / sqrt(head dim).
        backend: one of `BACKENDS` or ``"auto"`` (resolved per device on first use).
        cp_layout: how packed rows are split over context-parallel ranks ("document" or "row",
            as in `megapack.core.cp_share`); only read when the CP group has more than one rank.

    Context parallelism: the CP group is ``packed_seq_params.cp_group``, else ``pg_collection.cp``,
    else megatron-core's parallel state. With more than one CP rank, Transformer Engine runs its
    own THD CP ("document" layout only); every other backend runs `megapack.attention.cp_attention`.

    RoPE: when `megapack.megatron`'s self-attention has handed the tables over on
    ``packed_seq_params`` (`megapack.attention.rope.hand_over`), q and k are rotated here by each
    token's position in its document (under CP, the CP plan's positions), honouring
    ``config.rotary_interleaved`` and the table's rotary dim; layers in ``config.no_rope_freq`` are
    not rotated, as in megatron-core.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        *,
        backend: str = "auto",
        cp_layout: CpLayout = "document",
    ) -> None:
        super().__init__()
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(
                f"unknown attention backend {backend!r}; choose one of {BACKENDS} or 'auto'"
            )
        if cp_layout not in CP_LAYOUTS:
            raise ValueError(f"cp_layout must be one of {CP_LAYOUTS}, got {cp_layout!r}")
        if getattr(config, "window_size", None) is not None:
            raise ValueError(
                f"PackedAttention has no sliding window (window_size={config.window_size})"
            )
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"PackedAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
            )
        tp = (
            pg_collection.tp.size()
            if pg_collection is not None and hasattr(pg_collection, "tp")
            else _mpu_tp_size()
        )
        heads, groups = (
            config.num_attention_heads,
            config.num_query_groups or config.num_attention_heads,
        )
        if heads % tp or groups % tp:
            raise ValueError(
                f"num_attention_heads={heads} and num_query_groups={groups} must divide by tp={tp}"
            )
        self.backend = backend
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.heads_per_partition = heads // tp
        self.groups_per_partition = groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        )
        self.dropout = float(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.config = config
        self.cp_layout = cp_layout
        self.cp_comm_type = cp_comm_type
        self._cp_group = getattr(pg_collection, "cp", None)
        no_rope = getattr(config, "no_rope_freq", None)
        self.rotary = not (no_rope and no_rope[layer_number - 1])
        """Whether this layer applies RoPE (megatron-core's ``no_rope_freq`` turns it off per layer)."""
        self.rotary_interleaved = bool(getattr(config, "rotary_interleaved", False))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("PackedAttention does not support attention_bias")
        dropout = self.dropout if self.training else 0.0
        group = self.context_parallel_group(packed_seq_params)
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            if group is not None:
                return sbhd_cp_attention(
                    query,
                    key,
                    value,
                    attention_mask,
                    group=group,
                    scale=self.softmax_scale,
                    dropout=dropout,
                )
            return sbhd_attention(query, key, value, attention_mask, self.softmax_scale, dropout)
        if query.dim() != 3:
            raise ValueError(f"THD query must be [T, heads, dim], got shape {tuple(query.shape)}")
        needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
        docs = Documents.from_params(packed_seq_params, total=query.shape[0])
        choice = ("backend", self.backend, query.device, needs_grad, dropout, query.dtype)
        # resolved by the micro-batch's first layer, reused by the rest
        name = docs.memo.get(choice)
        if name is None:
            name = docs.memo[choice] = resolve_backend(
                self.backend,
                query.device,
                training=needs_grad,
                dropout=dropout,
                dtype=query.dtype,
                planned=docs.buckets is not None,
            )
        rope = handed_over(packed_seq_params) if self.rotary else None
        if group is not None:
            return self._cp_forward(
                query, key, value, packed_seq_params, docs, group, name, rope, dropout
            )
        if rope is not None:
            query, key = self._rotate(query, key, rope, docs.offsets(), docs)
        if name == "te":
            out = te_attention(
                query,
                key,
                value,
                docs,
                scale=self.softmax_scale,
                dropout=self.dropout,
                training=self.training,
            )
        else:
            ran, out = attend(name, query, key, value, docs, self.softmax_scale, dropout,
                              auto=self.backend == "auto", training=needs_grad)  # fmt: skip
            docs.memo[choice] = ran  # a cuDNN graph that could not be built: the next layers too
        return out.reshape(query.shape[0], -1)

    def context_parallel_group(self, params: Any) -> Any:
        """The CP group when it has more than one rank, else None."""
        group = getattr(params, "cp_group", None)
        group = self._cp_group if group is None else group
        if group is None and getattr(self.config, "context_parallel_size", 1) > 1:
            from megatron.core import parallel_state

            group = parallel_state.get_context_parallel_group()
        return group if group is not None and dist.get_world_size(group) > 1 else None

    def _cp_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        params: Any,
        docs: Documents,
        group: Any,
        name: str,
        rope: Any,
        dropout: float,
    ) -> torch.Tensor:
        """THD attention of this CP rank's share (see `megapack.attention.cp_attention`)."""
        if name in NO_CONTEXT_PARALLEL:
            if self.backend != "auto":
                raise ValueError(
                    f"attention backend {name!r} has no context-parallel path; with "
                    f"context_parallel_size > 1 use 'te' (cuDNN with its own CP), 'torch_varlen', "
                    "'flash_attn', 'flex' or 'sdpa', or backend='auto'"
                )
            name = resolve_backend(
                "auto",
                q.device,
                training=q.requires_grad or k.requires_grad,
                dropout=dropout,
                dtype=q.dtype,
                excluded=NO_CONTEXT_PARALLEL,
            )
        if name == "te" and self.cp_layout != "document":
            raise ValueError(
                f"Transformer Engine's THD context parallelism needs cp_layout='document', got "
                f"{self.cp_layout!r}; use another backend for the row layout"
            )
        plan = plan_for(
            docs,
            cp_size=dist.get_world_size(group),
            cp_rank=dist.get_rank(group),
            layout=self.cp_layout,
            local_total=q.shape[0],
        )
        if rope is not None:
            q, k = self._rotate(q, k, rope, plan.offsets, docs)
        if name == "te":
            out = te_attention(
                q,
                k,
                v,
                docs,
                scale=self.softmax_scale,
                dropout=self.dropout,
                training=self.training,
                cp_group=group,
                cp_comm_type=self.cp_comm_type,
            )
        else:
            out = cp_attention(
                q, k, v, plan, group=group, kernel=name, scale=self.softmax_scale, dropout=dropout
            )
        return out.reshape(q.shape[0], -1)

    def _rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        rope: RopeTables,
        positions: torch.Tensor,
        docs: Documents,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated by the handed-over tables at ``positions`` (per-token, on the device)."""
        inter, mscale = self.rotary_interleaved, rope.mscale
        if rope.q is not None:
            q = apply_rope(q, rope.q, positions, interleaved=inter, mscale=mscale, docs=docs)
        if rope.k is not None:
            k = apply_rope(k, rope.k, positions, interleaved=inter, mscale=mscale, docs=docs)
        return q, k


def _mpu_tp_size() -> int:
    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():
        from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_world_size()
        if parallel_state.is_initialized()
        else 1
    )
