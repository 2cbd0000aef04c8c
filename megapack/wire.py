"""The wire format of a micro-batch: which stage gets which field, the header, and the payload bytes.

One table, `FIELDS`, says which pipeline stage receives which tensor; the sender (`encode`) and
the receivers (`decode`) both derive everything from it, so adding a field is one edit. Megatron's
``get_batch_on_this_tp_rank`` spells out sender and receiver by hand for each stage case, which
is how middle stages ended up with no ``cu_seqlens`` at all (Megatron-LM #4092, Megatron-Bridge #2952).

A message is a fixed 24 x int64 `Header` (`megapack.header`: status, stage, layout, shapes, ``max_seqlen``,
``local_cp_size``, a bitmask of the fields present, payload bytes, the lean-form flags) and a flat
uint8 payload of `pieces`, each 8-byte aligned: the stage's per-token fields in their lean forms
(`megapack.codec`: int32 tokens, labels as a shift plus exceptions, loss mask rebuilt or as bits, positions
rebuilt from the boundaries) and the other fields as they are. `decode` gives every TP rank, the
source included, identical values, shapes, dtypes and None-ness. Metadata is O(documents).

What a data iterator may yield is validated into named fields by `megapack.inputs.normalize`; with
context parallelism `megapack.cp_share` cuts them to a CP rank's share before `encode_fields`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megapack.batch import CU_DTYPE, MASK_DTYPE, TOKEN_DTYPE, make_packed_seq_params
from megapack.codec import Share, as_dtype, compact, expand, grid_pieces
from megapack.cp import CP_LAYOUTS
from megapack.header import (
    Header,
    Status,
)
from megapack.inputs import Layout, Scalars, normalize
from megapack.topology import Stage

ALL_STAGES = frozenset(Stage)
FIRST = frozenset({Stage.ONLY, Stage.FIRST, Stage.MTP})  # the embedding (MTP layers embed too)
LAST = frozenset({Stage.ONLY, Stage.LAST, Stage.MTP})  # the loss


@dataclass(frozen=True, slots=True)
class Field:
    """One tensor of a batch on the wire: its name, wire dtype, the stages that get it, its shape kind."""

    name: str
    dtype: torch.dtype
    stages: frozenset[Stage]
    shape: str
    """"grid" ([rows, cols]), "cu" / "cu_padded" (1-D, length in the header), "mask" (4-D, header),
    "samples" (1-D, one entry per sample of the micro-batch, count in the header)."""
    cp_dim: int | None = None
    """Token dimension a context-parallel rank keeps its share of (`megapack.cp_share`); None: the
    field stays whole on every CP rank (boundaries describe the whole row)."""


# The one table: which pipeline stage receives which tensor. Sender and receivers both read it.
FIELDS: tuple[Field, ...] = (
    Field("tokens", TOKEN_DTYPE, FIRST, "grid", cp_dim=1),
    Field("position_ids", TOKEN_DTYPE, FIRST, "grid", cp_dim=1),
    Field("labels", TOKEN_DTYPE, LAST, "grid", cp_dim=1),
    Field("loss_mask", MASK_DTYPE, LAST, "grid", cp_dim=1),
    Field("attention_mask", torch.bool, ALL_STAGES, "mask", cp_dim=2),  # [b, 1, s_q, s_kv]: queries
    Field("cu_seqlens", CU_DTYPE, ALL_STAGES, "cu"),
    Field("cu_seqlens_padded", CU_DTYPE, ALL_STAGES, "cu_padded"),
    # BlendedDataset's source of each sample, [b]:
    Field("dataset_id", TOKEN_DTYPE, ALL_STAGES, "samples"),
)
FIELD_BITS = {f.name: 1 << i for i, f in enumerate(FIELDS)}
"""A field's bit in `Header.field_mask`."""


def travels(field: Field, stage: Stage) -> bool:
    """Whether ``field`` goes on the wire for ``stage``: where it is returned, and the tokens
    also where the labels are (the base the labels are rebuilt from, `megapack.codec`)."""
    return stage in field.stages or (field.name == "tokens" and stage in LAST)


SCALAR_KEYS = ("max_seqlen", "local_cp_size")
"""Python ints every stage gets from the header (None when the batch has none)."""
OUTPUT_KEYS = (*(f.name for f in FIELDS), *SCALAR_KEYS, "packed_seq_params")


def encode(item: Any, stage: Stage, device: torch.device) -> tuple[Header, torch.Tensor]:
    """Validate one batch from the data iterator and lay out what ``stage`` needs as one uint8 payload."""
    header, chunks = encode_chunks(item, stage, device)
    return header, join(chunks, device)


def encode_chunks(
    item: Any, stage: Stage, device: torch.device
) -> tuple[Header, list[torch.Tensor]]:
    """Like `encode`, but the payload as its 8-byte aligned pieces, so a caller can frame it without a copy."""
    return encode_fields(*normalize(item), stage, device)


