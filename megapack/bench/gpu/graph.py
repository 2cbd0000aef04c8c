"""The GPU kit's captured training step: `megapack.megatron.graph_step.GraphStep` against eager.

`graph_step` (in `steps.py`) runs, on the kit's model (reported) and on a launch-bound small
one (the targets):

1. the cap (`cap_check`): the smallest documents-per-row cap keeping 99% of OpenChat's packed rows
   as they are, and the share of the *uncapped* plan's micro-batches that fit the static shape it
   gives (CPU-computable);
2. `compare_replay`: two copies of the model with the same weights, each trained by a
   `GraphStep` of `MICRO_BATCHES` micro-batches fed by `megapack.GraphInputs` slots, one captured
   (``mode="graph"``), one eager (``mode="eager"``: the same work, not captured). Over
   ``WARMUP + PACKS`` steps of different capped packs at learning rate 0 (parameters stay, every
   kernel of the update runs) plus one step over the static shape (the eager fallback, counted),
   each step runs eager twice and the graph once: the replay's per-token losses and every
   parameter's gradient must differ from eager's by no more than eager differs from itself on the
   same pack (FA2's backward accumulates with atomics), or `FLOOR`. Then `OPTIMIZER_STEPS` steps
   with learning rates: the parameters after the replayed steps against the eager ones, within
   eager's own spread (from a rerun from the same state). Times: the median replayed step
   against the median eager step (target <= `megapack.bench.gpu.targets.REPLAY_TARGET` x on
   the launch-bound model); 0 synchronizing calls in `SYNC_REPLAYS` replays (set_lr, load,
   replay) under ``torch.cuda.set_sync_debug_mode("error")``, after its positive control;
3. packed + whole-step graphs against the eager length-grouped baseline (`graph_grouped.py`).

Without CUDA (the dry run) the eager half runs at toy size and the capture is skipped, saying so.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from megapack.bench.gpu.model import GptShape, build_gpt, forward
from megapack.bench.gpu.report import Check, Status

PACKS = 20
"""Different packs whose replayed step is compared with eager's."""
MICRO_BATCHES = 2
"""Micro-batches a captured step (one static buffer set each)."""
WARMUP = 2
"""Eager steps before the capture."""
OPTIMIZER_STEPS = 3
"""Steps whose parameters are compared after the update."""
SYNC_REPLAYS = 3
"""Replays run under the sync detector."""
CAP_SHARE = 0.99
"""The cap keeps this share of the uncapped plan's rows, and this share of its micro-batches fits."""
FLOOR = 1e-6
"""A difference this small passes even when eager agrees with itself exactly (rounding)."""
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


