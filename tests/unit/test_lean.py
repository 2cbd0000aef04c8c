"""Tests of megapack.lean: every codec round-trips bit-identically, on the numpy and the torch path."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack import lean
from megapack.batch import PackedBatch


@pytest.fixture(params=["numpy", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run a test on the CPU fast path (numpy) and on the device path (torch ops, as on CUDA)."""
    if request.param == "torch":
        monkeypatch.setattr(lean, "_host", lambda *tensors: False)
    yield request.param


def test_worked_example(path: str) -> None:
    b = PackedBatch.from_documents([[11, 12, 13], [14, 15], [16, 17, 18, 19]], pad_token_id=0)
    where, values = lean.shift_exceptions(b.labels, b.tokens)  # type: ignore[misc]
    assert where.tolist() == [2, 4, 8] and values.tolist() == [0, 0, 0]
    assert where.dtype == torch.int32 and values.dtype == torch.int64
    assert torch.equal(lean.apply_shift(b.tokens, where, values), b.labels)
    bits = lean.pack_bits(b.loss_mask)
    assert bits is not None and bits.tolist() == [0b11101011, 0]  # bit i = position i
    assert torch.equal(lean.unpack_bits(bits, 1, 9), b.loss_mask)
    positions = lean.standard_positions(b.cu_seqlens, 1, 9)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]] and positions.dtype == torch.int64
    assert torch.equal(positions, b.position_ids)
    plain = lean.standard_positions(torch.empty(0, dtype=torch.int32), 2, 3)
    assert plain.tolist() == [[0, 1, 2], [0, 1, 2]]


def test_fallbacks(path: str) -> None:
    assert lean.narrow(torch.tensor([[1, 2**31]])) is None
    assert lean.narrow(torch.tensor([[-(2**31) - 1, 0]])) is None
    narrowed = lean.narrow(torch.tensor([[-(2**31), 2**31 - 1]]))
    assert narrowed is not None and narrowed.dtype == torch.int32
    assert lean.widen(narrowed).tolist() == [[-(2**31), 2**31 - 1]]
    assert lean.widen(narrowed).dtype == torch.int64
    assert lean.pack_bits(torch.tensor([[1.0, 0.5]])) is None
    assert lean.pack_bits(torch.tensor([[1.0, -0.0]])) is None  # -0.0 would come back as 0.0
    tokens = torch.arange(64).view(1, 64)
    assert lean.shift_exceptions(torch.zeros(1, 64, dtype=torch.int64), tokens) is None
    seventeen = torch.roll(tokens, -1, 1)
    seventeen[0, :16] = -100  # 16 + the last position: 17 > max(16, 64 // 16)
    assert lean.shift_exceptions(seventeen, tokens) is None
    seventeen[0, 0] = 1
    assert lean.shift_exceptions(seventeen, tokens) is not None