def encode_fields(
    layout: Layout,
    tensors: Mapping[str, torch.Tensor | None],
    scalars: Scalars,
    stage: Stage,
    device: torch.device,
    *,
    share: Share | None = None,
    lean: bool = True,
) -> tuple[Header, list[torch.Tensor]]:
    """Lay out already normalized fields (`normalize`, then maybe `megapack.cp_share`) for ``stage``.

    Grid fields travel in their lean forms (`megapack.codec`; ``lean=False``: in full, as protocol
    v3 did). The pieces are built on the host and joined into one buffer; for a CUDA ``device``
    it is pinned and copied with one asynchronous host-to-device copy. A local link's frame,
    every field in full behind the header, is `megapack.frame`'s.
    """
    share = share if share is not None else Share()
    grid = [t for f in FIELDS if f.shape == "grid" and (t := tensors.get(f.name)) is not None]
    rows, cols = grid[0].shape if grid else (0, 0)  # every grid field has this (rows, cols)
    mask = tensors.get("attention_mask")
    present = frozenset(
        f.name for f in FIELDS if stage in f.stages and tensors.get(f.name) is not None
    )
    flags, exceptions, values = compact(layout, tensors, present, share, enabled=lean)
    fields: dict[str, Any] = {
        "status": Status.OK,
        "stage": stage,
        "layout": layout,
        "rows": int(rows),
        "cols": int(cols),
        "n_cu": _numel(tensors.get("cu_seqlens")),
        "n_cu_padded": _numel(tensors.get("cu_seqlens_padded")),
        "max_seqlen": -1 if scalars.max_seqlen is None else scalars.max_seqlen,
        "field_mask": sum(FIELD_BITS[name] for name in present),
        "mask_shape": (0, 0, 0, 0) if mask is None else tuple(mask.shape),
        "samples": _numel(tensors.get("dataset_id")),
        "local_cp_size": -1 if scalars.local_cp_size is None else scalars.local_cp_size,
        "codec": flags,
        "exceptions": exceptions,
        "cp_layout": share.layout_code,
    }
    parts: list[torch.Tensor] = []
    for name, dtype, _ in pieces(Header(**fields)):
        t = values[name] if name in values else tensors[name]
        assert t is not None  # pieces() lists present fields only
        parts.append(as_dtype(t, dtype))
    if all(t.is_cpu for t in parts):  # the usual case: one host buffer, in place
        payload = _assemble(parts)
        return Header(**fields, nbytes=payload.numel()), _to_device([payload], device)
    chunks, nbytes = [], 0
    for t in parts:
        raw = t.contiguous().view(-1).view(torch.uint8)
        chunks.append(raw)
        nbytes += raw.numel()
        if pad := -nbytes % 8:
            chunks.append(_ZEROS[:pad].to(raw.device))
            nbytes += pad
    return Header(**fields, nbytes=nbytes), _to_device(chunks, device)


def _assemble(parts: list[torch.Tensor]) -> torch.Tensor:
    """Host pieces copied into one uint8 payload, each at an 8-byte aligned offset (zero gaps)."""
    sizes = [t.numel() * t.element_size() for t in parts]
    payload = torch.empty(sum(n + (-n % 8) for n in sizes), dtype=torch.uint8)
    buf = payload.numpy()
    offset = 0
    for t, n in zip(parts, sizes, strict=True):
        if n:
            buf[offset : offset + n] = t.numpy().reshape(-1).view(np.uint8)
        buf[offset + n : offset + n + (-n % 8)] = 0
        offset += n + (-n % 8)
    return payload


NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32,
          torch.uint8: np.uint8, torch.bool: np.bool_}  # fmt: skip
_ZEROS = torch.zeros(8, dtype=torch.uint8)  # alignment padding (read-only)
GRID_BITS = sum(FIELD_BITS[f.name] for f in FIELDS if f.shape == "grid")
"""`Header.field_mask` bits of the grid fields (which come first in a frame)."""
_FULL_LAYOUT = tuple(
    (FIELD_BITS[f.name], f.name, f.shape, f.dtype.itemsize, NUMPY_DTYPES[f.dtype]) for f in FIELDS
)  # what `full_outputs` reads per field, looked up once
_REST_LAYOUT = tuple(entry for entry in _FULL_LAYOUT if entry[2] != "grid")  # after the grid


def pieces(header: Header) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Every piece of ``header``'s payload in order: (name, dtype, shape); each 8-byte aligned."""
    present = frozenset(f.name for i, f in enumerate(FIELDS) if header.field_mask >> i & 1)
    out = grid_pieces(present, header.codec, header.exceptions, header.rows, header.cols)
    out += [
        (f.name, f.dtype, header.shape_of(f.shape))
        for f in FIELDS
        if f.shape != "grid" and f.name in present
    ]
    return out


