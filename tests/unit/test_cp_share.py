"""take_share: a CP rank's share of a checked batch, by each field's declaration (cut or whole)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack import BatchField, PackedBatch
from megapack.core.cp_share import take_share
from megapack.core.fields import Stage, schema_of
from megapack.core.intake import BatchForm, to_batch
from megapack.core.seq_params import make_packed_seq_params

SCHEMA = schema_of()
ONLY = SCHEMA.by_stage[Stage.ONLY]


def two_documents() -> PackedBatch:
    """Two documents of 8 tokens; tokens hold their row position (0..15), the docstring's example."""
    b = PackedBatch.from_documents([list(range(8)), list(range(8, 16))])
    return dataclasses.replace(b, tokens=torch.arange(16)[None])


def share(item: object, rank: int, cp: int = 2, **kw: object) -> dict:
    batch = to_batch(item, SCHEMA)
    fields = kw.pop("fields", ONLY)
    return take_share(batch.values, fields, packed=batch.form == BatchForm.PACKED, cp_size=cp,  # type: ignore[arg-type]
                      cp_rank=rank, **kw)  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.parametrize(
    ("layout", "rank", "want"),
    [
        ("document", 0, [0, 1, 6, 7, 8, 9, 14, 15]),
        ("document", 1, [2, 3, 4, 5, 10, 11, 12, 13]),
        ("row", 0, [0, 1, 2, 3, 12, 13, 14, 15]),
        ("row", 1, [4, 5, 6, 7, 8, 9, 10, 11]),
    ],
)
def test_worked_example_cuts_tokens_and_keeps_boundaries(
    layout: str, rank: int, want: list[int]
) -> None:
    item = two_documents()
    out = share(item, rank, layout=layout)
    assert out["tokens"].tolist() == [want]
    assert out["position_ids"].tolist() == [[i % 8 for i in want]]
    assert out["labels"].tolist() == [item.labels[0, want].tolist()]
    assert out["cu_seqlens"] is item.cu_seqlens and out["max_seqlen"] == 8


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    cp=st.sampled_from([2, 4]),
    layout=st.sampled_from(["document", "row"]),
)
def test_regression_each_rank_keeps_exactly_its_zigzag_chunks(
    lengths: list[int], cp: int, layout: str
) -> None:
    # Every rank r keeps chunks r and 2cp-1-r of every span, in that order, computed here without
    # megapack: together the ranks hold every position exactly once.
    two_cp = 2 * cp
    docs = [[7] * (n * two_cp) for n in lengths]
    item = dataclasses.replace(
        PackedBatch.from_documents(docs), tokens=torch.arange(sum(map(len, docs)))[None]
    )
    spans = [(0, item.num_tokens)] if layout == "row" else [
        (int(a), int(b)) for a, b in zip(item.cu_seqlens[:-1], item.cu_seqlens[1:], strict=True)]  # fmt: skip
    held: list[int] = []
    for rank in range(cp):
        want = []
        for a, b in spans:
            c = (b - a) // two_cp
            want += list(range(a + rank * c, a + (rank + 1) * c))
            want += list(range(a + (two_cp - 1 - rank) * c, a + (two_cp - rank) * c))
        got = share(item, rank, cp=cp, layout=layout)["tokens"].tolist()[0]
        assert got == want, (rank, spans)
        held += got
    assert sorted(held) == list(range(item.num_tokens))


def test_padded_boundaries_drive_the_document_split() -> None:
    # Documents of 3 and 2 tokens padded to 4: spans come from cu_seqlens_padded [0, 4, 8].
    b = PackedBatch.from_documents([[5, 6, 7], [8, 9]], pad_to_multiple_of=4)
    out = share(b, 1)
    assert out["tokens"].tolist() == [[6, 7, 9, 0]]  # chunks 1, 2 of [5 6 7 _] and [8 9 _ _]
    assert out["cu_seqlens"].tolist() == [0, 3, 5]


def test_plain_batch_splits_rows_and_the_mask_query_dim() -> None:
    b, s = 2, 8
    plain = {
        "tokens": torch.arange(b * s).reshape(b, s),
        "labels": torch.arange(b * s).reshape(b, s),
        "loss_mask": torch.ones(b, s),
        "position_ids": torch.arange(s).repeat(b, 1),
        "attention_mask": torch.arange(b * s * s).reshape(b, 1, s, s) % 3 == 0,
    }
    out = share(plain, 0, layout="document")
    keep = [0, 1, 6, 7]  # plain rows always use the row layout, whatever cp_layout says
    assert out["tokens"].tolist() == [keep, [8 + i for i in keep]]
    assert out["attention_mask"].shape == (b, 1, 4, s)
    assert torch.equal(out["attention_mask"], plain["attention_mask"][:, :, keep, :])


def test_stage_drops_fields_it_does_not_receive() -> None:
    last = share(two_documents(), 0, fields=SCHEMA.by_stage[Stage.LAST])
    assert "tokens" not in last and "position_ids" not in last
    assert last["labels"].shape == (1, 8) and last["cu_seqlens"] is not None
    first = share(two_documents(), 0, fields=SCHEMA.by_stage[Stage.FIRST])
    assert "labels" not in first and first["tokens"].shape == (1, 8)


def test_declared_fields_share_as_declared() -> None:
    fields = (BatchField("adv", "token", torch.float32, "last", at="label"),
              BatchField("reward", "sample", torch.float32, "all"),
              BatchField("pixels", "ragged", torch.bfloat16, "first"))  # fmt: skip
    schema = schema_of(fields)
    item = two_documents()
    values = dict(to_batch(item, SCHEMA).values)
    values |= {"adv": torch.arange(16.0)[None], "reward": torch.tensor([1.5]),
               "pixels": torch.ones(5, 3, dtype=torch.bfloat16)}  # fmt: skip
    out = take_share(values, schema.by_stage[Stage.ONLY], packed=True, cp_size=2, cp_rank=1)
    assert out["adv"].tolist() == [[2.0, 3, 4, 5, 10, 11, 12, 13]]  # the labels' positions
    assert out["reward"] is values["reward"] and out["pixels"] is values["pixels"]


