"""A local link's frame: the header, then every field the stage gets in full, in one host buffer.

A local link (`megapack.local_link`) moves bytes with a memcpy, so the per-token fields travel as
they are: no lean forms to encode or rebuild (`megapack.codec`), header ``codec`` 0. The frame is
laid out (`plan_frame`, `write_frame`) with one copy of each field,

    [ header (HEADER_BYTES) | field | pad to 8 | field | pad to 8 | ... ]    fields in FIELDS order

into a fresh array, or a large frame straight into the link's shared memory
(`LocalLink.open_frame`, of which the source then keeps a copy). The source's own outputs are
views of its frame (`megapack.wire.full_outputs`), the bytes its peers decode: every rank's
tensors come from the same bytes and none aliases the data iterator's batch.

A peer spends the time it waits for the source on the next frame's buffer (`prepare`): a fresh
array as large as the last frame plus slack, with the grid fields' tensors already viewing it
where a frame laid out like the last one puts them (grid fields come first, so their places
depend only on which of them travel and on [rows, cols]). When the frame arrives into it laid
out so (`frame_outputs` checks), only the boundaries' views and the dict remain to build.

Example: a 4,096-token PackedBatch with 11 documents for the only stage is 192 + 114,784 bytes:
tokens, position_ids, labels (int64), loss_mask (float32), cu_seqlens (12 x int32, padded to 8).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megapack.codec import Share
from megapack.header import HEADER_BYTES, HEADER_STRUCT, Header, Status
from megapack.inputs import Layout, Scalars
from megapack.local_link import LocalLink
from megapack.topology import Stage
from megapack.wire import (
    FIELD_BITS,
    FIELDS,
    GRID_BITS,
    NUMPY_DTYPES,
    OUTPUT_KEYS,
    decode,
    full_outputs,
)

SLACK_BYTES = 4096
"""Room a prepared buffer keeps beyond the last frame (512 more boundaries, say)."""
_ZERO_PAD = bytes(8)
_STAGE_FIELDS = {
    stage: tuple((FIELD_BITS[f.name], f.name, f.dtype) for f in FIELDS if stage in f.stages)
    for stage in Stage
}  # (bit, name, wire dtype) of each field a stage gets, in frame order


def plan_frame(
    layout: Layout,
    tensors: Mapping[str, torch.Tensor | None],
    scalars: Scalars,
    stage: Stage,
    share: Share,
) -> tuple[Header, list[np.ndarray]]:
    """The frame's header and the arrays its payload holds, in order (`write_frame` lays them out
    in a buffer of HEADER_BYTES + ``header.nbytes`` bytes: a fresh array, or a local link's shared
    memory). The payload decodes (`megapack.wire.decode`) to exactly what
    `megapack.wire.encode_fields` with ``lean=False`` would give."""
    arrays: list[np.ndarray] = []
    field_mask = 0
    for bit, name, dtype in _STAGE_FIELDS[stage]:
        if (t := tensors.get(name)) is not None:
            t = t if t.dtype == dtype else t.to(dtype)
            arrays.append((t if t.is_cpu else t.cpu()).numpy())
            field_mask |= bit
    rows, cols = _grid_shape(tensors)
    mask = tensors.get("attention_mask")
    header = Header(
        status=Status.OK,
        stage=stage,
        layout=layout,
        rows=rows,
        cols=cols,
        n_cu=_numel(tensors.get("cu_seqlens")),
        n_cu_padded=_numel(tensors.get("cu_seqlens_padded")),
        max_seqlen=-1 if scalars.max_seqlen is None else scalars.max_seqlen,
        field_mask=field_mask,
        nbytes=sum(a.nbytes + (-a.nbytes % 8) for a in arrays),
        mask_shape=(0, 0, 0, 0) if mask is None else tuple(mask.shape),  # type: ignore[arg-type]
        samples=_numel(tensors.get("dataset_id")),
        local_cp_size=-1 if scalars.local_cp_size is None else scalars.local_cp_size,
        cp_layout=share.layout_code,
    )
    return header, arrays


def write_frame(header: Header, arrays: list[np.ndarray], frame: np.ndarray) -> None:
    """Lay ``header`` and `plan_frame`'s ``arrays`` out in ``frame`` (HEADER_BYTES + nbytes, uint8)."""
    out = frame.data  # byte copies through memoryviews: one memcpy each, no numpy machinery
    HEADER_STRUCT.pack_into(out, 0, *header.values())
    offset = HEADER_BYTES
    for a in arrays:
        n = a.nbytes
        if n:
            out[offset : offset + n] = (a if a.flags.c_contiguous else a.copy()).data.cast("B")
        offset += n
        if pad := -n % 8:
            out[offset : offset + pad] = _ZERO_PAD[:pad]
            offset += pad


