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
from megapack.bench.gpu.graph import REPLAY_TARGET
from megapack.bench.gpu.model import PRESET, GptShape, build_gpt, matmul_ceiling
from megapack.bench.gpu.report import Check, Report, Status
from megapack.bench.gpu.sizes import KitSizes
from megapack.bench.gpu.syncs import (
    backend_sync_checks,
    step_sync_checks,
    sync_checks,
)
from megapack.bench.gpu.throughput import (
    run_gpu_throughput,
    time_steps,
)
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
        f"torch.distributed {dist.get_backend()} world of 1, megatron-core parallel_state tp=1 pp=1"
    )
    return [Check(name="set-up", status="info", detail=detail)]


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
    sizes: KitSizes, device: torch.device, state: dict[str, Any], seq_len: int, seed: int
) -> Check:
    """On the bf16 model itself; the dry run (fp32) builds a bf16 copy of its toy model for it."""
    shape = sizes.shape
    if sizes.dtype == torch.bfloat16:
        model = state["model"]
    else:
        model = build_gpt(shape, device=device, dtype=torch.bfloat16, max_sequence_length=seq_len)
    return packed_vs_padded(
        model,
        device=device,
        dtype=torch.bfloat16,
        lengths=sizes.loss_lengths,
        seq_len=seq_len,
        vocab_size=shape.vocab_size,
        seed=seed,
        label=f"packed == padded per-token losses (bfloat16, {auto_backend(device, torch.bfloat16)}, "
        f"Float16Module, {shape.num_layers} layers)",
    )


def build_main(sizes: KitSizes, device: torch.device, state: dict[str, Any]) -> Check:
    model = build_gpt(
        sizes.shape,
        device=device,
        dtype=sizes.dtype,
        max_sequence_length=max(sizes.throughput.seq_lens),
    )
    state["model"] = model
    count, expected = sum(p.numel() for p in model.parameters()), sizes.shape.parameters()
    status: Status = "passed" if count == expected else "failed"
    return Check(
        name=f"model: {shape_name(sizes.shape)}, {str(sizes.dtype).removeprefix('torch.')}",
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

    from megapack.bench.layouts import micro_batches

    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, sizes.shape.vocab_size, n) for n in lengths]
    packed = micro_batches("packed", docs, seq_len, 1)
    checks = sync_checks(state["model"], packed, device=device)
    checks += step_sync_checks(state["model"], packed, docs, seq_len, device=device)
    checks += backend_sync_checks(device, sizes.dtype)
    state["sync"] = checks
    return checks


def throughput_step(
    sizes: KitSizes,
    device: torch.device,
    state: dict[str, Any],
    mixes: dict[str, list[int]],
    report: Report,
    start: float,
    seed: int,
    peak: float | None,
) -> list[Check]:
    from megapack import Topology

    matmul = matmul_ceiling(device, sizes.dtype, n=sizes.matmul_n)
    report.notes.append(
        f"measured matmul: {matmul / 1e12:.1f} TFLOP/s, "
        f"{str(sizes.dtype).removeprefix('torch.')} {sizes.matmul_n}^3, median of 10"
        + (f" ({matmul / peak:.0%} of the bf16 peak)" if peak else "")
    )
    rows = run_gpu_throughput(
        state["model"],
        sizes.shape,
        sizes.throughput,
        mixes,
        topology=Topology.single(device),
        deadline=start + sizes.budget_s,
        seed=seed,
    )
    report.details = rows
    report.throughput = summarize(rows, peak_flops=peak, matmul_flops=matmul)
    bad = [
        f"{r['mix']} seq {r['seq_len']} {r['mode']}: {r['status']}: {r['detail']}"
        for r in rows
        if r["status"] != "ok"
    ]
    if bad:
        return [Check(name="throughput", status="failed", detail="; ".join(bad))]
    t = sizes.throughput
    checks = [
        Check(
            name="throughput",
            status="passed",
            detail=(
                f"{len(rows)} runs: seq {', '.join(map(str, t.seq_lens))} x {len(mixes)} mixes x {len(rows) // len(mixes) // len(t.seq_lens)} "
                f"modes, {t.documents} documents, {t.rows} rows per micro-batch, {t.steps} timed steps after {t.warmup} warm-up"
            ),
        )
    ]
    noisy = [
        f"{e['config']} vs {e['baseline']} ({e['spread']:.0%})"
        for e in report.throughput
        if e["noisy"]
    ]
    checks.append(
        Check(
            name="throughput spread: ratios whose (max - min) / median exceeds 10% "
            "(verdicts read the median)",
            status="info",
            detail=("NOISY: " + "; ".join(noisy)) if noisy else "none: every ratio within 10%",
        )
    )
    return checks


