"""The GPU kit's steps (`megapack.bench.gpu.kit` runs them in order): set-up, the loss checks, the
model, the sync checks, throughput, the profile and the captured step; each returns report checks."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import torch
import torch.distributed as dist

from megapack.bench.baselines import summarize
from megapack.bench.gpu.checks import (
    packed_vs_padded,
)
from megapack.bench.gpu.model import PRESET, GptShape, build_gpt, matmul_ceiling
from megapack.bench.gpu.report import Check, Report, Status
from megapack.bench.gpu.sizes import KitSizes
from megapack.bench.gpu.syncs import (
    backend_sync_checks,
    step_sync_checks,
    sync_checks,
    sync_target,
)
from megapack.bench.gpu.targets import REPLAY_TARGET, VS_GROUPED_TARGET, target_checks
from megapack.bench.gpu.throughput import MIXES, ThroughputSizes, run_gpu_throughput, train_step
from megapack.bench.modes import FULL_MODES, MODES
from megapack.bench.report import environment


def set_up(device: torch.device, seed: int) -> list[Check]:
    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    if device.type == "cpu":
        from megapack.harness.megatron_cpu import megatron_on_cpu

        megatron_on_cpu(force=True)
    else:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(seed)
    detail = (
        f"torch.distributed {dist.get_backend()} world of 1, megatron-core parallel_state tp=1 pp=1; "
        + versions()
    )
    return [Check(name="set-up", status="info", detail=detail)]


def versions() -> str:
    """The cuDNN library and frontend the run has (`megapack.bench.gpu.devices.cudnn_versions`)."""
    from megapack.bench.gpu.devices import cudnn_versions

    found = cudnn_versions()
    return f"cuDNN {found['cudnn']}, cudnn frontend {found['cudnn_frontend']}"


def tear_down() -> None:
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def fp32_losses(sizes: KitSizes, device: torch.device, seq_len: int, seed: int) -> Check:
    model = build_gpt(
        sizes.fp32_shape, device=device, dtype=torch.float32, max_sequence_length=seq_len
    )
    try:
        return packed_vs_padded(
            model,
            device=device,
            dtype=torch.float32,
            lengths=sizes.loss_lengths,
            seq_len=seq_len,
            vocab_size=sizes.fp32_shape.vocab_size,
            seed=seed,
            label=f"packed == padded per-token losses (float32, {auto_backend(device, torch.float32)}, "
            f"{sizes.fp32_shape.num_layers} layers)",
        )
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def bf16_losses(
    sizes: KitSizes,
    device: torch.device,
    state: dict[str, Any],
    seq_len: int,
    seed: int,
    backend: str = "auto",
) -> Check:
    """On the bf16 model itself; the dry run (fp32) builds a bf16 copy of its toy model for it."""
    shape = sizes.shape
    if sizes.dtype == torch.bfloat16:
        model = state["model"]
    else:
        model = build_gpt(
            shape, device=device, dtype=torch.bfloat16, max_sequence_length=seq_len, backend=backend
        )
    return packed_vs_padded(
        model,
        device=device,
        dtype=torch.bfloat16,
        lengths=sizes.loss_lengths,
        seq_len=seq_len,
        vocab_size=shape.vocab_size,
        seed=seed,
        label=f"packed == padded per-token losses (bfloat16, {auto_backend(device, torch.bfloat16, backend)}, "
        f"Float16Module, {shape.num_layers} layers)",
    )


def build_main(
    sizes: KitSizes, device: torch.device, state: dict[str, Any], backend: str = "auto"
) -> Check:
    """The kit's model, attention ``backend`` (the kit's ``--backend``) in every layer."""
    model = build_gpt(
        sizes.shape,
        device=device,
        dtype=sizes.dtype,
        max_sequence_length=max(sizes.throughput.seq_lens),
        backend=backend,
    )
    state["model"] = model
    count, expected = sum(p.numel() for p in model.parameters()), sizes.shape.parameters()
    status: Status = "passed" if count == expected else "failed"
    return Check(
        name=f"model: {shape_name(sizes.shape)}, {str(sizes.dtype).removeprefix('torch.')}, "
        f"{auto_backend(device, sizes.dtype, backend)}",
        status=status,
        detail=f"{count:,} parameters; the FLOPs formula counts {expected:,}",
    )


def sync_step(
    sizes: KitSizes,
    device: torch.device,
    state: dict[str, Any],
    lengths: list[int],
    seq_len: int,
    seed: int,
) -> list[Check]:
    import numpy as np

    from megapack.bench.modes import micro_batches

    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, sizes.shape.vocab_size, n) for n in lengths]
    packed = micro_batches("packed", docs, seq_len, 1)
    checks = sync_checks(state["model"], packed, device=device)
    checks += step_sync_checks(state["model"], packed, docs, seq_len, device=device)
    checks += backend_sync_checks(device, sizes.dtype)
    return [*checks, sync_target(checks)]


def throughput_step(
    sizes: KitSizes,
    device: torch.device,
    state: dict[str, Any],
    mixes: dict[str, list[int]],
    report: Report,
    seed: int,
    peak: float | None,
    *,
    applies: bool,
    why_not: str,
    throughput: ThroughputSizes | None = None,
    modes: tuple[str, ...] = MODES,
    budget_s: float | None = None,
    label: str = "throughput",
) -> list[Check]:
    """The matmul rate, packing against the baselines of ``modes`` (`run_gpu_throughput`, at
    ``throughput``'s sizes, default ``sizes.throughput``, on ``mixes``), the spread line and the
    throughput targets of what ran (`target_checks`; skipped, saying ``why_not``, unless
    ``applies``). The deadline is ``budget_s`` (default ``sizes.budget_s``) from the start; the
    first check is named ``label``."""
    import time

    from megapack import Topology

    t = throughput or sizes.throughput
    start = time.perf_counter()
    matmul = matmul_ceiling(device, sizes.dtype, n=sizes.matmul_n)
    report.notes.append(
        f"measured matmul: {matmul / 1e12:.1f} TFLOP/s, "
        f"{str(sizes.dtype).removeprefix('torch.')} {sizes.matmul_n}^3, median of 10"
        + (f" ({matmul / peak:.0%} of the bf16 peak)" if peak else "")
    )
    rows = run_gpu_throughput(
        state["model"],
        sizes.shape,
        t,
        mixes,
        topology=Topology.single(device),
        deadline=start + (sizes.budget_s if budget_s is None else budget_s),
        seed=seed,
        modes=modes,
    )
    summary = summarize(rows, peak_flops=peak, matmul_flops=matmul)
    report.details += rows
    report.throughput += summary
    ran_mixes = tuple(m for m in MIXES if m in mixes)
    cannot = [r for r in rows if str(r.get("detail", "")).startswith("cannot compile here")]
    bad = [
        f"{r['mix']} seq {r['seq_len']} {r['mode']}: {r['status']}: {r['detail']}"
        for r in rows
        if r not in cannot
        and (r["status"] == "error" or (r["status"] == "skipped" and r["mode"] in FULL_MODES))
    ]
    done = sum(r["status"] == "ok" for r in rows)
    what = (
        f"{done} of {len(rows)} mode runs: seq {', '.join(map(str, t.seq_lens))} x "
        f"{len(ran_mixes)} mix{'es' if len(ran_mixes) > 1 else ''} ({', '.join(ran_mixes)}) x "
        f"{len(modes)} modes ({', '.join(modes)}) interleaved, {t.rows} rows per micro-batch, "
        f"steps of {t.step_tokens:,} packed token slots from plans over {t.pool:,} documents, "
        f"{t.steps} timed rounds after {t.warmup} warm-up"
    )
    checks = [
        Check(
            name=label,
            status="failed" if bad else "passed",
            detail=(what + "; " + "; ".join(bad)) if bad else what,
        )
    ]
    skipped = [
        f"{r['mix']} seq {r['seq_len']} {r['mode']}: {r['detail']}"
        for r in rows
        if r["status"] == "skipped" and (r in cannot or r["mode"] not in FULL_MODES)
    ]
    if skipped:  # a kernel that cannot compile here, a context baseline past the deadline
        checks.append(
            Check(name="throughput: modes not run", status="skipped", detail="; ".join(skipped))
        )
    noisy = [f"{e['config']} vs {e['baseline']} ({e['spread']:.0%})" for e in summary if e["noisy"]]
    checks.append(
        Check(
            name="throughput spread: ratios whose (max - min) / median exceeds 10% "
            "(a target on one fails as too noisy to judge)",
            status="info",
            detail=("NOISY: " + "; ".join(noisy)) if noisy else "none: every ratio within 10%",
        )
    )
    checks += target_checks(summary, seq_lens=t.seq_lens, applies=applies, why_not=why_not,
                            mixes=ran_mixes, ceiling="ceiling" in modes)  # fmt: skip
    return checks


def profile_modes(
    sizes: KitSizes,
    device: torch.device,
    state: dict[str, Any],
    lengths: list[int],
    report: Report,
    seed: int,
) -> list[Check]:
    """One step of each mode at the first configuration (seq, openchat), laid out as the
    throughput section lays it out, under torch.profiler."""
    import functools

    import numpy as np
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megapack import Topology
    from megapack.bench.gpu.profile import profile_step
    from megapack.bench.modes import micro_batches, plan_step, timed
    from megapack.harness.gpt import forward_step

    seq_len, rows = sizes.throughput.seq_lens[0], sizes.throughput.rows
    window = sizes.throughput.micro_batches(seq_len)
    step = plan_step(lengths, seq_len, rows, window, seed=seed)
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, sizes.shape.vocab_size, n) for n in step.lengths]
    model, topology = state["model"], Topology.single(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    step_fn = functools.partial(forward_step, topology)
    schedule = get_forward_backward_func()
    for mode in MODES:
        batches = timed(
            mode, micro_batches(mode, docs, seq_len, rows, packing=step.packing), window
        )
        run = functools.partial(train_step, schedule, step_fn, model, optimizer, batches, device)
        run()  # warm: the profiled step is a steady one
        report.profile.append(
            {"mode": mode, "micro_batches": len(batches)} | profile_step(run, device)
        )
    optimizer.zero_grad(set_to_none=True)
    report.write()
    summary = ", ".join(f"{p['mode']} {p['host_ms']:.0f} ms" for p in report.profile)
    return [
        Check(
            name=f"profile: one step per mode (openchat, seq {seq_len})",
            status="info",
            detail=f"host time {summary}; see the report's profile table",
        )
    ]


def graph_step(
    sizes: KitSizes,
    device: torch.device,
    state: dict[str, Any],
    lengths: list[int],
    seed: int,
    *,
    launch_only: bool = False,
    packs: int | None = None,
    backend: str = "auto",
) -> list[Check]:
    """The captured whole training step (`megapack.bench.gpu.graph`, `graph_grouped`): the cap
    from OpenChat; then, on fresh copies of the kit's model (reported; not with ``launch_only``)
    and of a launch-bound one (the targets), replay against eager over ``packs`` packs (default
    `megapack.bench.gpu.graph.PACKS`; losses, every gradient, AdamW's result, 0 syncs, time) and
    packed + whole-step graphs against eager length-grouped padding, THD attention ``backend``."""
    import numpy as np

    from megapack.bench.gpu.graph import LAUNCH_BOUND, PACKS, cap_check, compare_replay
    from megapack.bench.gpu.graph_grouped import packed_graph_vs_grouped

    seq_len, rows = sizes.throughput.seq_lens[0], sizes.throughput.rows
    scale = sizes.throughput.length_scale
    openchat = [max(1, round(n * scale)) for n in openchat_lengths()]
    check, cap = cap_check(openchat, seq_len, rows)
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, sizes.shape.vocab_size, n) for n in lengths]
    small_shape, small_seq = (
        (LAUNCH_BOUND, 1024) if sizes.shape == PRESET else (sizes.shape, seq_len // 2)
    )
    short = [d[: small_seq // 2] for d in docs]
    _, small_cap = cap_check([len(d) for d in short], small_seq, rows)
    if packs is None:
        packs = PACKS if device.type == "cuda" else 3  # the dry run: the eager half, toy-sized
    checks = [check]
    runs = (
        (sizes.shape, docs, seq_len, cap, shape_name(sizes.shape), None, None),
        (small_shape, short, small_seq, small_cap, f"launch-bound {shape_name(small_shape)}",
         REPLAY_TARGET, VS_GROUPED_TARGET),
    )[1 if launch_only else 0 :]  # fmt: skip
    for shape, texts, seq, c, label, replay_target, grouped_target in runs:
        common: dict[str, Any] = dict(device=device, dtype=sizes.dtype, seq_len=seq, rows=rows,
                                      cap=c, label=label, backend=backend)  # fmt: skip
        checks += compare_replay(shape, texts, target=replay_target, steps=packs, **common)
        checks += packed_graph_vs_grouped(
            shape, texts, target=grouped_target, steps=sizes.throughput.steps, **common
        )
        if device.type == "cuda":  # the pair's graphs and buffers, before the next pair
            import gc

            gc.collect()
            torch.cuda.empty_cache()
    return checks


def auto_backend(device: torch.device, dtype: torch.dtype, backend: str = "auto") -> str:
    """The backend a model trains with here (what the loss checks run): ``backend`` itself, or
    what "auto" chooses."""
    from megapack.attention import resolve_backend

    if backend != "auto":
        return f"attention {backend} (forced)"
    return f"attention {resolve_backend('auto', device, training=True, dtype=dtype)}"


def openchat_lengths() -> list[int]:
    from megapack.bench.datasets import bundled_lengths_path, load_lengths

    return load_lengths(bundled_lengths_path())[0]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def shape_name(shape: GptShape) -> str:
    return (
        f"{shape.parameters() / 1e6:,.1f}M-parameter GPT ({shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_attention_heads}/{shape.num_query_groups} heads, FFN {shape.ffn_hidden_size}, vocab {shape.vocab_size})"
    )


def notes(
    sizes: KitSizes, dry_run: bool, *, sections: tuple[str, ...] = (), backend: str = "auto"
) -> list[str]:
    """The report's header lines: versions (cuDNN and its frontend too), the sizes (the narrowed
    throughput's when only throughput-4k runs), the sections run and the attention backend."""
    env = environment(backend="none", launcher="one process")  # megatron-core's version, commit
    mcore, commit = env["megatron_core"], env["commit"]
    narrowed = "throughput-4k" in sections and "throughput" not in sections
    t = sizes.first_throughput if narrowed else sizes.throughput
    return [
        f"python {platform.python_version()}, megatron-core {mcore}, {versions()}, commit {commit}"
        + (", DRY RUN (CPU, toy sizes: no GPU numbers)" if dry_run else ""),
        f"model: {shape_name(sizes.shape)}, {str(sizes.dtype).removeprefix('torch.')}; "
        f"attention backend {backend}; seq {', '.join(map(str, t.seq_lens))}; a step: "
        f"{t.step_tokens:,} packed token slots from a plan over {t.pool:,} documents, "
        f"{t.rows} rows per micro-batch, {t.steps} timed rounds of every mode",
        f"sections: {', '.join(sections) if sections else 'all'}",
    ]
