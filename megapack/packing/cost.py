"""`CostModel`: what one packed row costs to train, ``a * tokens + b * sum(len_i ** 2)``.

Packing equalizes tokens per row, but a row's compute is not its tokens. The linear layers (QKV,
output projection, MLP, LM head) cost the same per token wherever it sits; causal attention inside a
document of ``L`` tokens costs about ``L ** 2 / 2`` query-key pairs. In a packed (THD) row every
document (every slice of a split document) attends only to itself, so for a row holding slices of
lengths ``len_1, ..., len_k``:

    cost(row) = a * (len_1 + ... + len_k) + b * (len_1 ** 2 + ... + len_k ** 2)

With a model shape (``from_shape``), ``a`` and ``b`` are training FLOPs (forward + backward = 3 x
forward; the factor cancels in any balance, it only makes the numbers readable):

    q  = heads * head_dim                 query width (hidden by default)
    kv = kv_heads * head_dim              key/value width (GQA: kv_heads < heads)
    m  = 3 if gated (SwiGLU) else 2       MLP matrices
    a  = 3 * (layers * 2 * (hidden * (q + 2 * kv) + q * hidden + m * hidden * ffn) + 2 * hidden * vocab)
    b  = 3 * layers * 2 * q               QK^T and AV, 2 * L^2 * q each, halved by the causal mask

Worked example, ``hidden 64, ffn 256, layers 2, heads 4, vocab 1000`` (not gated): per layer
QKV 2 * 64 * 192 = 24,576, output 2 * 64 * 64 = 8,192, MLP 2 * 2 * 64 * 256 = 65,536, so
``a = 3 * (2 * 98,304 + 128,000) = 973,824`` and ``b = 3 * 2 * 2 * 64 = 768``. A row holding
documents ``[3, 2, 4]`` has 9 tokens and ``sum(len^2) = 29``:
``973,824 * 9 + 768 * 29 = 8,786,688`` FLOPs. At that tiny width attention is cheap; for a
Llama-3-8B shape (``hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, vocab=128256,
gated=True``: ``a = 4.50e10``, ``b = 786,432``) a row of one 2,048-token document spends 3.5% of
its FLOPs in attention, a row of forty 50-token ones 0.09%; at 32k tokens the one-document row
spends 36%. ``CostModel.tokens()`` (``b = 0``) is plain token balance. Only the ratio
``b / a`` matters to balancing; override ``a``/``b`` directly to use measured kernel times.

Zero-loss padding rows count as cost 0 (they hold no documents); they still run through the model,
but every plan pads the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """Row cost ``a * tokens + b * sum(len_i ** 2)``; see the module docstring for the formula.

    Example:
        >>> m = CostModel.from_shape(hidden=64, ffn=256, layers=2, heads=4, vocab=1000)
        >>> m.a, m.b, m.row_cost([3, 2, 4])
        (973824.0, 768.0, 8786688.0)
        >>> CostModel.tokens().row_cost([3, 2, 4])
        9.0
    """

    a: float
    """Cost per token (linear layers, LM head); >= 0."""
    b: float
    """Cost per squared document length (attention); >= 0. ``b = 0`` balances tokens."""

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float | np.number):
                raise TypeError(f"CostModel.{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{name} must be finite and >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.a == 0 and self.b == 0:
            raise ValueError("CostModel needs a > 0 or b > 0; CostModel.tokens() balances tokens")

    @classmethod
    def tokens(cls) -> CostModel:
        """Plain token balance: ``a = 1, b = 0``."""
        return cls(a=1.0, b=0.0)

    @classmethod
    def from_shape(
        cls,
        *,
        hidden: int,
        ffn: int,
        layers: int,
        heads: int,
        vocab: int,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        gated: bool = False,
    ) -> CostModel:
        """Training FLOPs per token (``a``) and per squared document length (``b``) of a GPT.

        Args:
            hidden: model width (Megatron ``hidden_size``).
            ffn: MLP inner width (``ffn_hidden_size``; for MoE, top-k x the expert width).
            layers: transformer layers.
            heads: query heads.
            vocab: vocabulary size (the LM head); 0 leaves it out.
            kv_heads: key/value heads (GQA ``num_query_groups``); default ``heads``.
            head_dim: per-head width (``kv_channels``); default ``hidden // heads``.
            gated: SwiGLU-style MLP with three matrices (``gated_linear_unit``).

        Raises:
            ValueError: a size that is not a positive int (naming it), or ``heads`` not a
                multiple of ``kv_heads``.
        """
        kv_heads = heads if kv_heads is None else kv_heads
        sizes = {
            "hidden": hidden,
            "ffn": ffn,
            "layers": layers,
            "heads": heads,
            "kv_heads": kv_heads,
        }
        for name, value in {**sizes, "vocab": vocab, "head_dim": head_dim or 1}.items():
            low = 0 if name == "vocab" else 1
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if heads % kv_heads:
            raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
        head_dim = head_dim or hidden // heads
        if head_dim < 1:
            raise ValueError(f"hidden={hidden} < heads={heads}: pass head_dim explicitly")
        q, kv, m = heads * head_dim, kv_heads * head_dim, 3 if gated else 2
        per_layer = 2 * (hidden * (q + 2 * kv) + q * hidden + m * hidden * ffn)
        a = 3 * (layers * per_layer + 2 * hidden * vocab)
        b = 3 * layers * 2 * q
        return cls(a=float(a), b=float(b))

    @classmethod
    def from_transformer_config(cls, config: Any, *, vocab: int) -> CostModel:
        """`from_shape` read from a megatron-core ``TransformerConfig`` (which has no vocabulary).

        Uses ``hidden_size``, ``ffn_hidden_size``, ``num_layers``, ``num_attention_heads``,
        ``num_query_groups``, ``kv_channels`` and ``gated_linear_unit``.
        """
        return cls.from_shape(
            hidden=int(config.hidden_size),
            ffn=int(config.ffn_hidden_size),
            layers=int(config.num_layers),
            heads=int(config.num_attention_heads),
            kv_heads=int(config.num_query_groups or config.num_attention_heads),
            head_dim=int(config.kv_channels) if config.kv_channels else None,
            gated=bool(config.gated_linear_unit),
            vocab=vocab,
        )

    def row_cost(self, lengths: Any) -> float:
        """Cost of one row holding documents (slices) of these lengths."""
        values = np.asarray(lengths, dtype=np.float64)
        return float(self.a * values.sum() + self.b * (values * values).sum())

    def bin_costs(self, slices: np.ndarray, bin_offsets: np.ndarray) -> np.ndarray:
        """[num_bins] float64 cost of every bin of a plan in CSR form (`PackPlan.slices`/``bin_offsets``)."""
        sizes = np.asarray(slices, dtype=np.int64).reshape(-1, 3)
        sizes = (sizes[:, 2] - sizes[:, 1]).astype(np.float64)
        per_slice = self.a * sizes + self.b * sizes * sizes
        totals = np.concatenate(([0.0], np.cumsum(per_slice)))
        offsets = np.asarray(bin_offsets, dtype=np.int64)
        return totals[offsets[1:]] - totals[offsets[:-1]]
