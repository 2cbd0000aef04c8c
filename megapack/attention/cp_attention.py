"""Context-parallel (CP) attention for megapack's kernels: all-gather K/V, attend from global positions.

With cp > 1 every CP rank holds 1/cp of each packed row (`megapack.core.cp_share.cp_indices`: zigzag chunks of
every document, or of the whole row), while the boundaries (``cu_seqlens``, ``cu_seqlens_padded``)
stay those of the whole row. For the flash_attn, torch_varlen, flex and sdpa backends megapack
computes attention itself, in three steps:

1. **Gather.** K and V of the local tokens are concatenated and all-gathered over the CP group in
   one collective, then put back in row order (`GatherRows`). Backward sums each rank's K/V
   gradients with one reduce-scatter, so every rank gets the gradient of its own tokens.
2. **Plan.** `CpPlan` rebuilds the global row position of every local query from the boundaries
   alone (the same `cp_indices` the batch was sliced with) and cuts the real (non-padding) local
   queries into *segments*: maximal runs that lie in one document at consecutive positions. A
   segment of queries at positions ``[p, p + n)`` of a document starting at ``s`` attends to the keys
   ``[s, p + n)``, causally aligned at the bottom right (the last query sees the last key). The
   plan costs a few host syncs on a GPU; `plan_for` builds it once per micro-batch (first layer).
3. **Attend.** The selected queries, and the keys of every segment laid one after another, go to
   a varlen kernel with ``cu_seqlens_q != cu_seqlens_k`` (flash-attn, torch varlen: causal is
   bottom-right aligned there) or to the per-segment SDPA reference (`megapack.attention.cp_kernels`).
   flex instead attends all local queries to the whole gathered row, each to its document's keys up
   to its own position (a block mask of key intervals, `megapack.attention.flex`, built once per
   micro-batch), so its shapes depend on T alone. Outputs at padding positions are zero, as without CP.

Worked example, one document of 8 tokens, cp = 2, "document" layout, rank 1 holds positions
``[2, 3, 4, 5]``: one segment, queries at 2..5 attend keys 0..5 (query 2 sees 0..2, query 5 sees
0..5). In the "row" layout with documents ``[0, 3, 8]``, rank 0 holds ``[0, 1, 6, 7]``: segments
``{0, 1}`` (keys 0..1 of document 0) and ``{6, 7}`` (keys 3..7 of document 1).

Cost per layer and rank: one all-gather of 2 x T/cp x groups x head_dim (K and V) forward, one
reduce-scatter of the same size backward; the keys each rank attends to are about
T + T/(2 cp) (a document's two chunks share their prefix). Transformer Engine has its own CP
(`PackedAttention` passes it the CP group instead); none of this code runs for it.

Legend: T row positions, Tl = T / cp local positions, Nq real local queries, Nk gathered keys, S
segments; h query heads, g key/value groups, d head dim (per tensor-parallel partition).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapack.attention.cp_kernels import CROSS_KERNELS
from megapack.attention.cp_plan import CpPlan
from megapack.attention.flex import interval_block_mask, intervals, run_flex
from megapack.core.cp_share import cp_indices


class GatherRows(torch.autograd.Function):
    """All-gather [Tl, ...] shares over the CP group into the [T, ...] row; backward reduce-scatters."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, order: torch.Tensor, group: Any) -> torch.Tensor:
        cp = order.shape[0]
        parts = local.new_empty((cp * local.shape[0], *local.shape[1:]))
        _all_gather(parts, local.contiguous(), group)
        row = local.new_empty(parts.shape)
        row[order.flatten()] = parts
        ctx.save_for_backward(order)
        ctx.group = group
        return row

    @staticmethod
    def backward(ctx: Any, grad_row: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (order,) = ctx.saved_tensors
        parts = grad_row[order.flatten()].contiguous()  # rank after rank, each in its local order
        mine = grad_row.new_empty((order.shape[1], *grad_row.shape[1:]))
        _reduce_scatter(mine, parts, ctx.group)
        return mine, None, None


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: CpPlan,
    *,
    group: Any,
    kernel: str,
    scale: float,
    dropout: float,
) -> torch.Tensor:
    """Attention of this rank's queries ``q [Tl, h, d]`` over the whole row: returns [Tl, h, dv].

    ``k``/``v`` are this rank's [Tl, g, d] shares, ``plan`` this rank's `CpPlan` (`plan_for`);
    ``kernel`` one of ``CROSS_KERNELS`` or "flex". Every rank of ``group`` must call it, forward and
    backward. flex attends all Tl local queries to the whole gathered row with a block mask of
    per-query key intervals (static shapes: one compiled graph for every micro-batch of a row
    length); the others attend the selected real queries to the selected keys.
    """
    local = q.shape[0]
    row = GatherRows.apply(torch.cat([k, v], dim=-1), plan.order, group)
    if kernel == "flex":
        k_row, v_row = row.split([k.shape[-1], v.shape[-1]], dim=-1)
        mask, real = cp_flex_mask(plan, q.device, kv_len=row.shape[0])
        return run_flex(q, k_row, v_row, mask, scale) * real[:, None, None].to(q.dtype)
    kv = row[plan.k_index]
    k_sel, v_sel = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    if plan.max_q == 0:  # nothing real here; K/V stay in the graph for backward's reduce-scatter
        out = q.new_zeros(0, q.shape[1], v.shape[-1]) + 0.0 * (kv.sum() + q.sum())
    else:
        out = CROSS_KERNELS[kernel](q[plan.q_index], k_sel, v_sel, plan, scale, dropout)
    return q.new_zeros(local, q.shape[1], v.shape[-1]).index_copy(0, plan.q_index, out)


