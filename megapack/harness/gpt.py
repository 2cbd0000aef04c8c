"""A tiny megatron-core GPT fed by megapack: the model the throughput bench, examples and tests train.

* `TinyGPT` builds megatron-core's ``GPTModel`` with `megapack.megatron.packed_gpt_layer_spec` for
  this rank's pipeline stage (megatron-core ``parallel_state`` must be initialized).
* `init_weights` gives every rank the slice of one topology-independent set of full weights: each
  full tensor is drawn from a generator seeded by (seed, global parameter name), then cut along its
  ``partition_dim`` for this TP rank. So tp=2 x pp=4 starts from exactly the weights of tp=1 x pp=1,
  without saving or moving a checkpoint.
* `packed_micro_batch` / `padded_micro_batch` lay documents out as Megatron's own SFT dicts
  (packed rows with -1-padded ``cu_seqlens``) and padded ``[b, s]`` rows.
* `forward_step` is a pretrain_gpt-style ``forward_step_func`` that calls
  `megapack.get_batch_on_this_tp_rank` and returns each micro-batch's mean loss over its trained
  tokens (`megapack.megatron.normalized_loss`, ``mode="micro_batch_mean"``);
  `micro_batch_losses` reads those means back from the schedule's reports.

The MLP is ungated (GELU): a gated fc1 interleaves its two halves across TP ranks, which a plain
slice of the full tensor would not reproduce. megatron-core is imported lazily, inside the calls.

Example:
    >>> gpt = TinyGPT(num_layers=2, hidden_size=32)              # doctest: +SKIP
    >>> model = gpt.build()                                      # doctest: +SKIP
    >>> init_weights(model, seed=7)                              # same weights on every grid
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megapack.core.batch import PackedBatch
from megapack.core.cp_share import CpLayout
from megapack.core.fields import BatchField
from megapack.delivery.get_batch import get_batch_on_this_tp_rank
from megapack.distributed.topology import Topology
from megapack.megatron.loss import normalized_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyGPT:
    """Sizes of a GPT small enough for CPU tests; grouped-query attention on by default."""

    num_layers: int = 4
    """Transformer layers in the whole model (divided among pipeline stages)."""
    hidden_size: int = 32
    """Model width."""
    num_attention_heads: int = 4
    """Query heads (divisible by tp)."""
    num_query_groups: int = 2
    """Key/value heads (divisible by tp)."""
    vocab_size: int = 128
    """Vocabulary size (divisible by tp)."""
    max_sequence_length: int = 256
    """Longest position for learned absolute embeddings."""
    position_embedding_type: str = "rope"
    """"rope" or "learned_absolute"."""
    backend: str = "auto"
    """Attention backend for `megapack.attention.PackedAttention`."""
    cp_layout: CpLayout = "document"
    """How packed rows are split over context-parallel ranks (used when cp > 1)."""

    def build(self, *, vp_stage: int | None = None) -> Any:
        """This rank's ``GPTModel`` chunk, on CPU, fp32, no dropout, untied embeddings."""
        from megapack.core.quiet import quiet_megatron

        with quiet_megatron():  # megatron's known-harmless import and config warnings
            return self._build(vp_stage)

    def _build(self, vp_stage: int | None) -> Any:
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer import TransformerConfig

        from megapack.megatron import packed_gpt_layer_spec

        config = TransformerConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
            context_parallel_size=ps.get_context_parallel_world_size(),
            pipeline_dtype=torch.float32,
            params_dtype=torch.float32,
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        return GPTModel(
            config=config,
            transformer_layer_spec=packed_gpt_layer_spec(self.backend, cp_layout=self.cp_layout),
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            pre_process=ps.is_pipeline_first_stage(
                ignore_virtual=vp_stage is None, vp_stage=vp_stage
            ),
            post_process=ps.is_pipeline_last_stage(
                ignore_virtual=vp_stage is None, vp_stage=vp_stage
            ),
            share_embeddings_and_output_weights=False,
            position_embedding_type=self.position_embedding_type,
            vp_stage=vp_stage,
        )


def global_parameters(
    model: torch.nn.Module,
) -> Iterator[tuple[str, torch.nn.Parameter, int | None]]:
    """(name in the tp=1 x pp=1 model, parameter, TP-split dim or None) of this rank's parameters.

    A DDP-wrapped model (``module.`` prefix) gives the same names as the module it wraps.
    """
    inner = getattr(model, "module", model)
    layers = getattr(getattr(inner, "decoder", None), "layers", [])
    global_index = {str(i): str(layer.layer_number - 1) for i, layer in enumerate(layers)}
    for name, param in inner.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = global_index[parts[2]]
        split = bool(getattr(param, "tensor_model_parallel", False))
        yield ".".join(parts), param, int(getattr(param, "partition_dim", 0)) if split else None


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Load this rank's slice of topology-independent full weights into ``model`` (in place)."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for full_name, param, split_dim in global_parameters(model):
            split, dim = split_dim is not None, split_dim or 0
            shape = list(param.shape)
            if split:
                shape[dim] *= tp
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(full_name.encode()))
            full = torch.randn(shape, generator=gen)
            if "norm" in full_name and full_name.endswith("weight"):
                full = 1.0 + 0.1 * full
            else:
                full = (0.01 if full_name.endswith("bias") else 0.05) * full
            param.copy_(full.chunk(tp, dim=dim)[tp_rank] if split else full)


