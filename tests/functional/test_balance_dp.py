"""PackedDataset(balance="compute") on real data-parallel ranks (gloo workers): every rank derives
the same plan on its own (no collective), so the ranks' shards are disjoint, complete, of equal
length, and each step's rank costs are the balanced ones the plan promises."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from megapack.data import Document, PackedDataset
from megapack.packing import CostModel, LoadOptions
from megapack.packing.balance import imbalance, rank_costs

pytestmark = pytest.mark.distributed

COST = CostModel(a=1.0, b=0.05)
SEQ, MICRO = 64, 3


def corpus() -> list[Document]:
    lengths = np.clip(np.random.default_rng(7).lognormal(2.8, 1.0, 300), 1, 64).astype(int)
    return [
        Document(tokens=np.arange(1000 * (i + 1), 1000 * (i + 1) + k), loss_mask=np.ones(k))
        for i, k in enumerate(lengths)
    ]


def shard_on_rank(balance: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = PackedDataset(corpus(), SEQ, dp_rank=rank, dp_size=world, micro_batches=MICRO,
                       balance=balance, cost=COST, seed=5)  # fmt: skip
    ds.set_epoch(2)
    tokens, costs = [], []
    for batch in ds:
        row = batch.tokens[0].numpy()
        cu = batch.cu_seqlens.numpy()
        lengths = [int((row[a:b] != 0).sum()) for a, b in itertools.pairwise(cu)]
        costs.append(COST.row_cost([k for k in lengths if k]))
        tokens.extend(int(t) for t in row if t != 0)
    return {"tokens": tokens, "costs": costs, "order": ds.order().tolist()}


@pytest.mark.parametrize("world", [2, 4])
def test_balance_ranks_agree_and_are_balanced(dist_pool: Any, world: int) -> None:
    results = {m: dist_pool.run(shard_on_rank, world, m, timeout=120) for m in ("token", "compute")}
    ref = PackedDataset(corpus(), SEQ, dp_size=world, micro_batches=MICRO, balance="compute",
                        cost=COST, seed=5)  # fmt: skip
    ref.set_epoch(2)
    row_costs = COST.bin_costs(ref._arrays["slices"], ref._arrays["bin_offsets"])
    deal = LoadOptions(dp_size=world, micro_batches=MICRO)
    want_tokens = Counter(t for d in corpus() for t in d.tokens.tolist())
    measured = {}
    for mode, ranks in results.items():
        assert all(r["order"] == ranks[0]["order"] for r in ranks)  # one plan, derived everywhere
        assert len({len(r["costs"]) for r in ranks}) == 1 and len(ranks[0]["costs"]) % MICRO == 0
        assert Counter(t for r in ranks for t in r["tokens"]) == want_tokens
        steps = np.stack(
            [np.add.reduceat(r["costs"], np.arange(0, len(r["costs"]), MICRO)) for r in ranks], 1
        )
        order = np.array(ranks[0]["order"])
        np.testing.assert_allclose(steps, rank_costs(order, row_costs, deal))
        measured[mode] = imbalance(order, row_costs, deal)
    assert results["compute"][0]["order"] == ref.order().tolist()
    assert measured["compute"] < measured["token"]
