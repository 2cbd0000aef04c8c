"""The loss fields (`megapack.core.loss_fields`) in one process: what a batch carries, each token's
document on every CP share, and what the producers (the plan, StreamingPacker, PackedDataset,
PackWriter, `with_loss_fields`) give. The losses that read them: test_loss.py."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from megapack import LOSS_FIELDS, PackedBatch, with_loss_fields
from megapack.core.cp_share import CP_LAYOUTS, cp_indices, take_share
from megapack.core.fields import schema_of
from megapack.core.intake import to_batch
from megapack.core.loss_fields import (
    attach_loss_fields,
    check_mode,
    check_reading,
    item_segments,
    segment_trained,
    step_loss_fields,
    token_documents,
)
from megapack.data import Document, PackedDataset, PackWriter, step_batches
from megapack.harness.gpt import packed_micro_batch, padded_micro_batch
from megapack.packing import Piece
from megapack.testing.host_reads import host_reads

# ------------------------------------------------------------------ step_loss_fields


def test_loss_step_fields_worked_example_whole_and_pieces() -> None:
    trained = [np.array([3, 2]), np.array([4, 0])]  # A, C's first piece | C's second piece, B
    docs, step = step_loss_fields(trained, [np.array([0, 2]), np.array([2, 1])])
    assert [d.tolist() for d in docs] == [[[3, 1], [6, 1]], [[6, 0], [0, 0]]]
    assert step.tolist() == [9, 2, 2]
    assert step.dtype == np.int64 and all(d.dtype == np.int64 for d in docs)
    docs, step = step_loss_fields(trained)
    assert [d.tolist() for d in docs] == [[[3, 1], [2, 1]], [[4, 1], [0, 0]]]
    assert step.tolist() == [9, 3, 2]


def test_loss_step_fields_count_a_document_at_its_first_trained_piece() -> None:
    # the first piece trains nothing: the second one counts the document
    docs, step = step_loss_fields([np.array([0]), np.array([5])], [np.array([7]), np.array([7])])
    assert [d.tolist() for d in docs] == [[[5, 0]], [[5, 1]]]
    assert step.tolist() == [5, 1, 2]
    # a micro-batch of keys beside one without: the keyless segments are documents of their own
    docs, step = step_loss_fields([np.array([1, 1]), np.array([1])], [np.array([0, 0]), None])
    assert [d.tolist() for d in docs] == [[[2, 1], [2, 0]], [[1, 1]]]
    assert step.tolist() == [3, 2, 2]


def test_loss_step_fields_of_a_step_without_trained_tokens_are_zero() -> None:
    docs, step = step_loss_fields([np.array([0, 0]), np.array([0])])
    assert [d.tolist() for d in docs] == [[[0, 0], [0, 0]], [[0, 0]]]
    assert step.tolist() == [0, 0, 2]


def test_loss_step_fields_refuse_keys_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="2 segments but 1 document keys"):
        step_loss_fields([np.array([1, 2])], [np.array([0])])
    with pytest.raises(ValueError, match="keys must be >= 0, got -3"):
        step_loss_fields([np.array([1])], [np.array([-3])])
    with pytest.raises(ValueError, match="keys has 1 micro-batches but trained has 2"):
        step_loss_fields([np.array([1]), np.array([1])], [None])


def test_loss_mode_and_reading_checks_name_the_value() -> None:
    assert check_mode("sequence_sum") == "sequence_sum"
    with pytest.raises(ValueError, match=r"mode='seq-mean'; choose one of \('token_mean'"):
        check_mode("seq-mean")
    assert check_reading("pieces") == "pieces"
    with pytest.raises(
        ValueError,
        match=r"split_documents='doc'; choose one of \('whole', 'pieces'\) \(a split document's",
    ):
        check_reading("doc")


# ------------------------------------------------------------------ segments of every batch form


def test_loss_segment_trained_counts_nonzero_mask_per_segment() -> None:
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 0, 0.5, 0]])
    got = segment_trained(torch.tensor([0, 3, 5, 8]), mask)
    assert got.tolist() == [2, 1, 1] and got.dtype == np.int64
    # a zero-length segment (static shapes pad with them) has none
    assert segment_trained(torch.tensor([0, 3, 3, 8]), mask).tolist() == [2, 0, 2]
    assert segment_trained(None, torch.tensor([[1.0, 0, 1], [0, 0, 0]])).tolist() == [2, 0]


def test_loss_item_segments_reads_every_form_as_the_delivery_merges_it() -> None:
    docs = [[5, 6, 7], [8, 9], [1, 2, 3, 4]]
    packed = PackedBatch.from_documents(docs, seq_len=12)
    buffer, mask = item_segments(packed)
    assert buffer.tolist() == [0, 3, 5, 9, 12] and mask is packed.loss_mask
    sft = packed_micro_batch([docs[:2], docs[2:]], 8)  # two rows, -1 sentinels
    buffer, mask = item_segments(sft)
    merged = to_batch(sft, schema_of()).values
    assert buffer.tolist() == merged["cu_seqlens"].tolist() == [0, 3, 5, 8, 12, 16]
    assert torch.equal(mask, merged["loss_mask"])
    aligned = packed_micro_batch([docs], 16, pad_to_multiple_of=4)
    assert item_segments(aligned)[0].tolist() == [0, 4, 8, 16]  # the buffer's boundaries
    plain = padded_micro_batch(docs, 6)
    buffer, mask = item_segments(plain)
    assert buffer is None and mask.shape == (3, 6)
    with pytest.raises(
        TypeError, match=r"yielded list; expected a megapack\.PackedBatch or a Megatron batch dict"
    ):
        item_segments([1, 2])


def test_loss_attach_fields_to_a_packed_batch_and_a_dict() -> None:
    packed = PackedBatch.from_documents([[5, 6, 7], [8, 9]])
    out = attach_loss_fields(packed, np.array([[2, 1], [1, 1]]), np.array([3, 2, 1]))
    assert out.extras["loss_documents"].tolist() == [[2, 1], [1, 1]]
    assert out.extras["loss_documents"].dtype == torch.int64
    assert (
        out.extras["loss_step"].tolist() == [[3, 2, 1]]
        and out.extras["loss_step"].dtype == torch.int64
    )
    to_batch(out, schema_of(LOSS_FIELDS))  # travels as declared
    plain = attach_loss_fields(padded_micro_batch([[1, 2], [3]], 4), np.zeros((2, 2)), np.zeros(3))
    assert plain["loss_documents"].shape == (2, 2)
    with pytest.raises(ValueError, match=r"shape \(3, 2\) but the batch has 2 document segments"):
        attach_loss_fields(packed, np.zeros((3, 2)), np.zeros(3))
    with pytest.raises(ValueError, match=r"already holds \['loss_documents', 'loss_step'\]"):
        attach_loss_fields(out, np.zeros((2, 2)), np.zeros(3))


# ------------------------------------------------------------------ each token's document


@pytest.mark.parametrize("layout", CP_LAYOUTS)
@pytest.mark.parametrize("padded", [False, True], ids=["cu_seqlens", "cu_seqlens_padded"])
def test_loss_token_documents_agree_on_every_cp_share_without_host_reads(
    layout: str, padded: bool
) -> None:
    docs = [[1] * 5, [2] * 11, [3] * 1, [4] * 7]
    row = PackedBatch.from_documents(docs, seq_len=48, pad_to_multiple_of=8 if padded else 1)
    buffer = row.cu_seqlens_padded if padded else row.cu_seqlens
    whole = {"loss_mask": row.loss_mask, "cu_seqlens": row.cu_seqlens,
             "cu_seqlens_padded": row.cu_seqlens_padded}  # fmt: skip
    everywhere = token_documents(whole)
    # the whole row: a token's segment is the document it belongs to (tokens hold the doc's id)
    real = row.tokens[0] > 0
    assert (everywhere[0][real] + 1 == row.tokens[0][real]).all()
    for cp in (2, 4):
        if layout == "document" and not padded:
            continue  # the "document" layout needs spans divisible by 2 * cp
        for rank in range(cp):
            share = take_share(whole | {"tokens": row.tokens}, [f for f in schema_of().fields if f.name in whole],
                               packed=True, cp_size=cp, cp_rank=rank, layout=layout)  # fmt: skip
            with host_reads() as reads:
                got = token_documents(share, cp_size=cp, cp_rank=rank, layout=layout)
            assert reads.by_module() == {}, reads.report()
            where = cp_indices(buffer, cp, rank, layout=layout)
            assert got.tolist() == everywhere[:, where].tolist()


def test_loss_token_documents_of_plain_rows_are_the_rows() -> None:
    batch = {"loss_mask": torch.ones(3, 4), "cu_seqlens": None}
    assert token_documents(batch, cp_size=2, cp_rank=1).tolist() == [[0] * 4, [1] * 4, [2] * 4]


# ------------------------------------------------------------------ producers: the plan, StreamingPacker


def _corpus() -> list[Document]:
    """Documents whose every token is their index + 1, so a segment says whose piece it is."""
    rng = np.random.default_rng(3)
    out = []
    for i, n in enumerate([3, 30, 9, 1, 70, 14, 22, 5, 17, 2, 40, 11]):
        mask = (rng.random(n) < 0.7).astype(np.float32)
        if i == 5:
            mask[:] = 0  # fully masked
        out.append(Document(tokens=np.full(n, i + 1), loss_mask=mask, source=f"d{i}"))
    return out


def _expected(batches: list[PackedBatch], whole: bool) -> tuple[list[np.ndarray], np.ndarray]:
    """The fields by definition from the step's built micro-batches (global order): a segment's
    document is its first token (padding segments: their own)."""
    trained, keys = [], []
    for b in batches:
        buffer, mask = item_segments(b)
        trained.append(segment_trained(buffer, mask))
        first = b.tokens[0, buffer[:-1].long()].numpy()
        keys.append(np.where(first > 0, first, 10_000 + np.arange(len(first)) + 100 * len(keys)))
    return step_loss_fields(trained, keys if whole else None)


@pytest.mark.parametrize(("multiple", "balance"), [(1, "token"), (4, "token"), (1, "compute")])
@pytest.mark.parametrize("reading", ["whole", "pieces"])
def test_loss_fields_of_packed_dataset_come_from_the_plan(
    multiple: int, balance: str, reading: str
) -> None:
    from megapack.packing import CostModel

    kw = dict(seq_len=32, rows_per_micro_batch=1, micro_batches=2, dp_size=2, pad_to_multiple_of=multiple,
              balance=balance, cost=CostModel(a=1.0, b=1.0) if balance == "compute" else None)  # fmt: skip
    ranks = [PackedDataset(_corpus(), dp_rank=r, loss_fields=True, split_documents=reading, **kw)
             for r in range(2)]  # fmt: skip
    plain = [PackedDataset(_corpus(), dp_rank=r, **kw) for r in range(2)]
    steps = len(ranks[0]) // 2
    assert ranks[0].meta["split_documents"] == 2 and steps >= 2
    counted = 0
    for step in range(steps):
        index = [(g % 2, step * 2 + g // 2) for g in range(4)]  # the step's global order
        documents, totals = _expected([plain[r][i] for r, i in index], reading == "whole")
        for g, (r, i) in enumerate(index):
            extras = ranks[r][i].extras
            assert extras["loss_documents"].tolist() == documents[g].tolist(), (step, g)
            assert extras["loss_step"].tolist() == [totals.tolist()]
        assert totals[2] == 4
        counted += int(totals[1])
    trained_docs = sum(1 for d in _corpus() if (d.loss_mask[1:] != 0).any())
    assert counted > trained_docs if reading == "pieces" else counted >= trained_docs


def test_loss_fields_of_packed_dataset_survive_save_and_load(tmp_path: Path) -> None:
    ds = PackedDataset(_corpus(), seq_len=32, loss_fields=True, micro_batches=2)
    ds.save(tmp_path / "p")
    loaded = PackedDataset.load(tmp_path / "p", loss_fields=True, micro_batches=2)
    assert np.array_equal(loaded._arrays["origins"], ds._arrays["origins"])
    for i in range(len(ds)):
        assert (
            loaded[i].extras["loss_documents"].tolist() == ds[i].extras["loss_documents"].tolist()
        )
    # a directory packed before origins were written: "whole" cannot know the pieces, "pieces" can
    (tmp_path / "p" / "origins.npy").unlink()
    with pytest.raises(
        ValueError, match=r"split_documents='whole' needs to know .* no origins\.npy"
    ):
        PackedDataset.load(tmp_path / "p", loss_fields=True)
    PackedDataset.load(tmp_path / "p", loss_fields=True, split_documents="pieces")
    with pytest.raises(ValueError, match="split_documents='all'"):
        PackedDataset(_corpus(), seq_len=32, loss_fields=True, split_documents="all")
    with pytest.raises(TypeError, match="loss_fields must be True or False"):
        PackedDataset(_corpus(), seq_len=32, loss_fields="yes")  # type: ignore[arg-type]


def test_loss_fields_origins_written_by_pack_writer_equal_packed_dataset(tmp_path: Path) -> None:
    writer = PackWriter(tmp_path / "w", 32, checkpoint_every=3)
    writer.write(iter(_corpus()))
    ds = PackedDataset(_corpus(), seq_len=32)
    assert np.load(tmp_path / "w" / "origins.npy").tolist() == ds._arrays["origins"].tolist()
    assert ds._arrays["origins"].tolist()[:7] == [0, 1, 2, 3, 4, 4, 4]  # 70 tokens: 3 pieces


def test_loss_fields_warn_of_a_step_without_trained_tokens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    docs = [Document(tokens=[1, 2, 3], loss_mask=[0, 0, 0])]
    ds = PackedDataset(docs, seq_len=8, loss_fields=True)
    with caplog.at_level(logging.WARNING, logger="megapack"):
        batch = ds[0]
    assert batch.extras["loss_step"].tolist() == [[0, 0, 1]]
    assert "step 0 of epoch 0 has no trained token" in caplog.text


@pytest.mark.parametrize("reading", ["whole", "pieces"])
def test_loss_fields_of_streaming_bins_match_the_definition(reading: str) -> None:
    docs = _corpus()
    bins = [[Piece(4, 0, 32, docs[4]), Piece(0, 0, 3, docs[0])], [Piece(4, 32, 64, docs[4])],
            [Piece(4, 64, 70, docs[4]), Piece(1, 0, 30, docs[1].as_dict())], [Piece(2, 0, 9, list(docs[2].tokens))]]  # fmt: skip
    ranks = [step_batches(bins, seq_len=64, dp_rank=r, dp_size=2, micro_batches=2,
                          split_documents=reading) for r in range(2)]  # fmt: skip
    got = [ranks[g % 2][g // 2] for g in range(4)]
    t4 = [
        int(np.count_nonzero(docs[4].loss_mask[a + 1 : b]))
        for a, b in ((0, 32), (32, 64), (64, 70))
    ]
    t0, t1, t2 = (
        int(np.count_nonzero(docs[0].loss_mask[1:])),
        int(np.count_nonzero(docs[1].loss_mask[1:])),
        8,
    )
    if reading == "whole":
        c4 = sum(t4)
        want = [
            [[c4, 1], [t0, 1], [0, 0]],
            [[c4, 0], [0, 0]],
            [[c4, 0], [t1, 1], [0, 0]],
            [[t2, 1], [0, 0]],
        ]
    else:
        want = [
            [[t4[0], 1], [t0, 1], [0, 0]],
            [[t4[1], 1], [0, 0]],
            [[t4[2], 1], [t1, 1], [0, 0]],
            [[t2, 1], [0, 0]],
        ]
    assert [b.extras["loss_documents"].tolist() for b in got] == want
    docs_counted = 4 if reading == "whole" else 6
    assert got[0].extras["loss_step"].tolist() == [[sum(t4) + t0 + t1 + t2, docs_counted, 4]]
    short = step_batches(bins[:1], seq_len=64, dp_size=2, micro_batches=2)  # filler rows
    assert short[1].extras["loss_documents"].tolist() == [[0, 0]]
    with pytest.raises(ValueError, match="5 bins given for one global batch of 4 rows"):
        step_batches(bins + bins[:1], seq_len=64, dp_size=2, micro_batches=2)
    with pytest.raises(TypeError, match="stream document 9 is a bare length"):
        step_batches([[Piece(9, 0, 5, 5)]], seq_len=8)


def test_loss_with_loss_fields_on_one_rank_reads_a_step_at_a_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    micro = [padded_micro_batch([[1, 2, 3], [4, 5]], 4), padded_micro_batch([[6, 7, 8, 9]], 4),
             padded_micro_batch([[1, 1]], 4)]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="megapack"):
        got = list(with_loss_fields(iter(micro), micro_batches=2, group=None))
        assert "has no trained token" not in caplog.text
        list(with_loss_fields(iter([padded_micro_batch([[1]], 4)]), micro_batches=2, group=None))
    assert (
        "with_loss_fields step 0 has no trained token (every loss_mask is 0): its loss and gradient are 0"
        in caplog.text
    )
    assert [g["loss_documents"].tolist() for g in got] == [[[2, 1], [1, 1]], [[3, 1]], [[1, 1]]]
    assert [g["loss_step"].tolist() for g in got] == [[[6, 3, 2]], [[6, 3, 2]], [[1, 1, 1]]]
    with pytest.raises(ValueError, match="micro_batches must be"):
        with_loss_fields(iter(micro), micro_batches=0, group=None)
    broken = with_loss_fields(
        iter([micro[0], {"tokens": torch.zeros(1, 2)}]), micro_batches=2, group=None
    )
    with pytest.raises(ValueError, match="batch is missing 'loss_mask'"):
        next(broken)
