"""PackedDataset: nothing lost, rows never overflow, equal shards, epochs, save/load, long documents."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from megapack import PackedBatch
from megapack.data import Document, PackedDataset
from megapack.packing import LoadOptions, PackOptions


def corpus(n: int = 40, seed: int = 0, max_len: int = 50) -> list[Document]:
    """Documents whose tokens are unique across the corpus (doc i uses ids from i * 1000), to trace them."""
    rng = np.random.default_rng(seed)
    return [_doc(i, int(rng.integers(1, max_len))) for i in range(n)]


def _doc(i: int, n: int) -> Document:
    tokens = np.arange(1000 * (i + 1), 1000 * (i + 1) + n)
    return Document(tokens=tokens, loss_mask=np.ones(n, dtype=np.float32))


def real_tokens(batch: PackedBatch) -> list[int]:
    """The document tokens of a batch (padding uses id 0, which no document uses)."""
    return [t for t in batch.tokens[0].tolist() if t != 0]


def all_tokens(docs: list[Document]) -> Counter[int]:
    return Counter(t for d in docs for t in d.tokens.tolist())


@pytest.mark.parametrize("pad", [1, 8])
@pytest.mark.parametrize("rows", [1, 3])
def test_every_token_exactly_once_and_rows_fit(pad: int, rows: int) -> None:
    docs = corpus()
    ds = PackedDataset(docs, 64, rows_per_micro_batch=rows, pad_to_multiple_of=pad)
    seen: Counter[int] = Counter()
    for batch in ds:
        batch.validate()
        assert batch.tokens.shape == (1, rows * 64)
        seen.update(real_tokens(batch))
        if pad > 1:
            assert batch.cu_seqlens_padded is not None
            assert ((batch.cu_seqlens_padded[1:-1] % pad) == 0).all()  # documents start aligned
    assert seen == all_tokens(docs)


def test_labels_stay_inside_documents() -> None:
    ds = PackedDataset(corpus(), 64)
    for batch in ds:
        tokens, labels, mask = batch.tokens[0], batch.labels[0], batch.loss_mask[0]
        trained = mask.bool()
        # a trained position predicts the next token of the same document: ids differ by exactly 1
        assert torch.equal(labels[trained], tokens[trained] + 1)


def test_data_parallel_shards_are_equal_and_complete() -> None:
    docs = corpus(37)
    shards = [PackedDataset(docs, 64, dp_rank=r, dp_size=3) for r in range(3)]
    assert len({len(s) for s in shards}) == 1
    seen: Counter[int] = Counter()
    fillers = 0
    for shard in shards:
        for batch in shard:
            tokens = real_tokens(batch)
            if not tokens:
                fillers += 1
                assert batch.loss_mask.sum() == 0  # padding micro-batches train nothing
            seen.update(tokens)
    assert seen == all_tokens(docs)
    assert fillers == shards[0].padded_micro_batches - shards[0].num_micro_batches < 3


def test_epochs_reshuffle_deterministically() -> None:
    docs = corpus()
    a, b = PackedDataset(docs, 64, seed=3), PackedDataset(docs, 64, seed=3)
    first = [real_tokens(x) for x in a]
    assert first == [real_tokens(x) for x in b]
    a.set_epoch(1)
    b.set_epoch(1)
    second = [real_tokens(x) for x in a]
    assert second == [real_tokens(x) for x in b]
    assert second != first and sorted(map(tuple, second)) == sorted(map(tuple, first))


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    ds = PackedDataset(corpus(), 64, pad_to_multiple_of=4, algorithm="ffd", seed=5)
    loaded = PackedDataset.load(ds.save(tmp_path / "packed"), rows_per_micro_batch=1)
    assert len(loaded) == len(ds) and loaded.meta == ds.meta
    for x, y in zip(ds, loaded, strict=True):
        for name in (
            "tokens",
            "labels",
            "loss_mask",
            "position_ids",
            "cu_seqlens",
            "cu_seqlens_padded",
        ):
            assert torch.equal(getattr(x, name), getattr(y, name)), name


def test_long_documents_split_at_message_boundaries() -> None:
    long = Document(
        tokens=np.arange(1, 151), loss_mask=np.ones(150, dtype=np.float32), boundaries=(40, 90, 120)
    )
    ds = PackedDataset([long], 100)
    pieces = sorted((real_tokens(b) for b in ds), key=lambda t: t[0])
    assert [p[0] for p in pieces] == [1, 91]  # cut at the message start 90, not at 100
    assert sum(len(p) for p in pieces) == 150


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_other_long_document_policies(policy: str) -> None:
    docs = [_doc(0, 10), _doc(1, 80)]
    ds = PackedDataset(docs, 64, long_docs=policy)
    seen = Counter(t for b in ds for t in real_tokens(b))
    kept = Counter(docs[1].tokens[:64].tolist()) if policy == "truncate" else Counter()
    assert seen == all_tokens([docs[0]]) + kept
    lost = (ds.meta["truncated_tokens"], ds.meta["dropped_tokens"])
    assert lost == ((16, 0) if policy == "truncate" else (0, 80))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"seq_len": 60, "pad_to_multiple_of": 8},
            "seq_len=60 must be a multiple of pad_to_multiple_of=8",
        ),
        ({"seq_len": 64, "dp_rank": 3, "dp_size": 3}, "dp_rank=3 is outside dp_size=3"),
        ({"seq_len": 64, "long_docs": "wrap"}, "long_docs must be one of .*, got 'wrap'"),
        ({"seq_len": 0}, "seq_len must be an int >= 1, got 0"),
        (
            {"seq_len": 64, "rows_per_micro_batch": 0},
            "rows_per_micro_batch must be an int >= 1, got 0",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    rest = {k: v for k, v in kwargs.items() if k != "seq_len"}  # the parameter is shared: no pop
    with pytest.raises(ValueError, match=match):
        PackedDataset(corpus(5), kwargs["seq_len"], **rest)


def test_empty_corpus_and_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="documents is empty: nothing to pack"):
        PackedDataset([], 64)
    with pytest.raises(FileNotFoundError, match=r"meta\.json not found"):
        PackedDataset.load(tmp_path)


def test_a_spent_read_documents_iterator_is_named_as_the_cause(tmp_path: Path) -> None:
    from megapack.data import read_documents

    path = tmp_path / "sft.jsonl"
    path.write_text('{"text": "hello"}\n{"text": "world"}\n')
    docs = read_documents(path)
    assert len(PackedDataset(docs, 64)) == 1
    with pytest.raises(
        ValueError, match=r"documents is empty: the iterator \(JsonlReader\) .*one-pass"
    ):
        PackedDataset(docs, 64)  # the same iterator, already consumed
    reusable = list(read_documents(path))
    assert len(PackedDataset(reusable, 64)) == len(PackedDataset(reusable, 64)) == 1


def test_rows_carry_each_documents_loss_mask_and_the_pad_id() -> None:
    """Documents [5, 6, 7] (mask 0 1 1: the first token is a prompt) and [8, 9] (mask 1 0), seq_len
    8, pad id 3: one row. A position is learned when the token it predicts is: 5->6 and 6->7;
    8->9 is not (9 is masked), and no position predicts across a document or into padding."""
    docs = [Document(tokens=[5, 6, 7], loss_mask=[0, 1, 1], source="a"),
            Document(tokens=[8, 9], loss_mask=[1, 0], source="b")]  # fmt: skip
    ds = PackedDataset(docs, 8, pad_token_id=3)
    batch = ds[0]
    assert batch.tokens[0].tolist() == [5, 6, 7, 8, 9, 3, 3, 3]
    assert batch.labels[0].tolist() == [6, 7, 3, 9, 3, 3, 3, 3]
    assert batch.loss_mask[0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 8]
    with pytest.raises(
        IndexError, match=r"^PackedDataset index 1 out of range for 1 micro-batches$"
    ):
        ds[1]
    assert [b.tokens.tolist() for b in ds.iterate()] == [b.tokens.tolist() for b in ds]


def test_filler_micro_batches_are_whole_zero_loss_rows() -> None:
    """Two ranks, one row: rank 1 gets a filler micro-batch of seq_len padding tokens."""
    docs = [Document(tokens=[5, 6, 7], loss_mask=[1, 1, 1])]
    filler = PackedDataset(docs, 8, dp_rank=1, dp_size=2, pad_token_id=3, pad_to_multiple_of=4)[0]
    assert filler.tokens[0].tolist() == [3] * 8 and filler.loss_mask[0].tolist() == [0.0] * 8
    assert filler.cu_seqlens.tolist() == [0, 8]
    two = PackedDataset(docs * 3, 4, rows_per_micro_batch=2, pad_token_id=3)  # 3 rows + filler
    assert [b.tokens.shape[1] for b in two] == [8, 8]
    last = two[1]  # the shuffled order is padded at the end: [row, row], [row, filler]
    assert last.tokens[0, 4:].tolist() == [3] * 4 and last.loss_mask[0, 4:].sum() == 0


def test_meta_records_the_settings_and_counts() -> None:
    docs = [Document(tokens=np.arange(1, n + 1), loss_mask=np.ones(n)) for n in (10, 8, 3, 20)]
    meta = PackedDataset(docs, 8).meta  # 10 -> 8 + 2 and 20 -> 8 + 8 + 4; 8 fits exactly
    assert (meta["input_documents"], meta["split_documents"], meta["documents"]) == (4, 2, 7)
    assert meta["packing"] == PackOptions(seq_len=8).to_dict()  # how it was packed, every field
    assert PackedDataset(docs, 8, cp_size=2, long_docs="truncate").meta["packing"]["cp_size"] == 2
    truncated = PackedDataset(docs, 8, long_docs="truncate").meta
    assert (truncated["input_documents"], truncated["split_documents"]) == (4, 0)


def test_compute_balance_deals_rows_by_their_cost(tmp_path: Path) -> None:
    """``balance="compute"``: each epoch's order is `order_rows` of the rows' costs, seeded with
    (seed, epoch); loading the directory with the same settings deals the same rows."""
    from megapack.packing import CostModel
    from megapack.packing.balance import order_rows

    docs = corpus(60)
    cost = CostModel(a=1, b=1)
    layout = {"dp_size": 2, "micro_batches": 2, "rows_per_micro_batch": 1}
    deal = LoadOptions(balance="compute", cost=cost, **layout)
    ds = PackedDataset(docs, 64, seed=3, balance="compute", cost=cost, **layout)
    costs = cost.bin_costs(ds._arrays["slices"], ds._arrays["bin_offsets"])
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        want = order_rows(costs, deal, seed=(3, epoch))
        assert ds.order().tolist() == want.tolist()
    token = PackedDataset(docs, 64, seed=3, **layout)
    rows = int(token.meta["rows"])
    shuffle = np.random.default_rng((3, 0)).permutation(rows).tolist()
    assert token.order().tolist() == shuffle + [-1] * (-rows % 4)
    ds.save(tmp_path / "p")
    loaded = PackedDataset.load(tmp_path / "p", balance="compute", cost=cost, **layout)
    assert loaded.order().tolist() == order_rows(costs, deal, seed=(3, 0)).tolist()
    with pytest.raises(TypeError, match=r"^balance='compute' needs cost=CostModel"):
        PackedDataset(docs, 64, balance="compute")
    with pytest.raises(
        ValueError, match=r"^balance must be one of \('token', 'compute'\), got 'flops'$"
    ):
        PackedDataset(docs, 64, balance="flops")
    with pytest.raises(ValueError, match=r"^dp_size must be an int >= 1, got 0$"):
        PackedDataset(docs, 64, dp_size=0)


def test_save_and_load_details(tmp_path: Path) -> None:
    """save makes parent folders and may write over a directory; meta.json is indented JSON;
    load pads with the saved pad id (0 for a meta without one) unless told otherwise, serves
    one row per micro-batch by default, and refuses another format version."""
    import json

    docs = [Document(tokens=[5, 6, 7], loss_mask=[1, 1, 1])] * 3
    ds = PackedDataset(docs, 4, pad_token_id=9)
    out = ds.save(tmp_path / "a" / "b")
    ds.save(out)  # again: the same directory
    assert (out / "meta.json").read_text() == json.dumps(ds.meta, indent=2) + "\n"
    assert len(PackedDataset.load(out)) == 3
    assert PackedDataset.load(out)[0].tokens[0].tolist() == [5, 6, 7, 9]
    assert PackedDataset.load(out, pad_token_id=1)[0].tokens[0].tolist() == [5, 6, 7, 1]
    meta = json.loads((out / "meta.json").read_text())
    del meta["pad_token_id"]
    (out / "meta.json").write_text(json.dumps(meta))
    assert PackedDataset.load(out)[0].tokens[0].tolist() == [5, 6, 7, 0]
    (out / "meta.json").write_text(json.dumps({**meta, "version": 1}))
    with pytest.raises(
        ValueError,
        match=rf"^{out / 'meta.json'}: format version 1, this megapack reads 2: pack it again$",
    ):
        PackedDataset.load(out)
    (out / "meta.json").write_text(json.dumps({**meta, "packing": {**meta["packing"], "x": 1}}))
    with pytest.raises(ValueError, match=r"\"packing\" has 'x', which PackOptions does not know"):
        PackedDataset.load(out)


def test_empty_corpus_messages_name_the_cause() -> None:
    with pytest.raises(ValueError, match=r"^documents is empty: nothing to pack$"):
        PackedDataset([], 64)
    with pytest.raises(
        ValueError,
        match=r"^documents is empty: the iterator \(list_iterator\) yielded no documents\. "
        r"read_documents\(\.\.\.\) returns a one-pass iterator: if an earlier PackedDataset or "
        r"list\(\) consumed it, call read_documents again, or keep docs = "
        r"list\(read_documents\(\.\.\.\)\) to reuse$",
    ):
        PackedDataset(iter([]), 64)
