"""Megatron-Bridge's batch path: ``training/gpt_step.py``'s ``get_batch`` (every TP rank reads its
own iterator) and the start of its forward step, ``training/utils/batch_utils.py``'s
``get_batch_on_this_tp_rank`` with a step of one's own around it (``recipe_inputs``), and
``training/utils/packed_seq_utils.py``'s ``get_packed_seq_params``. Tensors stay where the
iterator gives them (Bridge moves them with ``.cuda()``); a context-parallel split of packed rows
needs megatron-core with Transformer Engine, as Bridge's does. The guide's line runs after this
file (for ``recipe_inputs`` it is the only ``get_batch_on_this_tp_rank`` there is).
"""

from __future__ import annotations

from typing import Any

import torch

from megapack.core.quiet import quiet_megatron
from tests.functional.callers.megatron_core import get_batch_on_this_cp_rank

with quiet_megatron():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel.utils import (
        is_pp_first_stage,
        is_pp_last_stage,
        is_vp_first_stage,
        is_vp_last_stage,
    )

_CURRENT_DEVICE_KEYS = (
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
)
_CURRENT_HOST_KEYS = ("max_seqlen_q", "max_seqlen_kv")
_CURRENT_PARAM_KEYS = (*_CURRENT_DEVICE_KEYS, *_CURRENT_HOST_KEYS, "total_tokens")
_LEGACY_DEVICE_KEYS = ("cu_seqlens", "cu_seqlens_unpadded")
_LEGACY_HOST_KEYS = ("cu_seqlens_argmin", "max_seqlen", "cu_seqlens_unpadded_argmin")
_LEGACY_PARAM_KEYS = (*_LEGACY_DEVICE_KEYS, *_LEGACY_HOST_KEYS, "total_tokens")


# -- packed_seq_utils.py -------------------------------------------------------------------------
def _squeeze(value: Any) -> Any:
    return value.squeeze() if isinstance(value, torch.Tensor) else value


def _as_python_int(value: Any, *, field_name: str) -> int | None:
    value = _squeeze(value)
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{field_name} must contain exactly one value, got {tuple(value.shape)}"
            )
        return int(value.item())
    return int(value)


def get_packed_seq_params(batch: dict[str, Any]) -> PackedSeqParams:
    """Bridge's PackedSeqParams of a packed batch's metadata (current or legacy keys)."""
    if "cu_seqlens_q" in batch:
        cu_q = _squeeze(batch["cu_seqlens_q"])
        cu_kv = _squeeze(batch.get("cu_seqlens_kv"))
        max_q = _as_python_int(batch.get("max_seqlen_q"), field_name="max_seqlen_q")
        max_kv = _as_python_int(batch.get("max_seqlen_kv"), field_name="max_seqlen_kv")
        return PackedSeqParams(
            cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_kv if cu_kv is not None else cu_q,
            cu_seqlens_q_padded=_squeeze(batch.get("cu_seqlens_q_padded")),
            cu_seqlens_kv_padded=_squeeze(batch.get("cu_seqlens_kv_padded")),
            max_seqlen_q=max_q,
            max_seqlen_kv=max_kv if max_kv is not None else max_q,
            qkv_format="thd",
        )
    padded = batch["cu_seqlens"].squeeze()
    unpadded = batch.get("cu_seqlens_unpadded")
    unpadded = None if unpadded is None else unpadded.squeeze()
    argmin = batch.get("cu_seqlens_argmin")
    padded = padded[: argmin.item()] if argmin is not None else padded[: torch.argmin(padded)]
    if unpadded is not None:
        argmin = batch.get("cu_seqlens_unpadded_argmin")
        unpadded = (unpadded[: argmin.item()] if argmin is not None
                    else unpadded[: torch.argmin(unpadded)])  # fmt: skip
    max_seqlen = _as_python_int(batch.get("max_seqlen"), field_name="max_seqlen")
    if unpadded is not None:
        return PackedSeqParams(cu_seqlens_q=unpadded, cu_seqlens_kv=unpadded,
                               cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                               max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen, qkv_format="thd")  # fmt: skip
    return PackedSeqParams(cu_seqlens_q=padded, cu_seqlens_kv=padded, max_seqlen_q=max_seqlen,
                           max_seqlen_kv=max_seqlen, qkv_format="thd")  # fmt: skip


# -- gpt_step.py ---------------------------------------------------------------------------------
def _packed_metadata_for_forward(batch: dict[str, Any]) -> dict[str, Any] | None:
    if batch.get("cu_seqlens_q") is not None:
        metadata = {k: batch[k] for k in _CURRENT_PARAM_KEYS if batch.get(k) is not None}
        if batch.get("padding_mask") is not None:
            metadata["padding_mask"] = batch["padding_mask"]
        return metadata
    if batch.get("cu_seqlens") is not None:
        return {k: batch[k] for k in _LEGACY_PARAM_KEYS if batch.get(k) is not None}
    return None


def _uses_packed_sequence_metadata(cfg: Any) -> bool:
    dataset = getattr(cfg, "dataset", None)
    if getattr(dataset, "enable_offline_packing", False):
        specs = getattr(dataset, "offline_packing_specs", None)
        size = getattr(specs, "packed_sequence_size", None)
        return size is None or size > 0
    return getattr(dataset, "enable_in_batch_packing", False)


def _middle_pp_stage_needs_batch(cfg: Any) -> bool:
    dataset = getattr(cfg, "dataset", None)
    custom_mask = not getattr(dataset, "skip_getting_attention_mask_from_dataset", True)
    return custom_mask or _uses_packed_sequence_metadata(cfg)


