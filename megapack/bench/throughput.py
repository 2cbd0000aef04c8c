"""Throughput benchmark: real tokens per second, packing against each baseline, same documents and model.

Runs on every rank of a tp x pp grid (megatron-core ``parallel_state``), training megapack's tiny
GPT (`megapack.harness.gpt.TinyGPT`, `packed_gpt_layer_spec`) through megatron-core's schedule with
batches from `megapack.get_batch_on_this_tp_rank`. One step = one schedule call over the same
documents in every mode of `megapack.bench.layouts` (packed; padded to seq; length-grouped padding
with a token budget; the ceiling of unbroken rows; the weak "padded to the longest"), the modes and
columns of the GPU kit (`megapack.bench.baselines`): the ratios' median, min and max over the timed
steps, the slot ratio, the executed-FLOP ideal and executed GFLOP/s. No target on CPU times.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megapack.bench.gpu.model import GptShape
from megapack.bench.layouts import MODES, layout_cost, micro_batches
from megapack.harness.gpt import TinyGPT, forward_step, init_weights

HIDDEN, HEADS, GROUPS, VOCAB = 64, 4, 2, 256
"""The tiny GPT's sizes (its FFN is megatron-core's default 4 x hidden, ungated)."""


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
    """On every rank of a tp x pp world: one row per (dataset, mode), every timed step's seconds
    (the slowest rank's), the FLOPs and slots (`megapack.bench.baselines` summarizes them)."""
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
    gpt = TinyGPT(
        num_layers=2 * pp,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        vocab_size=VOCAB,
        max_sequence_length=seq_len,
    )
    shape = GptShape(
        num_layers=2 * pp,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=4 * HIDDEN,
        vocab_size=VOCAB,
    )
    model = gpt.build()
    init_weights(model, seed)
    model.config.variable_seq_lengths = True  # padded micro-batches change shape
    if cuda:
        model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    topology = Topology.from_parallel_state()
    schedule = get_forward_backward_func()
    results: list[dict[str, Any]] = []
    for name, lengths in datasets.items():
        rng = np.random.default_rng(seed)
        docs = [rng.integers(1, gpt.vocab_size, n) for n in lengths]
        for mode in MODES:
            batches = micro_batches(mode, docs, seq_len, rows, seed=seed)
            cost = layout_cost(batches)
            plain = batches[0] if mode != "packed" else None
            times = []
            for step in range(warmup + steps):
                dist.barrier()
                start = time.perf_counter()
                optimizer.zero_grad()
                schedule(
                    forward_step_func=functools.partial(forward_step, topology),
                    data_iterator=iter(batches) if topology.is_source else None,
                    model=[model],
                    num_microbatches=len(batches),
                    seq_length=rows * seq_len if plain is None else int(plain["tokens"].shape[1]),
                    micro_batch_size=1 if plain is None else int(plain["tokens"].shape[0]),
                    forward_only=False,
                )
                optimizer.step()
                if cuda:
                    torch.cuda.synchronize()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step >= warmup:
                    times.append(elapsed.item())
            step_s = statistics.median(times)
            results.append(
                {
                    "config": name,
                    "dataset": name,
                    "mode": mode,
                    "status": "ok",
                    "step_times": times,
                    "step_s": step_s,
                    "tokens": sum(lengths),
                    "tokens_per_s": sum(lengths) / step_s,
                    "slots": cost.slots,
                    "efficiency": sum(lengths) / cost.slots,
                    "useful_flops": shape.training_flops(lengths),
                    "executed_flops": cost.executed_flops(shape),
                    "documents": len(docs),
                    "micro_batches": len(batches),
                }
            )
    return results
