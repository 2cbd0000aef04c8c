"""The GPU kit's ``smoke`` section: a toy `GraphStep` captured and replayed in bf16 with each
attention backend a user gets forced (`BACKENDS`), the first thing a GPU run must show.

For each backend that trains here, twin toy GPTs with the same weights and the backend forced in
every layer (`megapack.bench.gpu.graph.twin_models`), each trained by a `GraphStep` of
`MICRO_BATCHES` micro-batches at learning rate 0 (every kernel of the AdamW update runs, the
weights stay), the batches delivered in one static shape with their bucket plan:

    the captured step   packs A, B (its warm-up: eager, on a side stream), A (the capture and
                        its first replay), B, A (replays)
    the eager step      every pack twice: eager's own spread on it

1. The replays of A, B, A against eager on the same pack: every per-token loss and every
   gradient within eager's spread, or `FLOOR` where eager agrees with itself exactly (a replay
   that read the wrong pack is off by O(1)); captured after exactly `WARMUP` steps, no eager
   fallback.
2. Syncs, after both detectors' positive controls (a planted ``.item()`` must trip each): a replay
   (set_lr, load, replay) under ``torch.cuda.set_sync_debug_mode("error")``, then one under the
   host-wait probe (`megapack.bench.gpu.host_wait`); and the backend's attention alone, eager
   fwd+bwd on a ragged row, under both. torch's detector cannot see a sync inside a library it
   hands the stream to; the probe can. So the cudnn line answers cudnn-frontend issue #552 on
   Hopper: whether cuDNN's ragged (THD) execution synchronises the host.
3. Times: the median eager step and the median replay (info; the targets are the graph
   section's, on the launch-bound model).

A backend a capture cannot hold (`megapack.megatron.graph_parts.UNCAPTURABLE`: bucketed) must be
refused by GraphStep at its first step, by name and reason, before its warm-up trains anything:
that refusal is the expected outcome (passed), and its steps are timed eagerly instead. A
capturable backend refused, or an uncapturable one accepted, fails.

Without CUDA (the dry run: fp32, the toy model): cudnn and torch_varlen cannot train (skipped,
saying why); bucketed's refusal is checked with the function GraphStep runs before its warm-up
(`megapack.megatron.graph_parts.check_capture_attention`: GraphStep's graph mode needs CUDA), its
eager steps run, and the capture and the sync checks are skipped with their reason.
"""

from __future__ import annotations

import functools
import gc
import statistics
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from megapack.bench.gpu.checks import dtype_name
from megapack.bench.gpu.graph import MICRO_BATCHES, WARMUP, make_step, timed, twin_models
from megapack.bench.gpu.host_wait import Spin, cuda_spin, probe_control, wait_check
from megapack.bench.gpu.model import GptShape
from megapack.bench.gpu.report import Check, Status
from megapack.bench.gpu.syncs import positive_control, sync_debug_errors

BACKENDS = ("cudnn", "torch_varlen", "bucketed")
"""The backends the smoke forces, one twin pair each."""
SMOKE = GptShape(
    num_layers=2,
    hidden_size=512,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=2048,
    vocab_size=32000,
)
"""The smoke's GPT on a GPU: 38.5M parameters, head dim 128 (the preset's: the same attention
kernels), grouped-query attention, seconds to build and step."""
CAP = 8
"""Documents a row at most: the static shape holds ``segments_for(CAP, rows)`` segments."""
ORDER = "ABABA"
"""The packs the captured step runs: `WARMUP` warm-up steps, the capture, then replays."""
FLOOR = {
    torch.bfloat16: {"loss": 2e-2, "grad": 5e-2},
    torch.float32: {"loss": 1e-5, "grad": 1e-5},
}
"""Allowed differences where eager agrees with itself exactly: relative to the largest per-token
loss, and to each gradient's largest value (bf16: a few units of its 2^-8 rounding; a wrong pack
moves the losses by O(1))."""
SYNC_ROW = (1, 37, 0, 64, 5, 19)
"""The ragged row (a zero-length document in it) each backend's attention is probed on alone."""


