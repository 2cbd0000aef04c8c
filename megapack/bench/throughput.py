"""Throughput benchmark: real tokens per second, packing against each baseline, same documents and model.

Runs on every rank of a tp x pp grid (megatron-core ``parallel_state``), training megapack's tiny
GPT (`megapack.harness.gpt.TinyGPT`, `packed_gpt_layer_spec`) through megatron-core's schedule with
batches from `megapack.get_batch_on_this_tp_rank`. A step is a window of a plan over a pool of
documents (`megapack.bench.modes.plan_step`), laid out in every mode of `megapack.bench.modes`
(packed; padded to seq; length-grouped with the step sorted once and packing's token budget; the
ceiling of one document per row on packing's THD path; the weak "padded to the longest"), the
modes timed step by step in turn (`megapack.bench.baselines.interleave`), summarized with the GPU
kit's columns (`megapack.bench.baselines.summarize`). No target on CPU times.

Packing's attention backend on CPU (`choose_cpu_backend`): each candidate, ``sdpa`` and, where
`megapack.attention` has it and it trains on CPU, ``bucketed``, runs one packed step after one
warm-up; the faster trains packed and the ceiling, and the report says which and why. Padded
modes have no boundaries: they run dense attention whatever the backend.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megapack.bench.baselines import interleave
from megapack.bench.gpu.model import GptShape
from megapack.bench.modes import (
    MODES,
    micro_batches,
    mode_cost,
    plan_step,
    schedule_shape,
    timed,
    timed_lengths,
)
from megapack.harness.gpt import TinyGPT, forward_step, init_weights

HIDDEN, HEADS, GROUPS, VOCAB = 64, 4, 2, 256
"""The tiny GPT's sizes (its FFN is megatron-core's default 4 x hidden, ungated)."""
CPU_CANDIDATES = ("sdpa", "bucketed")
"""The attention backends packing may train with on CPU, the reference first."""


def run_throughput(
    tp: int,
    pp: int,
    datasets: dict[str, list[int]],
    seq_len: int,
    rows: int,
    micro_batches_per_step: int,
    steps: int,
    warmup: int,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """On every rank of a tp x pp world: one row per (dataset, mode), every timed step's seconds
    (the slowest rank's), the FLOPs and slots (`megapack.bench.baselines` summarizes them).

    ``datasets``: each a pool of document lengths; a step is ``micro_batches_per_step`` packed
    micro-batches of ``rows`` rows from a plan over the pool (`megapack.bench.modes.plan_step`).
    """
    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():  # megatron's known-harmless warnings, at import and while training
        return _run_throughput(
            tp, pp, datasets, seq_len, rows, micro_batches_per_step, steps, warmup, seed
        )


def _run_throughput(
    tp: int,
    pp: int,
    datasets: dict[str, list[int]],
    seq_len: int,
    rows: int,
    window: int,
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

    def one_step(batches: list[Any]) -> float:
        """One training step on every rank; the slowest rank's seconds."""
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        size, width = schedule_shape(batches[0])
        schedule(
            forward_step_func=functools.partial(forward_step, topology),
            data_iterator=iter(batches) if topology.is_source else None,
            model=[model],
            num_microbatches=len(batches),
            seq_length=width,
            micro_batch_size=size,
            forward_only=False,
        )
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed.item())

    results: list[dict[str, Any]] = []
    for name, pool in datasets.items():
        step = plan_step(pool, seq_len, rows, window, seed=seed)
        rng = np.random.default_rng(seed)
        docs = [rng.integers(1, gpt.vocab_size, n) for n in step.lengths]
        by_mode = {m: micro_batches(m, docs, seq_len, rows, packing=step.packing) for m in MODES}
        backend, why = choose_cpu_backend(model, functools.partial(one_step, by_mode["packed"]))
        runs = {m: functools.partial(one_step, timed(m, b, window)) for m, b in by_mode.items()}
        times, _ = interleave(runs, warmup=warmup, steps=steps, catch=False)
        for mode, batches in by_mode.items():
            ran = timed(mode, batches, window)
            ran_lengths = timed_lengths(mode, step.lengths, rows, window)
            step_s = statistics.median(times[mode])
            tokens, slots = sum(step.lengths), mode_cost(batches).slots
            thd = mode in ("packed", "ceiling")
            results.append(
                {
                    "config": name,
                    "dataset": name,
                    "mode": mode,
                    "status": "ok",
                    "step_times": times[mode],
                    "step_s": step_s,
                    "tokens": tokens,
                    "tokens_per_s": sum(ran_lengths) / step_s,
                    "slots": slots,
                    "efficiency": tokens / slots,
                    "useful_flops": shape.training_flops(step.lengths),
                    "executed_flops": mode_cost(batches).executed_flops(shape),
                    "timed_tokens": sum(ran_lengths),
                    "timed_useful_flops": shape.training_flops(ran_lengths),
                    "timed_executed_flops": mode_cost(ran).executed_flops(shape),
                    "timed_micro_batches": len(ran),
                    "documents": len(docs),
                    "micro_batches": len(batches),
                    "pool": step.pool_size,
                    "fill": step.fill(seq_len),
                    "attention": backend if thd else "dense (padded rows)",
                }
                | ({"attention_choice": why} if mode == "packed" else {})
            )
    return results


def cpu_candidates() -> tuple[list[str], str]:
    """(the CPU backends packing may train with here, why any of `CPU_CANDIDATES` is not one)."""
    from megapack.attention import BACKENDS, backend_available

    out, missing = [], []
    for name in CPU_CANDIDATES:
        if name not in BACKENDS:
            missing.append(f"{name} is not in megapack.attention.BACKENDS")
        elif not backend_available(name, "cpu", training=True):
            missing.append(f"{name} cannot train on CPU here")
        else:
            out.append(name)
    return out, "; ".join(missing)


def choose_cpu_backend(model: Any, packed_step: Callable[[], float]) -> tuple[str, str]:
    """(backend, why): each of `cpu_candidates` set on ``model``'s attention and measured by one
    ``packed_step`` after one warm-up; the fastest is left set. Every rank gets the same answer
    (the steps' seconds are the slowest rank's)."""
    candidates, missing = cpu_candidates()
    if not candidates:
        raise RuntimeError(f"no attention backend trains on CPU here: {missing}")
    if len(candidates) == 1:
        set_attention_backend(model, candidates[0])
        return candidates[0], f"the only candidate: {missing}"
    seconds = {}
    for name in candidates:
        set_attention_backend(model, name)
        packed_step()
        seconds[name] = packed_step()
    best = min(seconds, key=lambda n: seconds[n])
    set_attention_backend(model, best)
    measured = ", ".join(f"{n} {s:.3f} s" for n, s in seconds.items())
    return best, f"the faster packed step, one each after a warm-up: {measured}"


def set_attention_backend(model: Any, backend: str) -> int:
    """Set every `megapack.attention.PackedAttention` of ``model`` to ``backend``; how many."""
    from megapack.attention import BACKENDS, PackedAttention

    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {BACKENDS} or 'auto'")
    count = 0
    for module in model.modules():
        if isinstance(module, PackedAttention):
            module.backend = backend
            count += 1
    return count
