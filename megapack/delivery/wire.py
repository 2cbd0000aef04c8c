"""The frame a TP source sends its peers: a header of int64 slots, then the stage's fields in full.

    header   [magic, status, stage, form (packed or plain), schema key, payload bytes,
              then per schema field: ndim (-1 absent), dims... (a scalar: 0, its value)]
    payload  every tensor field the stage gets (`Schema.by_stage`), in schema order, in its
             declared dtype, each piece at an 8-byte aligned offset

The header's size follows from the schema (6 + 7 slots a field), which every rank of the group
shares, so a peer knows how much to read before it knows the batch; the payload's size is in the
header. Fields travel as the tensors the model uses: a peer's outputs are views of its payload,
on the host or the device, with no decode kernels (nothing to synchronize) and no copy.
The source's outputs are views of its own payload, a copy of the iterator's batch: no returned
tensor aliases what the data iterator yielded.

Worked example: a 4,096-token packed row of 11 documents for the only stage is a 608-byte header
(10 built-in fields) and 114,736 payload bytes: tokens, position_ids, labels (int64), loss_mask
(float32), cu_seqlens (12 x int32, padded to 8).
"""

from __future__ import annotations

import enum
import functools
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megapack.core.buckets import BUCKET_NAMES
from megapack.core.errors import ProtocolError
from megapack.core.fields import MAX_DIMS, Schema, Stage
from megapack.core.intake import Batch, BatchForm
from megapack.core.seq_params import make_packed_seq_params

MAGIC = 0x4D50_0005  # "MP" + protocol version 5 (fields in full, declared by a schema)
FIXED_SLOTS = 6
SLOTS_PER_FIELD = 1 + MAX_DIMS
STAGE_CODES = {stage: i for i, stage in enumerate(Stage)}
_STAGES = tuple(Stage)
_NUMPY = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.bool: np.bool_,
}
_ZERO_PAD = bytes(8)
_ABSENT = (-1, 0, 0, 0, 0, 0, 0)
_ZEROS = (0,) * MAX_DIMS


@functools.cache
def _struct(slots: int) -> struct.Struct:
    return struct.Struct(f"={slots}q")


class Status(enum.IntEnum):
    OK = 0
    STOP = 1
    ERROR = 2


_STATUSES = {int(s): s for s in Status}
_FORMS = {int(x): x for x in BatchForm}


def header_bytes(schema: Schema) -> int:
    """Bytes of a header for ``schema``: 8 x (6 + 7 x fields); 608 for the built-in fields."""
    return 8 * (FIXED_SLOTS + SLOTS_PER_FIELD * len(schema.fields))


