"""megatron-core integration: a GPT layer spec that trains THD packed batches without Transformer Engine.

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


def packed_gpt_layer_spec(backend: str = "auto", **local_spec_kwargs: Any) -> Any:
    """megatron-core's ``get_gpt_layer_local_spec(**local_spec_kwargs)`` with THD-capable core attention.

    Args:
        backend: attention backend, one of ``megapack.attention.BACKENDS`` or ``"auto"``.
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
    attention.core_attention = functools.partial(PackedAttention, backend=backend)
    return spec
