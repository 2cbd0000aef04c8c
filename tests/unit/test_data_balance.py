"""PackedDataset(balance="compute"): equal whole steps per rank, every token once, balanced ranks,
the same batches after save/load, and the token plan unchanged by default."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from megapack import PackedBatch
from megapack.data import Document, PackedDataset
from megapack.packing import CostModel, LoadOptions
from megapack.packing.balance import imbalance

SQUARES = CostModel(a=1.0, b=0.5)


def corpus(n: int = 120, seed: int = 0) -> list[Document]:
    """Long-tailed documents with tokens unique across the corpus (doc i uses ids from i * 1000)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(2.5, 1.0, n), 1, 64).astype(int)
    return [
        Document(tokens=np.arange(1000 * (i + 1), 1000 * (i + 1) + k), loss_mask=np.ones(k))
        for i, k in enumerate(lengths)
    ]


def served_cost(batch: PackedBatch) -> float:
    """Cost of a served micro-batch from its real documents (padding uses token id 0)."""
    tokens = batch.tokens[0].numpy()
    cu = batch.cu_seqlens.numpy()
    lengths = [int((tokens[a:b] != 0).sum()) for a, b in itertools.pairwise(cu)]
    return SQUARES.row_cost([k for k in lengths if k])


@pytest.mark.parametrize("dp, m, rows", [(2, 3, 1), (4, 2, 2), (3, 1, 1)])
def test_balance_dataset_shards_complete_and_balanced(dp: int, m: int, rows: int) -> None:
    docs = corpus()
    common = {"rows_per_micro_batch": rows, "dp_size": dp, "micro_batches": m}
    shards = {
        mode: [
            PackedDataset(docs, 64, **common, dp_rank=r, balance=mode, cost=SQUARES)
            for r in range(dp)
        ]
        for mode in ("token", "compute")
    }
    steps = {}
    for mode, ranks in shards.items():
        lengths = {len(ds) for ds in ranks}
        assert len(lengths) == 1 and lengths.pop() % m == 0  # whole steps, same on every rank
        seen: Counter[int] = Counter()
        per_rank = []
        for ds in ranks:
            costs = []
            for batch in ds:
                seen.update(t for t in batch.tokens[0].tolist() if t != 0)
                costs.append(served_cost(batch))
            per_rank.append(np.add.reduceat(costs, np.arange(0, len(costs), m)))
        assert seen == Counter(t for d in docs for t in d.tokens.tolist())
        steps[mode] = np.stack(per_rank, axis=1)  # [steps, dp]
        order = ranks[0].order()
        row_costs = SQUARES.bin_costs(ranks[0]._arrays["slices"], ranks[0]._arrays["bin_offsets"])
        deal = LoadOptions(dp_size=dp, micro_batches=m, rows_per_micro_batch=rows)
        want = imbalance(order, row_costs, deal)
        full = steps[mode][: ranks[0].meta["rows"] // (dp * m * rows)]
        assert np.mean(full.max(axis=1) / full.mean(axis=1)) == pytest.approx(want)
    token, compute = (np.mean(s.max(axis=1) / s.mean(axis=1)) for s in steps.values())
    assert compute <= token + 1e-9


def test_balance_dataset_save_load_and_epochs(tmp_path: Path) -> None:
    docs = corpus()
    kwargs = {"dp_size": 2, "micro_batches": 2, "balance": "compute", "cost": SQUARES}
    ds = PackedDataset(docs, 64, dp_rank=1, **kwargs)
    ds.save(tmp_path / "packed")
    loaded = PackedDataset.load(tmp_path / "packed", dp_rank=1, **kwargs)
    assert loaded.order().tolist() == ds.order().tolist()
    assert all(a.tokens.equal(b.tokens) for a, b in zip(ds, loaded, strict=True))
    first = ds.order().copy()
    ds.set_epoch(1)
    assert ds.order().tolist() != first.tolist()
    ds.set_epoch(0)
    assert ds.order().tolist() == first.tolist()


def test_balance_dataset_token_default_matches_the_seeded_shuffle() -> None:
    ds = PackedDataset(corpus(), 64, seed=3, dp_size=2)
    rows = int(ds.meta["rows"])
    want = np.random.default_rng((3, 0)).permutation(rows)
    assert ds.order()[:rows].tolist() == want.tolist() and (ds.order()[rows:] == -1).all()


def test_balance_dataset_bad_arguments() -> None:
    with pytest.raises(TypeError, match="needs cost=CostModel"):
        PackedDataset(corpus(10), 64, balance="compute")
    with pytest.raises(
        ValueError, match=r"balance must be one of \('token', 'compute'\), got 'flops'"
    ):
        PackedDataset(corpus(10), 64, balance="flops")
    with pytest.raises(ValueError, match="micro_batches"):
        PackedDataset(corpus(10), 64, micro_batches=0)