def over_shape_pack(docs: Sequence[np.ndarray], seq_len: int, rows: int, cap: int) -> Any:
    """A micro-batch of ``rows`` rows of ``cap + 2`` documents each: more segments than the
    static shape of ``cap`` documents a row holds (``cap + 1`` a row with its padding), so its
    step falls back to eager."""
    from megapack.core.batch import PackedBatch

    piece = max(1, seq_len // (cap + 3))
    row = PackedBatch.from_documents([d[:piece] for d in docs[: cap + 2]], seq_len=seq_len)
    return PackedBatch.concat([row] * rows)


def kit_forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    """The captured step's ``forward_step_func``: the next micro-batch dict, per-token losses,
    `megapack.megatron.normalized_loss` (per-token form) with the masked losses in its report."""
    batch = next(data_iterator)
    return forward(model, batch), functools.partial(_loss, batch)


def _loss(batch: dict[str, Any], per_token: torch.Tensor) -> tuple[Any, ...]:
    from megapack.megatron import normalized_loss

    total, count, report = normalized_loss(batch, per_token, calculate_per_token_loss=True)
    report["per_token"] = per_token.detach().float() * batch["loss_mask"]
    return total, count, report


def twin_models(
    shape: GptShape, device: torch.device, dtype: torch.dtype, seq_len: int, backend: str = "auto"
) -> Any:
    """Two copies of the kit's GPT with the same weights, per-token loss on, THD attention
    ``backend`` in every layer."""
    from megatron.core.utils import get_model_config

    build = functools.partial(build_gpt, shape, device=device, dtype=dtype,
                              max_sequence_length=seq_len, backend=backend)  # fmt: skip
    first, second = build(), build()
    second.load_state_dict(first.state_dict())
    for m in (first, second):
        get_model_config(m).calculate_per_token_loss = True
    return first, second


def make_step(model: Any, device: torch.device, static: Any, micro: int, mode: str) -> Any:
    """A `GraphStep` with AdamW (capturable on CUDA), lr a device tensor, clipping at 1.0."""
    from megapack import GraphInputs
    from megapack.megatron.graph_step import GraphStep

    cuda = device.type == "cuda"
    lr = torch.tensor(0.0, device=device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=0.1, capturable=cuda, foreach=cuda
    )
    return GraphStep(model, opt, kit_forward_step, micro_batches=micro, static=static,
                     inputs=GraphInputs, mode=mode, max_grad_norm=1.0, warmup=WARMUP)  # fmt: skip


def compare_replay(
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
    steps: int = PACKS,
    backend: str = "auto",
) -> list[Check]:
    """Step 2 of the module docstring on a fresh pair of ``shape`` models (THD attention
    ``backend``)."""
    from megapack import StaticShape, Topology, get_batch_on_this_tp_rank
    from megapack.core.static import segments_for

    topology = Topology.single(device)
    static = StaticShape(max_segments=segments_for(cap, rows), max_seqlen=seq_len)
    made = static_packs(docs, seq_len, rows, cap, (WARMUP + steps) * MICRO_BATCHES)
    deliver = functools.partial(get_batch_on_this_tp_rank, topology=topology, static=static)
    step_batches = [
        [deliver(iter([b])) for b in made[i : i + MICRO_BATCHES]]
        for i in range(0, len(made), MICRO_BATCHES)
    ]
    over = get_batch_on_this_tp_rank(
        iter([over_shape_pack(docs, seq_len, rows, cap)]), topology=topology
    )
    step_batches.insert(WARMUP + 1, [over, *step_batches[WARMUP + 1][1:]])
    name = (
        f"graph: {label}, whole step ({MICRO_BATCHES} micro-batches of {rows} x {seq_len}, "
        f"AdamW, clip) replayed over {steps} packs"
    )
    cuda = device.type == "cuda"
    model_g, model_e = twin_models(shape, device, dtype, seq_len, backend)
    eager = make_step(model_e, device, static, MICRO_BATCHES, "eager")
    graph = make_step(model_g, device, static, MICRO_BATCHES, "graph" if cuda else "eager")
    worst = {"eager loss": 0.0, "eager grad": 0.0, "replay loss": 0.0, "replay grad": 0.0}
    eager_s, replay_s = [], []
    for i, batches in enumerate(step_batches):
        out, seconds = timed(functools.partial(eager, batches), device)
        if i >= WARMUP and i != WARMUP + 1:
            eager_s.append(seconds)
        losses = [r["per_token"].clone() for r in out.reports]
        grads = [p.grad.clone() for p in model_e.parameters()]
        again = eager(batches)
        _worse(worst, "eager", again.reports, losses, model_e, grads)
        if cuda:
            out, seconds = timed(functools.partial(graph, batches), device)
            if out.replayed and graph.replays > 1:
                replay_s.append(seconds)
            _worse(worst, "replay", out.reports, losses, model_g, grads)
        del grads
    spread = {k: max(worst[f"eager {k}"], FLOOR) for k in ("loss", "grad")}
    checks = [
        Check(
            name=f"{name}: eager twice on the same packs (the spread)",
            status="passed" if eager.eager_steps == 2 else "failed",
            detail=f"largest per-token loss difference {worst['eager loss']:.2e}, largest "
            f"relative gradient difference {worst['eager grad']:.2e}; median eager step "
            f"{statistics.median(eager_s) * 1e3:.1f} ms; eager fallback steps: "
            f"{eager.eager_steps} (the planted step over the static shape, cap {cap} + 2 "
            "documents a row, run twice)",
        )
    ]
    if not cuda:
        checks.append(
            Check(
                name=f"{name}: captured and replayed",
                status="skipped",
                detail="capture needs CUDA (torch.cuda.graph); the static slots, GraphStep's "
                "eager step and its fallback ran here",
            )
        )
        return checks
    ok = all(worst[f"replay {k}"] <= spread[k] for k in spread)
    checks.append(
        Check(
            name=f"{name}: replayed losses and every gradient == eager (within eager's spread)",
            status="passed" if ok and graph.eager_steps == 1 else "failed",
            detail=f"largest per-token loss difference {worst['replay loss']:.2e} (allowed "
            f"{spread['loss']:.1e}), relative gradient {worst['replay grad']:.2e} (allowed "
            f"{spread['grad']:.1e}) over {len(step_batches)} steps; {graph.replays} replays, "
            f"eager fallback steps: {graph.eager_steps}",
        )
    )
    checks.append(_optimizer_check(name, graph, eager, model_g, model_e, step_batches, device))
    checks.append(_sync_check(name, graph, step_batches, device))
    checks.append(_time_check(name, replay_s, eager_s, target))
    return checks


def _worse(
    worst: dict[str, float],
    kind: str,
    reports: list[Any],
    losses: list[torch.Tensor],
    model: Any,
    grads: list[torch.Tensor],
) -> None:
    """Fold one step's largest differences against eager's (``losses``, ``grads``) into ``worst``."""
    loss = max(
        float((r["per_token"] - w).abs().max()) for r, w in zip(reports, losses, strict=True)
    )
    grad = max(
        float((p.grad - g).abs().max()) / max(float(g.abs().max()), 1e-30)
        for p, g in zip(model.parameters(), grads, strict=True)
    )
    worst[f"{kind} loss"] = max(worst[f"{kind} loss"], loss)
    worst[f"{kind} grad"] = max(worst[f"{kind} grad"], grad)


def _optimizer_check(
    name: str,
    graph: Any,
    eager: Any,
    model_g: Any,
    model_e: Any,
    step_batches: list[Any],
    device: torch.device,
) -> Check:
    """`OPTIMIZER_STEPS` replayed steps with learning rates against eager ones from the same state
    (eager's state copied from the graph's), and eager against its own rerun."""
    lrs = [1e-4 / (k + 1) for k in range(OPTIMIZER_STEPS)]
    pairs = list(zip(model_e.parameters(), model_g.parameters(), strict=True))
    with torch.no_grad():
        for pe, pg in pairs:
            pe.copy_(pg)
            for key, value in graph.optimizer.state[pg].items():
                eager.optimizer.state[pe][key].copy_(value)
    saved = [(p.detach().clone(), {k: v.clone() for k, v in eager.optimizer.state[p].items()})
             for p, _ in pairs]  # fmt: skip

    def run(step: Callable[[Any], Any]) -> None:
        for lr, batches in zip(lrs, step_batches[WARMUP + 2 :], strict=False):
            step.set_lr(lr)  # type: ignore[attr-defined]
            step(batches)

    run(eager)
    first = [p.detach().clone() for p, _ in pairs]
    with torch.no_grad():
        for (p, _), (value, state) in zip(pairs, saved, strict=True):
            p.copy_(value)
            for key, v in state.items():
                eager.optimizer.state[p][key].copy_(v)
    run(eager)
    run(graph)
    _sync(device)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)

    spread = max(rel(p.detach(), f) for (p, _), f in zip(pairs, first, strict=True))
    replay = max(rel(g.detach(), f) for (_, g), f in zip(pairs, first, strict=True))
    moved = max(float((f - v).abs().max()) for f, (v, _) in zip(first, saved, strict=True))
    return Check(
        name=f"{name}: parameters after {OPTIMIZER_STEPS} replayed AdamW steps == eager's",
        status="passed" if replay <= max(spread, FLOOR) and moved > 0 else "failed",
        detail=f"largest relative parameter difference {replay:.2e} (eager rerun: {spread:.2e}); "
        f"the steps moved a parameter by up to {moved:.2e} (absolute; lr {lrs[0]:g} falling)",
    )


