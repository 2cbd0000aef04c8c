"""A local link's frame (megapack.frame): the same bytes as the full encoding, and a peer's
prepared buffer used only when the frame is laid out as it assumes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.batch import PackedBatch
from megapack.codec import Share
from megapack.frame import Prepared, frame_outputs, plan_frame, prepare, write_frame
from megapack.header import HEADER_BYTES, Header, Status
from megapack.topology import Stage
from megapack.wire import decode, encode_fields, join, normalize
from tests.unit.test_codec import _same, batches, shares

CPU = torch.device("cpu")


def encode_frame(*normalized: Any) -> tuple[Header, np.ndarray]:
    """(header, frame) in a fresh array, as the source builds a frame too small for shared memory."""
    header, arrays = plan_frame(*normalized)
    frame = np.empty(HEADER_BYTES + header.nbytes, dtype=np.uint8)
    write_frame(header, arrays, frame)
    return header, frame


@settings(max_examples=40, deadline=None)
@given(case=batches(), cp=st.sampled_from([1, 2]), cp_layout=st.sampled_from(["document", "row"]))
def test_frame_is_the_header_and_the_full_payload(
    case: tuple[Any, str], cp: int, cp_layout: str
) -> None:
    item, _ = case
    layout, tensors, scalars = normalize(item)
    for cp_rank, stage, share_t, share in shares(layout, tensors, cp, cp_layout):
        header, frame = encode_frame(layout, share_t, scalars, stage, share)
        full_h, full_p = encode_fields(
            layout, share_t, scalars, stage, CPU, share=share, lean=False
        )
        where = f"stage {stage.value} cp {cp} rank {cp_rank} {cp_layout}"
        assert header == full_h, where
        assert frame.tobytes() == full_h.to_bytes() + join(full_p, CPU).numpy().tobytes(), where
        got = frame_outputs(
            Header.from_bytes(frame), frame, None, cp_group=None, cp_size=cp, cp_rank=cp_rank
        )
        want = decode(full_h, join(full_p, CPU), cp_size=cp, cp_rank=cp_rank)
        for key in want:
            if key != "packed_seq_params":
                assert _same(got[key], want[key]), f"{where}: {key}"


def _batch(lengths: list[int], seq_len: int, seed: int = 0) -> PackedBatch:
    gen = np.random.default_rng(seed)
    return PackedBatch.from_documents([gen.integers(1, 1000, n) for n in lengths], seq_len=seq_len)


def _frame(batch: PackedBatch, stage: Stage = Stage.ONLY) -> tuple[Header, np.ndarray]:
    layout, tensors, scalars = normalize(batch)
    return encode_frame(layout, tensors, scalars, stage, Share())


def _arrive(frame: np.ndarray, prepared: Prepared | None) -> np.ndarray:
    """What `LocalLink.receive` gives a peer: the body in the prepared buffer when it fits."""
    if prepared is not None and len(prepared.buffer) >= len(frame):
        body = prepared.buffer[: len(frame)]
    else:
        body = np.empty(len(frame), dtype=np.uint8)
    body[:] = frame
    return body


def _outputs(frame: np.ndarray, prepared: Prepared | None) -> dict[str, Any]:
    body = _arrive(frame, prepared)
    return frame_outputs(
        Header.from_bytes(body), body, prepared, cp_group=None, cp_size=1, cp_rank=0
    )


def _expected(batch: PackedBatch) -> dict[str, Any]:
    layout, tensors, scalars = normalize(batch)
    header, payload = encode_fields(layout, tensors, scalars, Stage.ONLY, CPU, lean=False)
    return decode(header, join(payload, CPU))


@pytest.mark.parametrize(
    "nxt, reuses",
    [
        ([100, 50, 106], True),  # same grid, same documents
        ([10, 20, 30, 40, 50, 106], True),  # same grid, more documents: cu_seqlens is viewed anew
        ([200, 56], True),  # fewer documents
        ([100, 100, 100, 100], False),  # [1, 400]: another grid, nothing prepared is used
    ],
)
def test_prepared_views_only_where_the_frame_puts_them(nxt: list[int], reuses: bool) -> None:
    first = _batch([100, 50, 106], 256)
    header, _ = _frame(first)
    prepared = prepare(header)
    assert prepared is not None
    batch = _batch(nxt, sum(nxt), seed=1)
    out = _outputs(_frame(batch)[1], prepared)
    assert (out is prepared.outputs) == reuses
    assert (out["tokens"] is prepared.outputs["tokens"]) == reuses
    for key, want in _expected(batch).items():
        if key != "packed_seq_params":
            assert _same(out[key], want), key
    assert out["packed_seq_params"].cu_seqlens_q is out["cu_seqlens"]


def test_a_frame_larger_than_the_prepared_buffer_lands_in_a_fresh_array() -> None:
    header, _ = _frame(_batch([8, 8], 16))
    prepared = prepare(header)
    assert prepared is not None
    batch = _batch([3] * 3000, 9000)  # same field set, far more bytes than the buffer holds
    out = _outputs(_frame(batch)[1], prepared)
    assert not np.shares_memory(out["tokens"].numpy(), prepared.buffer)
    assert _same(out["cu_seqlens"], batch.cu_seqlens)
    assert _same(out["labels"], batch.labels)


def test_the_last_stage_frame_prepares_its_own_fields() -> None:
    batch = _batch([30, 34], 64)
    header, _ = _frame(batch, Stage.LAST)
    prepared = prepare(header)
    assert prepared is not None and {k for k, v in prepared.outputs.items() if v is not None} == {
        "labels",
        "loss_mask",
    }
    out = _outputs(_frame(_batch([60, 4], 64, seed=3), Stage.LAST)[1], prepared)
    assert out["tokens"] is None and out["labels"] is prepared.outputs["labels"]


@pytest.mark.parametrize(
    "last",
    [
        None,
        Header(status=Status.STOP, stage=Stage.ONLY),
        Header(status=Status.ERROR, stage=Stage.ONLY, nbytes=10),
        Header(status=Status.OK, stage=Stage.ONLY, codec=1, nbytes=64),  # a lean frame
    ],
)
def test_nothing_to_prepare_from(last: Header | None) -> None:
    assert prepare(last) is None


def test_outputs_are_fresh_memory_not_the_iterators_batch() -> None:
    batch = _batch([5, 11], 16)
    header, frame = _frame(batch)
    out = frame_outputs(header, frame, None, cp_group=None, cp_size=1, cp_rank=0)
    for key in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens"):
        assert not np.shares_memory(out[key].numpy(), getattr(batch, key).numpy()), key
        assert np.shares_memory(out[key].numpy(), frame), key


def test_write_frame_lays_out_strided_bool_and_empty_arrays_like_the_full_encoding() -> None:
    """A batch's fields need not be contiguous (a strided view of a larger buffer, say): the frame
    holds their values in order, each padded to 8 bytes, whatever the dtype or size."""
    arrays = [
        np.arange(16, dtype=np.int64).reshape(2, 8)[:, ::2],  # strided
        np.array([[True, False, True]]),
        np.zeros(0, dtype=np.int32),
        np.arange(3, dtype=np.float32),
    ]
    nbytes = sum(a.nbytes + (-a.nbytes % 8) for a in arrays)
    header = Header(status=Status.OK, stage=Stage.ONLY, nbytes=nbytes)
    frame = np.full(HEADER_BYTES + nbytes, 0xAB, dtype=np.uint8)  # no byte left unwritten
    write_frame(header, arrays, frame)
    expected = b"".join(a.tobytes() + bytes(-a.nbytes % 8) for a in arrays)  # C order, padded
    assert frame[HEADER_BYTES:].tobytes() == expected
    assert Header.from_bytes(frame) == header
