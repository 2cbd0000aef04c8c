"""What a data iterator may yield, checked and made a `Batch`: one value per declared field (`to_batch`).

Three kinds of item are accepted, the same on every stage:

    PackedBatch                      THD [1, T] as is (`megapack.core.batch`)
    Megatron SFT-style dict          [b, s] rows with per-row ``cu_seqlens`` [b, k] (and optionally
                                     ``cu_seqlens_padded``), merged into THD [1, b * s]
    plain pretraining dict           [b, s] without ``cu_seqlens``, optional ``attention_mask``
                                     [b, 1, s, s], kept as [b, s]

This module and `megapack.core.rows` (which merges packed rows, `merge_rows`) are the one place
that parses Megatron's dicts.

Keys Megatron's datasets add travel too: ``dataset_id`` ([b], BlendedDataset's source of each
sample), ``local_cp_size`` (hybrid context parallelism). NeMo's ``cu_seqlens_argmin`` is
redundant with ``cu_seqlens`` and dropped. A trainer's own keys travel when declared
(`megapack.core.fields.BatchField`); any other key is a ValueError naming it.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megapack.core.batch import PackedBatch
from megapack.core.buckets import BUCKET_FIELDS, BUCKET_NAMES
from megapack.core.checks import check_int
from megapack.core.fields import GRID_NAMES, MAX_DIMS, BatchField, Schema
from megapack.core.loss_fields import LOSS_FIELDS
from megapack.core.rows import grid_tensor, merge_rows

PLAIN_KEYS = frozenset({*GRID_NAMES, "attention_mask", "dataset_id"})
PACKED_KEYS = PLAIN_KEYS | {"cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size"}
IGNORED_KEYS = frozenset({"cu_seqlens_argmin"})
"""Accepted and dropped: NeMo's index of each row's first cu_seqlens sentinel, redundant with it."""


class BatchForm(enum.IntEnum):
    """Whether a batch is packed or plain (its code travels in the frame's header)."""

    PACKED = 0  # THD [1, T] with cu_seqlens
    PLAIN = 1  # Megatron pretraining [b, s], attention_mask optional


@dataclass(frozen=True, slots=True)
class Batch:
    """One checked micro-batch: its form and a value (tensor, Python int or None) per schema field."""

    form: BatchForm
    values: dict[str, Any]


def to_batch(item: Any, schema: Schema, *, packed: bool | None = None) -> Batch:
    """The `Batch` of one item from the data iterator, every field checked against ``schema``.

    Args:
        item: a `PackedBatch` or a Megatron dict (see the module docstring).
        schema: the built-in fields and the trainer's declared ones (`schema_of`).
        packed: True/False when the job's batches must all be packed/plain (else either).

    Raises:
        TypeError: not a PackedBatch or a dict, or a field of the wrong type or dtype.
        ValueError: an undeclared or missing key (named), a dense attention_mask on a packed
            dict, or a field whose shape or values break the contract, naming field, row, value.
    """
    if isinstance(item, PackedBatch):
        batch = _from_packed_batch(item, schema)
    elif isinstance(item, Mapping):
        batch = _from_dict(item, schema)
    else:
        raise TypeError(
            f"data_iterator yielded {type(item).__name__}; expected a megapack.PackedBatch or a dict "
            "of tensors (Megatron SFT-style with cu_seqlens, or a plain pretraining batch)"
        )
    if packed is not None and (batch.form == BatchForm.PACKED) != packed:
        raise ValueError(
            f"get_batch_on_this_tp_rank(packed={packed}) but the batch "
            + ("has cu_seqlens" if batch.form == BatchForm.PACKED else "has no cu_seqlens")
            + ": pass packed= matching the data (Megatron: --sft or inter-document masking)"
        )
    return batch


def _from_packed_batch(item: PackedBatch, schema: Schema) -> Batch:
    b = item.validate()
    values: dict[str, Any] = dict.fromkeys(schema.names)
    values |= {name: getattr(b, name) for name in GRID_NAMES}
    values |= {
        "cu_seqlens": b.cu_seqlens,
        "cu_seqlens_padded": b.cu_seqlens_padded,
        "max_seqlen": b.max_seqlen,
    }
    extras = dict(b.extras)
    for field in schema.declared:
        if field.name not in extras and field.name in BUCKET_NAMES:
            continue  # planned by the TP source from the boundaries (megapack.core.buckets)
        if field.name not in extras:
            raise ValueError(
                f"PackedBatch.extras has no {field.name!r}, declared in fields= (extras: "
                f"{sorted(b.extras)})"
            )
        values[field.name] = _declared(
            extras.pop(field.name),
            field,
            (1, b.num_tokens),
            where="PackedBatch.extras",
            samples=None,
        )
    if extras:
        raise ValueError(undeclared_extras(extras, [f.name for f in schema.declared]))
    return Batch(BatchForm.PACKED, values)


def _from_dict(item: Mapping[str, Any], schema: Schema) -> Batch:
    is_packed = item.get("cu_seqlens") is not None
    allowed = PACKED_KEYS if is_packed else PLAIN_KEYS
    declared = {f.name: f for f in schema.declared}
    unknown = sorted(set(item) - allowed - IGNORED_KEYS - set(declared))
    if unknown:
        hint = (
            "; cu_seqlens_padded and local_cp_size need cu_seqlens (a packed batch)"
            if set(unknown) & PACKED_KEYS
            else ""
        )
        known, others = known_fields_hint(unknown, declared)  # megapack's own fields, by name
        fixes = [known] if known else []
        if others:
            fixes.append(
                f"declare a trainer's own field with fields=(megapack.BatchField({others[0]!r}, "
                f"per, dtype, stages), ...) or drop it{hint}"
            )
        raise ValueError(
            f"batch has undeclared keys {unknown}; megapack transfers {sorted(allowed)} and the "
            f"fields= declarations ({sorted(declared) or 'none'}): {'; '.join(fixes)}"
        )
    tokens = grid_tensor(item, "tokens")
    rows, cols = (int(n) for n in tokens.shape)
    values: dict[str, Any] = dict.fromkeys(schema.names)
    values["dataset_id"] = _dataset_id(item.get("dataset_id"), rows)
    for name, field in declared.items():
        if item.get(name) is None and name in BUCKET_NAMES:
            continue  # planned by the TP source from the boundaries (megapack.core.buckets)
        if item.get(name) is None:
            raise ValueError(
                f"batch is missing {name!r}, declared in fields= (got keys {sorted(item)})"
            )
        if field.at == "token":  # only from_documents knows each document's tokens to shift by
            raise ValueError(
                f"batch[{name!r}] is declared at='token' (one value per input token, which "
                "PackedBatch.from_documents shifts to the labels), but a dict's per-token fields "
                "travel as given, beside its labels: declare at='label' with values aligned to "
                "batch['labels'], or build the batch with PackedBatch.from_documents"
            )
        value = _declared(item[name], field, (rows, cols), where="batch", samples=rows)
        values[name] = value.reshape(1, -1) if is_packed and field.per == "token" else value
    if not is_packed:
        for name in GRID_NAMES:
            values[name] = grid_tensor(item, name, (rows, cols))
        values["attention_mask"] = _attention_mask(item.get("attention_mask"), rows, cols)
        return Batch(BatchForm.PLAIN, values)
    if item.get("attention_mask") is not None:
        raise ValueError(
            "batch has both cu_seqlens and a dense attention_mask: packed batches mask by "
            "document from cu_seqlens, so the mask would be dropped; turn off "
            "create_attention_mask_in_dataloader (--no-create-attention-mask-in-dataloader) "
            "or drop 'attention_mask' from the batch"
        )
    merged = merge_rows(item)
    values |= {
        name: getattr(merged, name)
        for name in (*GRID_NAMES, "cu_seqlens", "cu_seqlens_padded", "max_seqlen")
    }
    values["local_cp_size"] = _local_cp_size(item.get("local_cp_size"))
    return Batch(BatchForm.PACKED, values)


def _declared(
    value: Any, field: BatchField, grid: tuple[int, int], *, where: str, samples: int | None
) -> torch.Tensor:
    """A trainer's declared field checked against its declaration; ragged lists concatenated.

    ``samples``: b, the samples a per-sample field and a ragged list hold (None in a PackedBatch,
    whose samples are the trainer's: one per document from `PackedBatch.from_documents`).
    """
    name = f"{where}[{field.name!r}]"
    if field.per == "ragged" and isinstance(value, list | tuple):
        value = _ragged(value, field, samples, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype != field.dtype:
        raise TypeError(
            f"{name} has dtype {value.dtype} but fields= declares {field.dtype} (values travel "
            f"bit-exact, never converted: pass {field.dtype})"
        )
    if value.dim() > MAX_DIMS:
        raise ValueError(f"{name} has {value.dim()} dimensions; at most {MAX_DIMS} travel")
    if field.per == "token" and tuple(value.shape) != grid:
        raise ValueError(
            f"{name} has shape {tuple(value.shape)} but tokens has {grid}: a per-token field "
            "has the tokens' shape"
        )
    if field.per == "sample" and (value.dim() == 0 or samples not in (None, value.shape[0])):
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}; a per-sample field is [b, ...] with "
            f"b={samples} like tokens' rows"
        )
    if field.per == "ragged" and value.dim() == 0:
        raise ValueError(f"{name} is a scalar; a ragged field is [sum n_i, ...]")
    return value


