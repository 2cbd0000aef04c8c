"""wire: the header, and encode/decode of each stage's payload (fields in full, views on decode)."""

from __future__ import annotations

import struct
from typing import ClassVar

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack import BatchField, PackedBatch
from megapack.core.errors import ProtocolError
from megapack.core.fields import BUILTIN_FIELDS, OUTPUT_KEYS, Stage, schema_of
from megapack.core.intake import Batch, BatchForm, to_batch
from megapack.delivery.wire import (
    MAGIC,
    Header,
    Status,
    decode,
    encode,
    header_bytes,
    payload_of,
    signal,
    write_payload,
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
    header, pieces = encode(to_batch(item, schema), schema, stage)
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
    assert slots[:6] == (MAGIC, 0, 1, int(BatchForm.PACKED), SCHEMA.key, header.nbytes)
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
        status=status, stage=stage, form=BatchForm.PLAIN, key=123, nbytes=99, dims=tuple(dims)
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
    fields = (BatchField("logp", "token", torch.bfloat16, "last", at="label"),
              BatchField("weight", "sample", torch.float16, "all"),
              BatchField("grid_thw", "ragged", torch.int32, "first"))  # fmt: skip
    schema = schema_of(fields)
    item = sample()
    logp = torch.randn(1, 9).to(torch.bfloat16)
    logp[0, 3] = float("nan")
    values = dict(to_batch(item, SCHEMA).values)
    values |= {"logp": logp, "weight": torch.tensor([-0.0], dtype=torch.float16),
               "grid_thw": torch.tensor([[1, 2, 2], [1, 4, 4]], dtype=torch.int32)}  # fmt: skip
    header, pieces = encode(Batch(BatchForm.PACKED, values), schema, Stage.ONLY)
    out = decode(
        Header.from_bytes(header.to_bytes()), payload_of(pieces, header.nbytes, CPU), schema
    )
    assert out["logp"].dtype == torch.bfloat16
    assert torch.equal(out["logp"].view(torch.int16), logp.view(torch.int16))  # NaN included
    assert out["weight"].view(torch.int16).tolist() == [np.float16(-0.0).view(np.int16)]
    assert out["grid_thw"].tolist() == [[1, 2, 2], [1, 4, 4]]
    h, p = encode(Batch(BatchForm.PACKED, values), schema, Stage.FIRST)
    first = decode(h, payload_of(p, h.nbytes, CPU), schema)
    assert first["logp"] is None and first["grid_thw"] is not None and first["weight"] is not None


# What a peer reads is byte-exact: the header's slots, the payload's layout, every refusal's words.

OUT_OF_STEP = "TP ranks are out of step (every TP rank must call get_batch_on_this_tp_rank once per micro-step)"  # fmt: skip


def test_the_worked_example_header_slot_by_slot() -> None:
    # Documents 3, 2, 4 for the only stage: 3 x 72 int64 bytes, 36 float32 (+4 zero), 16 int32.
    header, _, _ = roundtrip(sample(), Stage.ONLY)
    absent, zeros = [-1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0]
    want = [MAGIC, 0, 0, 0, SCHEMA.key, 272]
    want += [2, 1, 9, *zeros[:4]] * 4  # tokens, position_ids, labels, loss_mask: [1, 9]
    want += absent  # attention_mask
    want += [1, 4, *zeros]  # cu_seqlens [4]
    want += absent * 2  # cu_seqlens_padded, dataset_id
    want += [0, 4, *zeros]  # max_seqlen: a scalar, its value 4, the rest zero
    want += absent  # local_cp_size
    assert header.to_bytes() == struct.pack(f"={len(want)}q", *want)


def test_a_stop_or_an_error_header_carries_no_field_and_the_messages_size() -> None:
    stop = signal(Status.STOP, Stage.LAST, SCHEMA)
    assert (stop.status, stop.stage, stop.form, stop.key, stop.nbytes) == (
        Status.STOP, Stage.LAST, BatchForm.PACKED, SCHEMA.key, 0,
    )  # fmt: skip
    assert stop.dims == (None,) * 10
    error = signal(Status.ERROR, Stage.FIRST, SCHEMA, 12)
    assert (error.status, error.nbytes, error.key) == (Status.ERROR, 12, SCHEMA.key)
    slots = struct.unpack("=76q", error.to_bytes())
    assert (
        slots[:6] == (MAGIC, 2, 1, 0, SCHEMA.key, 12) and slots[6:] == (-1, 0, 0, 0, 0, 0, 0) * 10
    )


@pytest.mark.parametrize(
    "size", [0, 4, 40, 72, 100, 108, 604, 612], ids=lambda n: f"{n}-bytes"
)  # fmt: skip
def test_a_header_whose_size_fits_no_schema_is_refused_naming_its_size(size: int) -> None:
    # 608 = 8 x (6 + 7 x 10) fits; sizes off by 4 bytes or a few slots do not (72: 9 slots,
    # 108: 13 slots and a half, which would fit one field but for the half slot).
    with pytest.raises(ProtocolError) as info:
        Header.from_bytes(bytes(size))
    assert str(info.value) == f"megapack header of {size} bytes fits no schema: {OUT_OF_STEP}"


def test_the_magic_number_refusal_in_full() -> None:
    raw = bytearray(signal(Status.ERROR, Stage.ONLY, SCHEMA, 5).to_bytes())
    raw[0] ^= 1  # magic 0x4d500004, status 2
    with pytest.raises(ProtocolError) as info:
        Header.from_bytes(bytes(raw))
    assert str(info.value) == (
        f"megapack header magic 0x4d500004 != 0x4d500005: {OUT_OF_STEP} or run different "
        "megapack versions"
    )


@pytest.mark.parametrize(
    ("status", "stage", "form"),
    [(3, 0, 0), (-1, 0, 0), (0, 5, 1), (0, -1, 0), (1, 4, 2), (2, 0, -1)],
)
def test_a_header_out_of_range_is_refused_naming_status_stage_and_form(
    status: int, stage: int, form: int
) -> None:
    raw = bytearray(signal(Status.OK, Stage.ONLY, SCHEMA).to_bytes())
    raw[8:32] = struct.pack("=3q", status, stage, form)
    with pytest.raises(ProtocolError) as info:
        Header.from_bytes(bytes(raw))
    assert str(info.value) == (f"megapack header has status {status}, stage {stage}, form {form}")


def test_the_last_stage_code_and_every_status_and_form_are_accepted() -> None:
    for code, stage in enumerate(Stage):
        for status in Status:
            for form in BatchForm:
                raw = bytearray(signal(Status.OK, Stage.ONLY, SCHEMA).to_bytes())
                raw[8:32] = struct.pack("=3q", status, code, form)
                h = Header.from_bytes(bytes(raw))
                assert (h.status, h.stage, h.form) == (status, stage, form)


@settings(max_examples=40, deadline=None)
@given(
    dims=st.lists(
        st.one_of(st.none(), st.integers(-(2**40), 2**40),
                  st.lists(st.integers(0, 2**31), min_size=1, max_size=6).map(tuple)),
        max_size=13,
    ),
)  # fmt: skip
def test_a_header_of_any_number_of_fields_roundtrips_zero_included(dims: list) -> None:
    h = Header(status=Status.OK, stage=Stage.MTP, key=7, nbytes=1, dims=tuple(dims))
    raw = h.to_bytes()
    assert len(raw) == 8 * (6 + 7 * len(dims))
    assert Header.from_bytes(raw) == h


def test_decode_refuses_a_header_of_another_field_count() -> None:
    header, payload, _ = roundtrip(sample(), Stage.ONLY)
    for dims in (header.dims[:-1], (*header.dims, None)):
        short = Header(status=Status.OK, stage=Stage.ONLY, key=header.key, nbytes=header.nbytes,
                       dims=dims)  # fmt: skip
        with pytest.raises(ValueError, match="zip"):
            decode(short, payload, SCHEMA)


def test_packed_seq_params_carry_padded_boundaries_maxima_cp_group_and_local_cp_size() -> None:
    item = PackedBatch.from_documents([[5, 6, 7], [8, 9], [1, 2, 3, 4]], pad_to_multiple_of=4)
    values = dict(to_batch(item, SCHEMA).values) | {"local_cp_size": 2}
    header, pieces = encode(Batch(BatchForm.PACKED, values), SCHEMA, Stage.MIDDLE)
    group = object()  # what a CP process group is to decode: passed through untouched
    out = decode(Header.from_bytes(header.to_bytes()), payload_of(pieces, header.nbytes, CPU),
                 SCHEMA, cp_group=group)  # fmt: skip
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 9]
    assert out["cu_seqlens_padded"].tolist() == [0, 4, 8, 12]
    assert (out["max_seqlen"], out["local_cp_size"]) == (4, 2)
    params = out["packed_seq_params"]
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q is out["cu_seqlens"] and params.cu_seqlens_kv is out["cu_seqlens"]
    assert params.cu_seqlens_q_padded is out["cu_seqlens_padded"]
    assert params.cu_seqlens_kv_padded is out["cu_seqlens_padded"]
    assert (params.max_seqlen_q, params.max_seqlen_kv) == (4, 4)
    assert params.cp_group is group and params.local_cp_size == 2


