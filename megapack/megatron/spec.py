"""A GPT layer spec that trains THD packed batches without Transformer Engine.

`packed_gpt_layer_spec` is megatron-core's local GPT layer spec with ``core_attention`` replaced by
`megapack.attention.PackedAttention`. With it, ``GPTModel`` trains the batches that
`megapack.get_batch_on_this_tp_rank` returns:

* attention stays within each document (``packed_seq_params.cu_seqlens_q``), on every stage;
* RoPE restarts at 0 for every document: the self-attention hands megatron-core's RoPE table
  (sized by ``max_seqlen``, why every stage needs it) to `PackedAttention`, which rotates q and k by
  each token's position in its document, computed on the device (megatron-core 0.16's own THD RoPE
  reads the lengths on the host and loops over documents, for q and k in every layer);
* learned absolute position embeddings read the per-document ``position_ids`` on the first stage.

Padded batches (no ``packed_seq_params``) run through the same spec with causal attention, so packed
and padded training can be compared with identical weights.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from megapack.attention import BACKENDS, PackedAttention
from megapack.attention.rope import RopeTables, hand_over
from megapack.core.cp_share import CpLayout


def packed_gpt_layer_spec(
    backend: str = "auto", *, cp_layout: CpLayout = "document", **local_spec_kwargs: Any
) -> Any:
    """megatron-core's ``get_gpt_layer_local_spec(**local_spec_kwargs)`` with THD-capable core attention.

    For THD batches the self-attention hands megatron-core's RoPE table to `PackedAttention`, which
    rotates each token by its position in its document, on the device, without reading the
    boundaries on the host (`megapack.attention.rope`); under context parallelism the positions come
    from the whole row's boundaries and ``cp_layout``. Padded batches keep megatron-core's RoPE.

    Args:
        backend: attention backend, one of ``megapack.attention.BACKENDS`` or ``"auto"``.
        cp_layout: how packed rows are split over CP ranks, as the batches were ("document" or
            "row", `megapack.core.cp_share`); padded [b, s] batches always split by row.
        local_spec_kwargs: passed to ``get_gpt_layer_local_spec`` (e.g. ``normalization="RMSNorm"``,
            ``qk_layernorm=True``); ``multi_latent_attention`` is not supported.

    Returns:
        A ``ModuleSpec`` for ``GPTModel(transformer_layer_spec=...)``.

    Example:
        >>> spec = packed_gpt_layer_spec()                                   # doctest: +SKIP
        >>> model = GPTModel(config, transformer_layer_spec=spec, vocab_size=..., max_sequence_length=...,
        ...                  position_embedding_type="rope")                 # doctest: +SKIP
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {backend!r}; choose one of {BACKENDS} or 'auto'"
        )
    if local_spec_kwargs.get("multi_latent_attention"):
        raise ValueError("packed_gpt_layer_spec does not support multi_latent_attention=True")
    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec(**local_spec_kwargs))
    attention = spec.submodules.self_attention.submodules
    # megatron-core 0.16 calls core_attention(config=..., layer_number=..., ...) directly.
    attention.core_attention = functools.partial(
        PackedAttention, backend=backend, cp_layout=cp_layout
    )
    spec.submodules.self_attention.module = _rope_handover_attention()
    return spec


@functools.cache
def _rope_handover_attention() -> type:
    """megatron-core's ``SelfAttention`` that lets `PackedAttention` rotate THD batches."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config as yarn_mscale,
    )
    from megatron.core.transformer.attention import SelfAttention

    class RopeHandoverSelfAttention(SelfAttention):
        """``SelfAttention`` whose RoPE tables go to `PackedAttention` for THD batches.

        The tables travel on ``packed_seq_params`` (`megapack.attention.rope.hand_over`), which
        megatron-core passes to the core attention again when it recomputes it (activation
        checkpointing). Inference (a KV cache) keeps megatron-core's own RoPE.
        """

        def forward(
            self,
            *args: Any,
            rotary_pos_emb: Any = None,
            packed_seq_params: Any = None,
            **kwargs: Any,
        ) -> Any:
            inference = kwargs.get("inference_context") or kwargs.get("inference_params")
            if (
                getattr(packed_seq_params, "qkv_format", None) == "thd"
                and isinstance(self.core_attention, PackedAttention)
                and inference is None
            ):
                tables = None
                if rotary_pos_emb is not None:
                    q_emb, k_emb = (
                        rotary_pos_emb
                        if isinstance(rotary_pos_emb, tuple)
                        else (rotary_pos_emb, rotary_pos_emb)
                    )
                    tables = RopeTables(q=q_emb, k=k_emb, mscale=yarn_mscale(self.config))
                if hand_over(packed_seq_params, tables):
                    rotary_pos_emb = None
            return super().forward(
                *args, rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params, **kwargs
            )

    return RopeHandoverSelfAttention
