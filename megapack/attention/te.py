"""Transformer Engine's THD attention, with its own context parallelism when given a CP group.

Untested here (CUDA and Transformer Engine only). TE takes the CP group, its global ranks, a side
stream and the comm type ("p2p" unless megatron-core passed ``cp_comm_type``) at construction, and
wants the whole row's ``cu_seqlens`` with this rank's "document"-layout share of the tokens. TE's
``DotProductAttention`` holds no parameters, so one module per configuration serves every caller.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from megapack.attention.documents import Documents, zero_padding


def te_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: Documents,
    *,
    scale: float,
    dropout: float,
    training: bool,
    cp_group: Any = None,
    cp_comm_type: str | None = None,
) -> torch.Tensor:
    """``q [T, h, d]``, ``k``/``v [T, g, d]`` -> [T, h, d], causal within every document (padding_causal)."""
    module = _module(q.shape[1], k.shape[1], q.shape[2], scale, dropout, cp_group, cp_comm_type)
    module.train(training)
    out = module(
        q,
        k,
        v,
        qkv_format="thd",
        attn_mask_type="padding_causal",
        cu_seqlens_q=docs.cu_real,
        cu_seqlens_kv=docs.cu_real,
        cu_seqlens_q_padded=docs.cu_buffer,
        cu_seqlens_kv_padded=docs.cu_buffer,
        max_seqlen_q=docs.max_seqlen,
        max_seqlen_kv=docs.max_seqlen,
    )
    return zero_padding(out.reshape(q.shape[0], q.shape[1], -1), docs)


@functools.lru_cache(maxsize=32)
def _module(
    heads: int,
    groups: int,
    dim: int,
    scale: float,
    dropout: float,
    cp_group: Any,
    cp_comm_type: str | None,
) -> Any:
    import transformer_engine.pytorch as te

    cp_args = (
        {}
        if cp_group is None
        else {
            "cp_group": cp_group,
            "cp_global_ranks": dist.get_process_group_ranks(cp_group),
            "cp_stream": torch.cuda.Stream(),
            "cp_comm_type": cp_comm_type or "p2p",
        }
    )
    return te.DotProductAttention(
        heads,
        dim,
        num_gqa_groups=groups,
        attention_dropout=dropout,
        qkv_format="thd",
        attn_mask_type="padding_causal",
        softmax_scale=scale,
        **cp_args,
    )
