"""The GPU kit's captured training step: static-shape packed batches replayed by one CUDA graph.

`graph_checks` runs, on the kit's model and on a launch-bound small one:

1. the cap: the smallest documents-per-row cap that keeps 99% of OpenChat's packed rows (at the
   kit's sequence length) as they are, the rows it costs, and the share of micro-batches of the
   *uncapped* plan that fit the static shape it gives (target >= 99%; CPU-computable);
2. >= `PACKS` different packs of the capped plan, each delivered by `get_batch_on_this_tp_rank`
   in that `StaticShape` and loaded into one `megapack.GraphInputs`;
3. eager: each pack's forward + backward (per-token losses, masked sum) on the model;
4. on CUDA: the same step captured once (``torch.cuda.graph``, after warm-up on a side stream)
   and replayed for every pack: per-token losses equal eager's (fp32: exactly, or <= 1e-6; bf16:
   `BF16_LOSS` absolute: the same kernels in the same order give the same bits, so any
   difference is a captured value gone stale), 0 synchronizing calls per replay
   (``set_sync_debug_mode("error")`` around load + replay), and the replayed step's median time
   against eager's (target <= `REPLAY_TARGET` x on the launch-bound model; the preset's reported).

Without CUDA, steps 1-3 run (the dry run exercises the static batches, the graph inputs and the
eager step at toy size) and the capture is skipped, saying so.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megapack.bench.gpu.model import GptShape, forward
from megapack.bench.gpu.report import Check, Status

PACKS = 20
"""Different packs replayed by one captured graph."""
CAP_SHARE = 0.99
"""The cap keeps this share of the uncapped plan's rows, and this share of its micro-batches fits."""
REPLAY_TARGET = 0.9
"""Target: a replayed step <= this x eager's, on the launch-bound model."""
BF16_LOSS = 1e-6
"""Largest per-token difference allowed between replay and eager, every dtype (see the docstring)."""
LAUNCH_BOUND = GptShape(
    num_layers=12,
    hidden_size=768,
    num_attention_heads=12,
    num_query_groups=4,
    ffn_hidden_size=3072,
    vocab_size=32000,
)
"""~0.11B parameters at seq 1,024: per-kernel work small enough that launches dominate eager."""


def cap_check(lengths: Sequence[int], seq_len: int, rows: int) -> tuple[Check, int]:
    """The cap from the data and the share of the uncapped plan's micro-batches that fit it."""
    from megapack.core.static import segments_for
    from megapack.packing import plan

    clipped = np.minimum(np.asarray(lengths, dtype=np.int64), seq_len)
    free = plan(clipped, seq_len)
    per_row = np.diff(free.bin_offsets)
    cap = int(np.quantile(per_row, CAP_SHARE, method="higher"))
    capped = plan(clipped, seq_len, max_documents=cap)
    whole = len(per_row) // rows * rows
    segments = (per_row[:whole] + 1).reshape(-1, rows).sum(axis=1)  # each row: + its padding
    fits = float((segments <= segments_for(cap, rows)).mean()) if whole else 1.0
    detail = (
        f"cap {cap} documents a row (keeps {float((per_row <= cap).mean()):.2%} of {len(per_row):,} "
        f"rows; capped plan {capped.num_bins:,} rows, +{capped.num_bins - free.num_bins}); "
        f"{fits:.2%} of the uncapped plan's micro-batches of {rows} rows fit the static shape"
    )
    status: Status = "passed" if fits >= CAP_SHARE else "failed"
    return Check(
        name=f"graph: OpenChat micro-batches fitting one captured shape >= {CAP_SHARE:.0%} (seq {seq_len})",
        status=status,
        detail=detail,
    ), cap


def static_packs(
    docs: Sequence[np.ndarray], seq_len: int, rows: int, cap: int, count: int
) -> list[Any]:
    """``count`` micro-batches of ``rows`` capped rows (documents recycled as needed)."""
    from megapack.core.batch import PackedBatch
    from megapack.packing import plan

    p = plan([len(d) for d in docs], seq_len, max_documents=cap)
    made = [
        PackedBatch.from_documents([docs[i][a:b] for i, a, b in row], seq_len=seq_len)
        for row in p.bins
    ]
    return [
        PackedBatch.concat([made[(j * rows + r) % len(made)] for r in range(rows)])
        for j in range(count)
    ]


