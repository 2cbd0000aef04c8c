"""No host reads on the delivery path (issue 24): what a GPU would sync on, counted on CPU.

On NCCL a peer gets the header on the host and the payload as device tensors, and decodes them
into views: it must never read a device tensor on the host (a sync that stalls the step's
run-ahead). This test counts host reads (`megapack.testing.host_reads`) on the gloo worker pool,
with `decode` taking its device path (views through torch, as for a CUDA payload), after a
warm-up call:

* every peer, every transport (local link, header over the link + payload broadcast, header on
  the control group + payload broadcast) and through `prefetch`: 0 reads, except the prefetch
  agreement's flags (a CPU tensor of the gloo control group on every backend);
* the TP source: reads only while checking and laying out its host input (the data iterator's
  batch is on the host; nothing there reads a device tensor).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from megapack import PackedBatch, get_batch_on_this_tp_rank, prefetch
from megapack.delivery import wire
from megapack.delivery.transport import use_transport
from megapack.harness.grid import grid_topology
from megapack.testing.host_reads import host_reads

pytestmark = pytest.mark.distributed

SOURCE_INPUT = {"megapack.core", "megapack.delivery.wire"}
"""The source's host input: checked (core.intake, core.batch, core.cp_share) and laid out (wire)."""
AGREEMENT = {"megapack.delivery.prefetch"}
"""The prefetch thread's per-batch agreement reads its gloo flags (CPU on every backend)."""


def batches(n: int) -> list[PackedBatch]:
    return [PackedBatch.from_documents([[1, 2, 3] * (i + 1), [4] * 40, [5, 6]], seq_len=64,
                                       pad_to_multiple_of=2) for i in range(n)]  # fmt: skip


def run_reads(mode: str, ahead: bool, device_views: bool = True) -> dict[str, Any]:
    numpy_views = wire._numpy_views
    if device_views:
        wire._numpy_views = lambda payload: False  # decode as for a device payload
    try:
        with use_transport(mode):
            topo = grid_topology(dist.get_world_size(), 1)
            data = iter(batches(4)) if topo.is_source else None
            allow = SOURCE_INPUT if topo.is_source else set()
            if ahead:
                with prefetch(data, topology=topo, depth=2) as it:
                    next(it)  # warm-up
                    with host_reads(allow=allow | AGREEMENT) as reads:
                        got = [next(it) for _ in range(3)]
            else:
                get_batch_on_this_tp_rank(data, topology=topo)  # warm-up: set-up, imports
                with host_reads(allow=allow) as reads:
                    got = [get_batch_on_this_tp_rank(data, topology=topo) for _ in range(3)]
            dist.barrier()
    finally:
        wire._numpy_views = numpy_views
    return {"source": topo.is_source, "unexpected": [r.where() for r in reads.unexpected()],
            "report": reads.report(), "cu": [b["cu_seqlens"].tolist() for b in got]}  # fmt: skip


@pytest.mark.parametrize("ahead", [False, True], ids=["call", "prefetch"])
@pytest.mark.parametrize("mode", ["auto", "split", "collectives"])
def test_sync_free_delivery_no_peer_reads_a_device_tensor(
    dist_pool: Any, mode: str, ahead: bool
) -> None:
    results = dist_pool.run(run_reads, 2, mode, ahead, timeout=60)
    want = [b.cu_seqlens.tolist() for b in batches(4)[1:]]
    for r in results:
        assert r["cu"] == want
        assert r["unexpected"] == [], r["report"]
    peer = next(r for r in results if not r["source"])
    assert ahead or peer["report"].startswith("0 host reads"), peer["report"]


def test_sync_free_delivery_check_catches_a_read(dist_pool: Any) -> None:
    # The check itself: decoding through numpy (the host path, a read of the payload) is caught
    # on the peer.
    results = dist_pool.run(run_reads, 2, "split", False, False, timeout=60)
    peer = next(r for r in results if not r["source"])
    assert peer["unexpected"] and "in decode" in peer["unexpected"][0], peer["report"]
