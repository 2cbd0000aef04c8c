"""A GPT layer spec that trains THD packed batches without Transformer Engine.

`packed_gpt_layer_spec` is megatron-core's local GPT layer spec with ``core_attention`` replaced by
`megapack.attention.PackedAttention`. With it, ``GPTModel`` trains the batches that
`megapack.get_batch_on_this_tp_rank` returns:

* attention stays within each document (``packed_seq_params.cu_seqlens_q``), on every stage;
* RoPE restarts at 0 for every document: megatron-core's ``apply_rotary_pos_emb`` receives
  ``cu_seqlens`` from ``packed_seq_params`` when ``qkv_format == "thd"`` and rotates each document
  from position 0, with tables sized by ``max_seqlen`` (why every stage needs ``max_seqlen``);
* learned absolute position embeddings read the per-document ``position_ids`` on the first stage.

Padded batches (no ``packed_seq_params``) run through the same spec with causal attention, so packed
and padded training can be compared with identical weights.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from megapack.attention import BACKENDS, PackedAttention
from megapack.cp import CpLayout


def packed_gpt_layer_spec(
    backend: str = "auto", *, cp_layout: CpLayout = "document", **local_spec_kwargs: Any
) -> Any:
    """megatron-core's ``get_gpt_layer_local_spec(**local_spec_kwargs)`` with THD-capable core attention.

    With context parallelism (``context_parallel_size > 1``), the self-attention hands RoPE to
    `PackedAttention`, which rotates each token by its position in its document, computed from the
    whole row's boundaries and ``cp_layout`` (megatron-core's THD RoPE with ``cp_group`` assumes the
    "document" layout and padded spans no longer than ``max_seqlen``). Without CP nothing changes.

    Args:
        backend: attention backend, one of ``megapack.attention.BACKENDS`` or ``"auto"``.
        cp_layout: how packed rows are split over CP ranks, as the batches were ("document" or
            "row", `megapack.cp`); padded [b, s] batches always split by row.
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
    from megapack.quiet import quiet_megatron

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
    """megatron-core's ``SelfAttention`` that, under THD context parallelism, lets the core attention rotate."""
    from megatron.core.transformer.attention import SelfAttention

    class RopeHandoverSelfAttention(SelfAttention):
        """``SelfAttention`` whose RoPE table goes to `PackedAttention` when THD batches use CP."""

        def forward(
            self,
            *args: Any,
            rotary_pos_emb: Any = None,
            packed_seq_params: Any = None,
            **kwargs: Any,
        ) -> Any:
            core = self.core_attention
            if (
                rotary_pos_emb is not None
                and getattr(packed_seq_params, "qkv_format", None) == "thd"
                and isinstance(core, PackedAttention)
                and core.context_parallel_group(packed_seq_params) is not None
            ):
                core.rope, rotary_pos_emb = rotary_pos_emb, None
            return super().forward(
                *args, rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params, **kwargs
            )

    return RopeHandoverSelfAttention
