"""The fixed-size header every micro-batch message starts with (`megapack.wire` lays out the rest).

24 native int64 slots: magic (protocol version), status, stage, layout, the shapes receivers
allocate from, ``max_seqlen``, ``local_cp_size``, a bitmask of the fields present, the payload's
bytes and the lean-form flags. Receivers read it without a device-to-host copy where it arrives
on the host (`Header.from_bytes`); parsing runs on every call, so enum values are looked up in
tables, not through ``Enum.__call__``.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

import torch

from megapack.errors import ProtocolError
from megapack.inputs import Layout
from megapack.topology import Stage

MAGIC = 0x4D50_0004  # "MP" + protocol version 4 (lean grid fields: `megapack.codec`)
HEADER_LEN = 24
HEADER_BYTES = HEADER_LEN * 8
HEADER_STRUCT = struct.Struct(f"={HEADER_LEN}q")  # native, as the int64 tensor it travels in
STAGE_CODES = {stage: i for i, stage in enumerate(Stage)}
_STAGES = tuple(Stage)


class Status(enum.IntEnum):
    OK = 0
    STOP = 1
    ERROR = 2


_STATUSES = {int(s): s for s in Status}  # enum lookups by value without Enum.__call__
_LAYOUTS = {int(x): x for x in Layout}


@dataclass(frozen=True, kw_only=True, slots=True)
class Header:
    """The fixed-size message that precedes every payload. Slots 20-23 are reserved (zero)."""

    status: Status
    stage: Stage
    layout: Layout = Layout.PACKED
    rows: int = 0
    cols: int = 0
    n_cu: int = 0
    n_cu_padded: int = 0
    max_seqlen: int = -1
    field_mask: int = 0
    nbytes: int = 0
    mask_shape: tuple[int, int, int, int] = (0, 0, 0, 0)
    samples: int = 0
    local_cp_size: int = -1
    codec: int = 0
    """`megapack.codec.Lean` flags: which lean forms the grid fields travel in."""
    exceptions: int = 0
    """Positions where the labels are not the shifted tokens (with ``Lean.LABELS_SHIFTED``)."""
    cp_layout: int = 0
    """Index in `megapack.cp.CP_LAYOUTS` of the source's CP layout (receivers rebuild positions)."""

    def to_bytes(self) -> bytes:
        """The header's HEADER_BYTES bytes (24 native int64, as `to_tensor` holds them)."""
        return HEADER_STRUCT.pack(*self.values())

    def values(self) -> tuple[int, ...]:
        """The header's HEADER_LEN int64 slots, in wire order."""
        return (
            MAGIC, self.status, STAGE_CODES[self.stage], self.layout, self.rows, self.cols,
            self.n_cu, self.n_cu_padded, self.max_seqlen, self.field_mask, self.nbytes,
            *self.mask_shape, self.samples, self.local_cp_size, self.codec, self.exceptions,
            self.cp_layout, 0, 0, 0, 0,
        )  # fmt: skip

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        host = torch.frombuffer(bytearray(self.to_bytes()), dtype=torch.int64)
        return host if device.type == "cpu" else host.to(device)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Header:
        if tensor.is_cpu:  # no device-to-host copy: read the bytes
            return cls.from_bytes(tensor.contiguous().view(torch.uint8).numpy().data)
        return cls._from_values(tensor.tolist())  # the one device-to-host sync of a receiver

    @classmethod
    def from_bytes(cls, raw: Any) -> Header:
        """The header in the first HEADER_BYTES of ``raw`` (a bytes-like object)."""
        if (size := memoryview(raw).nbytes) < HEADER_BYTES:
            raise ProtocolError(
                f"megapack header has {size} bytes, not {HEADER_BYTES}: TP ranks are out of step "
                "(every TP rank must call get_batch_on_this_tp_rank once per micro-step)"
            )
        return cls._from_values(HEADER_STRUCT.unpack_from(raw))

    @classmethod
    def _from_values(cls, v: Any) -> Header:
        if v[0] != MAGIC:
            raise ProtocolError(
                f"megapack header magic {v[0]:#x} != {MAGIC:#x}: TP ranks are out of step (every TP rank "
                "must call get_batch_on_this_tp_rank once per micro-step) or run different megapack versions"
            )
        status = _STATUSES[v[1]] if v[1] in _STATUSES else Status(v[1])  # ValueError if unknown
        layout = _LAYOUTS[v[3]] if v[3] in _LAYOUTS else Layout(v[3])
        return cls(
            status=status, stage=_STAGES[v[2]], layout=layout, rows=v[4], cols=v[5], n_cu=v[6],
            n_cu_padded=v[7], max_seqlen=v[8], field_mask=v[9], nbytes=v[10],
            mask_shape=(v[11], v[12], v[13], v[14]), samples=v[15], local_cp_size=v[16],
            codec=v[17], exceptions=v[18], cp_layout=v[19],
        )  # fmt: skip

    def shape_of(self, kind: str) -> tuple[int, ...]:
        """The shape of a field of shape kind ``kind`` (`megapack.wire.Field.shape`) in this message."""
        if kind == "grid":
            return (self.rows, self.cols)
        if kind == "cu":
            return (self.n_cu,)
        if kind == "cu_padded":
            return (self.n_cu_padded,)
        return self.mask_shape if kind == "mask" else (self.samples,)
