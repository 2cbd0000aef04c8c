"""The cross kernels of megapack's context-parallel attention: selected queries x selected keys.

`megapack.attention.cp_attention.cp_attention` hands each kernel the real local queries ``q [Nq, h, d]`` and
the keys of every segment laid one after another ``k``/``v [Nk, g, d]``, with the plan's segment
offsets ``cu_q``/``cu_k``; causal is bottom-right aligned within a segment (the last query sees the
last key). flex runs differently (all local queries x the whole row, `cp_attention`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from megapack.attention.varlen import call_varlen

if TYPE_CHECKING:
    from megapack.attention.cp_plan import CpPlan


def sdpa_cross(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CpPlan, scale: float, dropout: float
) -> torch.Tensor:
    """Reference: one SDPA call per segment with a bottom-right causal mask.

    Reads the segment offsets on the host once per micro-batch (kept in ``plan.memo``).
    """
    if "host_cu" not in plan.memo:
        plan.memo["host_cu"] = torch.cat([plan.cu_q, plan.cu_k]).tolist()
    both = plan.memo["host_cu"]
    cq, ck = both[: len(plan.cu_q)], both[len(plan.cu_q) :]
    pieces = [q.new_zeros(0, q.shape[1], v.shape[-1])]
    for i in range(len(cq) - 1):
        nq, nk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        allowed = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        seg_q, seg_k, seg_v = (
            x[None, a:b].transpose(1, 2)
            for x, a, b in ((q, cq[i], cq[i + 1]), (k, ck[i], ck[i + 1]), (v, ck[i], ck[i + 1]))
        )
        o = F.scaled_dot_product_attention(
            seg_q,
            seg_k,
            seg_v,
            attn_mask=allowed,
            scale=scale,
            dropout_p=dropout,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        pieces.append(o[0].transpose(0, 1))
    return torch.cat(pieces)


def varlen_cross(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CpPlan, scale: float, dropout: float
) -> torch.Tensor:
    """torch's varlen_attn, causal (its flash kernel aligns bottom-right), in the installed form."""
    return call_varlen(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale=scale)


def flash_attn_cross(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CpPlan, scale: float, dropout: float
) -> torch.Tensor:
    """flash_attn_varlen_func, causal: bottom-right aligned when keys outnumber queries (flash-attn >= 2.1)."""
    from flash_attn import flash_attn_varlen_func

    out = flash_attn_varlen_func(
        q,
        k,
        v,
        plan.cu_q,
        plan.cu_k,
        plan.max_q,
        plan.max_k,
        dropout_p=dropout,
        softmax_scale=scale,
        causal=True,
    )
    return out


CROSS_KERNELS = {
    "sdpa": sdpa_cross,
    "torch_varlen": varlen_cross,
    "flash_attn": flash_attn_cross,
}
"""megapack's CP kernels by backend name (flex: `cp_attention` itself; Transformer Engine brings its own CP)."""
