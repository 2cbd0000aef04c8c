"""wire: the field table, the header, and encode/decode of each stage's payload."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megapack import FIELDS, PackedBatch, Stage
from megapack.header import Header, Status
from megapack.wire import OUTPUT_KEYS, Layout, decode, encode, encode_fields, normalize

CPU = torch.device("cpu")
EXPECTED_FIELDS = {
    Stage.ONLY: {"tokens", "position_ids", "labels", "loss_mask", "cu_seqlens"},
    Stage.FIRST: {"tokens", "position_ids", "cu_seqlens"},
    Stage.MIDDLE: {"cu_seqlens"},
    Stage.LAST: {"labels", "loss_mask", "cu_seqlens"},
    Stage.MTP: {"tokens", "position_ids", "labels", "loss_mask", "cu_seqlens"},
}


def sample() -> PackedBatch:
    return PackedBatch.from_documents([[5, 6, 7], [8, 9], [1, 2, 3, 4]])


def test_table_gives_every_stage_the_attention_metadata() -> None:
    by_name = {f.name: f.stages for f in FIELDS}
    for name in ("cu_seqlens", "cu_seqlens_padded", "attention_mask", "dataset_id"):
        assert by_name[name] == frozenset(Stage)
    assert by_name["tokens"] == by_name["position_ids"] == {Stage.ONLY, Stage.FIRST, Stage.MTP}
    assert by_name["labels"] == by_name["loss_mask"] == {Stage.ONLY, Stage.LAST, Stage.MTP}


@pytest.mark.parametrize("stage", list(Stage), ids=lambda s: s.value)
def test_encode_decode_per_stage(stage: Stage) -> None:
    batch = sample()
    header, payload = encode(batch, stage, CPU)
    assert payload.dtype == torch.uint8 and payload.numel() == header.nbytes
    out = decode(Header.from_tensor(header.to_tensor(CPU)), payload)
    assert tuple(out) == OUTPUT_KEYS
    present = {
        k
        for k in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens")
        if out[k] is not None
    }
    assert present == EXPECTED_FIELDS[stage]
    for name in present:
        assert torch.equal(out[name], getattr(batch, name)), name
        assert out[name].dtype == getattr(batch, name).dtype
    assert out["attention_mask"] is None and out["cu_seqlens_padded"] is None
    assert out["max_seqlen"] == 4 and type(out["max_seqlen"]) is int
    assert out["packed_seq_params"].cu_seqlens_q is out["cu_seqlens"]


def test_payload_is_only_what_the_stage_needs() -> None:
    batch = sample()  # T = 9 tokens, 4 boundaries
    sizes = {stage: encode(batch, stage, CPU)[0].nbytes for stage in Stage}
    cu = 16  # 4 x int32, already 8-byte aligned
    assert sizes[Stage.MIDDLE] == cu
    # lean: int32 tokens (36 -> 40 aligned), positions rebuilt from cu_seqlens
    assert sizes[Stage.FIRST] == 40 + cu
    # ONLY: the labels as the shifted tokens plus the 3 document ends (int32 positions, int64
    # values); the loss mask (every token but each document's last) rebuilt from cu_seqlens
    assert sizes[Stage.ONLY] == 40 + 16 + 24 + cu
    # LAST would need the tokens as the label base: 40 + 16 + 24 > 72 bytes of labels, so not here
    assert sizes[Stage.LAST] == 72 + cu
    # an SFT mask (a prompt token not learned) is not the standard one: 2 bytes of bits (8 aligned)
    sft = dataclasses.replace(
        batch, loss_mask=batch.loss_mask.clone().index_fill_(1, torch.tensor([0]), 0.0)
    )
    assert encode(sft, Stage.ONLY, CPU)[0].nbytes == 40 + 16 + 24 + 8 + cu
    full = {
        stage: encode_fields(*normalize(batch), stage, CPU, lean=False)[0].nbytes for stage in Stage
    }
    assert full[Stage.FIRST] == 2 * 9 * 8 + cu  # protocol v3: every grid field in full
    assert full[Stage.LAST] == 9 * 8 + 9 * 4 + 4 + cu  # float32 loss_mask padded to 8 bytes


def test_padded_cu_seqlens_travel() -> None:
    batch = PackedBatch.from_documents([[5, 6, 7], [8, 9]], pad_to_multiple_of=4)
    header, payload = encode(batch, Stage.MIDDLE, CPU)
    out = decode(header, payload)
    assert out["cu_seqlens"].tolist() == [0, 3, 5]
    assert out["cu_seqlens_padded"].tolist() == [0, 4, 8]
    assert out["packed_seq_params"].cu_seqlens_kv_padded is out["cu_seqlens_padded"]


def test_plain_batch_passes_through_in_megatron_format() -> None:
    b, s = 2, 5
    plain = {
        "tokens": torch.arange(10).reshape(b, s),
        "labels": torch.arange(1, 11).reshape(b, s),
        "loss_mask": torch.ones(b, s),
        "position_ids": torch.arange(s).repeat(b, 1),
        "attention_mask": torch.tril(torch.ones(s, s, dtype=torch.bool)).expand(b, 1, s, s),
    }
    header, payload = encode(plain, Stage.ONLY, CPU)
    assert header.layout == Layout.PLAIN
    out = decode(header, payload)
    for k in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"):
        assert torch.equal(out[k], plain[k]), k
    assert (
        out["cu_seqlens"] is None and out["max_seqlen"] is None and out["packed_seq_params"] is None
    )
    middle = decode(*encode({**plain, "attention_mask": None}, Stage.MIDDLE, CPU))
    assert all(v is None for v in middle.values())


def test_header_rejects_out_of_step_peer() -> None:
    garbage = torch.arange(16, dtype=torch.int64)
    with pytest.raises(Exception, match="TP ranks are out of step"):
        Header.from_tensor(garbage)
    h = Header(status=Status.STOP, stage=Stage.LAST)
    assert Header.from_tensor(h.to_tensor(CPU)) == h