def _ragged(parts: Any, field: BatchField, samples: int | None, name: str) -> torch.Tensor:
    """b tensors [n_i, ...] (n_i may be 0) as one [sum n_i, ...] tensor, in sample order."""
    if samples is not None and len(parts) != samples:
        raise ValueError(
            f"{name} is a list of {len(parts)} tensors; a ragged field has one per sample "
            f"(b={samples})"
        )
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor) or p.dim() == 0:
            got = type(p).__name__ if not isinstance(p, torch.Tensor) else "a 0-d tensor"
            raise TypeError(f"{name}[{i}] must be a tensor [n_i, ...], got {got}")
        if p.shape[1:] != parts[0].shape[1:]:
            raise ValueError(
                f"{name}[{i}] has trailing dims {tuple(p.shape[1:])} but {name}[0] has "
                f"{tuple(parts[0].shape[1:])}: every sample's [n_i, ...] must agree after n_i"
            )
        if p.dtype != field.dtype:
            raise TypeError(f"{name}[{i}] has dtype {p.dtype} but fields= declares {field.dtype}")
    return torch.cat(list(parts))  # b >= 1 parts (`grid_tensor` refuses a batch of no row)


def _attention_mask(mask: Any, rows: int, cols: int) -> torch.Tensor | None:
    """A plain batch's optional mask, exactly [b, 1, s, s] as Megatron's receivers expect it."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (rows, 1, cols, cols):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"batch['attention_mask'] is {got}; expected a [b, 1, s, s] tensor with b={rows} "
            f"and s={cols}"
        )
    return mask


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
        integer = not (value.dtype.is_floating_point or value.dtype.is_complex)
        if not integer or value.dtype == torch.bool or value.numel() != 1:
            error = ValueError if integer and value.dtype != torch.bool else TypeError
            raise error(
                f"batch['local_cp_size'] must be one integer, got a {value.dtype} tensor of shape "
                f"{tuple(value.shape)}"
            )
        value = int(value.item())
    return check_int("batch['local_cp_size']", value, minimum=1)


def undeclared_extras(keys: Collection[str], declared: Collection[str] = ()) -> str:
    """The error for ``PackedBatch.extras`` keys that no declaration in ``fields=`` names.

    Keys of megapack's own fields (``megapack.LOSS_FIELDS``, ``megapack.BUCKET_FIELDS``) get the
    declaration to pass, to every call that checks a batch (`megapack.get_batch_on_this_tp_rank`,
    `megapack.lockstep_steps`, `megapack.prefetch`); any other key the hint to declare it with
    `BatchField`. ``declared``: the names already in ``fields=``, so that the hint says to add to
    them rather than replace them.

    Example:
        >>> print(undeclared_extras(["loss_documents", "loss_step"]))  # doctest: +NORMALIZE_WHITESPACE
        PackedBatch.extras has undeclared keys ['loss_documents', 'loss_step']: megapack's loss
        fields (which loss_fields=True or with_loss_fields adds): pass fields=megapack.LOSS_FIELDS
        to get_batch_on_this_tp_rank, lockstep_steps and prefetch alike
    """
    hint, others = known_fields_hint(keys, declared)
    if others:
        which = f"each other key ({others})" if hint else "each"
        hint += ("; " if hint else "") + (
            f"declare {which} with fields=(megapack.BatchField(name, per, dtype, stages), ...) "
            "or drop it"
        )
    return f"PackedBatch.extras has undeclared keys {sorted(keys)}: {hint}"


def known_fields_hint(
    keys: Collection[str], declared: Collection[str] = ()
) -> tuple[str, list[str]]:
    """(how to declare the ``keys`` that megapack's own declarations name, or ""; the other keys).

    Example:
        >>> hint, others = known_fields_hint(["attention_bucket_0", "adv"], declared=["old"])
        >>> hint
        "megapack's attention bucket plan: pass fields=(*megapack.BUCKET_FIELDS, *your_fields) to get_batch_on_this_tp_rank, lockstep_steps and prefetch alike"
        >>> others
        ['adv']
    """
    known = (
        ("megapack.LOSS_FIELDS", LOSS_FIELDS, "megapack's loss fields (which loss_fields=True "
         "or with_loss_fields adds)"),
        ("megapack.BUCKET_FIELDS", BUCKET_FIELDS, "megapack's attention bucket plan"),
    )  # fmt: skip
    found, covered = [], set()
    for name, fields, what in known:
        names = {f.name for f in fields}
        if names & set(keys):
            found.append((name, what))
            covered |= names
    others = sorted(set(keys) - covered)
    if not found:
        return "", others
    if len(found) == 1 and not declared and not others:
        give = f"fields={found[0][0]}"
    else:  # the user's own fields go in the same tuple
        give = "fields=(" + ", ".join(f"*{name}" for name, _ in found)
        give += ", *your_fields)" if declared or others else ")"
    what = " and ".join(what for _, what in found)
    return (
        f"{what}: pass {give} to get_batch_on_this_tp_rank, lockstep_steps and prefetch alike",
        others,
    )
