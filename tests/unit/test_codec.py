"""Lean wire (megapack.codec) vs the full encoding: every stage, cp in {1, 2}, both CP layouts.

A property test draws random packed and plain batches (random documents, padding, loss masks, pad
ids, and now and then labels, positions or ids that break a lean form), encodes each CP rank's
share for every stage leanly and in full (protocol v3, ``lean=False``), and checks that decoding
gives bit-identical outputs (values, dtype, shape, None-ness) and never more bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.batch import PackedBatch
from megapack.codec import Lean, Share
from megapack.cp_share import take_cp_share
from megapack.header import Header
from megapack.inputs import Layout
from megapack.topology import Stage
from megapack.wire import decode, encode_fields, join, normalize

CPU = torch.device("cpu")


@st.composite
def batches(draw: st.DrawFn) -> tuple[Any, str]:
    """A PackedBatch or a plain [b, s] dict, every span divisible by 4 (cp=2 zigzag); and what it
    breaks ("nothing", a field, or "standard": nothing, and the mask is the standard one)."""
    gen = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    breaks = draw(st.sampled_from(["nothing", "labels", "positions", "mask", "ids"]))
    standard = False
    if draw(st.booleans()):  # packed
        lengths = draw(st.lists(st.integers(1, 30), min_size=1, max_size=6))
        standard = draw(st.booleans())  # the default mask: every token but each document's last
        docs = [
            {"tokens": gen.integers(0, 50_000, n)}
            | ({} if standard else {"loss_mask": (gen.random(n) < 0.7).astype(np.float32)})
            for n in lengths
        ]
        pad = draw(st.sampled_from([4, 8]))
        b = PackedBatch.from_documents(
            docs, pad_to_multiple_of=pad, pad_token_id=draw(st.integers(0, 9))
        )
        item: Any = {
            k: getattr(b, k).clone() for k in ("tokens", "labels", "loss_mask", "position_ids")
        }
        item |= {"cu_seqlens": b.cu_seqlens, "max_seqlen": b.max_seqlen}
        if b.cu_seqlens_padded is not None:
            item["cu_seqlens_padded"] = b.cu_seqlens_padded
        item = PackedBatch(**item)
    else:
        rows, cols = draw(st.integers(1, 3)), 4 * draw(st.integers(1, 8))
        tokens = torch.from_numpy(gen.integers(0, 50_000, (rows, cols)))
        labels = torch.roll(tokens, -1, 1)
        labels[:, -1] = -100
        item = {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": torch.from_numpy((gen.random((rows, cols)) < 0.9).astype(np.float32)),
            "position_ids": torch.arange(cols).repeat(rows, 1),
        }
    grid = item if isinstance(item, dict) else None
    fields = (
        grid
        if grid is not None
        else {k: getattr(item, k) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    )
    if breaks == "labels":
        fields["labels"].copy_(torch.from_numpy(gen.integers(0, 50_000, fields["labels"].shape)))
    elif breaks == "positions":
        fields["position_ids"].view(-1)[gen.integers(0, fields["position_ids"].numel())] += 1
    elif breaks == "mask":
        fields["loss_mask"].view(-1)[0] = 0.5
    elif breaks == "ids":
        fields["tokens"].view(-1)[-1] = 2**40
    elif isinstance(item, PackedBatch) and standard:
        breaks = "standard"
    return item, breaks


def shares(
    layout: Layout, tensors: dict[str, Any], cp: int, cp_layout: str
) -> Iterator[tuple[int, Stage, dict[str, Any], Share]]:
    """Every (CP rank, stage, that rank's share of the normalized fields for the stage, its Share)."""
    for cp_rank in range(cp):
        for stage in Stage:
            share_t = take_cp_share(
                layout, tensors, cp_size=cp, cp_rank=cp_rank, cp_layout=cp_layout, stage=stage
            )  # type: ignore[arg-type]
            yield cp_rank, stage, share_t, Share(cp, cp_rank, cp_layout)  # type: ignore[arg-type]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return a == b


@settings(max_examples=60, deadline=None)
@given(case=batches(), cp=st.sampled_from([1, 2]), cp_layout=st.sampled_from(["document", "row"]))
def test_lean_decodes_bit_identical_to_full(case: tuple[Any, str], cp: int, cp_layout: str) -> None:
    item, breaks = case
    layout, tensors, scalars = normalize(item)
    for cp_rank, stage, share_t, share in shares(layout, tensors, cp, cp_layout):
        lean_h, lean_p = encode_fields(layout, share_t, scalars, stage, CPU, share=share)
        full_h, full_p = encode_fields(
            layout, share_t, scalars, stage, CPU, share=share, lean=False
        )
        wire_h = Header.from_tensor(lean_h.to_tensor(CPU))  # what a receiver reads
        lean_out = decode(wire_h, join(lean_p, CPU), cp_size=cp, cp_rank=cp_rank)
        full_out = decode(full_h, join(full_p, CPU), cp_size=cp, cp_rank=cp_rank)
        where = f"stage {stage.value} cp {cp} rank {cp_rank} {cp_layout} breaks {breaks}"
        for key in full_out:
            if key == "packed_seq_params":
                continue
            assert _same(lean_out[key], full_out[key]), f"{where}: {key}"
        assert lean_h.nbytes <= full_h.nbytes, where
        flags = lean_h.codec
        if stage == Stage.MIDDLE:
            assert lean_h.codec == 0, where
        if cp > 1:
            continue  # the broken value is in one CP rank's share only
        if stage in (Stage.ONLY, Stage.FIRST):
            assert bool(flags & Lean.TOKENS_INT32) == (breaks != "ids"), where
            assert bool(flags & Lean.POSITIONS_DERIVED) == (breaks != "positions"), where
        if stage in (Stage.ONLY, Stage.LAST):
            # (a random mask may happen to be the standard one, e.g. a 1-token document's [0])
            derived, bits = bool(flags & Lean.MASK_DERIVED), bool(flags & Lean.MASK_BITS)
            assert derived or breaks != "standard", where
            assert not (bits and derived) and (bits or derived) == (breaks != "mask"), where
            if (
                breaks in ("nothing", "standard")
                and stage == Stage.ONLY
                and full_h.rows * full_h.cols >= 16
            ):
                assert flags & Lean.LABELS_SHIFTED, where


def test_only_stage_of_a_4k_row_is_about_17_kb() -> None:
    gen = np.random.default_rng(0)
    docs, used = [], 0
    while used < 4096:
        n = int(min(max(gen.lognormal(np.log(300), 0.9), 8), 4096 - used))
        docs.append(gen.integers(1, 32_000, n))
        used += n
    batch = PackedBatch.from_documents(docs, seq_len=4096)
    layout, tensors, scalars = normalize(batch)
    lean_h, _ = encode_fields(layout, tensors, scalars, Stage.ONLY, CPU)
    full_h, _ = encode_fields(layout, tensors, scalars, Stage.ONLY, CPU, lean=False)
    assert full_h.nbytes == 4096 * (8 + 8 + 8 + 4) + 8 * ((len(batch.cu_seqlens) * 4 + 7) // 8)
    assert (  # every document learned but its last token: the loss mask needs no bytes
        lean_h.nbytes < 17_000
        and lean_h.codec
        == Lean.TOKENS_INT32 | Lean.POSITIONS_DERIVED | Lean.LABELS_SHIFTED | Lean.MASK_DERIVED
    ), lean_h


def test_a_standard_mask_with_a_negative_zero_travels_as_it_is() -> None:
    """-0.0 equals 0.0 but is not its bits: neither the derived mask nor bits may carry it."""
    batch = PackedBatch.from_documents([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = batch.loss_mask.clone()
    mask[0, 3] = -0.0  # the first document's last token: 0.0 in the standard mask
    layout, tensors, scalars = normalize(dataclasses.replace(batch, loss_mask=mask))
    header, payload = encode_fields(layout, tensors, scalars, Stage.ONLY, CPU)
    assert not header.codec & (Lean.MASK_DERIVED | Lean.MASK_BITS)
    out = decode(header, join(payload, CPU))
    assert torch.equal(out["loss_mask"].view(torch.int32), mask.view(torch.int32))