def test_a_strided_piece_is_laid_out_as_its_values() -> None:
    # A CP rank's or a trainer's tensor may be a strided view; the frame holds its values in order.
    base = torch.arange(40, dtype=torch.int64).reshape(4, 10)
    strided = base[:, ::3]  # [4, 4], not contiguous
    half = torch.arange(12, dtype=torch.int16).reshape(3, 4).t()  # [4, 3] transposed, 24 bytes
    assert not strided.is_contiguous() and not half.is_contiguous()
    payload = payload_of([strided, half], 128 + 24, CPU)
    want = strided.contiguous().numpy().tobytes() + half.contiguous().numpy().tobytes()
    assert bytes(payload.numpy()) == want
    bf = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t()  # no numpy dtype: torch's bytes
    assert bytes(payload_of([bf], 16, CPU).numpy()) == (
        bf.contiguous().view(torch.int16).numpy().tobytes() + bytes(4)
    )


def test_an_error_message_fills_its_payload_exactly_with_no_padding() -> None:
    message = torch.frombuffer(bytearray(b"ValueError: x"), dtype=torch.uint8)  # 13 bytes
    assert bytes(payload_of([message], 13, CPU).numpy()) == b"ValueError: x"
    out = bytearray(b"\xff" * 16)
    write_payload([message], memoryview(out))
    assert bytes(out) == b"ValueError: x\0\0\0"  # with room: zero padding to 8 bytes