def _sync_check(name: str, graph: Any, step_batches: list[Any], device: torch.device) -> Check:
    from megapack.bench.gpu.syncs import positive_control, sync_debug_errors

    control = positive_control(device)
    label = f"{name}: 0 syncs in {SYNC_REPLAYS} replays (set_lr, load, replay)"
    if control.status != "passed":
        return Check(name=label, status="failed", detail=f"positive control: {control.detail}")
    try:
        for batches in step_batches[WARMUP + 2 : WARMUP + 2 + SYNC_REPLAYS]:
            with sync_debug_errors(device):
                graph.set_lr(0.0)
                out = graph(batches)
            if not out.replayed:
                return Check(name=label, status="failed", detail="a step did not replay")
    except RuntimeError as exc:
        return Check(name=label, status="failed", detail=f"{type(exc).__name__}: {exc}")
    return Check(
        name=label, status="passed", detail="the detector's planted .item() raised; no replay did"
    )


def _time_check(
    name: str, replay_s: list[float], eager_s: list[float], target: float | None
) -> Check:
    ratio = statistics.median(replay_s) / statistics.median(eager_s)
    detail = (
        f"replay {statistics.median(replay_s) * 1e3:.2f} ms vs eager "
        f"{statistics.median(eager_s) * 1e3:.2f} ms a step (medians of {len(replay_s)} and "
        f"{len(eager_s)}): {ratio:.2f}x"
    )
    if target is None:
        return Check(name=f"{name}: replay time", status="info", detail=detail)
    return Check(
        name=f"{name}: replay <= {target}x eager",
        status="passed" if ratio <= target else "failed",
        detail=detail,
    )


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