def forward_step(
    topology: Topology | None,
    data_iterator: Any,
    model: Any,
    *,
    fields: Sequence[BatchField] = (),
    loss: Callable[[dict[str, Any], Any], Any] | None = None,
    embed: Callable[[Any, dict[str, Any]], torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, Any]:
    """pretrain_gpt-style forward step: megapack delivers the batch, the model computes per-token loss.

    Use as ``functools.partial(forward_step, topology)`` for megatron-core's schedules.

    Args:
        fields: a trainer's own fields to deliver too (`megapack.BatchField`).
        loss: ``loss(batch, cp_group)`` gives the schedule's loss function (default:
            `megapack.megatron.normalized_loss` with ``mode="micro_batch_mean"`` and
            ``calculate_per_token_loss=False``: each micro-batch's mean over its trained tokens),
            e.g. `megapack.megatron.policy_loss` of delivered advantages and old log-probs.
        embed: ``embed(model, batch)`` gives the first stage's ``decoder_input`` (e.g. token
            embeddings plus image patch embeddings), or None to let the model embed.
    """
    if topology is None:
        topology = Topology.from_parallel_state()
    batch = get_batch_on_this_tp_rank(data_iterator, topology=topology, fields=fields)
    decoder_input = embed(model, batch) if embed is not None else None
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        decoder_input=decoder_input,
        labels=batch["labels"],
        packed_seq_params=batch["packed_seq_params"],
    )
    cp_group = topology.cp_group if topology.cp_size > 1 else None
    if loss is not None:
        return output, loss(batch, cp_group)
    return output, functools.partial(
        normalized_loss,
        batch,
        mode="micro_batch_mean",
        calculate_per_token_loss=False,
        cp_group=cp_group,
    )


def micro_batch_losses(reports: Sequence[dict[str, Any]], cp_group: Any = None) -> list[float]:
    """Each micro-batch's loss from the schedule's reports (``{"lm loss": [sum, count]}`` each, as
    `megapack.megatron.normalized_loss` returns them): sum / count after summing over ``cp_group``
    (Megatron-LM's ``train_step`` sums them over DP x CP alike). Every rank of ``cp_group`` must call it (one
    all-reduce, none without a group or without reports).

    Example: micro_batch_mean on cp 2, micro-batch means 2.0 and 3.0 -> CP rank 0 reports
    ``[[1.5, 1], [1.0, 1]]``, rank 1 ``[[0.5, 0], [2.0, 0]]`` -> ``[2.0, 3.0]`` on both.
    """
    if not reports:
        return []
    sums = torch.stack([r["lm loss"].detach().double() for r in reports])
    if cp_group is not None:
        dist.all_reduce(sums, group=cp_group)
    return (sums[:, 0] / sums[:, 1].clamp(min=1.0)).tolist()


def packed_micro_batch(
    rows: Sequence[Sequence[Sequence[int]]], seq_len: int, *, pad_to_multiple_of: int = 1
) -> dict[str, torch.Tensor]:
    """Megatron SFT-style packed micro-batch: one row of ``seq_len`` per entry of ``rows``.

    Each row's documents are packed with `PackedBatch.from_documents`; ``cu_seqlens`` rows are
    padded with -1, as Megatron's SFT datasets do. With ``pad_to_multiple_of > 1`` every document
    is padded to that multiple (context parallelism's "document" layout) and the batch also
    carries ``cu_seqlens_padded`` rows.
    """
    packed = [
        PackedBatch.from_documents(
            list(docs), seq_len=seq_len, pad_to_multiple_of=pad_to_multiple_of
        )
        for docs in rows
    ]
    out = {
        k: torch.cat([getattr(p, k) for p in packed])
        for k in ("tokens", "labels", "loss_mask", "position_ids")
    }
    out["cu_seqlens"] = _cu_rows([p.cu_seqlens for p in packed])
    if pad_to_multiple_of > 1:
        out["cu_seqlens_padded"] = _cu_rows([p.cu_seqlens_padded for p in packed])  # type: ignore[misc]
    return out


def _cu_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """[b, max n + 1] int32, each row's boundaries then -1."""
    cu = torch.full((len(rows), max(len(r) for r in rows)), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        cu[i, : len(r)] = r
    return cu


def padded_micro_batch(docs: Sequence[Sequence[int]], seq_len: int) -> dict[str, torch.Tensor]:
    """Plain [len(docs), seq_len] micro-batch: one document per row, padded at the end (Megatron SFT)."""
    rows = [PackedBatch.from_documents([doc], seq_len=seq_len) for doc in docs]
    return {
        k: torch.cat([getattr(r, k) for r in rows])
        for k in ("tokens", "labels", "loss_mask", "position_ids")
    }
