"""Rotary position embedding (RoPE) of THD tokens, from each token's position in its document."""

from __future__ import annotations

from typing import Any

import torch


def apply_rope(
    t: torch.Tensor, table: torch.Tensor, offsets: torch.Tensor, config: Any
) -> torch.Tensor:
    """megatron-core's RoPE on ``t [Tl, heads, d]`` at positions ``offsets [Tl]`` of ``table [S, 1, 1, r]``.

    Positions past the table (alignment padding beyond ``max_seqlen``) use its last row; their
    outputs are zeroed by attention anyway.
    """
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    freqs = table[offsets.clamp(max=table.shape[0] - 1)]  # [Tl, 1, 1, r]
    return apply_rotary_pos_emb(t.unsqueeze(1), freqs, config).squeeze(1)
