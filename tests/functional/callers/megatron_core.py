"""megatron-core's names the re-created callers import: the installed release's where it has
them, else re-created here from megatron-core 0.19.2's ``megatron/core/utils.py`` (main's) or
0.16.1's (the older callers'), so that every caller runs on both lines.

    name                                 0.19.2                   0.16.1
    get_batch_on_this_tp_rank (main's)   megatron.core.utils      None: tests that need it are skipped
    flatten_batch_for_packed_sequences   megatron.core.utils      re-created (0.19.2's)
    get_batch_on_this_cp_rank (main's)   megatron.core.utils      re-created (0.19.2's)
    get_batch_on_this_cp_rank_pre_4103   re-created (0.16.1's)    megatron.core.utils
    get_thd_batch_on_this_cp_rank        re-created (0.16.1's)    megatron.core.utils
    mtp_on_this_rank_func (main's form)  megatron.core (as is)    megatron.core, config wrapped

The re-created context-parallel splits stop where megatron-core needs Transformer Engine (a
per-document split with cp > 1), as megatron-core does without it.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import torch

from megapack.core.quiet import quiet_megatron

with quiet_megatron():
    from megatron.core import parallel_state
    from megatron.core import utils as _utils
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import multi_token_prediction as _mtp

NEW = hasattr(_utils, "flatten_batch_for_packed_sequences")
"""Whether the installed megatron-core has main's data functions (0.19 onwards)."""

get_batch_on_this_tp_rank = _utils.get_batch_on_this_tp_rank if NEW else None


def _merge_cu_seqlens(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    def strip(row: torch.Tensor) -> torch.Tensor:
        hits = (row == seq_length).nonzero(as_tuple=True)[0]
        return row[: hits[0].item() + 1] if hits.numel() > 0 else row

    parts = [strip(cu_seqlens[0])]
    for i in range(1, cu_seqlens.shape[0]):
        parts.append(strip(cu_seqlens[i])[1:] + i * seq_length)
    return torch.cat(parts)


def _flatten(batch: dict[str, Any]) -> dict[str, Any]:
    cu_seqlens = batch.get("cu_seqlens")
    if cu_seqlens is None:
        return batch
    seq_length = None
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        if batch.get(key) is not None:
            seq_length = batch[key].shape[1]
            break
    if seq_length is None:  # a middle stage: the row length from the boundaries
        seq_length = cu_seqlens[0, -1].item()
    batch["cu_seqlens"] = _merge_cu_seqlens(cu_seqlens, seq_length).unsqueeze(0)
    if batch.get("cu_seqlens_padded") is not None:
        batch["cu_seqlens_padded"] = _merge_cu_seqlens(
            batch["cu_seqlens_padded"], seq_length
        ).unsqueeze(0)
    if batch.get("max_seqlen") is not None:
        batch["max_seqlen"] = batch["max_seqlen"].max().unsqueeze(0)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        if batch.get(key) is not None:
            batch[key] = batch[key].reshape(1, -1)
    return batch


def _per_sequence(batch: dict[str, Any], cp_group: Any) -> dict[str, Any]:
    cp_size = torch.distributed.get_world_size(cp_group)
    cp_rank = torch.distributed.get_rank(cp_group)
    metadata = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size", "hybrid_cp_group")
    if cp_size > 1:
        for key, val in batch.items():
            if key in metadata or val is None:
                continue
            dim = 2 if key == "attention_mask" else 1
            val = val.view(*val.shape[:dim], 2 * cp_size, val.shape[dim] // (2 * cp_size),
                           *val.shape[dim + 1 :])  # fmt: skip
            index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=val.device)
            val = val.index_select(dim, index)
            batch[key] = val.view(*val.shape[:dim], -1, *val.shape[dim + 2 :])
    return batch


def _cp_split(
    batch: dict[str, Any],
    is_hybrid_cp: bool,
    cp_group: Any = None,
    hybrid_cp_group_func: Any = None,
    use_per_sequence_balancing: bool = False,
) -> dict[str, Any]:
    if use_per_sequence_balancing or batch.get("cu_seqlens") is None:
        return _per_sequence(batch, cp_group)
    if is_hybrid_cp:
        raise NotImplementedError("hybrid CP: megapack refuses it before this point")
    if torch.distributed.get_world_size(cp_group) > 1:
        raise RuntimeError("a per-document CP split needs Transformer Engine, as megatron-core's")
    return batch


flatten_batch_for_packed_sequences = _utils.flatten_batch_for_packed_sequences if NEW else _flatten
get_batch_on_this_cp_rank = _utils.get_batch_on_this_cp_rank if NEW else _cp_split


def _old_cp_split(batch: dict[str, Any], cp_group: Any = None) -> dict[str, Any]:
    """0.16.1's ``get_batch_on_this_cp_rank(batch)``: every tensor split per sequence."""
    if cp_group is None:
        cp_group = parallel_state.get_context_parallel_group()
    return _per_sequence(batch, cp_group)


def _old_thd_split(
    batch: dict[str, Any],
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    max_seqlen: torch.Tensor,
    cp_size: int | None = None,
    cp_rank: int | None = None,
) -> tuple[dict[str, Any], PackedSeqParams]:
    """0.16.1's ``get_thd_batch_on_this_cp_rank``: the THD PackedSeqParams (and a TE split)."""
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=int(max_seqlen[0].item()),
        max_seqlen_kv=int(max_seqlen[0].item()),
    )
    cp_size = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
    if cp_size > 1:
        raise RuntimeError("a THD CP split needs Transformer Engine, as megatron-core's")
    return batch, params


get_batch_on_this_cp_rank_pre_4103 = _old_cp_split if NEW else _utils.get_batch_on_this_cp_rank
get_thd_batch_on_this_cp_rank = getattr(_utils, "get_thd_batch_on_this_cp_rank", _old_thd_split)


def mtp_on_this_rank_func(
    layout: Any = None,
    mtp_num_layers: int | None = None,
    ignore_virtual: bool = True,
    vp_stage: int | None = None,
) -> bool:
    """megatron-core's ``mtp_on_this_rank`` in main's keyword form (0.16.1 takes a config)."""
    if "layout" in inspect.signature(_mtp.mtp_on_this_rank).parameters:
        return _mtp.mtp_on_this_rank(layout=layout, mtp_num_layers=mtp_num_layers,
                                     ignore_virtual=ignore_virtual, vp_stage=vp_stage)  # fmt: skip
    config = SimpleNamespace(pipeline_model_parallel_layout=layout, mtp_num_layers=mtp_num_layers)
    return _mtp.mtp_on_this_rank(config, ignore_virtual=ignore_virtual, vp_stage=vp_stage)
