"""cp_share: a CP rank's share of a normalized batch (per-token fields cut, boundaries whole)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megapack import PackedBatch, Stage
from megapack.batch import make_packed_seq_params
from megapack.cp_share import take_cp_share
from megapack.inputs import Layout, Scalars, normalize
from megapack.wire import decode, encode_fields

CPU = torch.device("cpu")


def two_documents() -> PackedBatch:
    """Two documents of 8 tokens; tokens hold their row position (0..15), the docstring's example."""
    b = PackedBatch.from_documents([list(range(8)), list(range(8, 16))])
    return dataclasses.replace(b, tokens=torch.arange(16)[None])


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
    kind, tensors, scalars = normalize(two_documents())
    share = take_cp_share(kind, tensors, cp_size=2, cp_rank=rank, cp_layout=layout)  # type: ignore[arg-type]
    assert share["tokens"] is not None and share["tokens"].tolist() == [want]
    assert share["position_ids"] is not None and share["position_ids"].tolist() == [
        [i % 8 for i in want]
    ]
    assert share["cu_seqlens"] is tensors["cu_seqlens"] and scalars.max_seqlen == 8
    out = decode(*_header_payload(kind, share, scalars, Stage.ONLY))
    assert out["tokens"].tolist() == [want] and out["cu_seqlens"].tolist() == [0, 8, 16]
    assert out["max_seqlen"] == 8


def _header_payload(kind: Layout, tensors: dict, scalars: Scalars, stage: Stage) -> tuple:
    header, chunks = encode_fields(kind, tensors, scalars, stage, CPU)
    return header, torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)


def test_padded_boundaries_drive_the_document_split() -> None:
    # Documents of 3 and 2 tokens padded to 4: spans come from cu_seqlens_padded [0, 4, 8].
    b = PackedBatch.from_documents([[5, 6, 7], [8, 9]], pad_to_multiple_of=4)
    kind, tensors, _ = normalize(b)
    share = take_cp_share(kind, tensors, cp_size=2, cp_rank=1)
    assert share["tokens"].tolist() == [[6, 7, 9, 0]]  # chunks 1, 2 of [5 6 7 _] and [8 9 _ _]  # type: ignore[union-attr]
    assert share["cu_seqlens"].tolist() == [0, 3, 5]  # type: ignore[union-attr]


def test_plain_batch_splits_rows_and_the_mask_query_dim() -> None:
    b, s = 2, 8
    plain = {
        "tokens": torch.arange(b * s).reshape(b, s),
        "labels": torch.arange(b * s).reshape(b, s),
        "loss_mask": torch.ones(b, s),
        "position_ids": torch.arange(s).repeat(b, 1),
        "attention_mask": torch.arange(b * s * s).reshape(b, 1, s, s) % 3 == 0,
    }
    kind, tensors, _ = normalize(plain)
    share = take_cp_share(kind, tensors, cp_size=2, cp_rank=0, cp_layout="document")
    keep = [0, 1, 6, 7]  # plain rows always use the row layout, whatever cp_layout says
    assert share["tokens"].tolist() == [keep, [8 + i for i in keep]]  # type: ignore[union-attr]
    assert share["attention_mask"].shape == (b, 1, 4, s)  # type: ignore[union-attr]
    assert torch.equal(share["attention_mask"], plain["attention_mask"][:, :, keep, :])  # type: ignore[index]


def test_stage_drops_fields_it_does_not_receive() -> None:
    kind, tensors, scalars = normalize(two_documents())
    share = take_cp_share(kind, tensors, cp_size=2, cp_rank=0, stage=Stage.LAST)
    assert share["position_ids"] is None
    # tokens travel to the last stage as the base its labels are rebuilt from (megapack.codec)
    assert share["tokens"] is not None and share["tokens"].shape == (1, 8)
    assert share["labels"] is not None and share["labels"].shape == (1, 8)
    first = take_cp_share(kind, tensors, cp_size=2, cp_rank=0, stage=Stage.FIRST)
    assert first["labels"] is None and first["loss_mask"] is None
    header, _ = encode_fields(kind, share, scalars, Stage.LAST, CPU)
    assert (header.rows, header.cols) == (1, 8)


def test_cp_size_one_is_the_identity() -> None:
    kind, tensors, _ = normalize(two_documents())
    share = take_cp_share(kind, tensors, cp_size=1, cp_rank=0)
    assert all(share[k] is tensors[k] for k in tensors)


def test_bad_span_names_document_length_and_fix() -> None:
    kind, tensors, _ = normalize(PackedBatch.from_documents([[1] * 8, [2] * 5, [3] * 3]))
    with pytest.raises(
        ValueError, match=r"cu_seqlens document 1 spans 5 positions, not a multiple of 2\*cp=4"
    ) as e:
        take_cp_share(kind, tensors, cp_size=2, cp_rank=0)
    assert "pad_to_multiple_of=4" in str(e.value) and "sequence parallelism" not in str(e.value)
    with pytest.raises(
        ValueError, match=r"with sequence parallelism \(tp=2\) pad to a multiple of 2\*cp\*tp=8"
    ):
        take_cp_share(kind, tensors, cp_size=2, cp_rank=0, tp_size=2, sequence_parallel=True)
    # The row layout needs only T (16) to divide by 2 * cp.
    assert take_cp_share(kind, tensors, cp_size=2, cp_rank=0, cp_layout="row")["tokens"].shape == (
        1,
        8,
    )  # type: ignore[union-attr]


def test_sequence_parallel_needs_per_rank_tokens_divisible_by_tp() -> None:
    # 12 tokens, cp=2: spans of 4 and 8 divide by 4, but 6 tokens per CP rank do not divide by tp=4.
    kind, tensors, _ = normalize(PackedBatch.from_documents([[1] * 4, [2] * 8]))
    with pytest.raises(
        ValueError, match=r"each CP rank keeps 6 of the row's 12 tokens, not a multiple of tp=4"
    ):
        take_cp_share(kind, tensors, cp_size=2, cp_rank=0, tp_size=4, sequence_parallel=True)
    assert take_cp_share(kind, tensors, cp_size=2, cp_rank=0, tp_size=4)["tokens"].shape == (1, 6)  # type: ignore[union-attr]


def test_plain_rows_not_divisible_name_the_row_length() -> None:
    kind, tensors, _ = normalize({k: torch.zeros(2, 6, dtype=torch.long) for k in ("tokens", "labels", "position_ids")}
                                 | {"loss_mask": torch.ones(2, 6)})  # fmt: skip
    with pytest.raises(
        ValueError, match=r"the row holds 6 positions, not a multiple of 2\*cp=4.*plain \[b, s\]"
    ):
        take_cp_share(kind, tensors, cp_size=2, cp_rank=1)


def test_packed_seq_params_carries_cp_group_and_local_cp_size() -> None:
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    group = object()  # stands in for a ProcessGroup: the dataclass stores it as given
    psp = make_packed_seq_params(cu, cu, 4, cp_group=group, local_cp_size=2)
    assert psp.cp_group is group and psp.local_cp_size == 2
    assert (
        psp.cu_seqlens_q_padded is cu and psp.cu_seqlens_kv_padded is cu and psp.max_seqlen_q == 4
    )
