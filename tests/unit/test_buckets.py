"""Length buckets (megapack.core.buckets): the plan covers every real token once, shapes come from
the fixed classes, padded boundaries and zero-length documents included, and the delivery carries
the plan on ``packed_seq_params`` when declared. The kernel that runs it: test_bucketed.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megapack
from megapack.attention.documents import Documents
from megapack.core.buckets import (
    BUCKET_FIELDS,
    BUCKET_NAMES,
    MAX_BUCKETS,
    WORK_PER_SLOT,
    length_class,
    length_classes,
    plan_buckets,
    with_bucket_plan,
)
from megapack.core.seq_params import BUCKETS_ATTR, make_packed_seq_params

CPU = megapack.Topology.single(torch.device("cpu"))


def test_worked_example_from_the_module_docstring() -> None:
    (bucket,) = plan_buckets([0, 3, 8, 10, 16], total=16)
    s = 16
    assert bucket.dtype == np.int32 and bucket.tolist() == [
        [0, 1, 2, s, s, s, s, s],
        [3, 4, 5, 6, 7, s, s, s],
        [8, 9, s, s, s, s, s, s],
        [10, 11, 12, 13, 14, 15, s, s],
    ]


def test_classes_are_multiples_of_8_then_less_than_an_eighth_above() -> None:
    n = np.arange(0, 40000)
    c = length_classes(n)
    assert c[0] == 0 and (c[1:] >= n[1:]).all()
    assert (c[1:65] % 8 == 0).all() and (c[1:65] - n[1:65] < 8).all()
    assert (c[65:129] % 16 == 0).all() and (c[65:129] - n[65:129] < 16).all()
    assert (c[129:] < 1.125 * n[129:]).all() and (c[129:] % 16 == 0).all()
    assert len(set(c[129:32769].tolist())) == 8 * 8  # 8 classes per power of two, 128..32,768
    assert [length_class(x) for x in (64, 65, 129, 1024, 1025)] == [64, 80, 144, 1024, 1152]


def test_padded_boundaries_and_zero_length_documents() -> None:
    # real lengths 3, 0, 2; buffer spans 4, 4, 8 (alignment padding, a zero-length document)
    (bucket,) = plan_buckets([0, 4, 8, 16], [0, 3, 3, 5], total=16)
    assert bucket.tolist() == [[0, 1, 2, 16, 16, 16, 16, 16], [8, 9, 16, 16, 16, 16, 16, 16]]
    assert plan_buckets([0, 0, 0], total=0) == []  # nothing real: no bucket
    with pytest.raises(ValueError, match="cu_seqlens has 3 entries but cu_seqlens_padded 4"):
        plan_buckets([0, 4, 8, 16], [0, 3, 5], total=16)


def test_more_classes_than_buckets_merge_the_cheapest_neighbours() -> None:
    lengths = [8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 2000]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    buckets = plan_buckets(cu, total=int(cu[-1]))
    assert len(buckets) == MAX_BUCKETS
    assert buckets[-1].shape == (1, length_class(2000))  # the long document is never merged down
    sizes = [b.shape[1] for b in buckets]
    assert sizes == sorted(sizes) and all(s == length_class(s) for s in sizes)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 300), min_size=1, max_size=40),
    st.integers(1, 8),
    st.integers(1, MAX_BUCKETS),
)
def test_every_real_position_is_in_exactly_one_slot(
    lengths: list[int], multiple: int, max_buckets: int
) -> None:
    spans = [-(-n // multiple) * multiple for n in lengths]
    buffer = np.concatenate([[0], np.cumsum(spans)])
    real = np.concatenate([[0], np.cumsum(lengths)])
    total = int(buffer[-1])
    buckets = plan_buckets(buffer, real, total=total, max_buckets=max_buckets)
    assert len(buckets) <= max_buckets
    slots = np.concatenate([b.reshape(-1) for b in buckets]) if buckets else np.zeros(0)
    expected = np.concatenate(
        [np.arange(s, s + n) for s, n in zip(buffer[:-1], lengths, strict=True)]
    )
    assert sorted(slots[slots < total].tolist()) == sorted(expected.tolist())
    for b in buckets:  # each row: a document's positions in order, then padding
        for row in b:
            real_part = row[row < total]
            assert (np.diff(real_part) == 1).all() and (row[len(real_part) :] == total).all()


def test_get_batch_delivers_the_plan_on_the_params_when_declared() -> None:
    batch = megapack.PackedBatch.from_documents([[1] * 5, [2] * 90, [3] * 3], seq_len=128)
    plain = megapack.get_batch_on_this_tp_rank(iter([batch]), topology=CPU)
    assert getattr(plain["packed_seq_params"], BUCKETS_ATTR, None) is None
    out = megapack.get_batch_on_this_tp_rank(iter([batch]), topology=CPU, fields=BUCKET_FIELDS)
    want = plan_buckets(batch.cu_seqlens.tolist(), total=128)
    got = getattr(out["packed_seq_params"], BUCKETS_ATTR)
    assert [b.tolist() for b in got] == [b.tolist() for b in want]
    assert [out[n] is None for n in BUCKET_NAMES] == [i >= len(want) for i in range(MAX_BUCKETS)]
    assert Documents.from_params(out["packed_seq_params"], total=128).buckets is got


def test_with_bucket_plan_reads_padded_boundaries() -> None:
    values = {"cu_seqlens": torch.tensor([0, 3, 5]), "cu_seqlens_padded": torch.tensor([0, 8, 16])}
    out = with_bucket_plan(values)
    assert out[BUCKET_NAMES[0]].tolist() == [[0, 1, 2, 16, 16, 16, 16, 16], [8, 9, 16, 16, 16, 16, 16, 16]]  # fmt: skip
    assert all(out[n] is None for n in BUCKET_NAMES[1:])
    params = make_packed_seq_params(values["cu_seqlens"], values["cu_seqlens_padded"], 8,
                                    buckets=(out[BUCKET_NAMES[0]],))  # fmt: skip
    assert getattr(params, BUCKETS_ATTR)[0] is out[BUCKET_NAMES[0]]


def test_class_boundaries_exactly_and_as_int64() -> None:
    n = np.array([0, 1, 8, 9, 64, 65, 128, 129, 144, 145, 256, 257, 4096, 4097])
    classes = length_classes(n)
    assert classes.dtype == np.int64
    assert classes.tolist() == [0, 8, 8, 16, 64, 80, 128, 144, 144, 160, 256, 288, 4096, 4608]


def test_the_sentinel_is_total_where_given() -> None:
    (bucket,) = plan_buckets([0, 3, 8], total=20)  # e.g. a static row longer than the documents
    assert bucket.tolist() == [[0, 1, 2, 20, 20, 20, 20, 20], [3, 4, 5, 6, 7, 20, 20, 20]]


def merged_by_the_rule(classes: list[int], max_buckets: int) -> list[int]:
    """The documented merge rule, written out: while there are too many sizes, merge the two
    neighbours whose merge adds the least work, count x (big^2 - small^2 + WORK_PER_SLOT x (big -
    small)), the first such pair on a tie; the merged documents count at the bigger size."""
    counts = {c: classes.count(c) for c in sorted(set(classes))}
    while len(counts) > max_buckets:
        sizes = list(counts)
        work = [
            counts[a] * (b * b - a * a + WORK_PER_SLOT * (b - a))
            for a, b in itertools.pairwise(sizes)
        ]
        i = work.index(min(work))
        counts[sizes[i + 1]] += counts.pop(sizes[i])
    return list(counts)


def test_merging_follows_the_rule_counts_included() -> None:
    # many short documents and a few long ones: the cheapest merge is the last pair here
    assert merged_by_the_rule([8] * 100 + [16] * 100 + [24, 32], 3) == [8, 16, 32]
    rng = np.random.default_rng(0)
    for _ in range(300):
        lengths = rng.integers(1, 3000, rng.integers(2, 60)) // rng.integers(1, 40)
        lengths = np.maximum(lengths, 1)
        cu = np.concatenate([[0], np.cumsum(lengths)])
        most = int(rng.integers(1, MAX_BUCKETS + 1))
        want = merged_by_the_rule(length_classes(lengths).tolist(), most)
        got = [b.shape[1] for b in plan_buckets(cu, total=int(cu[-1]), max_buckets=most)]
        assert got == want, lengths.tolist()


def test_the_sentinel_is_t_never_the_last_boundary() -> None:
    """issue 48: a plan marked with the last boundary aliases a real position where the boundaries
    end before T (position 30 of a 40-token row): the sentinel must be T, and is required."""
    slots = np.concatenate([b.reshape(-1) for b in plan_buckets([0, 7, 19, 30], total=40)])
    assert sorted(slots[slots < 30].tolist()) == list(range(30))
    assert set(slots[slots >= 30].tolist()) == {40}
    with pytest.raises(TypeError, match="total"):
        plan_buckets([0, 7, 19, 30])  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="total=20 is below the last boundary 30"):
        plan_buckets([0, 7, 19, 30], total=20)


def test_with_bucket_plan_marks_padding_with_the_rows_token_count() -> None:
    values = {"cu_seqlens": torch.tensor([0, 3, 5]), "cu_seqlens_padded": None,
              "tokens": torch.zeros(1, 9, dtype=torch.int64)}  # fmt: skip
    assert out_first(values)[0] == [0, 1, 2, 9, 9, 9, 9, 9]
    values["tokens"] = None  # no tokens at all: the next token grid gives T
    values["labels"] = torch.zeros(1, 12, dtype=torch.int64)
    assert out_first(values)[0] == [0, 1, 2, 12, 12, 12, 12, 12]


def out_first(values: dict) -> list[list[int]]:
    return with_bucket_plan(values)[BUCKET_NAMES[0]].tolist()


def test_docstring_examples() -> None:
    import doctest

    from megapack.core import buckets

    result = doctest.testmod(buckets)
    assert result.attempted >= 6 and result.failed == 0


def test_a_total_below_the_last_boundary_says_what_to_pass() -> None:
    with pytest.raises(ValueError) as caught:
        plan_buckets([0, 7, 19, 30], total=20)
    assert str(caught.value) == (
        "total=20 is below the last boundary 30: pass the micro-batch's token count T "
        "(tokens.shape[-1]), which the boundaries never exceed"
    )