@dataclass(frozen=True, kw_only=True, slots=True)
class Header:
    """What precedes a payload: status, stage, the batch's form, the schema's key, the payload's size, and
    each field's dims (None: absent) or, for a scalar field, its value (an int)."""

    status: Status
    stage: Stage
    form: BatchForm = BatchForm.PACKED
    key: int = 0
    nbytes: int = 0
    dims: tuple[tuple[int, ...] | int | None, ...] = ()

    def to_bytes(self) -> bytes:
        """The header as native int64 slots, one record per schema field (`header_bytes`)."""
        slots = [MAGIC, self.status, STAGE_CODES[self.stage], self.form, self.key, self.nbytes]
        for d in self.dims:
            if d is None:
                slots += _ABSENT
            elif isinstance(d, int):  # a scalar: ndim 0, then its value
                slots += (0, d, 0, 0, 0, 0, 0)
            else:
                slots += (len(d), *d, *_ZEROS[: MAX_DIMS - len(d)])
        return _struct(len(slots)).pack(*slots)

    @classmethod
    def from_bytes(cls, raw: Any) -> Header:
        """The header filling the bytes-like ``raw`` (its size says how many fields)."""
        size = memoryview(raw).nbytes
        fields, rest = divmod(size // 8 - FIXED_SLOTS, SLOTS_PER_FIELD)
        if size % 8 or fields < 0 or rest:
            raise ProtocolError(
                f"megapack header of {size} bytes fits no schema: TP ranks are out of step "
                "(every TP rank must call get_batch_on_this_tp_rank once per micro-step)"
            )
        v = _struct(size // 8).unpack(raw)
        if v[0] != MAGIC:
            raise ProtocolError(
                f"megapack header magic {v[0]:#x} != {MAGIC:#x}: TP ranks are out of step (every "
                "TP rank must call get_batch_on_this_tp_rank once per micro-step) or run "
                "different megapack versions"
            )
        if v[1] not in _STATUSES or v[3] not in _FORMS or not 0 <= v[2] < len(_STAGES):
            raise ProtocolError(f"megapack header has status {v[1]}, stage {v[2]}, form {v[3]}")
        dims: list[tuple[int, ...] | int | None] = []
        for i in range(fields):
            base = FIXED_SLOTS + SLOTS_PER_FIELD * i
            n = v[base]
            dims.append(None if n < 0 else v[base + 1] if n == 0 else v[base + 1 : base + 1 + n])
        return cls(
            status=_STATUSES[v[1]],
            stage=_STAGES[v[2]],
            form=_FORMS[v[3]],
            key=v[4],
            nbytes=v[5],
            dims=tuple(dims),
        )


def signal(status: Status, stage: Stage, schema: Schema, nbytes: int = 0) -> Header:
    """A header with no fields: a clean stop, or an error whose message (``nbytes``) follows."""
    return Header(
        status=status, stage=stage, key=schema.key, nbytes=nbytes, dims=(None,) * len(schema.fields)
    )


def encode(batch: Batch, schema: Schema, stage: Stage) -> tuple[Header, list[torch.Tensor]]:
    """The header of ``batch`` (already this stage's CP share) for ``stage``, and the payload's
    pieces: the stage's tensor fields in schema order, in their declared dtypes.

    The transport lays the pieces out (`write_payload`, `payload_of`) where it sends them from,
    so a large frame is copied once on the way out (into a local link's shared memory).
    """
    values = batch.values
    dims: list[tuple[int, ...] | int | None] = []
    pieces: list[torch.Tensor] = []
    nbytes = 0
    for name, kind, dtype in _plan(schema, stage):
        value = values.get(name) if kind else None
        if value is None:
            dims.append(None)
        elif kind == _SCALAR:
            dims.append(int(value))
        else:
            t = value if value.dtype == dtype else value.to(dtype)
            dims.append(tuple(t.shape))
            pieces.append(t)
            n = t.numel() * t.element_size()
            nbytes += n + (-n % 8)
    header = Header(
        status=Status.OK,
        stage=stage,
        form=batch.form,
        key=schema.key,
        nbytes=nbytes,
        dims=tuple(dims),
    )
    return header, pieces


_SCALAR, _TENSOR = 1, 2


@functools.cache
def _plan(schema: Schema, stage: Stage) -> tuple[tuple[str, int, torch.dtype], ...]:
    """(name, 0 not for this stage / scalar / tensor, dtype) of every schema field, looked up once."""
    names = {f.name for f in schema.by_stage[stage]}
    return tuple(
        (f.name, 0 if f.name not in names else _TENSOR if f.is_tensor else _SCALAR, f.dtype)
        for f in schema.fields
    )


def _numpy_views(payload: torch.Tensor) -> bool:
    """Whether `decode` views a payload through numpy: a host payload, several times cheaper than
    torch's views (tests patch it to run the device path, views with no host read, on CPU)."""
    return payload.is_cpu


@functools.cache
def _views(schema: Schema) -> tuple[tuple[str, torch.dtype, int, Any], ...]:
    """(name, dtype, item bytes, numpy dtype or None) of every schema field, looked up once."""
    return tuple((f.name, f.dtype, f.dtype.itemsize, _NUMPY.get(f.dtype)) for f in schema.fields)


def write_payload(pieces: list[torch.Tensor], out: memoryview) -> None:
    """Lay host ``pieces`` out in ``out`` back to back, each at an 8-byte aligned offset (zero
    gaps): one memcpy a piece."""
    offset = 0
    for t in pieces:
        b = _bytes_of(t)
        n = len(b)
        out[offset : offset + n] = b
        offset += n
        if pad := min(-n % 8, len(out) - offset):  # (an error's message has no padding)
            out[offset : offset + pad] = _ZERO_PAD[:pad]
            offset += pad


def payload_of(pieces: list[torch.Tensor], nbytes: int, device: torch.device) -> torch.Tensor:
    """The payload of ``nbytes`` as one new uint8 buffer on ``device``: laid out on the host when
    the pieces are host tensors (then, for a CUDA ``device``, one pinned asynchronous copy), else
    concatenated on the device."""
    if all(t.is_cpu for t in pieces):
        host = torch.empty(nbytes, dtype=torch.uint8)
        write_payload(pieces, host.numpy().data)
        return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)
    chunks = []  # not empty: no pieces at all is the host path above
    for t in pieces:
        raw = t.to(device, non_blocking=True).contiguous().view(-1).view(torch.uint8)
        chunks.append(raw)
        if pad := -raw.numel() % 8:
            chunks.append(torch.zeros(pad, dtype=torch.uint8, device=device))
    return torch.cat(chunks)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A host tensor's bytes (made contiguous first when strided)."""
    if t.dtype in _NUMPY:
        a = t.numpy()
        return (a if a.flags.c_contiguous else np.ascontiguousarray(a)).data.cast("B")
    return t.contiguous().view(-1).view(torch.uint8).numpy().data


def decode(
    header: Header, payload: torch.Tensor, schema: Schema, *, cp_group: Any = None
) -> dict[str, Any]:
    """Every output key of ``schema``: views of ``payload`` where the header has the field, else
    None; the scalars as Python ints; for a packed batch, megatron-core's PackedSeqParams."""
    out: dict[str, Any] = dict.fromkeys(schema.output_keys)
    host = payload.numpy() if _numpy_views(payload) else None
    offset = 0
    for (name, dtype, itemsize, np_dtype), dims in zip(_views(schema), header.dims, strict=True):
        if dims is None:
            continue
        if isinstance(dims, int):  # a scalar field
            out[name] = dims
            continue
        size = math.prod(dims) * itemsize
        if host is not None and np_dtype is not None:
            out[name] = torch.from_numpy(host[offset : offset + size].view(np_dtype).reshape(dims))
        else:
            out[name] = payload[offset : offset + size].view(dtype).view(dims)
        offset += size + (-size % 8)
    if header.form == BatchForm.PACKED:
        buckets = None
        if BUCKET_NAMES[0] in out:  # declared: the plan travels to the attention on the params
            buckets = tuple(out[n] for n in BUCKET_NAMES if out[n] is not None)
        out["packed_seq_params"] = make_packed_seq_params(
            out["cu_seqlens"],
            out["cu_seqlens_padded"],
            out["max_seqlen"],
            cp_group=cp_group,
            local_cp_size=out["local_cp_size"],
            buckets=buckets,
        )
    return out
