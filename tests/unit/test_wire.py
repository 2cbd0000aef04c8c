"""wire: the header, and encode/decode of each stage's payload (fields in full, views on decode)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack import BatchField, PackedBatch
from megapack.core.errors import ProtocolError
from megapack.core.fields import BUILTIN_FIELDS, OUTPUT_KEYS, Stage, schema_of
from megapack.core.items import Batch, Layout, normalize
from megapack.delivery.wire import (
    MAGIC,
    Header,
    Status,
    decode,
    encode,
    header_bytes,
    payload_of,
    signal,
)

CPU = torch.device("cpu")
SCHEMA = schema_of()
EXPECTED_FIELDS = {
    Stage.ONLY: {"tokens", "position_ids", "labels", "loss_mask", "cu_seqlens"},
    Stage.FIRST: {"tokens", "position_ids", "cu_seqlens"},
    Stage.MIDDLE: {"cu_seqlens"},
    Stage.LAST: {"labels", "loss_mask", "cu_seqlens"},
    Stage.MTP: {"tokens", "position_ids", "labels", "loss_mask", "cu_seqlens"},
}


def sample() -> PackedBatch:
    return PackedBatch.from_documents([[5, 6, 7], [8, 9], [1, 2, 3, 4]])


def roundtrip(item: object, stage: Stage, schema=SCHEMA) -> tuple[Header, torch.Tensor, dict]:  # type: ignore[no-untyped-def]
    header, pieces = encode(normalize(item, schema), schema, stage)
    payload = payload_of(pieces, header.nbytes, CPU)
    again = Header.from_bytes(header.to_bytes())  # what a peer parses
    assert again == header
    return header, payload, decode(again, payload, schema)


def test_declarations_give_every_stage_the_attention_metadata() -> None:
    by_name = {f.name: f.stage_set for f in BUILTIN_FIELDS}
    for name in ("cu_seqlens", "cu_seqlens_padded", "attention_mask", "dataset_id", "max_seqlen"):
        assert by_name[name] == frozenset(Stage)
    assert by_name["tokens"] == by_name["position_ids"] == {Stage.ONLY, Stage.FIRST, Stage.MTP}
    assert by_name["labels"] == by_name["loss_mask"] == {Stage.ONLY, Stage.LAST, Stage.MTP}


@pytest.mark.parametrize("stage", list(Stage), ids=lambda s: s.value)
def test_encode_decode_per_stage(stage: Stage) -> None:
    item = sample()
    header, payload, out = roundtrip(item, stage)
    assert payload.dtype == torch.uint8 and payload.numel() == header.nbytes
    assert set(out) == set(OUTPUT_KEYS)
    got = {k for k, v in out.items() if isinstance(v, torch.Tensor)}
    assert got == EXPECTED_FIELDS[stage]
    for name in got:
        assert (
            torch.equal(out[name], getattr(item, name))
            and out[name].dtype == getattr(item, name).dtype
        )
    assert out["max_seqlen"] == 4 and type(out["max_seqlen"]) is int
    assert out["packed_seq_params"].cu_seqlens_q is out["cu_seqlens"]


def test_payload_bytes_are_the_fields_in_schema_order_8_byte_aligned() -> None:
    # The worked example (documents 3, 2, 4): 9 x int64 tokens, 9 x int64 position_ids,
    # 9 x int64 labels, 9 x float32 loss_mask (+4 zero bytes), 4 x int32 cu_seqlens.
    item = sample()
    _, payload, _ = roundtrip(item, Stage.ONLY)
    want = b"".join([
        item.tokens.numpy().tobytes(), item.position_ids.numpy().tobytes(),
        item.labels.numpy().tobytes(), item.loss_mask.numpy().tobytes(), bytes(4),
        item.cu_seqlens.numpy().tobytes(),
    ])  # fmt: skip
    assert bytes(payload.numpy()) == want


def test_decoded_tensors_are_views_of_the_payload_not_the_iterators_batch() -> None:
    item = sample()
    _, payload, out = roundtrip(item, Stage.ONLY)
    for name in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens"):
        assert np.shares_memory(out[name].numpy(), payload.numpy()), name
        assert not np.shares_memory(out[name].numpy(), getattr(item, name).numpy()), name


def test_header_layout_is_int64_slots_and_its_size_follows_the_schema() -> None:
    assert header_bytes(SCHEMA) == 8 * (6 + 7 * 10) == 608
    header, _, _ = roundtrip(sample(), Stage.FIRST)
    slots = struct.unpack(f"={608 // 8}q", header.to_bytes())
    assert slots[:6] == (MAGIC, 0, 1, int(Layout.PACKED), SCHEMA.key, header.nbytes)
    tokens, labels, max_seqlen = slots[6:13], slots[6 + 14 : 6 + 21], slots[6 + 56 : 6 + 63]
    assert tokens == (2, 1, 9, 0, 0, 0, 0)  # ndim 2, dims [1, 9]
    assert labels[0] == -1  # the first stage does not get labels
    assert max_seqlen[:2] == (0, 4)  # a scalar: ndim 0, then its value
    wide = schema_of((BatchField("x", "sample", torch.float32, "all"),))
    assert header_bytes(wide) == 608 + 56


@settings(max_examples=60, deadline=None)
@given(
    status=st.sampled_from(list(Status)),
    stage=st.sampled_from(list(Stage)),
    dims=st.lists(
        st.one_of(
            st.none(),
            st.integers(0, 2**40),
            st.lists(st.integers(0, 2**31), min_size=1, max_size=6).map(tuple),
        ),
        min_size=10,
        max_size=10,
    ),
)
def test_header_roundtrips(status: Status, stage: Stage, dims: list) -> None:
    h = Header(
        status=status, stage=stage, layout=Layout.PLAIN, key=123, nbytes=99, dims=tuple(dims)
    )
    assert Header.from_bytes(h.to_bytes()) == h


def test_regression_a_header_without_the_magic_number_is_refused() -> None:
    raw = bytearray(signal(Status.OK, Stage.ONLY, SCHEMA).to_bytes())
    with pytest.raises(ProtocolError, match="magic 0x0 != 0x4d500005"):
        Header.from_bytes(bytes(len(raw)))  # zeros of the right size
    raw[0] ^= 1
    with pytest.raises(ProtocolError, match="magic"):
        Header.from_bytes(bytes(raw))
    with pytest.raises(ProtocolError, match="fits no schema"):
        Header.from_bytes(bytes(raw[:100]))


def test_a_header_with_an_unknown_status_is_refused() -> None:
    raw = bytearray(signal(Status.OK, Stage.ONLY, SCHEMA).to_bytes())
    raw[8:16] = (7).to_bytes(8, "little", signed=True)
    with pytest.raises(ProtocolError, match="status 7"):
        Header.from_bytes(bytes(raw))


def test_plain_batch_and_middle_stage() -> None:
    s = 4
    item = {"tokens": torch.arange(8).reshape(2, s), "labels": torch.arange(8).reshape(2, s),
            "loss_mask": torch.ones(2, s, dtype=torch.bool), "position_ids": torch.arange(s).repeat(2, 1),
            "attention_mask": torch.ones(2, 1, s, s, dtype=torch.bool)}  # fmt: skip
    _, _, out = roundtrip(item, Stage.LAST)
    assert out["loss_mask"].dtype == torch.float32 and out["loss_mask"].tolist() == [[1.0] * 4] * 2
    assert out["attention_mask"].shape == (2, 1, s, s) and out["packed_seq_params"] is None
    assert out["tokens"] is None and out["max_seqlen"] is None
    _, payload, middle = roundtrip(
        {k: v for k, v in item.items() if k != "attention_mask"}, Stage.MIDDLE
    )
    assert payload.numel() == 0 and all(v is None for v in middle.values())


def test_declared_fields_roundtrip_bit_exact_in_their_dtypes() -> None:
    fields = (BatchField("logp", "token", torch.bfloat16, "last"),
              BatchField("weight", "sample", torch.float16, "all"),
              BatchField("grid_thw", "ragged", torch.int32, "first"))  # fmt: skip
    schema = schema_of(fields)
    item = sample()
    logp = torch.randn(1, 9).to(torch.bfloat16)
    logp[0, 3] = float("nan")
    values = dict(normalize(item, SCHEMA).values)
    values |= {"logp": logp, "weight": torch.tensor([-0.0], dtype=torch.float16),
               "grid_thw": torch.tensor([[1, 2, 2], [1, 4, 4]], dtype=torch.int32)}  # fmt: skip
    header, pieces = encode(Batch(Layout.PACKED, values), schema, Stage.ONLY)
    out = decode(
        Header.from_bytes(header.to_bytes()), payload_of(pieces, header.nbytes, CPU), schema
    )
    assert out["logp"].dtype == torch.bfloat16
    assert torch.equal(out["logp"].view(torch.int16), logp.view(torch.int16))  # NaN included
    assert out["weight"].view(torch.int16).tolist() == [np.float16(-0.0).view(np.int16)]
    assert out["grid_thw"].tolist() == [[1, 2, 2], [1, 4, 4]]
    h, p = encode(Batch(Layout.PACKED, values), schema, Stage.FIRST)
    first = decode(h, payload_of(p, h.nbytes, CPU), schema)
    assert first["logp"] is None and first["grid_thw"] is not None and first["weight"] is not None