def smoke_checks(
    shape: GptShape,
    docs: Sequence[np.ndarray],
    *,
    device: torch.device,
    dtype: torch.dtype,
    seq_len: int,
    rows: int,
    backends: Sequence[str] = BACKENDS,
) -> list[Check]:
    """The module docstring's checks: the detectors' controls, then each of ``backends``."""
    from megapack import BUCKET_FIELDS, StaticShape, Topology, get_batch_on_this_tp_rank
    from megapack.core.static import segments_for

    static = StaticShape(max_segments=segments_for(CAP, rows), max_seqlen=seq_len)
    topology = Topology.single(device)
    deliver = functools.partial(get_batch_on_this_tp_rank, topology=topology, static=static,
                                fields=BUCKET_FIELDS)  # fmt: skip
    made = two_packs(docs, seq_len, rows, MICRO_BATCHES)
    packs = {key: [deliver(iter([b])) for b in pack] for key, pack in zip("AB", made, strict=True)}
    spin = cuda_spin(device)
    controls = [positive_control(device), probe_control(spin, device)]
    checks = list(controls)
    for name in backends:
        try:
            checks += backend_checks(name, shape, packs, static, controls, spin,
                                     device=device, dtype=dtype, seq_len=seq_len)  # fmt: skip
        except Exception as exc:
            stack = "\n".join(traceback.format_exc().splitlines()[-25:])
            checks.append(Check(name=f"smoke: {name}", status="failed",
                                detail=f"{type(exc).__name__}: {exc}\n{stack}"))  # fmt: skip
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return checks


def two_packs(
    docs: Sequence[np.ndarray], seq_len: int, rows: int, micro: int
) -> tuple[list[Any], list[Any]]:
    """Packs A and B: ``micro`` micro-batches of ``rows`` rows each, every row at most `CAP`
    documents, no row in both (ValueError when ``docs`` fill fewer than ``2 x micro x rows``)."""
    from megapack.core.batch import PackedBatch
    from megapack.packing import plan

    p = plan([len(d) for d in docs], seq_len, max_documents=CAP)
    need = 2 * micro * rows
    if p.num_bins < need:
        raise ValueError(f"the smoke's {len(docs)} documents fill {p.num_bins} rows of {seq_len}; "
                         f"packs A and B need {need} different rows")  # fmt: skip
    made = [PackedBatch.from_documents([docs[i][a:b] for i, a, b in row], seq_len=seq_len)
            for row in p.bins[:need]]  # fmt: skip
    batches = [PackedBatch.concat(made[j : j + rows]) for j in range(0, need, rows)]
    return batches[:micro], batches[micro:]


def backend_checks(
    name: str,
    shape: GptShape,
    packs: dict[str, list[Any]],
    static: Any,
    controls: list[Check],
    spin: Spin | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    seq_len: int,
) -> list[Check]:
    """One backend's checks (module docstring)."""
    from megapack.attention.choice import installed_here, refusal
    from megapack.megatron.graph_parts import UNCAPTURABLE

    why = refusal(name, device.type, dtype, training=True, dropout=0.0, installed=installed_here())
    if why is not None:
        return [Check(name=f"smoke: {name}", status="skipped",
                      detail=f"cannot train {dtype_name(dtype)} on {device.type} here: {why}")]  # fmt: skip
    model_g, model_e = twin_models(shape, device, dtype, seq_len, name)
    eager = make_step(model_e, device, static, MICRO_BATCHES, "eager")
    parts: list[tuple[str, Callable[[], list[Check]]]] = []
    if name in UNCAPTURABLE:
        parts += [
            (
                "refusal",
                lambda: [refusal_check(name, model_g, packs, static, device=device, dtype=dtype)],
            ),
            ("eager steps", lambda: [eager_time_check(name, eager, packs, device)]),
        ]
    elif device.type != "cuda":
        skip = Check(
            name=f"smoke: {name}: captured step vs eager",
            status="skipped",
            detail="capture needs CUDA (torch.cuda.graph)",
        )
        parts += [
            ("capture", lambda: [skip]),
            ("eager steps", lambda: [eager_time_check(name, eager, packs, device)]),
        ]
    else:
        graph = make_step(model_g, device, static, MICRO_BATCHES, "graph")
        parts += [
            (
                "capture and replays",
                lambda: replay_checks(name, graph, eager, model_g, model_e, packs, device, dtype),
            ),
            (
                "replay syncs",
                lambda: [replay_sync_check(name, graph, packs, controls, spin, device)],
            ),
        ]
    parts.append(
        (
            "attention syncs",
            lambda: [attention_sync_check(name, shape, controls, spin, device=device, dtype=dtype)],
        )
    )
    checks = []
    for part, run in parts:  # each part reports; a part that raises does not stop the next
        try:
            checks += run()
        except Exception as exc:
            stack = "\n".join(traceback.format_exc().splitlines()[-25:])
            checks.append(
                Check(
                    name=f"smoke: {name}: {part}",
                    status="failed",
                    detail=f"{type(exc).__name__}: {exc}\n{stack}",
                )
            )
    return checks


