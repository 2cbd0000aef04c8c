"""Transfer benchmark: one micro-batch from the TP source to its peers, five ways, side by side.

* ``megapack``: `megapack.get_batch_on_this_tp_rank`, validation and PackedSeqParams included,
  as it runs by default: TP peers on one host get the frame over a local link
  (`megapack.delivery.link`: Unix sockets, sealed shared memory for frames of 64 KiB or more;
  no gloo collective per call).
* ``megapack_collectives``: the same call with links off ($MEGAPACK_TRANSPORT=collectives): the
  header and the payload broadcast on the TP group, the transport of TP groups spread over hosts.
* ``megapack_fields``: the default call with three float32 per-token fields declared
  (``fields=``: an RL trainer's advantages and old and reference log-probs), against none.
* ``per_tensor``: what Megatron-LM's ``get_batch_on_this_tp_rank`` does for a packed batch: one
  broadcast per tensor (tokens, labels, loss_mask, position_ids), a broadcast of the ``cu_seqlens``
  length followed by a host sync (``.item()``) to allocate, the ``cu_seqlens`` broadcast, and a
  ``max_seqlen`` broadcast with another host sync: 7 collectives.
* ``bare_megatron``: one broadcast of a uint8 buffer as large as Megatron's tensors (int64 tokens,
  labels and position_ids, float32 loss_mask, int32 cu_seqlens): the floor for those bytes, which
  megapack's payload matches byte for byte (the fields in full).
* ``prefetch``: `megapack.prefetch` (depth 2) feeding a loop whose step is ``next()`` plus a
  simulated compute step (a sleep of 5 ms per 4,096 tokens: GPU compute leaves the host idle);
  reported as the time the step spends blocked in ``next()`` and the step time over the compute
  time (the sleep's measured length), medians of the slowest rank per step. Training uses
  prefetch, so its targets are the transfer's targets.

The first five alternate within every repeat (so drift hits all alike), in an order shuffled
anew every repeat (seeded, the same on every rank): a call runs faster right after one that ran
the same code (caches), so a fixed order would favour whichever method follows its like. Each
sample is the slowest rank's time for one call (the call is done when every rank has its batch),
and the median over repeats is reported. Runs inside a process group whose ranks form one TP group (single stage).
Bytes per stage are megapack's payload for each pipeline stage's fields (`megapack.core.fields`).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megapack.core.batch import PackedBatch
from megapack.core.fields import BatchField, Stage, schema_of
from megapack.core.intake import to_batch
from megapack.delivery.get_batch import get_batch_on_this_tp_rank
from megapack.delivery.prefetch import prefetch
from megapack.delivery.transport import use_transport
from megapack.delivery.wire import encode
from megapack.distributed.topology import Topology
from megapack.harness.grid import grid_topology

METHODS = ("megapack", "megapack_collectives", "megapack_fields", "per_tensor", "bare_megatron")
RL_FIELDS = tuple(
    BatchField(name, "token", torch.float32, "last", at="label")
    for name in ("advantages", "old_logprobs", "ref_logprobs")
)
"""The three float32 per-token fields of the ``megapack_fields`` method."""
_TENSORS = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens")
PREFETCH_DEPTH = 2
COMPUTE_MS_PER_4K = 5.0  # the simulated compute step: 5 ms per 4,096 tokens
TARGETS = {
    "blocked_vs_bare": 0.25,  # with prefetch, time blocked in next() <= 0.25x a bare broadcast
    "step_vs_compute": 1.05,  # with prefetch, step time <= compute + 5%
}
JSON_KEYS = (
    "tp",
    "seq_len",
    "documents",
    "payload_bytes",
    "fields_payload_bytes",
    "megatron_bytes",
    "bytes_per_stage",
    *(f"{m}_ms" for m in METHODS),
    "compute_ms",
    "prefetch_blocked_ms",
    "prefetch_step_ms",
)


def sample_batch(seq_len: int, seed: int = 0) -> PackedBatch:
    """A [1, seq_len] packed row of documents with SFT-like lognormal lengths (median ~300 tokens)."""
    rng = np.random.default_rng(seed)
    docs, used = [], 0
    while used < seq_len:
        n = int(min(max(rng.lognormal(np.log(300), 0.9), 8), seq_len - used))
        docs.append(rng.integers(1, 32_000, n))
        used += n
    return PackedBatch.from_documents(docs, seq_len=seq_len)


def payload_bytes(batch: PackedBatch, stage: Stage, fields: tuple[BatchField, ...] = ()) -> int:
    """Bytes of megapack's payload of ``batch`` for ``stage`` (`megapack.delivery.wire`)."""
    schema = schema_of(fields)
    return encode(to_batch(batch, schema), schema, stage)[0].nbytes