def _to_device(chunks: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host pieces to ``device``: one pinned buffer and one non-blocking copy for CUDA."""
    if all(c.device == device for c in chunks):  # the usual CPU case: nothing to move
        return chunks
    if device.type == "cpu":
        return [c.to(device) for c in chunks]
    host = torch.cat([c.cpu() for c in chunks])
    return [host.pin_memory().to(device, non_blocking=True)]


def join(chunks: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Concatenate uint8 pieces (an empty tensor for none)."""
    return torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=device)


def decode(
    header: Header,
    payload: torch.Tensor,
    *,
    cp_group: dist.ProcessGroup | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> dict[str, Any]:
    """The output dict from the payload; identical on the source and its peers.

    ``cp_group`` (the context-parallel group, None without CP) goes into ``packed_seq_params``;
    ``cp_size`` and ``cp_rank`` say which share of the row this rank's grid fields hold.
    """
    if header.codec == 0 and payload.is_cpu:  # every field in full (a local link's frame)
        return full_outputs(header, payload.numpy(), cp_group=cp_group)
    out: dict[str, Any] = dict.fromkeys(OUTPUT_KEYS)
    views: dict[str, torch.Tensor] = {}
    offset = 0
    host = payload.numpy() if payload.is_cpu else None  # numpy views: ~5x cheaper than torch's
    for name, dtype, shape in pieces(header):
        size = math.prod(shape) * dtype.itemsize
        views[name] = (
            torch.from_numpy(host[offset : offset + size].view(NUMPY_DTYPES[dtype]).reshape(shape))
            if host is not None
            else payload[offset : offset + size].view(dtype).view(shape)
        )
        offset += size + (-size % 8)
    present = frozenset(f.name for i, f in enumerate(FIELDS) if header.field_mask >> i & 1)
    for f in FIELDS:
        if f.shape != "grid" and f.name in present:
            out[f.name] = views[f.name]
    share = Share(cp_size, cp_rank, CP_LAYOUTS[header.cp_layout])
    out |= expand(views, present, header.codec, header.layout, out, header.rows, header.cols,
                  share, payload.device)  # fmt: skip
    return _with_scalars(out, header, cp_group)


def full_outputs(
    header: Header,
    host: np.ndarray,
    *,
    cp_group: dist.ProcessGroup | None = None,
    ready: dict[str, Any] | None = None,
    ready_bytes: int = 0,
) -> dict[str, Any]:
    """`decode`'s output for a ``codec`` 0 payload (every field in full, pieces in FIELDS order)
    held in the uint8 array ``host``: views of it. ``ready`` is an outputs dict to fill in and
    return (every OUTPUT_KEYS key) that already holds the frame's grid fields, viewed at their
    places in the first ``ready_bytes`` of ``host`` (`megapack.frame.prepare`); the caller vouches
    for their offsets and shapes.
    """
    if ready is None:
        out, layout, offset = dict.fromkeys(OUTPUT_KEYS), _FULL_LAYOUT, 0
    else:
        out, layout, offset = ready, _REST_LAYOUT, ready_bytes
    present = header.field_mask
    for bit, name, kind, itemsize, dtype in layout:
        if present & bit:
            shape = (header.rows, header.cols) if kind == "grid" else header.shape_of(kind)
            size = math.prod(shape) * itemsize
            out[name] = torch.from_numpy(host[offset : offset + size].view(dtype).reshape(shape))
            offset += size + (-size % 8)
    return _with_scalars(out, header, cp_group)


def source_outputs(
    header: Header,
    tensors: Mapping[str, torch.Tensor | None],
    *,
    cp_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """`decode`'s output on the source, from the host fields it encoded ``header``'s payload from.

    Every lean form is exact (`megapack.codec`; property-tested against the full encoding), so this
    equals ``decode(header, payload)`` bit for bit without rebuilding anything: each field the stage
    returns, in its wire dtype, copied (contiguous) so the output never aliases the data iterator's
    batch. For CPU transfers; a device transfer decodes its device payload.
    """
    out: dict[str, Any] = dict.fromkeys(OUTPUT_KEYS)
    for i, f in enumerate(FIELDS):
        if header.field_mask >> i & 1 and (t := tensors.get(f.name)) is not None:
            out[f.name] = (
                t.clone(memory_format=torch.contiguous_format)
                if t.dtype == f.dtype
                else t.to(f.dtype, memory_format=torch.contiguous_format)
            )
    return _with_scalars(out, header, cp_group)


def _with_scalars(
    out: dict[str, Any], header: Header, cp_group: dist.ProcessGroup | None
) -> dict[str, Any]:
    """``out`` with the header's Python ints and, for packed batches, its PackedSeqParams."""
    if header.layout == Layout.PACKED:
        out["max_seqlen"] = header.max_seqlen
        out["local_cp_size"] = None if header.local_cp_size < 0 else header.local_cp_size
        out["packed_seq_params"] = make_packed_seq_params(
            out["cu_seqlens"],
            out["cu_seqlens_padded"],
            header.max_seqlen,
            cp_group=cp_group,
            local_cp_size=out["local_cp_size"],
        )
    return out


def _numel(t: torch.Tensor | None) -> int:
    return 0 if t is None else int(t.numel())