def cp_flex_mask(plan: CpPlan, device: torch.device, *, kv_len: int) -> tuple[Any, torch.Tensor]:
    """(block mask of local queries x row keys, [Tl] real) for flex, once per micro-batch."""
    if "flex" not in plan.memo:
        lo, hi, extra = intervals(plan.positions, plan.starts, plan.ends)
        plan.memo["flex"] = (interval_block_mask(lo, hi, extra, kv_len), extra < 0)
    return plan.memo["flex"]


def sbhd_cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    group: Any,
    scale: float,
    dropout: float,
) -> torch.Tensor:
    """Padded [b, s] batches split by row over CP (Megatron's pretraining split): [sl, b, h * dv].

    ``q [sl, b, h, d]``, ``k``/``v [sl, b, g, d]`` hold this rank's zigzag share of every sequence
    (``cp_indices([0, s], cp, rank, layout="row")``); ``mask`` is None (causal) or Megatron's
    ``[b, 1, sl, s]`` mask (True = masked out) sliced on its query dim as the tokens were.
    """
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    local, total = q.shape[0], cp_size * q.shape[0]
    if mask is not None and mask.shape[-2:] != (local, total):  # before the collective
        raise ValueError(
            f"with cp_size={cp_size} attention_mask must be [b, 1, {local}, {total}] (this rank's "
            f"queries x all keys), got {tuple(mask.shape)}"
        )
    order = torch.stack(
        [cp_indices([0, total], cp_size, r, layout="row") for r in range(cp_size)]
    ).to(q.device)
    kv = GatherRows.apply(torch.cat([k, v], dim=-1), order, group)  # [s, b, g, dk + dv]
    k_row, v_row = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    if mask is None:
        allowed = torch.arange(total, device=q.device)[None, :] <= order[cp_rank][:, None]
    else:
        allowed = ~mask.to(torch.bool)
    out = F.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3),
        k_row.permute(1, 2, 0, 3),
        v_row.permute(1, 2, 0, 3),
        attn_mask=allowed,
        scale=scale,
        dropout_p=dropout,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.permute(2, 0, 1, 3).reshape(local, q.shape[1], -1)


def _all_gather(out: torch.Tensor, local: torch.Tensor, group: Any) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local, group=group)


def _reduce_scatter(out: torch.Tensor, parts: torch.Tensor, group: Any) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, parts, group=group)
