"""The GPU kit's model: a ~0.84B megatron-core GPT preset, its THD-aware FLOPs, and the matmul ceiling.

`GptShape` names a GPT's sizes; `PRESET` is the kit's real-size model (16 layers, hidden 2,048,
16 query heads in 4 key/value groups, head dim 128, ungated GELU FFN of 8,192, vocabulary 32,000
untied: 835.9M parameters) and `TOY` the dry run's. `build_gpt` builds it as megatron-core's
``GPTModel`` with `megapack.megatron.packed_gpt_layer_spec`, in bf16 through megatron-core's
``Float16Module`` (as Megatron-LM's ``--bf16``) or in fp32.

FLOPs are THD-aware: a packed row costs what its documents cost, never ``seq_len^2``. For one
forward pass over documents of lengths ``L_i``:

    matmuls    2 * sum(L_i) * (num_layers * (h*(h + 2*g*d) + h*h + k*h*f) + h*V)
    attention  4 * h * num_layers * sum(L_i * (L_i + 1) / 2)        (causal: QK^T and AV)

with h hidden, g key/value groups, d head dim, f FFN width (k = 2 ungated, 3 gated), V vocabulary;
training is 3x the forward. Worked example, `TOY` on lengths ``[3, 2]``: matmuls 2 * 5 * (2 * (64 *
(64 + 64) + 4,096 + 2 * 64 * 256) + 64 * 256) = 1,064,960; attention 4 * 64 * 2 * (6 + 3) = 4,608;
training 3 * 1,069,568 = 3,208,704. Padding tokens and filler rows add nothing: they are work
the GPU did but nobody wanted, so TFLOP/s computed this way is the *effective* rate.

`matmul_ceiling` measures the device's own dense matmul rate (bf16 8,192^3 on a GPU, ~790 TFLOP/s on
an H200 of this workplace), the denominator of the kit's MFU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class GptShape:
    """Sizes of a megatron-core GPT (no dropout, RoPE, LayerNorm, no linear biases)."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width h."""
    num_attention_heads: int
    """Query heads; head dim d = h / heads."""
    num_query_groups: int
    """Key/value heads g (grouped-query attention)."""
    ffn_hidden_size: int
    """MLP width f."""
    vocab_size: int
    """Vocabulary V (input embedding and an untied output layer)."""
    gated: bool = False
    """SwiGLU-style gated MLP (3 matrices) instead of GELU (2)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def parameters(self) -> int:
        """Weights, embeddings and norms included (e.g. `PRESET`: 835,850,240)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        attention = h * (h + 2 * self.num_query_groups * self.head_dim) + h * h
        mlp = (3 if self.gated else 2) * h * f
        per_layer = attention + mlp + 4 * h  # two LayerNorms (weight + bias)
        return self.num_layers * per_layer + 2 * h * self.vocab_size + 2 * h

    def matmul_flops_per_token(self) -> int:
        """Forward matmul FLOPs of one token: 2 x every weight it multiplies (the output layer too)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        layer = h * (h + 2 * self.num_query_groups * self.head_dim) + h * h
        layer += (3 if self.gated else 2) * h * f
        return 2 * (self.num_layers * layer + h * self.vocab_size)

    def training_flops(self, lengths: Sequence[int]) -> int:
        """Forward + backward FLOPs of one pass over documents of these lengths (see module docstring)."""
        tokens = sum(lengths)
        pairs = sum(n * (n + 1) // 2 for n in lengths)  # causal (query, key) pairs per document
        attention = 4 * self.hidden_size * self.num_layers * pairs
        return 3 * (tokens * self.matmul_flops_per_token() + attention)


PRESET = GptShape(
    num_layers=16,
    hidden_size=2048,
    num_attention_heads=16,
    num_query_groups=4,
    ffn_hidden_size=8192,
    vocab_size=32000,
)
"""The kit's real-size GPT: 835.9M parameters, about what one GPU trains at seq 4,096-8,192."""

TOY = GptShape(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=256,
    vocab_size=256,
)
"""The dry run's GPT: the same code on CPU in seconds."""


def build_gpt(
    shape: GptShape,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_sequence_length: int,
    backend: str = "auto",
) -> Any:
    """``GPTModel`` with megapack's packed layer spec; bf16 is wrapped in ``Float16Module``.

    megatron-core's ``parallel_state`` must be initialized and its RNG seeded
    (``model_parallel_cuda_manual_seed``). On CUDA the weights are initialized on the device; on CPU
    with ``use_cpu_initialization`` (and `megapack.harness.megatron_cpu.megatron_on_cpu` applied first).
    ``variable_seq_lengths`` is on: padding to each micro-batch's longest changes the shape.
    """
    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():
        return _build(shape, device, dtype, max_sequence_length, backend)


def _build(
    shape: GptShape, device: torch.device, dtype: torch.dtype, max_len: int, backend: str
) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from megapack.megatron import packed_gpt_layer_spec

    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    bf16 = dtype == torch.bfloat16
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        gated_linear_unit=shape.gated,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=device.type == "cpu",
    )
    config.variable_seq_lengths = True  # after __post_init__, which refuses it for MoE dispatch
    model = GPTModel(
        config=config,
        transformer_layer_spec=packed_gpt_layer_spec(backend),
        vocab_size=shape.vocab_size,
        max_sequence_length=max_len,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    model.to(device)
    return Float16Module(config, model) if bf16 else model


def forward(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Per-token losses of ``model`` on one delivered micro-batch (`megapack.get_batch_on_this_tp_rank`'s
    dict, or `megapack.GraphInputs`'s, which holds no ``attention_mask``: THD needs none)."""
    return model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
        packed_seq_params=batch["packed_seq_params"],
    )


def matmul_ceiling(device: torch.device, dtype: torch.dtype, *, n: int, repeats: int = 10) -> float:
    """Median FLOP/s of an ``n x n x n`` matmul on random data (CUDA events on a GPU).

    The MFU denominator, measured in the same run rather than read off a datasheet: random
    normal inputs (zeros run faster), 3 warm-ups, then the median of ``repeats`` timed products.
    """
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b, out=out)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            torch.matmul(a, b, out=out)
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)
