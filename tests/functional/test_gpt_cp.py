"""Context-parallel GPT training through megatron-core's GPTModel and schedules on CPU gloo ranks.

megatron-core's ``parallel_state`` is built with ``context_parallel_size=cp``; the tiny GPT uses
`megapack.megatron.packed_gpt_layer_spec`, whose `PackedAttention` all-gathers K/V over the CP group
and rotates each token by its position in its document. Every run starts from the same weights
(`megapack.harness.gpt.init_weights`). Checks, for both CP layouts ("document", "row"):

* 3 SGD steps on (tp, pp, cp) = (1,1,2), (2,1,2), (1,2,2), (2,2,2), (1,1,4) give the losses of the
  cp=1 run of the same data (relative 1e-4);
* packed loss == padded loss with cp (padded [b, s] batches split by row, as Megatron does);
* changing one document changes no other document's per-token losses.

The documents include 1-token, odd-length and shorter-than-2*cp ones; for the "document" layout
every document is padded to a multiple of 8 (``pad_to_multiple_of``, = 2*cp for cp 4), for "row"
only the row length (48) divides by 2*cp.

Batches go through `megapack.get_batch_on_this_tp_rank` (`megapack.harness.gpt.forward_step`): each CP
rank's TP source reads the whole micro-batch and sends its TP peers only its CP share, with the whole
row's boundaries and ``cp_group`` in ``packed_seq_params``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pytest
import torch

from megapack.core.batch import PackedBatch
from megapack.core.cp_share import cp_indices
from megapack.harness.gpt import (
    TinyGPT,
    forward_step,
    init_weights,
    micro_batch_losses,
    padded_micro_batch,
)
from tests.functional.test_gpt_packed import traced_mean_loss

pytestmark = pytest.mark.distributed

CP_GRIDS = [(1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 1, 4)]  # (tp, pp, cp)
S = 48  # tokens per row; divides by 2 * cp for cp in {1, 2, 4}
PAD = 8  # per-document padding of the "document" layout
CHANGED = (1, 0, 2)  # (micro-batch, row, document) altered by the leakage test
GPT = TinyGPT(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
              vocab_size=128, max_sequence_length=S)  # fmt: skip


def documents(change: bool = False) -> list[list[list[list[int]]]]:
    """micro-batches -> rows -> documents -> tokens, with 1-token, odd and < 2*cp documents."""
    rng = np.random.default_rng(3)
    lengths = [[[1, 7, 3, 13], [5, 2, 17]], [[11, 1, 9, 6], [15, 3, 1, 10]]]  # padded: <= 48 a row
    micro = [[[rng.integers(1, 128, n).tolist() for n in row] for row in rows] for rows in lengths]
    if change:
        m, r, d = CHANGED
        micro[m][r][d] = [(t * 7 + 3) % 127 + 1 for t in micro[m][r][d]]
    return micro


def packed(rows: list[list[list[int]]], layout: str) -> PackedBatch:
    pad = PAD if layout == "document" else 1
    return PackedBatch.concat(
        [PackedBatch.from_documents(docs, seq_len=S, pad_to_multiple_of=pad) for docs in rows]
    )


def run(tp: int, pp: int, cp: int, *, layout: str, mode: str, steps: int, change: bool = False) -> dict[str, Any]:  # fmt: skip
    """On every rank: build the model on a tp x pp x cp grid and run ``steps`` schedule calls."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack import Topology
    from megapack.harness.megatron_cpu import megatron_on_cpu

    megatron_on_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp)  # fmt: skip
    model_parallel_cuda_manual_seed(1234)
    model = dataclasses.replace(GPT, cp_layout=layout).build()
    init_weights(model, seed=7)
    topology = Topology.from_parallel_state(cp_layout=layout)  # type: ignore[arg-type]
    docs = documents(change=change)
    if mode == "packed":
        micro: list[Any] = [packed(rows, layout) for rows in docs]
        seq_length, micro_batch_size = 2 * S, 1
    else:
        micro = [padded_micro_batch([d for row in rows for d in row], S) for rows in docs]
        seq_length, micro_batch_size = S, len(micro[0]["tokens"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    schedule = get_forward_backward_func()
    losses, per_token = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        reduced = schedule(
            forward_step_func=functools.partial(forward_step, topology, loss=traced_mean_loss),
            data_iterator=iter(micro) if topology.is_source else None, model=[model], num_microbatches=len(micro),
            seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=steps == 1,
        )  # fmt: skip
        if steps > 1:
            for p in model.parameters():  # megatron-core's DDP averages over the dp x cp group
                if p.grad is not None and cp > 1:
                    dist.all_reduce(p.grad, group=topology.cp_group)
                    p.grad /= cp
            optimizer.step()
        losses.append(micro_batch_losses(reduced, topology.cp_group if cp > 1 else None))
        per_token = [r["per_token"] for r in reduced]
    return {"last": topology.is_last_stage, "tp_rank": topology.tp_rank, "cp_rank": topology.cp_rank,
            "cp": cp, "losses": losses, "per_token": per_token}  # fmt: skip


def last_stage(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Losses of the last stage after checking all its TP and CP ranks report the same."""
    last = [r for r in results if r["last"]]
    assert len(last) == results[0]["cp"] * (1 + max(r["tp_rank"] for r in results))
    for r in last[1:]:
        assert r["losses"] == last[0]["losses"], "TP/CP ranks of the last stage disagree"
    return last[0]


def per_token_row(results: list[dict[str, Any]], layout: str) -> list[torch.Tensor]:
    """Each micro-batch's per-token losses in row order, reassembled from the CP ranks."""
    last = [r for r in results if r["last"] and r["tp_rank"] == 0]
    cp = last[0]["cp"]
    rows = []
    for m, rows_docs in enumerate(documents()):
        batch = packed(rows_docs, layout)
        cu = batch.cu_seqlens if batch.cu_seqlens_padded is None else batch.cu_seqlens_padded
        full = torch.zeros(batch.tokens.shape[1])
        for r in last:
            full[cp_indices(cu, cp, r["cp_rank"], layout=layout)] = r["per_token"][m][0]
        rows.append(full)
    return rows


def run_on_pool(pool: Any, tp: int, pp: int, cp: int, **kwargs: Any) -> list[dict[str, Any]]:
    return pool.run(functools.partial(run, tp, pp, cp, **kwargs), tp * pp * cp, timeout=180)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def reference(dist_pool: Any) -> dict[str, list[list[float]]]:
    """The cp=1 losses over 3 steps, per layout."""
    runs = {
        layout: run_on_pool(dist_pool, 1, 1, 1, layout=layout, mode="packed", steps=3)
        for layout in ("document", "row")
    }
    return {layout: last_stage(results)["losses"] for layout, results in runs.items()}


@pytest.mark.parametrize("layout", ["document", "row"])
@pytest.mark.parametrize("grid", CP_GRIDS, ids=lambda g: f"tp{g[0]}-pp{g[1]}-cp{g[2]}")
def test_cp_training_matches_cp1(dist_pool: Any, reference: Any, grid: tuple[int, int, int], layout: str) -> None:  # fmt: skip
    tp, pp, cp = grid
    got = last_stage(run_on_pool(dist_pool, tp, pp, cp, layout=layout, mode="packed", steps=3))
    np.testing.assert_allclose(got["losses"], reference[layout], rtol=1e-4)
    assert np.mean(got["losses"][-1]) < np.mean(got["losses"][0]), "loss did not fall"


@pytest.mark.parametrize("layout", ["document", "row"])
def test_cp_packed_loss_equals_padded_loss(dist_pool: Any, layout: str) -> None:
    packed_run = last_stage(run_on_pool(dist_pool, 2, 1, 2, layout=layout, mode="packed", steps=1))
    padded_run = last_stage(run_on_pool(dist_pool, 2, 1, 2, layout=layout, mode="padded", steps=1))
    np.testing.assert_allclose(packed_run["losses"][0], padded_run["losses"][0], rtol=1e-5)


@pytest.mark.parametrize(("layout", "cp"), [("document", 4), ("row", 2)])
def test_cp_no_cross_document_leakage(dist_pool: Any, layout: str, cp: int) -> None:
    base, changed = (
        run_on_pool(dist_pool, 1, 1, cp, layout=layout, mode="packed", steps=1, change=c)
        for c in (False, True)
    )
    before, after = per_token_row(base, layout), per_token_row(changed, layout)
    m, r, d = CHANGED
    row = documents()[m][r]
    span = [-(-len(doc) // PAD) * PAD if layout == "document" else len(doc) for doc in row]
    a = r * S + sum(span[:d])
    b = a + len(row[d])
    for i, (x, y) in enumerate(zip(before, after, strict=True)):
        if i != m:
            torch.testing.assert_close(x, y, rtol=0, atol=0)
            continue
        outside = torch.ones_like(x, dtype=torch.bool)
        outside[a:b] = False
        torch.testing.assert_close(x[outside], y[outside], rtol=1e-6, atol=1e-6)
        assert not torch.allclose(x[a:b], y[a:b]), (
            "the changed document's own losses did not change"
        )
