"""Throughput benchmark: real (non-padding) tokens per second, packed vs padded, same documents and model.

Runs on every rank of a tp x pp grid (megatron-core ``parallel_state``), training megapack's tiny
GPT (`megapack.harness.gpt.TinyGPT`, `packed_gpt_layer_spec`) through megatron-core's schedule with
batches from `megapack.get_batch_on_this_tp_rank`. One step = one schedule call over the same
documents in every mode:

* ``packed``: `megapack.packing.plan` (BFD) rows of ``seq_len``, ``rows`` rows per THD micro-batch;
* ``padded_fixed``: one document per row padded to ``seq_len`` (Megatron's SFT), ``rows`` per micro-batch;
* ``padded_longest``: ``rows`` documents per micro-batch in order, padded to the micro-batch's longest.

Every mode has the same micro-batch size, ``rows`` (Megatron's micro-batch size: a packed row takes
the place of one sequence), so they differ only in how documents fill the slots.

``theoretical_speedup`` of a padded mode = its token slots / packed token slots (the compute a
perfect kernel would save); the measured speedup is packed tokens/s / the mode's tokens/s.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megapack.core.batch import PackedBatch
from megapack.harness.gpt import TinyGPT, forward_step, init_weights

MODES = ("packed", "padded_fixed", "padded_longest")


def micro_batches(mode: str, docs: list[np.ndarray], seq_len: int, rows: int) -> list[Any]:
    """The documents laid out for ``mode``: a list of micro-batches."""
    if mode == "packed":
        from megapack.packing import plan

        bins = plan([len(d) for d in docs], seq_len, algorithm="bfd").bins
        packed = [
            PackedBatch.from_documents([docs[i][a:b] for i, a, b in row], seq_len=seq_len)
            for row in bins
        ]
        packed += [PackedBatch.from_documents([[0]], seq_len=seq_len)] * (
            -len(packed) % rows
        )  # zero-loss filler
        return [PackedBatch.concat(packed[i : i + rows]) for i in range(0, len(packed), rows)]
    if mode == "padded_fixed":
        groups = [docs[i : i + rows] for i in range(0, len(docs), rows)]
        return [_plain(group, seq_len) for group in groups]
    groups = [docs[i : i + rows] for i in range(0, len(docs), rows)]
    return [_plain(group, max(len(d) for d in group)) for group in groups]


def _plain(docs: list[np.ndarray], width: int) -> dict[str, torch.Tensor]:
    rows = [PackedBatch.from_documents([d], seq_len=width) for d in docs]
    out = {k: torch.cat([getattr(r, k) for r in rows]) for k in ("tokens", "labels", "loss_mask")}
    return {**out, "position_ids": torch.arange(width).expand(len(docs), width).contiguous()}


def slots(batches: list[Any]) -> tuple[int, int]:
    """(token slots, trained tokens) of a list of micro-batches."""
    total = sum(
        int(b.tokens.numel() if isinstance(b, PackedBatch) else b["tokens"].numel())
        for b in batches
    )
    real = sum(
        int((b.loss_mask if isinstance(b, PackedBatch) else b["loss_mask"]).sum().item())
        for b in batches
    )
    return total, real


def run_throughput(
    tp: int,
    pp: int,
    datasets: dict[str, list[int]],
    seq_len: int,
    rows: int,
    steps: int,
    warmup: int,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """On every rank of a tp x pp world: median real tokens/s per dataset and mode (rank 0's list)."""
    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():  # megatron's known-harmless warnings, at import and while training
        return _run_throughput(tp, pp, datasets, seq_len, rows, steps, warmup, seed)


def _run_throughput(
    tp: int,
    pp: int,
    datasets: dict[str, list[int]],
    seq_len: int,
    rows: int,
    steps: int,
    warmup: int,
    seed: int,
) -> list[dict[str, Any]]:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack.distributed.topology import Topology

    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    if not cuda:
        from megapack.harness.megatron_cpu import megatron_on_cpu

        megatron_on_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(seed)
    gpt = TinyGPT(num_layers=2 * pp, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=256,
                  max_sequence_length=seq_len)  # fmt: skip
    model = gpt.build()
    init_weights(model, seed)
    model.config.variable_seq_lengths = True  # padded_longest changes shape per micro-batch
    if cuda:
        model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    topology = Topology.from_parallel_state()
    schedule = get_forward_backward_func()
    results: list[dict[str, Any]] = []
    for name, lengths in datasets.items():
        rng = np.random.default_rng(seed)
        docs = [rng.integers(1, gpt.vocab_size, n) for n in lengths]
        packed_slots = None
        for mode in MODES:
            batches = micro_batches(mode, docs, seq_len, rows)
            total, real = slots(batches)
            packed_slots = packed_slots or total
            width = rows * seq_len if mode == "packed" else seq_len
            times = []
            for step in range(warmup + steps):
                dist.barrier()
                start = time.perf_counter()
                optimizer.zero_grad()
                schedule(
                    forward_step_func=functools.partial(forward_step, topology),
                    data_iterator=iter(batches) if topology.is_source else None,
                    model=[model], num_microbatches=len(batches), seq_length=width,
                    micro_batch_size=1 if mode == "packed" else rows, forward_only=False,
                )  # fmt: skip
                optimizer.step()
                if cuda:
                    torch.cuda.synchronize()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step >= warmup:
                    times.append(elapsed.item())
            seconds = statistics.median(times)
            results.append({
                "dataset": name, "mode": mode, "tokens_per_s": real / seconds, "efficiency": real / total,
                "theoretical_speedup": total / packed_slots, "step_s": seconds, "documents": len(docs),
                "micro_batches": len(batches),
            })  # fmt: skip
    packed: dict[str, float] = {
        r["dataset"]: r["tokens_per_s"] for r in results if r["mode"] == "packed"
    }
    for r in results:
        r["measured_speedup"] = packed[r["dataset"]] / r["tokens_per_s"]
    return results