@st.composite
def grids(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, labels, loss_mask, bounds) of a random packed row or plain [b, s] grid."""
    packed = draw(st.booleans())
    rows = 1 if packed else draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=8))
    cols = sum(lengths) if packed else draw(st.integers(1, 50))
    seed = draw(st.integers(0, 2**31))
    gen = np.random.default_rng(seed)
    big = draw(st.booleans())
    tokens = gen.integers(0, 2**40 if big else 50_000, (rows, cols))
    labels = np.empty_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    labels[:, -1] = -100
    for flip in gen.integers(0, rows * cols, draw(st.integers(0, 6))):
        labels.reshape(-1)[flip] = gen.integers(-5, 5)
    mask = (gen.random((rows, cols)) < 0.8).astype(np.float32)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32) if packed else []
    return (
        torch.from_numpy(tokens),
        torch.from_numpy(labels),
        torch.from_numpy(mask),
        torch.tensor(bounds, dtype=torch.int32),
    )


@settings(max_examples=150, deadline=None)
@given(batch=grids(), device_path=st.booleans())
def test_round_trips_are_bit_identical(
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], device_path: bool
) -> None:
    tokens, labels, mask, bounds = batch
    rows, cols = tokens.shape
    with pytest.MonkeyPatch.context() as mp:
        if device_path:
            mp.setattr(lean, "_host", lambda *tensors: False)
        narrowed = lean.narrow(tokens)
        if narrowed is not None:
            assert torch.equal(lean.widen(narrowed), tokens)
        else:
            assert int(tokens.max()) > 2**31 - 1
        found = lean.shift_exceptions(labels, tokens)
        if found is not None:
            where, values = found
            assert torch.equal(lean.apply_shift(tokens, where, values), labels)
            assert where.numel() <= max(16, labels.numel() // 16)
        bits = lean.pack_bits(mask)
        assert bits is not None and bits.numel() == -(-mask.numel() // 8)
        back = lean.unpack_bits(bits, rows, cols)
        assert back.dtype == torch.float32 and torch.equal(
            back.view(torch.int32), mask.view(torch.int32)
        )
        positions = lean.standard_positions(bounds, rows, cols)
        want = np.zeros((rows, cols), dtype=np.int64)
        b = bounds.tolist() or [0, cols]
        for r in range(rows):
            for start, end in itertools.pairwise(b):
                want[r, start:end] = np.arange(end - start)
        assert positions.dtype == torch.int64 and positions.tolist() == want.tolist()


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    poke=st.none() | st.tuples(st.integers(0, 1000), st.integers(-3, 3)),
)
def test_restarts_at_agrees_with_the_reference(
    lengths: list[int], poke: tuple[int, int] | None
) -> None:
    # Empty segments included (a 0 length, also first): the one-pass check must say exactly
    # whether the positions equal the rebuilt ones, or leave it to the reference (None).
    bounds = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    total = int(bounds[-1])
    if total == 0:
        return
    positions = lean.standard_positions(bounds, 1, total).clone()
    if poke is not None and poke[1] != 0:
        positions[0, poke[0] % total] += poke[1]
    want = torch.equal(positions, lean.standard_positions(bounds, 1, total))
    assert lean.restarts_at(positions, bounds) is want
    if int(bounds[-2]) != total:  # bounds short of T: not decided here
        assert lean.restarts_at(positions, bounds[:-1]) is None


def test_restarts_at_worked_example() -> None:
    bounds = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert lean.restarts_at(torch.tensor([[0, 1, 2, 0, 1]]), bounds) is True
    assert lean.restarts_at(torch.tensor([[0, 1, 2, 3, 4]]), bounds) is False  # no restart
    assert lean.restarts_at(torch.tensor([[0, 1, 2, 0, 2]]), bounds) is False  # a skip
    assert lean.restarts_at(torch.tensor([[0, 1, 2, 0, 1]], dtype=torch.int32), bounds) is None


def test_standard_mask_worked_example(path: str) -> None:
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    padded = torch.tensor([0, 4, 8], dtype=torch.int32)
    got = lean.standard_mask(cu, padded, 8)
    assert got.dtype == torch.float32 and got.tolist() == [[1, 1, 0, 0, 1, 0, 0, 0]]
    one_token_docs = lean.standard_mask(torch.tensor([0, 3, 4, 5], dtype=torch.int32), None, 5)
    assert one_token_docs.tolist() == [[1, 1, 0, 0, 0]]
    # a CP share's 8 positions checked against the whole row's boundaries: no error, just a mask
    assert lean.standard_mask(torch.tensor([0, 8, 16], dtype=torch.int32), None, 8).shape == (1, 8)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    pad=st.sampled_from([1, 2, 8]),
    device_path=st.booleans(),
)
def test_standard_mask_is_what_from_documents_learns(
    lengths: list[int], pad: int, device_path: bool
) -> None:
    """Documents without a mask of their own learn every token but the last: the standard mask."""
    b = PackedBatch.from_documents([[7] * n for n in lengths], pad_to_multiple_of=pad)
    with pytest.MonkeyPatch.context() as mp:
        if device_path:
            mp.setattr(lean, "_host", lambda *tensors: False)
        got = lean.standard_mask(b.cu_seqlens, b.cu_seqlens_padded, b.num_tokens)
    assert torch.equal(got.view(torch.int32), b.loss_mask.view(torch.int32))