class Elsewhere(torch.Tensor):
    """A CPU tensor that says it is not on the host, so `payload_of` takes its device path; it
    records the `.to` calls made on it."""

    calls: ClassVar[list[tuple[tuple, dict]]] = []

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.to:
            cls.calls.append((args[1:], dict(kwargs or {})))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_device_pieces_are_concatenated_on_the_device_with_the_host_layout() -> None:
    fields = (BatchField("logp", "token", torch.bfloat16, "last", at="label"),
              BatchField("n", "sample", torch.int8, "all"))  # fmt: skip
    schema = schema_of(fields)
    values = dict(to_batch(sample(), SCHEMA).values)
    values |= {"logp": torch.linspace(-1, 1, 9).reshape(1, 9).to(torch.bfloat16),
               "n": torch.tensor([3, -1, 7], dtype=torch.int8)}  # fmt: skip
    header, pieces = encode(Batch(BatchForm.PACKED, values), schema, Stage.ONLY)
    host = payload_of(pieces, header.nbytes, CPU)
    Elsewhere.calls = []
    device = payload_of([p.as_subclass(Elsewhere) for p in pieces], header.nbytes, CPU)
    assert [c for c in Elsewhere.calls if c[0]] == [((CPU,), {"non_blocking": True})] * len(pieces)
    assert device.dtype == torch.uint8 and device.numel() == header.nbytes == 272 + 24 + 8
    assert bytes(device.as_subclass(torch.Tensor).numpy()) == bytes(host.numpy())
    meta = torch.device("meta")
    on_meta = payload_of([p.as_subclass(Elsewhere) for p in pieces], header.nbytes, meta)
    assert on_meta.device == meta and on_meta.dtype == torch.uint8
    assert on_meta.numel() == header.nbytes


def test_host_pieces_for_a_device_go_by_one_pinned_non_blocking_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    copies: list[tuple[bytes, torch.device, bool]] = []

    class Pinned:
        def __init__(self, host: torch.Tensor) -> None:
            self.host = host

        def to(self, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
            copies.append((bytes(self.host.numpy()), device, non_blocking))
            return self.host.to(device)

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: Pinned(self))
    meta = torch.device("meta")
    header, pieces = encode(to_batch(sample(), SCHEMA), SCHEMA, Stage.LAST)
    out = payload_of(pieces, header.nbytes, meta)
    assert out.device == meta and out.numel() == header.nbytes
    assert copies == [(bytes(payload_of(pieces, header.nbytes, CPU).numpy()), meta, True)]


def test_decode_of_a_device_payload_makes_views_there_and_reads_nothing_on_the_host() -> None:
    # A meta tensor has no values (as a GPU payload, no host read may touch it): decode must give
    # views of the right dtypes and shapes on its device, the scalars from the header.
    header, _, _ = roundtrip(sample(), Stage.ONLY)
    payload = torch.empty(header.nbytes, dtype=torch.uint8, device="meta")
    out = decode(header, payload, SCHEMA)
    for name, shape, dtype in [("tokens", (1, 9), torch.int64), ("labels", (1, 9), torch.int64),
                               ("loss_mask", (1, 9), torch.float32),
                               ("position_ids", (1, 9), torch.int64),
                               ("cu_seqlens", (4,), torch.int32)]:  # fmt: skip
        t = out[name]
        assert (t.device.type, tuple(t.shape), t.dtype) == ("meta", shape, dtype), name
    assert out["max_seqlen"] == 4 and out["packed_seq_params"].cu_seqlens_q is out["cu_seqlens"]
