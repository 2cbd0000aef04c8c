"""Packed GPT training through megatron-core's real GPTModel and schedules on tp x pp grids (CPU, gloo).

Every run starts from the same topology-independent weights (`megapack.harness.gpt.init_weights`),
uses 2 micro-batches of 2 Megatron SFT rows (mbs > 1, several micro-batches per step) and feeds the
model through `megapack.get_batch_on_this_tp_rank`. Checks:

* packed loss == padded loss for the same documents and weights (relative 1e-5, fp32);
* 3 SGD steps on every grid give the losses of the tp=1 x pp=1 run (relative 1e-4);
* changing one document changes its own per-token losses and no other document's.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

from megapack.harness.gpt import (
    TinyGPT,
    forward_step,
    init_weights,
    micro_batch_losses,
    packed_micro_batch,
    padded_micro_batch,
)
from megapack.megatron.loss import normalized_loss
from megapack.testing.grids import Grid

pytestmark = pytest.mark.distributed

GPT_GRIDS = [Grid(1, 1), Grid(2, 1), Grid(1, 2), Grid(2, 2), Grid(1, 4), Grid(2, 4)]
S = 24  # tokens per Megatron row
ROWS, DOCS_PER_ROW, MICRO_BATCHES = 2, 2, 2
CHANGED = (0, 1, 0)  # (micro-batch, row, document) altered by the leakage test


def documents(seed: int = 0, change: bool = False) -> list[list[list[list[int]]]]:
    """micro-batches -> rows -> documents -> tokens; every row's documents fit in S tokens."""
    rng = np.random.default_rng(seed)
    micro = []
    for _ in range(MICRO_BATCHES):
        rows = []
        for _ in range(ROWS):
            a = int(rng.integers(3, S // 2))
            b = int(rng.integers(3, S - a + 1))
            rows.append([rng.integers(1, 128, a).tolist(), rng.integers(1, 128, b).tolist()])
        micro.append(rows)
    if change:
        m, r, d = CHANGED
        doc = micro[m][r][d]
        micro[m][r][d] = [(t * 7 + 3) % 127 + 1 for t in doc]
    return micro


def traced_mean_loss(batch: dict[str, Any], cp_group: Any) -> Any:
    """The harness's default loss (each micro-batch's mean), its report also holding the masked
    per-token losses."""

    def loss(per_token: torch.Tensor) -> Any:
        out = normalized_loss(batch, per_token, mode="micro_batch_mean",
                              calculate_per_token_loss=False, cp_group=cp_group)  # fmt: skip
        out[-1]["per_token"] = (per_token.detach() * batch["loss_mask"]).clone()
        return out

    return loss


def run(
    tp: int, pp: int, *, mode: str, steps: int, position: str = "rope", change: bool = False
) -> dict[str, Any]:
    """On every rank: build the model, run ``steps`` schedule calls (training when steps > 1)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack import Topology
    from megapack.harness.megatron_cpu import megatron_on_cpu

    megatron_on_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(1234)
    model = TinyGPT(position_embedding_type=position).build()
    init_weights(model, seed=7)
    topology = Topology.from_parallel_state()
    docs = documents(change=change)
    if mode == "packed":
        micro = [packed_micro_batch(rows, S) for rows in docs]
        seq_length, micro_batch_size = ROWS * S, 1  # THD: [T, 1, hidden] between stages
    else:
        micro = [padded_micro_batch([d for row in rows for d in row], S) for rows in docs]
        seq_length, micro_batch_size = S, ROWS * DOCS_PER_ROW
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    schedule = get_forward_backward_func()
    losses, per_token = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        reduced = schedule(
            forward_step_func=functools.partial(forward_step, topology, loss=traced_mean_loss),
            data_iterator=iter(micro) if topology.is_source else None,
            model=[model],
            num_microbatches=len(micro),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=steps == 1,
        )
        if steps > 1:
            optimizer.step()
        losses.append(micro_batch_losses(reduced))
        per_token = [r["per_token"] for r in reduced]
    return {
        "last": topology.is_last_stage,
        "tp_rank": topology.tp_rank,
        "losses": losses,
        "per_token": per_token,
    }


def last_stage(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The last stage's result, after checking that all its TP ranks agree exactly."""
    last = [r for r in results if r["last"]]
    for r in last[1:]:
        assert r["losses"] == last[0]["losses"], "TP ranks of the last stage disagree"
    assert all(not r["losses"][0] for r in results if not r["last"]), (
        "only the last stage reports losses"
    )
    return last[0]


@pytest.fixture(scope="module")
def reference_training(dist_pool: Any) -> list[list[float]]:
    return last_stage(
        dist_pool.run(functools.partial(run, 1, 1, mode="packed", steps=3), 1, timeout=120)
    )["losses"]


@pytest.mark.parametrize("position", ["rope", "learned_absolute"])
@pytest.mark.parametrize("grid", GPT_GRIDS, ids=lambda g: g.id)
def test_packed_loss_equals_padded_loss(dist_pool: Any, grid: Grid, position: str) -> None:
    packed = last_stage(
        dist_pool.run(
            functools.partial(run, grid.tp, grid.pp, mode="packed", steps=1, position=position),
            grid.world_size,
            timeout=120,
        )
    )
    padded = last_stage(dist_pool.run(functools.partial(run, grid.tp, grid.pp, mode="padded", steps=1, position=position), grid.world_size, timeout=120))  # fmt: skip
    assert len(packed["losses"][0]) == MICRO_BATCHES
    np.testing.assert_allclose(packed["losses"][0], padded["losses"][0], rtol=1e-5)


@pytest.mark.parametrize("grid", GPT_GRIDS, ids=lambda g: g.id)
def test_training_matches_single_rank(
    dist_pool: Any, grid: Grid, reference_training: list[list[float]]
) -> None:
    got = last_stage(dist_pool.run(functools.partial(run, grid.tp, grid.pp, mode="packed", steps=3), grid.world_size, timeout=120))  # fmt: skip
    np.testing.assert_allclose(got["losses"], reference_training, rtol=1e-4)
    first, final = np.mean(got["losses"][0]), np.mean(got["losses"][-1])
    assert final < first, f"loss did not fall over 3 steps: {first} -> {final}"


@pytest.mark.parametrize("grid", GPT_GRIDS, ids=lambda g: g.id)
def test_no_cross_document_leakage(dist_pool: Any, grid: Grid) -> None:
    base = last_stage(
        dist_pool.run(
            functools.partial(run, grid.tp, grid.pp, mode="packed", steps=1),
            grid.world_size,
            timeout=120,
        )
    )
    changed = last_stage(dist_pool.run(functools.partial(run, grid.tp, grid.pp, mode="packed", steps=1, change=True), grid.world_size, timeout=120))  # fmt: skip
    m, r, d = CHANGED
    doc_len = len(documents()[m][r][d])
    start = r * S + sum(len(x) for x in documents()[m][r][:d])
    inside = torch.zeros(ROWS * S, dtype=torch.bool)
    inside[start : start + doc_len] = True
    for i, (a, b) in enumerate(zip(base["per_token"], changed["per_token"], strict=True)):
        a, b = a.reshape(-1), b.reshape(-1)
        outside = ~inside if i == m else torch.ones_like(inside)
        torch.testing.assert_close(a[outside], b[outside], rtol=0, atol=1e-6)
        if i == m:
            assert not torch.allclose(a[inside], b[inside]), (
                "the changed document's losses did not change"
            )