def get_batch_from_iterator(
    data_iterator: Any,
    include_mtp_inputs: bool = False,
    skip_getting_attention_mask_from_dataset: bool = True,
    *,
    is_first_pp_stage: bool,
    is_last_pp_stage: bool,
    include_full_batch_fields: bool = False,
) -> dict[str, Any]:
    batch = next(data_iterator)
    device_keys: set[str] = set()
    host_keys: set[str] = set()
    if include_full_batch_fields:
        device_keys.update(("tokens", "labels", "loss_mask", "attention_mask", "position_ids"))
    elif not skip_getting_attention_mask_from_dataset:
        device_keys.add("attention_mask")
    if "cu_seqlens_q" in batch:
        device_keys.update(k for k in _CURRENT_DEVICE_KEYS if k in batch)
        host_keys.update(k for k in _CURRENT_HOST_KEYS if k in batch)
        if batch.get("padding_mask") is not None:
            device_keys.add("padding_mask")
    elif "cu_seqlens" in batch:
        device_keys.update(k for k in _LEGACY_DEVICE_KEYS if k in batch)
        host_keys.update(k for k in _LEGACY_HOST_KEYS if k in batch)
    if not include_full_batch_fields:
        if is_first_pp_stage or include_mtp_inputs:
            device_keys.update(("tokens", "position_ids"))
        if is_last_pp_stage:
            device_keys.update(("labels", "loss_mask"))
    out: dict[str, Any] = {}
    for key, val in batch.items():  # Bridge: .cuda(non_blocking=True) / .cpu()
        out[key] = (
            val
            if key in device_keys
            else val.cpu()
            if key in host_keys and val is not None
            else None
        )
    return out


def get_batch(
    data_iterator: Any,
    cfg: Any,
    use_mtp: bool = False,
    *,
    pg_collection: Any,
    vp_stage: int | None = None,
) -> tuple[Any, ...]:
    """Generate a batch (Bridge's gpt_step.get_batch)."""
    vp_size = getattr(getattr(cfg, "model", None), "virtual_pipeline_model_parallel_size", None)
    is_first = is_pp_first_stage(pg_collection.pp) and (
        vp_stage is None or is_vp_first_stage(vp_stage=vp_stage, vp_size=vp_size)
    )
    is_last = is_pp_last_stage(pg_collection.pp) and (
        vp_stage is None or is_vp_last_stage(vp_stage=vp_stage, vp_size=vp_size)
    )
    is_middle = not is_first and not is_last
    include_full = is_middle and _middle_pp_stage_needs_batch(cfg)
    include_mtp = use_mtp and is_last  # no pipeline layout: MTP layers on the last stage
    if is_middle and not include_full and not include_mtp:
        return None, None, None, None, None, None
    batch = get_batch_from_iterator(
        data_iterator,
        include_mtp_inputs=include_mtp,
        skip_getting_attention_mask_from_dataset=getattr(
            cfg.dataset, "skip_getting_attention_mask_from_dataset", True
        ),
        is_first_pp_stage=is_first,
        is_last_pp_stage=is_last,
        include_full_batch_fields=include_full,
    )
    has_packed = batch.get("cu_seqlens_q") is not None or batch.get("cu_seqlens") is not None
    if has_packed and pg_collection.cp.size() > 1:
        raise RuntimeError("Bridge's packed CP split needs Transformer Engine")
    if not has_packed:
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=pg_collection.cp)
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"),
            batch["position_ids"], _packed_metadata_for_forward(batch))  # fmt: skip


def forward_inputs(
    data_iterator: Any, cfg: Any, use_mtp: bool, *, pg_collection: Any, vp_stage: int | None = None
) -> dict[str, Any]:
    """``_forward_step_common`` up to the model call: its ``forward_args``."""
    tokens, labels, loss_mask, attention_mask, position_ids, metadata = get_batch(
        data_iterator, cfg, use_mtp, pg_collection=pg_collection, vp_stage=vp_stage
    )
    forward_args: dict[str, Any] = {"input_ids": tokens, "position_ids": position_ids,
                                    "attention_mask": attention_mask, "labels": labels,
                                    "loss_mask": loss_mask}  # fmt: skip
    if metadata is not None:
        padding_mask = metadata.get("padding_mask")
        metadata = {k: v for k, v in metadata.items() if k != "padding_mask"}
        forward_args["packed_seq_params"] = get_packed_seq_params(metadata)
        if padding_mask is not None:
            forward_args["padding_mask"] = padding_mask
    return forward_args


# -- batch_utils.py, and a step of one's own around it ---------------------------------------------
get_batch_on_this_tp_rank: Any = None
"""batch_utils' function allocates its buffers on ``torch.cuda.current_device()``: nothing of it
runs on a CPU machine, so the name is None here until the guide's line binds megapack's."""


def recipe_inputs(
    data_iterator: Any, cfg: Any, use_mtp: bool, *, pg_collection: Any
) -> dict[str, Any]:
    """A step of one's own: Bridge's TP-rank function, then what gpt_step does with a batch."""
    batch = get_batch_on_this_tp_rank(data_iterator, cfg, use_mtp, pg_collection=pg_collection)
    metadata = _packed_metadata_for_forward(batch)
    if metadata is None:
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=pg_collection.cp)
    inputs = {
        k: batch[k] for k in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    }
    if metadata is not None:
        padding_mask = metadata.pop("padding_mask", None)
        inputs["packed_seq_params"] = get_packed_seq_params(metadata)
        inputs["padding_mask"] = padding_mask
    return inputs