def with_rl_fields(batch: PackedBatch) -> PackedBatch:
    """``batch`` with `RL_FIELDS` in its extras: seeded float32 values per token."""
    gen = torch.Generator().manual_seed(1)
    extras = {f.name: torch.randn(batch.tokens.shape, generator=gen) for f in RL_FIELDS}
    return dataclasses.replace(batch, extras=extras)


def megatron_bytes(batch: PackedBatch) -> int:
    """Bytes of the tensors Megatron's get_batch_on_this_tp_rank broadcasts for this batch."""
    n = batch.tokens.numel()
    return n * (8 + 8 + 4 + 8) + batch.cu_seqlens.numel() * 4


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


def _slowest(seconds: list[float], group: Any) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _prefetch_steps(
    topo: Topology, batch: PackedBatch, compute_s: float, repeats: int, warmup: int
) -> tuple[float, float, float]:
    """Medians in ms (blocked in next(), whole step, compute) with prefetch, slowest rank per step.

    The compute step is a sleep; its measured length (sleeps overshoot on a busy machine) is the
    compute time the step is compared with.
    """
    data = iter([batch] * (warmup + repeats)) if topo.is_source else None
    blocked, steps, computes = [], [], []
    with prefetch(data, topology=topo, depth=PREFETCH_DEPTH) as batches:
        for rep in range(warmup + repeats):
            start = time.perf_counter()
            batch_k = next(batches)
            got = time.perf_counter()
            time.sleep(compute_s)
            del batch_k  # a step uses its batch through the compute (not freed inside next())
            end = time.perf_counter()
            # the model's TP sync point: every rank's step ends with the slowest
            waited, step, compute = _slowest([got - start, end - start, end - got], topo.tp_group)
            if rep >= warmup:
                blocked.append(waited * 1e3)
                steps.append(step * 1e3)
                computes.append(compute * 1e3)
    return statistics.median(blocked), statistics.median(steps), statistics.median(computes)


def run_transfer(seq_lens: list[int], repeats: int, warmup: int) -> list[dict[str, Any]]:
    """On every rank of a single-stage TP group: median ms per call for each method and seq_len."""
    tp = dist.get_world_size()
    topo = grid_topology(tp, 1)
    rows = []
    for seq_len in seq_lens:
        batch = sample_batch(seq_len)
        rl_batch = with_rl_fields(batch)
        mbytes = megatron_bytes(batch)
        bare_megatron = torch.zeros(mbytes, dtype=torch.uint8, device=topo.device)
        on_device = dataclasses.replace(
            batch, **{k: getattr(batch, k).to(topo.device) for k in _TENSORS}
        )

        def megapack_call(b: PackedBatch = batch, fields: tuple[BatchField, ...] = ()) -> None:
            data = iter([b]) if topo.is_source else None
            get_batch_on_this_tp_rank(data, topology=topo, fields=fields)

        def megapack_collectives_call(b: PackedBatch = batch) -> None:
            with use_transport("collectives"):
                get_batch_on_this_tp_rank(iter([b]) if topo.is_source else None, topology=topo)

        def per_tensor_call(b: PackedBatch = on_device) -> None:
            _per_tensor(b, topo.src_rank, topo.tp_group, topo.device, topo.is_source)

        calls: dict[str, Callable[[], None]] = {
            "megapack": megapack_call,
            "megapack_collectives": megapack_collectives_call,
            "megapack_fields": functools.partial(megapack_call, rl_batch, RL_FIELDS),
            "per_tensor": per_tensor_call,
            "bare_megatron": functools.partial(
                dist.broadcast, bare_megatron, topo.src_rank, group=topo.tp_group
            ),
        }
        samples: dict[str, list[float]] = {m: [] for m in METHODS}
        for rep in range(warmup + repeats):
            order = list(METHODS)  # shuffled (seeded: the same on every rank), so no method
            random.Random(rep).shuffle(order)  # always runs right after the same one
            for method in order:
                dist.barrier(group=topo.tp_group)
                start = time.perf_counter()
                calls[method]()
                (elapsed,) = _slowest([time.perf_counter() - start], topo.tp_group)
                if rep >= warmup:
                    samples[method].append(elapsed * 1e3)
        sleep_s = COMPUTE_MS_PER_4K * seq_len / 4096 / 1e3
        blocked_ms, step_ms, compute_ms = _prefetch_steps(topo, batch, sleep_s, repeats, warmup)
        row: dict[str, Any] = {
            "tp": tp,
            "seq_len": seq_len,
            "payload_bytes": payload_bytes(batch, Stage.ONLY),
            "fields_payload_bytes": payload_bytes(rl_batch, Stage.ONLY, RL_FIELDS),
            "megatron_bytes": mbytes,
            "bytes_per_stage": {s.value: payload_bytes(batch, s) for s in Stage},
            "documents": len(batch.cu_seqlens) - 1,
            "compute_ms": compute_ms,
            "prefetch_blocked_ms": blocked_ms,
            "prefetch_step_ms": step_ms,
        }
        row |= {f"{m}_ms": statistics.median(samples[m]) for m in METHODS}
        rows.append(row)
    return rows