def test_cp_size_one_is_the_identity() -> None:
    item = two_documents()
    out = share(item, 0, cp=1)
    assert out["tokens"] is item.tokens and out["labels"] is item.labels


def test_bad_span_names_document_length_and_fix() -> None:
    item = PackedBatch.from_documents([[1] * 8, [2] * 5, [3] * 3])
    with pytest.raises(
        ValueError, match=r"cu_seqlens document 1 spans 5 positions, not a multiple of 2\*cp=4"
    ) as e:
        share(item, 0)
    assert "pad_to_multiple_of=4" in str(e.value) and "sequence parallelism" not in str(e.value)
    with pytest.raises(
        ValueError, match=r"with sequence parallelism \(tp=2\) pad to a multiple of 2\*cp\*tp=8"
    ):
        share(item, 0, tp_size=2, sequence_parallel=True)
    assert share(item, 0, layout="row")["tokens"].shape == (1, 8)  # row: only T must divide


def test_sequence_parallel_needs_per_rank_tokens_divisible_by_tp() -> None:
    # 12 tokens, cp=2: spans of 4 and 8 divide by 4, but 6 tokens per CP rank do not divide by tp=4.
    item = PackedBatch.from_documents([[1] * 4, [2] * 8])
    with pytest.raises(
        ValueError, match=r"each CP rank keeps 6 of the row's 12 tokens, not a multiple of tp=4"
    ):
        share(item, 0, tp_size=4, sequence_parallel=True)
    assert share(item, 0, tp_size=4)["tokens"].shape == (1, 6)


def test_plain_rows_not_divisible_name_the_row_length() -> None:
    plain = {k: torch.zeros(2, 6, dtype=torch.long) for k in ("tokens", "labels", "position_ids")}
    with pytest.raises(
        ValueError, match=r"the row holds 6 positions, not a multiple of 2\*cp=4.*plain \[b, s\]"
    ):
        share(plain | {"loss_mask": torch.ones(2, 6)}, 1)


def test_packed_seq_params_carries_cp_group_and_local_cp_size() -> None:
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    group = object()  # stands in for a ProcessGroup: the dataclass stores it as given
    psp = make_packed_seq_params(cu, cu, 4, cp_group=group, local_cp_size=2)
    assert psp.cp_group is group and psp.local_cp_size == 2
    assert (
        psp.cu_seqlens_q_padded is cu and psp.cu_seqlens_kv_padded is cu and psp.max_seqlen_q == 4
    )


SPAN_FIX = (
    "not a multiple of 2*cp=4 (cp_size=2, layout='document'): pack with pad_to_multiple_of=4 "
    "(--pad-multiple 4) so every document is padded, or use cp_layout='row' (in the packed batch)"
)


def test_a_padded_batchs_bad_span_names_cu_seqlens_padded_in_full() -> None:
    # Documents of 3 and 5 tokens padded to multiples of 2: buffer spans 4 and 6 (6 % 4 != 0).
    item = PackedBatch.from_documents([[1] * 3, [2] * 5], pad_to_multiple_of=2)
    want = f"cu_seqlens_padded document 1 spans 6 positions, {SPAN_FIX}"
    for kw in ({}, {"tp_size": 2}, {"tp_size": 1, "sequence_parallel": True},
               {"sequence_parallel": True}):  # fmt: skip
        with pytest.raises(ValueError) as info:
            share(item, 1, **kw)
        assert str(info.value) == want, kw  # no hint without sequence parallelism over tp > 1
    with pytest.raises(ValueError) as info:
        share(item, 1, tp_size=2, sequence_parallel=True)
    assert str(info.value) == (
        f"{want}; with sequence parallelism (tp=2) pad to a multiple of 2*cp*tp=8"
    )


def test_a_plain_batchs_bad_rows_in_full() -> None:
    plain = {k: torch.zeros(2, 6, dtype=torch.long) for k in ("tokens", "labels", "position_ids")}
    with pytest.raises(ValueError) as info:
        share(plain | {"loss_mask": torch.ones(2, 6)}, 1)
    assert str(info.value) == (
        "the row holds 6 positions, not a multiple of 2*cp=4 (cp_size=2, layout='row'): pad rows "
        "to a multiple of 4 (seq_len or pad_to_multiple_of) (in the plain [b, s] batch's rows)"
    )


def test_sequence_parallels_refusal_in_full_and_a_count_that_divides() -> None:
    item = PackedBatch.from_documents([[1] * 4, [2] * 8])  # 12 tokens: 6 per CP rank
    with pytest.raises(ValueError) as info:
        share(item, 0, tp_size=4, sequence_parallel=True)
    assert str(info.value) == (
        "each CP rank keeps 6 of the row's 12 tokens, not a multiple of tp=4 as sequence "
        "parallelism needs (cp_size=2): pack with pad_to_multiple_of=16 (--pad-multiple 16) or "
        "pad rows to a multiple of 16"
    )
    out = share(item, 1, tp_size=2, sequence_parallel=True)  # 6 tokens divide by tp=2
    assert out["tokens"].shape == (1, 6)
    out = share(two_documents(), 1, tp_size=2, sequence_parallel=True)
    assert out["tokens"].tolist() == [[2, 3, 4, 5, 10, 11, 12, 13]]