def graph_step_check(
    model: Any,
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
) -> list[Check]:
    """Steps 2-4 of the module docstring on ``model``."""
    from megapack import GraphInputs, StaticShape, Topology, get_batch_on_this_tp_rank
    from megapack.core.static import segments_for

    topology = Topology.single(device)
    static = StaticShape(max_segments=segments_for(cap, rows), max_seqlen=seq_len)
    packs = [
        get_batch_on_this_tp_rank(iter([b]), topology=topology, static=static)
        for b in static_packs(docs, seq_len, rows, cap, PACKS)
    ]
    inputs = GraphInputs(packs[0])
    name = f"graph: {label}, {PACKS} packs of {rows} x {seq_len} through one static shape"

    def step(batch: dict[str, Any]) -> torch.Tensor:
        losses = forward(model, batch)
        (losses.float() * batch["loss_mask"]).sum().backward()
        return losses

    eager, eager_s = [], []
    for b in packs:
        model.zero_grad(set_to_none=False)
        _sync(device)
        start = time.perf_counter()
        eager.append(step(inputs.load(b)).detach().float().clone())
        _sync(device)
        eager_s.append(time.perf_counter() - start)
    checks = [
        Check(
            name=f"{name}: eager",
            status="passed" if all(torch.isfinite(x).all() for x in eager) else "failed",
            detail=f"median step {statistics.median(eager_s) * 1e3:.1f} ms; {len(packs)} packs, "
            f"cu_seqlens {static.max_segments + 1} entries, max_seqlen {seq_len}",
        )
    ]
    if device.type != "cuda":
        checks.append(
            Check(
                name=f"{name}: captured and replayed",
                status="skipped",
                detail="capture needs CUDA (torch.cuda.graph); the static batches, the graph "
                "inputs and the eager step ran here",
            )
        )
        return checks
    checks += _capture_and_replay(model, step, inputs, packs, eager, eager_s, device, name, target)
    return checks


def _capture_and_replay(
    model: Any,
    step: Any,
    inputs: Any,
    packs: list[Any],
    eager: list[torch.Tensor],
    eager_s: list[float],
    device: torch.device,
    name: str,
    target: float | None,
) -> list[Check]:
    from megapack.bench.gpu.syncs import sync_debug_errors

    static = inputs.load(packs[0])
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up off the capture: workspaces, caches, the autograd graph
            model.zero_grad(set_to_none=False)
            step(static)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        losses = step(static)
    worst, replay_s = 0.0, []
    for b, want in zip(packs, eager, strict=True):
        model.zero_grad(set_to_none=False)
        _sync(device)
        start = time.perf_counter()
        with sync_debug_errors(device):
            inputs.load(b)
            graph.replay()
        _sync(device)
        replay_s.append(time.perf_counter() - start)
        worst = max(worst, float((losses.detach().float() - want).abs().max()))
    ratio = statistics.median(replay_s) / statistics.median(eager_s)
    checks = [
        Check(
            name=f"{name}: replayed losses == eager (<= {BF16_LOSS:g}), 0 syncs per replay",
            status="passed" if worst <= BF16_LOSS else "failed",
            detail=f"largest per-token difference {worst:.2e} over {len(packs)} packs",
        )
    ]
    detail = (
        f"replay {statistics.median(replay_s) * 1e3:.1f} ms vs eager {statistics.median(eager_s) * 1e3:.1f} ms "
        f"(median): {ratio:.2f}x"
    )
    if target is None:
        checks.append(Check(name=f"{name}: replay time", status="info", detail=detail))
    else:
        checks.append(
            Check(
                name=f"{name}: replay <= {target}x eager",
                status="passed" if ratio <= target else "failed",
                detail=detail,
            )
        )
    return checks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