def verdicts(row: dict[str, Any]) -> dict[str, Any]:
    """The row's ratios; those with a target in `TARGETS` also whether it is met (``<key>_met``)
    and as the table prints it (``<key>_verdict``: "0.04, met")."""
    ratios = {
        "vs_bare_megatron": row["megapack_ms"] / row["bare_megatron_ms"],
        "vs_per_tensor": row["megapack_ms"] / row["per_tensor_ms"],
        "fields_vs_none": row["megapack_fields_ms"] / row["megapack_ms"],
        "blocked_vs_bare": row["prefetch_blocked_ms"] / row["bare_megatron_ms"],
        "step_vs_compute": row["prefetch_step_ms"] / row["compute_ms"],
    }
    out: dict[str, Any] = dict(ratios)
    for key, limit in TARGETS.items():
        out[f"{key}_met"] = ratios[key] <= limit
        out[f"{key}_verdict"] = f"{ratios[key]:.2f}, {'met' if out[f'{key}_met'] else 'not met'}"
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """Two markdown tables (latency with verdicts; bytes per stage) for the report and the README."""
    head = (
        "| tp | seq_len | megapack | megapack, collectives (links off) | megapack + 3 float32 "
        "token fields | per-tensor (Megatron-style) | bare broadcast of Megatron's bytes | "
        "megapack / bare | fields / none | prefetch: blocked in next() | blocked / bare "
        "(target <= 0.25) | step / compute (target <= 1.05) |"
    )
    lines = [head, "|" + " --- |" * 12]
    for r in rows:
        v = verdicts(r)
        lines.append(
            f"| {r['tp']} | {r['seq_len']:,} | {r['megapack_ms']:.3f} | "
            f"{r['megapack_collectives_ms']:.3f} | {r['megapack_fields_ms']:.3f} | "
            f"{r['per_tensor_ms']:.3f} | {r['bare_megatron_ms']:.3f} | "
            f"{v['vs_bare_megatron']:.2f} | {v['fields_vs_none']:.2f} | "
            f"{r['prefetch_blocked_ms']:.3f} | {v['blocked_vs_bare_verdict']} | "
            f"{v['step_vs_compute_verdict']} |"
        )
    stages = [s.value for s in Stage]
    bytes_head = "| seq_len | documents | Megatron's bytes | " + " | ".join(
        f"megapack, {s} stage" for s in stages
    )
    bytes_lines = [
        bytes_head + " | only stage + 3 float32 token fields |",
        "|" + " --- |" * (4 + len(stages)),
    ]
    for r in {r["seq_len"]: r for r in rows}.values():
        per = " | ".join(f"{r['bytes_per_stage'][s]:,}" for s in stages)
        bytes_lines.append(
            f"| {r['seq_len']:,} | {r['documents']} | {r['megatron_bytes']:,} | {per} | "
            f"{r['fields_payload_bytes']:,} |"
        )
    return "\n".join(lines) + "\n\nBytes per micro-batch:\n\n" + "\n".join(bytes_lines)