def profile_modes(
    sizes: KitSizes,
    device: torch.device,
    state: dict[str, Any],
    lengths: list[int],
    report: Report,
    seed: int,
) -> list[Check]:
    """One step of each mode at the first configuration (seq, openchat) under torch.profiler."""
    import functools

    import numpy as np
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megapack import Topology
    from megapack.bench.gpu.profile import profile_step
    from megapack.bench.layouts import MODES, micro_batches
    from megapack.harness.gpt import forward_step

    seq_len, rows = sizes.throughput.seq_lens[0], sizes.throughput.rows
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, sizes.shape.vocab_size, n) for n in lengths]
    model, topology = state["model"], Topology.single(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    step_fn = functools.partial(forward_step, topology)
    for mode in MODES:
        batches = micro_batches(mode, docs, seq_len, rows, seed=seed)
        packed = mode == "packed"

        def run(batches: list[Any] = batches, packed: bool = packed) -> None:
            time_steps(
                get_forward_backward_func(),
                step_fn,
                model,
                optimizer,
                batches,
                device,
                width=rows * seq_len if packed else None,
                micro_batch_size=1 if packed else None,
                warmup=0,
                steps=1,
            )

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
    sizes: KitSizes, device: torch.device, state: dict[str, Any], lengths: list[int], seed: int
) -> list[Check]:
    """The captured step (`megapack.bench.gpu.graph`): the cap from OpenChat, then the kit's model
    (reported) and a launch-bound one (the target) replayed over static packs."""
    import numpy as np

    from megapack.bench.gpu.graph import LAUNCH_BOUND, cap_check, graph_step_check

    seq_len, rows = sizes.throughput.seq_lens[0], sizes.throughput.rows
    scale = sizes.throughput.length_scale
    openchat = [max(1, round(n * scale)) for n in openchat_lengths()]
    check, cap = cap_check(openchat, seq_len, rows)
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, sizes.shape.vocab_size, n) for n in lengths]
    checks = [check]
    checks += graph_step_check(
        state["model"],
        sizes.shape,
        docs,
        device=device,
        dtype=sizes.dtype,
        seq_len=seq_len,
        rows=rows,
        cap=cap,
        label=shape_name(sizes.shape),
        target=None,
    )
    small_shape, small_seq = (
        (LAUNCH_BOUND, 1024) if sizes.shape == PRESET else (sizes.shape, seq_len // 2)
    )
    small = build_gpt(small_shape, device=device, dtype=sizes.dtype, max_sequence_length=small_seq)
    try:
        short = [d[: small_seq // 2] for d in docs]
        _, small_cap = cap_check([len(d) for d in short], small_seq, rows)
        checks += graph_step_check(
            small,
            small_shape,
            short,
            device=device,
            dtype=sizes.dtype,
            seq_len=small_seq,
            rows=rows,
            cap=small_cap,
            label=f"launch-bound {shape_name(small_shape)}",
            target=REPLAY_TARGET,
        )
    finally:
        del small
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return checks


def auto_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The backend "auto" trains with here (what the loss checks run)."""
    from megapack.attention import choose_backend

    return f"attention {choose_backend(device, dtype, training=True)}"


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


def notes(sizes: KitSizes, dry_run: bool) -> list[str]:
    env = environment(backend="none", launcher="one process")  # megatron-core's version, commit
    mcore, commit = env["megatron_core"], env["commit"]
    t = sizes.throughput
    return [
        f"python {platform.python_version()}, megatron-core {mcore}, commit {commit}"
        + (", DRY RUN (CPU, toy sizes: no GPU numbers)" if dry_run else ""),
        f"model: {shape_name(sizes.shape)}, {str(sizes.dtype).removeprefix('torch.')}; seq {', '.join(map(str, t.seq_lens))}; "
        f"{t.documents} documents a step, {t.rows} rows per micro-batch, {t.steps} timed steps per mode",
    ]
