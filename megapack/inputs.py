"""What a data iterator may yield, validated into the named fields the wire carries (`normalize`).

Three forms are accepted, the same on every stage:

    PackedBatch                      THD [1, T] as is
    Megatron SFT-style dict          [b, s] rows with per-row ``cu_seqlens`` [b, k] (and optionally
                                     ``cu_seqlens_padded``), merged into THD [1, b * s]
    plain pretraining dict           [b, s] without ``cu_seqlens``, optional ``attention_mask``
                                     [b, 1, s, s], kept as [b, s]

Keys Megatron's datasets add travel too: ``dataset_id`` ([b] integers, BlendedDataset's source
of each sample) on every stage, ``local_cp_size`` (Megatron's hybrid context parallelism, an int
or a 1-element tensor) into ``packed_seq_params``. ``cu_seqlens_argmin`` (NeMo's position of each
row's first sentinel) is redundant with ``cu_seqlens`` and dropped. Any other key is a ValueError
naming it. A packed dict with a dense ``attention_mask`` is refused: the mask would be silently
dropped (Megatron's ``create_attention_mask_in_dataloader`` must be off for packed batches).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megapack.batch import PackedBatch
from megapack.sft import grid_tensor

PLAIN_KEYS = frozenset(
    {"tokens", "labels", "loss_mask", "position_ids", "attention_mask", "dataset_id"}
)
PACKED_KEYS = PLAIN_KEYS | {"cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size"}
IGNORED_KEYS = frozenset({"cu_seqlens_argmin"})
"""Accepted and dropped: NeMo's index of each row's first cu_seqlens sentinel, redundant with it."""


class Layout(enum.IntEnum):
    PACKED = 0  # THD [1, T] with cu_seqlens
    PLAIN = 1  # Megatron pretraining [b, s], attention_mask optional


@dataclass(frozen=True, kw_only=True, slots=True)
class Scalars:
    """The per-batch Python ints that travel in the header, not the payload."""

    max_seqlen: int | None = None
    """Longest buffer segment of a packed batch; None for plain batches."""
    local_cp_size: int | None = None
    """Megatron's hybrid-CP group size for this batch, when the batch carries one."""


def normalize(item: Any) -> tuple[Layout, dict[str, torch.Tensor | None], Scalars]:
    """(layout, tensors by field name, scalars) of one item from the data iterator, validated.

    Raises:
        TypeError: not a PackedBatch or a dict, or a field of the wrong type.
        ValueError: an unknown key (named), a dense attention_mask on a packed dict, or a
            field whose shape or values break the THD contract.
    """
    if isinstance(item, PackedBatch):
        batch = item.validate()
        extras: dict[str, Any] = {}
    elif isinstance(item, Mapping):
        packed = item.get("cu_seqlens") is not None
        allowed = PACKED_KEYS if packed else PLAIN_KEYS
        unknown = sorted(set(item) - allowed - IGNORED_KEYS)
        if unknown:
            hint = (
                "; cu_seqlens_padded and local_cp_size need cu_seqlens (a packed batch)"
                if set(unknown) & PACKED_KEYS
                else ""
            )
            raise ValueError(
                f"batch has unexpected keys {unknown}; megapack transfers {sorted(allowed)} and "
                f"ignores {sorted(IGNORED_KEYS)} (drop the extra keys or carry them yourself){hint}"
            )
        tokens = grid_tensor(item, "tokens")
        extras = {"dataset_id": _dataset_id(item.get("dataset_id"), int(tokens.shape[0]))}
        if not packed:
            return Layout.PLAIN, _plain_tensors(item) | extras, Scalars()
        if item.get("attention_mask") is not None:
            raise ValueError(
                "batch has both cu_seqlens and a dense attention_mask: packed batches mask by "
                "document from cu_seqlens, so the mask would be dropped; turn off "
                "create_attention_mask_in_dataloader (--no-create-attention-mask-in-dataloader) "
                "or drop 'attention_mask' from the batch"
            )
        batch = PackedBatch.from_megatron_batch(item)
        extras["local_cp_size"] = item.get("local_cp_size")
    else:
        raise TypeError(
            f"data_iterator yielded {type(item).__name__}; expected a megapack.PackedBatch or a dict of "
            "tensors (Megatron SFT-style with cu_seqlens, or a plain pretraining batch)"
        )
    tensors: dict[str, torch.Tensor | None] = {
        "tokens": batch.tokens,
        "labels": batch.labels,
        "loss_mask": batch.loss_mask,
        "position_ids": batch.position_ids,
        "cu_seqlens": batch.cu_seqlens,
        "cu_seqlens_padded": batch.cu_seqlens_padded,
        "dataset_id": extras.get("dataset_id"),
    }
    scalars = Scalars(
        max_seqlen=batch.max_seqlen, local_cp_size=_local_cp_size(extras.get("local_cp_size"))
    )
    return Layout.PACKED, tensors, scalars


def _plain_tensors(item: Mapping[str, Any]) -> dict[str, torch.Tensor | None]:
    tokens = grid_tensor(item, "tokens")
    shape = tuple(tokens.shape)
    tensors: dict[str, torch.Tensor | None] = {"tokens": tokens}
    for name in ("labels", "loss_mask", "position_ids"):
        tensors[name] = grid_tensor(item, name, shape)
    mask = item.get("attention_mask")
    is_mask = isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] == shape[1]
    if mask is not None and not is_mask:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"batch['attention_mask'] is {got}; expected a [b, 1, s, s] tensor with s={shape[1]}"
        )
    tensors["attention_mask"] = mask
    return tensors


def _dataset_id(value: Any, samples: int) -> torch.Tensor | None:
    """``dataset_id`` as [b] (also accepted: [b, 1], as collated from [1]-shaped items)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"batch['dataset_id'] must be a tensor of integers (one per sample), got {type(value).__name__}"
        )
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"batch['dataset_id'] has dtype {value.dtype}; expected integers")
    flat = value.reshape(-1) if value.dim() == 2 and value.shape[1] == 1 else value
    if flat.dim() != 1 or flat.shape[0] != samples:
        raise ValueError(
            f"batch['dataset_id'] has shape {tuple(value.shape)}; expected [{samples}], one per sample "
            "like tokens' rows"
        )
    return flat


def _local_cp_size(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(
                f"batch['local_cp_size'] must be one integer, got a {value.dtype} tensor of shape "
                f"{tuple(value.shape)}"
            )
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"batch['local_cp_size'] must be an int >= 1, got {value!r}")
    return value
