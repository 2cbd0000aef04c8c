"""Transfer benchmark: one micro-batch from the TP source to its peers, three ways, side by side.

* ``megapack``: `megapack.get_batch_on_this_tp_rank`, validation and PackedSeqParams included.
* ``per_tensor``: what Megatron-LM's ``get_batch_on_this_tp_rank`` does for a packed batch: one
  broadcast per tensor (tokens, labels, loss_mask, position_ids), a broadcast of the ``cu_seqlens``
  length followed by a host sync (``.item()``) to allocate, the ``cu_seqlens`` broadcast, and a
  ``max_seqlen`` broadcast with another host sync: 7 collectives.
* ``bare``: one broadcast of a uint8 buffer holding exactly megapack's payload bytes: the floor.

The methods alternate within every repeat (so drift hits all alike); each sample is the slowest
rank's time for one call (the call is done when every rank has its batch), and the median over
repeats is reported. Runs inside a process group whose ranks form one TP group (single stage).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megapack.batch import PackedBatch
from megapack.grid import grid_topology
from megapack.topology import Stage
from megapack.transfer import get_batch_on_this_tp_rank
from megapack.wire import encode

METHODS = ("megapack", "per_tensor", "bare")
_TENSORS = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens")


def sample_batch(seq_len: int, seed: int = 0) -> PackedBatch:
    """A [1, seq_len] packed row of documents with SFT-like lognormal lengths (median ~300 tokens)."""
    rng = np.random.default_rng(seed)
    docs, used = [], 0
    while used < seq_len:
        n = int(min(max(rng.lognormal(np.log(300), 0.9), 8), seq_len - used))
        docs.append(rng.integers(1, 32_000, n))
        used += n
    return PackedBatch.from_documents(docs, seq_len=seq_len)


def _per_tensor(
    batch: PackedBatch, src: int, group: Any, device: torch.device, is_src: bool
) -> None:
    shape = batch.tokens.shape
    for name, dtype in (
        ("tokens", torch.int64),
        ("labels", torch.int64),
        ("loss_mask", torch.float32),
        ("position_ids", torch.int64),
    ):
        t = getattr(batch, name) if is_src else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src, group=group)
    n = torch.tensor([batch.cu_seqlens.numel() if is_src else 0], device=device)
    dist.broadcast(n, src, group=group)
    cu = (
        batch.cu_seqlens if is_src else torch.empty(int(n.item()), dtype=torch.int32, device=device)
    )
    dist.broadcast(cu, src, group=group)
    m = torch.tensor([batch.max_seqlen if is_src else 0], device=device)
    dist.broadcast(m, src, group=group)
    int(m.item())


def run_transfer(seq_lens: list[int], repeats: int, warmup: int) -> list[dict[str, Any]]:
    """On every rank of a single-stage TP group: median ms per call for each method and seq_len."""
    tp = dist.get_world_size()
    topo = grid_topology(tp, 1)
    rows = []
    for seq_len in seq_lens:
        batch = sample_batch(seq_len)
        nbytes = encode(batch, Stage.ONLY, topo.device)[0].nbytes
        bare = torch.zeros(nbytes, dtype=torch.uint8, device=topo.device)
        on_device = dataclasses.replace(
            batch, **{k: getattr(batch, k).to(topo.device) for k in _TENSORS}
        )

        def megapack_call(b: PackedBatch = batch) -> None:
            get_batch_on_this_tp_rank(iter([b]) if topo.is_source else None, topology=topo)

        def per_tensor_call(b: PackedBatch = on_device) -> None:
            _per_tensor(b, topo.src_rank, topo.tp_group, topo.device, topo.is_source)

        def bare_call(t: torch.Tensor = bare) -> None:
            dist.broadcast(t, topo.src_rank, group=topo.tp_group)

        calls: dict[str, Callable[[], None]] = {
            "megapack": megapack_call,
            "per_tensor": per_tensor_call,
            "bare": bare_call,
        }
        samples: dict[str, list[float]] = {m: [] for m in METHODS}
        for rep in range(warmup + repeats):
            for method in METHODS:
                dist.barrier(group=topo.tp_group)
                start = time.perf_counter()
                calls[method]()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=topo.tp_group)
                if rep >= warmup:
                    samples[method].append(elapsed.item() * 1e3)
        row: dict[str, Any] = {
            "tp": tp,
            "seq_len": seq_len,
            "payload_bytes": nbytes,
            "documents": len(batch.cu_seqlens) - 1,
        }
        row |= {f"{m}_ms": statistics.median(samples[m]) for m in METHODS}
        rows.append(row)
    return rows
