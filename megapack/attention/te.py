"""Transformer Engine's THD attention, with its own context parallelism when given a CP group.

Runs on CUDA with Transformer Engine only; on CPU its wrapper is tested with the module stubbed
(tests/unit/test_zero_outside.py). TE takes the CP group, its global ranks, a side
stream and the comm type ("p2p" unless megatron-core passed ``cp_comm_type``) at construction, and
wants the whole row's ``cu_seqlens`` with this rank's "document"-layout share of the tokens. TE's
``DotProductAttention`` holds no parameters, so one module per configuration serves every caller.

``pad_between_seqs`` (TE >= 2.2, whose ``forward`` takes it) is passed from the host's knowledge of
the boundaries (`Documents.padded`): without it TE compares ``cu_seqlens`` with
``cu_seqlens_padded`` on the device and reads the answer on the host (``torch.equal``), a sync
that breaks a CUDA-graph capture. Older TE releases do not take it and run that comparison.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.distributed as dist

from megapack.attention.documents import Documents, guard_outside, zero_outside


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
    """``q [T, h, d]``, ``k``/``v [T, g, d]`` -> [T, h, d], causal within every document (padding_causal).

    Without a CP group, outputs and input gradients are exactly zero where no real token is
    (`megapack.attention.documents.zero_outside`, ``guard_outside``): TE zero-fills them in its
    fused (cuDNN) path, not in every path it may choose. With a CP group ``docs`` describes the
    whole row and q this rank's share, so the masks do not apply: TE's own CP handles padding.
    """
    module = _module(q.shape[1], k.shape[1], q.shape[2], scale, dropout, cp_group, cp_comm_type)
    if cp_group is None:
        q, k, v = guard_outside(q, k, v, docs)
    module.train(training)
    kind: type = type(module)
    told = {"pad_between_seqs": docs.padded} if _takes_pad_between_seqs(kind) else {}
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
        **told,
    )
    out = out.reshape(q.shape[0], q.shape[1], -1)
    return out if cp_group is not None else zero_outside(out, docs)


@functools.cache
def _takes_pad_between_seqs(module_type: type) -> bool:
    """Whether this TE release's ``DotProductAttention.forward`` takes ``pad_between_seqs``
    (TE >= 2.2; read once per class)."""
    method = getattr(module_type, "forward", None) or module_type.__call__
    try:
        return "pad_between_seqs" in inspect.signature(method).parameters
    except (TypeError, ValueError):  # a C callable without a signature: assume an old release
        return False


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