@dataclass(frozen=True, eq=False, slots=True)
class Prepared:
    """A peer's buffer for the next frame, and the grid fields' tensors viewing it."""

    buffer: np.ndarray
    outputs: dict[str, Any]
    """The call's outputs to be: every `megapack.wire.OUTPUT_KEYS` key, the grid fields filled
    with tensors viewing ``buffer``, the rest None."""
    grid_bytes: int
    """Payload bytes the viewed grid fields take (the payload's first)."""
    key: tuple[int, int, int]
    """(grid field bits, rows, cols) of the frame the views assume."""


def prepare(last: Header | None) -> Prepared | None:
    """The buffer and grid views for a frame laid out like ``last`` (None: nothing to go by)."""
    if last is None or last.status != Status.OK or last.codec != 0:
        return None
    buffer = np.empty(HEADER_BYTES + last.nbytes + SLACK_BYTES, dtype=np.uint8)
    outputs: dict[str, Any] = dict.fromkeys(OUTPUT_KEYS)
    offset = HEADER_BYTES
    for i, f in enumerate(FIELDS):
        if f.shape == "grid" and last.field_mask >> i & 1:
            size = last.rows * last.cols * f.dtype.itemsize
            view: np.ndarray = buffer[offset : offset + size].view(NUMPY_DTYPES[f.dtype])
            outputs[f.name] = torch.from_numpy(view.reshape(last.rows, last.cols))
            offset += size + (-size % 8)
    return Prepared(buffer, outputs, offset - HEADER_BYTES, _grid_key(last))


def frame_outputs(
    header: Header,
    body: np.ndarray,
    prepared: Prepared | None,
    *,
    cp_group: dist.ProcessGroup | None,
    cp_size: int,
    cp_rank: int,
) -> dict[str, Any]:
    """A peer's outputs from a frame's ``body`` (header bytes included), using ``prepared``'s
    views when the body landed in its buffer laid out as they assume."""
    payload = body[HEADER_BYTES:]
    if header.codec != 0:  # lean forms: the general decoder
        payload_t = torch.from_numpy(payload)
        return decode(header, payload_t, cp_group=cp_group, cp_size=cp_size, cp_rank=cp_rank)
    if prepared is not None and body.base is prepared.buffer and _grid_key(header) == prepared.key:
        return full_outputs(header, payload, cp_group=cp_group, ready=prepared.outputs,
                            ready_bytes=prepared.grid_bytes)  # fmt: skip
    return full_outputs(header, payload, cp_group=cp_group)


def _grid_key(header: Header) -> tuple[int, int, int]:
    return header.field_mask & GRID_BITS, header.rows, header.cols


def send_link_frame(
    link: LocalLink,
    header: Header,
    arrays: list[np.ndarray],
    *,
    what: str,
    timeout: float | None,
) -> np.ndarray:
    """Source: lay the frame out where ``link`` sends it from (its shared memory when large: no
    copy on the way to the peers), send it, and return the source's own copy. A failure while
    laying it out reaches the peers as the source's error (they are waiting for this frame)."""
    frame, shared = link.open_frame(HEADER_BYTES + header.nbytes, what=what, timeout=timeout)
    try:
        write_frame(header, arrays, frame)
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}".encode()
        failed = Header(status=Status.ERROR, stage=header.stage, nbytes=len(message))
        link.send([failed.to_bytes(), message], what=what, timeout=timeout)
        raise
    link.send_frame(frame, what=what, timeout=timeout)
    return frame.copy() if shared else frame  # the shared memory takes the next frame


def _grid_shape(tensors: Mapping[str, torch.Tensor | None]) -> tuple[int, int]:
    """(rows, cols) every grid field shares; (0, 0) when the batch has none."""
    for f in FIELDS:
        if f.shape == "grid" and (t := tensors.get(f.name)) is not None:
            rows, cols = t.shape
            return int(rows), int(cols)
    return 0, 0


def _numel(t: torch.Tensor | None) -> int:
    return 0 if t is None else int(t.numel())
