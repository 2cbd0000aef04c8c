"""Rotary position embedding (RoPE) of THD tokens from each token's position in its document.

megatron-core 0.16's THD RoPE (``_apply_rotary_pos_emb_thd``) reads the document lengths on the host
(``.tolist()``, and ``freqs.size(0) == cu_seqlens[-1]``) for q and for k in every layer, then loops
over the documents in Python. Here the rotation is one gather and four elementwise ops, with the
position of every token computed on the device from the boundaries and cached per micro-batch
(`Documents.offsets`: index minus the start of its buffer segment; under context parallelism the CP
plan's offsets). No host read, no loop.

`megapack.megatron`'s self-attention hands megatron-core's RoPE table to `PackedAttention` through
``packed_seq_params`` (`hand_over`), so a recomputed core attention (activation checkpointing) finds
the same table again. Worked example, documents ``[3, 2]`` padded to ``[4, 4]``: positions
``[0, 1, 2, 3, 0, 1, 2, 3]``; token 5 (second of document 1) is rotated by the table's row 1.

The table is megatron-core's ``RotaryEmbedding`` output ``[S, 1, 1, r]``: r = the rotated part of the
head dim (``rotary_percent < 1`` makes r < d: the first r dims rotate, the rest pass through, as in
megatron-core), halves repeated (``cat(freqs, freqs)``) or, with ``rotary_interleaved``, pairs
interleaved. Positions past the table (alignment padding beyond ``max_seqlen``) use its last row;
attention zeroes those outputs. One difference: megatron-core's THD path switches to absolute
positions when the table has exactly T rows (its multimodal "exact mapping" mode); megapack always
uses positions within documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megapack.attention.documents import Documents

_HANDOVER = "_megapack_rope"


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeTables:
    """The RoPE tables of one forward pass, as megatron-core's self-attention received them."""

    q: torch.Tensor | None
    """[S, 1, 1, r] table for the queries (None: queries not rotated)."""
    k: torch.Tensor | None
    """[S, 1, 1, r] table for the keys."""
    mscale: float = 1.0
    """YaRN's concentration factor (1.0 for plain RoPE), as megatron-core applies it."""


def hand_over(params: Any, tables: RopeTables | None) -> bool:
    """Store ``tables`` on ``params`` for `PackedAttention`; False when ``params`` takes no attribute."""
    try:
        setattr(params, _HANDOVER, tables)
    except AttributeError:
        return False
    return True


def handed_over(params: Any) -> RopeTables | None:
    """The tables `hand_over` stored on ``params``, if any."""
    return getattr(params, _HANDOVER, None)


def check_table(table: torch.Tensor, head_dim: int) -> None:
    """ValueError unless ``table`` is a megatron-core RoPE table usable on heads of ``head_dim``."""
    if table.dim() != 4 or table.shape[1] != 1 or table.shape[2] != 1:
        raise ValueError(
            f"RoPE table must be megatron-core's [max_seqlen, 1, 1, rotary_dim], got shape "
            f"{tuple(table.shape)} (multimodal mrope tables are not supported with THD batches)"
        )
    width = table.shape[-1]
    if width % 2 or width > head_dim:
        raise ValueError(
            f"RoPE table's rotary_dim={width} must be even and at most the head dim {head_dim} "
            f"(rotary_percent sets it)"
        )


def apply_rope(
    t: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor,
    *,
    interleaved: bool,
    mscale: float = 1.0,
    docs: Documents | None = None,
) -> torch.Tensor:
    """``t [N, heads, d]`` rotated by ``table [S, 1, 1, r]`` at ``positions [N]`` (int64).

    With ``docs``, the gathered cos/sin are kept in ``docs.memo`` for the micro-batch (every layer
    receives the same table object). Equal to megatron-core's ``apply_rotary_pos_emb`` (unfused)
    for the same positions.

    Example:
        >>> table = torch.zeros(4, 1, 1, 2)
        >>> table[:, 0, 0, :] = torch.arange(4.0)[:, None] * torch.pi / 2  # 90 degrees a step
        >>> t = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])
        >>> out = apply_rope(t, table, torch.tensor([0, 1]), interleaved=False)  # token 1: 90 degrees
        >>> torch.allclose(out, torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]]), atol=1e-6)
        True
    """
    check_table(table, t.shape[-1])
    cos, sin = _cos_sin(table, positions, t.dtype, mscale, docs)
    width = table.shape[-1]
    rot, rest = t[..., :width], t[..., width:]
    rotated = rot * cos + _rotate_half(rot, interleaved) * sin
    return rotated if rest.shape[-1] == 0 else torch.cat([rotated, rest], dim=-1)


def _cos_sin(
    table: torch.Tensor,
    positions: torch.Tensor,
    dtype: torch.dtype,
    mscale: float,
    docs: Documents | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    key = ("rope", id(table), id(positions), dtype, mscale)
    hit = None if docs is None else docs.memo.get(key)
    if hit is not None:
        return hit[2], hit[3]
    freqs = table.reshape(table.shape[0], -1)[positions.clamp(max=table.shape[0] - 1)]  # [N, r]
    cos = (torch.cos(freqs) * mscale).to(dtype)[:, None, :]
    sin = (torch.sin(freqs) * mscale).to(dtype)[:, None, :]
    if docs is not None:  # the table and positions stay referenced, so their ids stay theirs
        docs.memo[key] = (table, positions, cos, sin)
    return cos, sin


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """[-x2, x1] of the halves, or of the (even, odd) pairs when ``interleaved``."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([-x2, x1], dim=-1).flatten(-2)