def refusal_check(
    name: str,
    model: Any,
    packs: dict[str, list[Any]],
    static: Any,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> Check:
    """The expected refusal of an uncapturable backend, before anything trains: on CUDA a
    graph-mode GraphStep's first step; without CUDA the check GraphStep runs there."""
    from megapack.megatron.graph_parts import check_capture_attention

    label = f"smoke: {name}: refused by GraphStep before its warm-up (expected: a capture cannot hold it)"
    before = [p.detach().clone() for p in model.parameters()]
    how = "GraphStep(mode='graph') at its first step"
    step = None
    try:
        if device.type == "cuda":
            step = make_step(model, device, static, MICRO_BATCHES, "graph")
            step(packs["A"])
        else:
            how = ("check_capture_attention, which GraphStep runs before its warm-up (its graph "
                   "mode needs CUDA)")  # fmt: skip
            check_capture_attention(model, packs["A"][0], device=device, dtype=dtype)
    except ValueError as exc:
        message = str(exc)
        untouched = all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        warm = 0 if step is None else step.warmup_steps
        state = bool(step is not None and step.optimizer.state)
        ok = f"it runs '{name}'" in message and untouched and warm == 0 and not state
        status: Status = "passed" if ok else "failed"
        return Check(name=label, status=status,
                     detail=f"{how}: ValueError: {message}; warm-up steps run {warm}, optimizer "
                     f"state {'built' if state else 'none'}, weights "
                     f"{'unchanged' if untouched else 'CHANGED'}")  # fmt: skip
    return Check(name=label, status="failed",
                 detail=f"{how} accepted backend {name!r}: a capture would hold an attention that "
                 "reads the host or changes shape with every batch")  # fmt: skip


def eager_time_check(
    name: str, eager: Any, packs: dict[str, list[Any]], device: torch.device
) -> Check:
    """The eager steps of ``ORDER``'s packs, timed (the first `WARMUP` untimed)."""
    seconds = [timed(functools.partial(eager, packs[key]), device)[1] for key in ORDER]
    ran = seconds[WARMUP:]
    return Check(name=f"smoke: {name}: eager step time", status="info",
                 detail=f"median {statistics.median(ran) * 1e3:.1f} ms over packs "
                 f"{', '.join(ORDER[WARMUP:])} after {WARMUP} untimed; steps over the static "
                 f"shape (eager fallback): {eager.eager_steps}")  # fmt: skip


def replay_checks(
    name: str,
    graph: Any,
    eager: Any,
    model_g: Any,
    model_e: Any,
    packs: dict[str, list[Any]],
    device: torch.device,
    dtype: torch.dtype,
) -> list[Check]:
    """1. and 3. of the module docstring: ``graph`` (captured after `WARMUP` steps) against
    ``eager`` over `ORDER`, and their times."""
    spread = {"loss": 0.0, "grad": 0.0}
    worst = {"loss": 0.0, "grad": 0.0}
    eager_s, replay_s, replayed = [], [], []
    for i, key in enumerate(ORDER):
        out, seconds = timed(functools.partial(eager, packs[key]), device)
        if i >= WARMUP:
            eager_s.append(seconds)
        losses, grads = snapshot(out, model_e)
        fold(spread, differences(eager(packs[key]), model_e, losses, grads))
        out_g, seconds = timed(functools.partial(graph, packs[key]), device)
        replayed.append(out_g.replayed)
        if i >= WARMUP:
            fold(worst, differences(out_g, model_g, losses, grads))
        if i > WARMUP:  # the capture's own step records too: left out
            replay_s.append(seconds)
    floor = FLOOR.get(dtype, FLOOR[torch.float32])
    allowed = {k: max(spread[k], floor[k]) for k in spread}
    expected = [False] * WARMUP + [True] * (len(ORDER) - WARMUP)
    counts = (graph.warmup_steps, graph.replays, graph.eager_steps)
    ok = (all(worst[k] <= allowed[k] for k in worst) and replayed == expected
          and counts == (WARMUP, len(ORDER) - WARMUP, 0))  # fmt: skip
    replays = ", ".join(ORDER[WARMUP:])
    return [
        Check(name=f"smoke: {name}: replays of packs {replays} == eager (within eager's spread)",
              status="passed" if ok else "failed",
              detail=f"largest per-token loss difference {worst['loss']:.2e} relative (allowed "
              f"{allowed['loss']:.1e}: eager twice {spread['loss']:.1e}), gradient {worst['grad']:.2e} "
              f"(allowed {allowed['grad']:.1e}: eager twice {spread['grad']:.1e}); warm-up steps "
              f"{counts[0]}, replays {counts[1]}, eager fallback steps {counts[2]}; replayed per "
              f"step {replayed}"),
        Check(name=f"smoke: {name}: step time, eager and replayed", status="info",
              detail=f"eager {statistics.median(eager_s) * 1e3:.2f} ms (median of {len(eager_s)}), "
              f"replay {statistics.median(replay_s) * 1e3:.2f} ms (median of {len(replay_s)}): "
              f"{statistics.median(replay_s) / statistics.median(eager_s):.2f}x"),
    ]  # fmt: skip


def snapshot(out: Any, model: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(every micro-batch's per-token losses, every gradient) of a step, copied."""
    losses = [r["per_token"].detach().float().clone() for r in out.reports]
    return losses, [p.grad.detach().float().clone() for p in model.parameters()]


def differences(
    out: Any, model: Any, losses: list[torch.Tensor], grads: list[torch.Tensor]
) -> dict[str, float]:
    """The largest per-token loss difference relative to the largest loss, and the largest
    gradient difference relative to that gradient's largest value, of a step against ``losses``
    and ``grads``.

    Example:
        >>> from types import SimpleNamespace as N
        >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.tensor([1.0, 2.0])
        >>> out = N(reports=[{"per_token": torch.tensor([4.0, 3.0])}])
        >>> differences(out, N(parameters=lambda: [p]), [torch.tensor([4.0, 2.0])], [torch.tensor([1.0, 4.0])])
        {'loss': 0.25, 'grad': 0.5}
    """
    scale = max(float(w.abs().max()) for w in losses)
    loss = max(float((r["per_token"].float() - w).abs().max())
               for r, w in zip(out.reports, losses, strict=True))  # fmt: skip
    grad = max(float((p.grad.float() - g).abs().max()) / max(float(g.abs().max()), 1e-30)
               for p, g in zip(model.parameters(), grads, strict=True))  # fmt: skip
    return {"loss": loss / max(scale, 1e-30), "grad": grad}


def fold(into: dict[str, float], new: dict[str, float]) -> None:
    for key, value in new.items():
        into[key] = max(into[key], value)


def replay_sync_check(
    name: str,
    graph: Any,
    packs: dict[str, list[Any]],
    controls: list[Check],
    spin: Spin | None,
    device: torch.device,
) -> Check:
    """A replay (set_lr, load, replay) under torch's detector, another under the host-wait probe."""

    def replay(key: str) -> None:
        graph.set_lr(0.0)
        if not graph(packs[key]).replayed:
            raise RuntimeError("the step did not replay")

    return _both(f"smoke: {name}: 0 syncs in a replay (set_lr, load, replay)", replay, controls,
                 spin, device)  # fmt: skip


def attention_sync_check(
    name: str,
    shape: GptShape,
    controls: list[Check],
    spin: Spin | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> Check:
    """The backend's attention alone, eager fwd+bwd on `SYNC_ROW` (warm), under both detectors."""
    from megapack.attention import packed_attention

    heads, groups, dim = shape.num_attention_heads, shape.num_query_groups, shape.head_dim
    cu = torch.tensor(np.concatenate([[0], np.cumsum(SYNC_ROW)]), dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(sum(SYNC_ROW), h, dim, device=device, dtype=dtype, generator=gen)
               for h in (heads, groups, groups))  # fmt: skip

    def run(_: str) -> None:
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        out = packed_attention(qq, kk, vv, cu_seqlens=cu, max_seqlen=max(SYNC_ROW), backend=name)
        out.sum().backward()

    run("warm")  # graphs built, plans made, kernels loaded
    note = (
        " (cudnn-frontend #552 on Hopper: does ragged execution sync?)" if name == "cudnn" else ""
    )
    label = (f"smoke: {name}: 0 syncs in its attention alone, eager fwd+bwd on a ragged row of "
             f"{len(SYNC_ROW)} documents{note}")  # fmt: skip
    return _both(label, run, controls, spin, device)


def _both(
    label: str,
    run: Callable[[str], None],
    controls: list[Check],
    spin: Spin | None,
    device: torch.device,
) -> Check:
    """``run("B")`` under torch's detector, then ``run("A")`` under the host-wait probe: one check
    (failed if either sees a sync, or either positive control did not pass)."""
    if device.type != "cuda":
        return Check(name=label, status="skipped",
                     detail=f"needs CUDA (torch.cuda.set_sync_debug_mode, a spin kernel); {device.type} "
                     "cannot detect syncs")  # fmt: skip
    bad = [c.name for c in controls if c.status != "passed"]
    if bad:
        return Check(name=label, status="failed", detail=f"a positive control did not pass: {bad}")
    try:
        with sync_debug_errors(device):
            run("B")
    except Exception as exc:
        return Check(name=label, status="failed",
                     detail=f"torch's detector: {type(exc).__name__}: {exc}")  # fmt: skip
    probed = wait_check(label, lambda: run("A"), spin, device)
    detail = f"torch's detector: 0 syncs; host-wait probe: {probed.detail}"
    return Check(name=label, status=probed.status, detail=detail)
