"""On NCCL: no synchronizing CUDA call per micro-batch on any TP rank (split header/payload path).

Needs 2 GPUs; skipped at collection time otherwise (this CPU-only dev machine cannot run it). Every
rank runs ``get_batch_on_this_tp_rank`` under ``torch.cuda.set_sync_debug_mode("error")`` after a
warm-up call (which creates the gloo control group and lazily imports megatron), with and
without `megapack.prefetch`; any device-to-host copy or host wait raises on the rank that made it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from megapack import get_batch_on_this_tp_rank, prefetch
from megapack.harness.grid import grid_topology
from megapack.harness.pool import WorkerPool
from megapack.testing.grids import Grid
from tests.functional.test_tp_pp_grid import _summary, stream

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs 2 CUDA devices (NCCL)",
    ),
]


def run_without_syncs(tp: int, pp: int, depth: int) -> list[dict[str, Any]]:
    torch.cuda.set_device(dist.get_rank())
    topo = grid_topology(tp, pp)
    items = stream(1) + stream(1)
    data = iter(items) if topo.is_source else None
    out = []
    if depth:
        batches = prefetch(data, topology=topo, depth=depth)
        fetch = lambda: next(batches)  # noqa: E731
    else:
        fetch = lambda: get_batch_on_this_tp_rank(data, topology=topo)  # noqa: E731
    out.append(_summary(fetch()))  # warm-up: control group, imports
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(len(items) - 1):
            out.append(fetch())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    if depth:
        batches.close()
    summaries = [out[0], *(_summary(b) for b in out[1:])]
    return [
        {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in summaries
    ]


@pytest.mark.parametrize("depth", [0, 2], ids=["no-prefetch", "prefetch2"])
def test_no_synchronizing_call_per_micro_batch(depth: int) -> None:
    grid = Grid(2, 1)
    with WorkerPool(size=2, backend="nccl", preload=("torch", "megapack")) as pool:
        results = pool.run(run_without_syncs, grid.world_size, grid.tp, grid.pp, depth, timeout=120)
    for r in results[1:]:
        assert len(r) == len(results[0])
        for a, b in zip(r, results[0], strict=True):
            for key in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens"):
                assert (a[key] is None) == (b[key] is None)
                if a[key] is not None:
                    assert torch.equal(a[key], b[key]), key
