"""Where packing must win: packed micro-batches under whole-step CUDA graphs against the eager
length-grouped baseline, on the same documents (the GPU kit's graph section, step 3).

Packing's edge over length-grouped padding is its static shape: every packed micro-batch is
``[1, rows x seq_len]`` with ``max_segments + 1`` boundaries, so one graph replays every step,
while grouped micro-batches change shape with the lengths they meet (a graph per shape bucket at
best) and run eagerly. `packed_graph_vs_grouped` times one step over the same documents three
ways:

    grouped eager       `megapack.bench.modes.micro_batches("grouped", ...)`: the documents
                        sorted by length, each micro-batch filling packing's token budget padded
                        to its longest; megatron-core's schedule, the per-token division on the
                        device, clip_grad_norm_, AdamW (foreach, float learning rate)
    packed eager        packing's micro-batches through that same eager loop (packing alone)
    packed + graph      the same packed micro-batches as one `GraphStep` of all of them
                        (capturable AdamW, device learning rate), replayed

The documents are those of whole micro-batches of a capped plan (``max_documents=cap``, so every
micro-batch fits the static shape: no fallback, no filler row); grouped lays out exactly those.
The ratio is grouped's median step over packed + graph's (the same tokens, so real tokens/s):
target >= `megapack.bench.gpu.targets.VS_GROUPED_TARGET` on the launch-bound model, reported on the preset. What packing
pays for it: the capped plan's extra rows and each row's trailing padding, both in the detail.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megapack.bench.gpu.graph import WARMUP, kit_forward_step, make_step, timed, twin_models
from megapack.bench.gpu.model import GptShape
from megapack.bench.gpu.report import Check


def packed_graph_vs_grouped(
    shape: GptShape,
    docs: Sequence[np.ndarray],
    *,
    device: torch.device,
    dtype: torch.dtype,
    seq_len: int,
    rows: int,
    cap: int,
    label: str,
    target: float | None,
    steps: int,
    backend: str = "auto",
) -> list[Check]:
    """The three timings of the module docstring; ``steps`` timed steps each after warm-up; THD
    attention ``backend`` (the grouped baseline is padded: dense attention whatever it is)."""
    from megapack import StaticShape, Topology, get_batch_on_this_tp_rank
    from megapack.bench.modes import micro_batches
    from megapack.core.batch import PackedBatch
    from megapack.core.static import segments_for
    from megapack.packing import plan

    name = f"graph: {label}, packed + whole-step graph vs length-grouped padding (eager), seq {seq_len}"
    p = plan([len(d) for d in docs], seq_len, max_documents=cap)
    bins = p.bins[: len(p.bins) // rows * rows]
    if not bins:
        return [
            Check(name=name, status="failed", detail=f"{len(docs)} documents fill no micro-batch")
        ]
    made = [
        PackedBatch.from_documents([docs[i][a:b] for i, a, b in row], seq_len=seq_len)
        for row in bins
    ]
    topology = Topology.single(device)
    static = StaticShape(max_segments=segments_for(cap, rows), max_seqlen=seq_len)
    packed = [
        get_batch_on_this_tp_rank(iter([PackedBatch.concat(made[j : j + rows])]),
                                  topology=topology, static=static)
        for j in range(0, len(made), rows)
    ]  # fmt: skip
    used = [docs[i] for i in sorted({i for row in bins for i, _, _ in row})]
    grouped = [
        get_batch_on_this_tp_rank(iter([b]), topology=topology)
        for b in micro_batches("grouped", used, seq_len, rows)
    ]
    tokens = sum(len(d) for d in used)
    model_p, model_q = twin_models(shape, device, dtype, seq_len, backend)
    cuda = device.type == "cuda"
    graph = make_step(model_p, device, static, len(packed), "graph" if cuda else "eager")
    graph.set_lr(1e-5)
    optimizer = torch.optim.AdamW(model_q.parameters(), lr=1e-5, weight_decay=0.1)
    t_grouped = _times(lambda: eager_step(model_q, optimizer, grouped), device, steps, 1)
    t_packed = _times(lambda: eager_step(model_q, optimizer, packed), device, steps, 1)
    base = (
        f"{tokens:,} tokens of {len(used)} documents: packed {len(packed)} micro-batches of "
        f"{rows} x {seq_len} (cap {cap} documents a row; plan {p.num_bins} rows, slots "
        f"{len(made) * seq_len:,}), grouped {len(grouped)} micro-batches (slots "
        f"{sum(int(b['tokens'].numel()) for b in grouped):,}); eager steps: grouped "
        f"{statistics.median(t_grouped) * 1e3:.1f} ms, packed {statistics.median(t_packed) * 1e3:.1f} ms"
    )
    if not cuda:
        return [
            Check(name=f"{name}: eager", status="info", detail=base),
            Check(
                name=f"{name}: captured",
                status="skipped",
                detail="capture needs CUDA (torch.cuda.graph); the eager modes ran here",
            ),
        ]
    t_graph = _times(lambda: graph(packed), device, steps, WARMUP + 1)
    ratio = statistics.median(t_grouped) / statistics.median(t_graph)
    detail = (
        f"{base}, packed + graph {statistics.median(t_graph) * 1e3:.1f} ms (medians of {steps}): "
        f"{ratio:.2f}x grouped's real tokens/s [{min(t_grouped) / max(t_graph):.2f}, "
        f"{max(t_grouped) / min(t_graph):.2f}]; eager fallback steps: {graph.eager_steps}"
    )
    if target is None:
        return [Check(name=name, status="info", detail=detail)]
    return [
        Check(
            name=f"{name} >= {target}x",
            status="passed" if ratio >= target and graph.eager_steps == 0 else "failed",
            detail=detail,
        )
    ]


def eager_step(model: Any, optimizer: torch.optim.Optimizer, batches: list[Any]) -> None:
    """One eager training step as a trainer runs it without graphs: megatron-core's schedule, the
    gradients divided by the step's trained tokens on the device, clip_grad_norm_ at 1.0, the
    optimizer."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    model.zero_grad(set_to_none=True)
    saved, config.finalize_model_grads_func = (
        config.finalize_model_grads_func,
        functools.partial(_divide, model),
    )
    try:
        get_forward_backward_func()(
            forward_step_func=kit_forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=len(batches),
            seq_length=int(batches[0]["tokens"].shape[-1]),
            micro_batch_size=int(batches[0]["tokens"].shape[0]),
            forward_only=False,
        )
    finally:
        config.finalize_model_grads_func = saved
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def _divide(model: Any, models: Any, num_tokens: torch.Tensor | None, **_: Any) -> None:
    if num_tokens is not None:
        scale = 1.0 / num_tokens.clamp(min=1)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, scale)


def _times(fn: Any, device: torch.device, steps: int, warmup: int) -> list[float]:
    times = [timed(fn, device)[1] for _ in range(warmup + steps)]
    return times[warmup:]
