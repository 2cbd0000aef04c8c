"""The GPU kit: ``python -m megapack.bench.gpu_kit --out DIR [--dry-run]`` (``scripts/gpu_check.sh`` runs it).

On one GPU, in one process (a torch.distributed world of 1, megatron-core ``parallel_state`` at
tp = pp = 1), in this order:

1. attention: every backend fwd+bwd against a float64 reference (`gpu_checks.attention_checks`),
   then each one's time on one row of 8 documents and flex against varlen (`gpu_checks.attention_timing`);
2. packed == padded per-token losses in fp32 (`FULL`: the preset's shapes with 4 layers);
3. the model: `gpu_model.PRESET` in bf16 through ``Float16Module``, its parameter count against the
   FLOPs formula's;
4. packed == padded in bf16 on that model (the dry run: on a bf16 copy of its toy model);
5. syncs under ``torch.cuda.set_sync_debug_mode("error")``, a positive control first: get_batch,
   prefetch, a packed fwd+bwd, whole training steps (schedule, prefetch, optimizer; aligned padding
   too) and every backend that trains in bf16 (`gpu_checks.sync_checks`);
6. the bf16 matmul rate (8,192^3), then throughput: packing against every baseline of
   `megapack.bench.layouts` (`megapack.bench.gpu`, summarized by `megapack.bench.baselines`),
   MFU against the device's bf16 peak (`megapack.bench.devices`);
7. one profiled step per mode (`megapack.bench.profile`);
8. a captured training step (`megapack.bench.gpu_graph`): static-shape packs replayed by one CUDA
   graph on the kit's model and on a launch-bound one; then the targets.

Every step's exception becomes a failed check and the next step runs; the report
(`megapack.bench.gpu_report`) is rewritten after each. Exit status: 0 when nothing failed, 3 when a
check failed (the report is complete either way), anything else when the process itself died.

``--dry-run`` runs the same steps on CPU (gloo, megatron-core redirected by
`megapack.harness.megatron_cpu`) at `DRY` sizes in fp32 (bf16 for step 4): the CUDA-only checks (syncs,
the targets, backends without a CPU kernel) are skipped with their reason. It takes ~15-25 s on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megapack.bench.baselines import summarize
from megapack.bench.devices import peak_bf16_flops
from megapack.bench.gpu import (
    ThroughputSizes,
    length_mixes,
    run_gpu_throughput,
    target_checks,
    time_steps,
)
from megapack.bench.gpu_checks import (
    attention_checks,
    attention_timing,
    backend_sync_checks,
    packed_vs_padded,
    step_sync_checks,
    sync_checks,
)
from megapack.bench.gpu_graph import REPLAY_TARGET
from megapack.bench.gpu_model import PRESET, TOY, GptShape, build_gpt, matmul_ceiling
from megapack.bench.gpu_report import Check, Report, Status
from megapack.bench.report import environment

logger = logging.getLogger("megapack.bench.gpu_kit")


@dataclass(frozen=True, kw_only=True, slots=True)
class KitSizes:
    """Everything the kit runs, at one size."""

    shape: GptShape
    """The throughput model (and the bf16 packed == padded check's)."""
    dtype: torch.dtype
    """Its dtype: bf16 on a GPU, fp32 in the dry run."""
    fp32_shape: GptShape
    """The fp32 packed == padded check's model."""
    attention: dict[str, int]
    """heads, groups, head_dim, max_len of the attention checks."""
    loss_lengths: tuple[int, ...]
    """Document lengths of the packed == padded checks (one row of ``throughput.seq_lens[0]``)."""
    timing_lengths: tuple[int, ...]
    """Document lengths of the one row the attention backends are timed on."""
    timing_repeats: int
    """Timed fwd+bwd calls per backend (the median counts), after 3 untimed ones."""
    throughput: ThroughputSizes
    """The throughput section's sizes."""
    matmul_n: int
    """Side of the square matmul that measures the ceiling."""
    budget_s: float
    """Seconds from the kit's start after which no further throughput configuration starts."""


FULL = KitSizes(
    shape=PRESET,
    dtype=torch.bfloat16,
    fp32_shape=dataclasses.replace(PRESET, num_layers=4),
    attention={"heads": 16, "groups": 4, "head_dim": 128, "max_len": 4096},
    loss_lengths=(1, 7, 1500, 33, 1024, 2, 511, 900),
    timing_lengths=(2048, 2048, 1893, 2048, 1207, 2048, 1058, 2048),  # 14,398 tokens, 8 documents
    timing_repeats=20,
    throughput=ThroughputSizes(seq_lens=(4096, 8192), documents=64, rows=2, warmup=1, steps=5, length_scale=1.0),
    matmul_n=8192,
    budget_s=270.0,
)  # fmt: skip
"""One GPU: the 0.84B preset at seq 4,096 (then 8,192 while the budget lasts); under 6 minutes."""
KIT_TARGET_S = 360.0
"""Target: the whole kit within 6 minutes on the device."""

DRY = KitSizes(
    shape=TOY,
    dtype=torch.float32,
    fp32_shape=TOY,
    attention={"heads": 4, "groups": 2, "head_dim": 16, "max_len": 64},
    loss_lengths=(1, 7, 40, 3, 30, 2, 20),
    timing_lengths=(64, 64, 59, 64, 38, 64, 33, 64),
    timing_repeats=2,
    throughput=ThroughputSizes(seq_lens=(128, 256), documents=16, rows=2, warmup=1, steps=3, length_scale=1 / 16),
    matmul_n=512,
    budget_s=600.0,
)  # fmt: skip
"""CPU: the same steps, toy sizes, fp32."""


def run_kit(out: Path, *, dry_run: bool, sizes: KitSizes | None = None, seed: int = 0) -> Report:
    """Run every step (module docstring) and return the report, already written to ``out``."""
    start = time.perf_counter()
    cuda = torch.cuda.is_available() and not dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sizes = sizes or (FULL if cuda else DRY)
    name = _device_name(device)
    peak, peak_name = peak_bf16_flops(name) if cuda else (None, "unknown device")
    report = Report(out=out, device=name, torch=torch.__version__, notes=_notes(sizes, dry_run),
                    peak=f"{peak_name}, {peak / 1e12:,.0f} TFLOP/s" if peak else peak_name)  # fmt: skip
    report.write()
    state: dict[str, Any] = {}

    def step(label: str, fn: Callable[[], list[Check]]) -> None:
        logger.info("%s ...", label)
        try:
            report.add(*fn())
        except Exception as exc:
            stack = "\n".join(traceback.format_exc().splitlines()[-25:])
            report.add(
                Check(name=label, status="failed", detail=f"{type(exc).__name__}: {exc}\n{stack}")
            )

    step("set-up", lambda: _set_up(device, seed))
    a = sizes.attention
    step("attention", lambda: attention_checks(device, sizes.dtype, heads=a["heads"], groups=a["groups"],
                                               head_dim=a["head_dim"], max_len=a["max_len"]))  # fmt: skip
    step("attention time", lambda: attention_timing(device, sizes.dtype, lengths=sizes.timing_lengths,
                                                    heads=a["heads"], groups=a["groups"], head_dim=a["head_dim"],
                                                    repeats=sizes.timing_repeats))  # fmt: skip
    seq = sizes.throughput.seq_lens[0]
    step("packed == padded (float32)", lambda: [_fp32_losses(sizes, device, seq, seed)])
    step("model", lambda: [_build_main(sizes, device, state)])
    step("packed == padded (bfloat16)", lambda: [_bf16_losses(sizes, device, state, seq, seed)])
    mixes = length_mixes(_openchat(), sizes.throughput.documents, max_len=min(sizes.throughput.seq_lens),
                         scale=sizes.throughput.length_scale, seed=seed)  # fmt: skip
    step("sync", lambda: _syncs(sizes, device, state, mixes["openchat"], seq, seed))
    step("throughput", lambda: _throughput(sizes, device, state, mixes, report, start, seed, peak))
    step("profile", lambda: _profile(sizes, device, state, mixes["openchat"], report, seed))
    step("graph", lambda: _graph(sizes, device, state, mixes["openchat"], seed))
    on_preset = cuda and sizes.shape == PRESET
    why_not = f"the targets apply on a GPU at the preset size; this run: {device.type}, {_shape(sizes.shape)}"
    step("targets", lambda: target_checks(report.throughput, state.get("sync", []), seq_len=seq,
                                          applies=on_preset, why_not=why_not))  # fmt: skip
    wall = time.perf_counter() - start
    report.notes.append(f"kit wall time {wall:.0f} s")
    target = f"target: the kit within {KIT_TARGET_S / 60:.0f} minutes"
    report.add(Check(name=target, status="skipped", detail=why_not) if not on_preset else
               Check(name=target, status="passed" if wall <= KIT_TARGET_S else "failed",
                     detail=f"{wall:.0f} s"))  # fmt: skip
    report.write()
    _tear_down()
    return report


def _set_up(device: torch.device, seed: int) -> list[Check]:
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


def _tear_down() -> None:
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _fp32_losses(sizes: KitSizes, device: torch.device, seq_len: int, seed: int) -> Check:
    model = build_gpt(
        sizes.fp32_shape, device=device, dtype=torch.float32, max_sequence_length=seq_len
    )
    try:
        return packed_vs_padded(
            model, device=device, dtype=torch.float32, lengths=sizes.loss_lengths, seq_len=seq_len,
            vocab_size=sizes.fp32_shape.vocab_size, seed=seed,
            label=f"packed == padded per-token losses (float32, {_auto(device, torch.float32)}, "
            f"{sizes.fp32_shape.num_layers} layers)",
        )  # fmt: skip
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _bf16_losses(
    sizes: KitSizes, device: torch.device, state: dict[str, Any], seq_len: int, seed: int
) -> Check:
    """On the bf16 model itself; the dry run (fp32) builds a bf16 copy of its toy model for it."""
    shape = sizes.shape
    if sizes.dtype == torch.bfloat16:
        model = state["model"]
    else:
        model = build_gpt(shape, device=device, dtype=torch.bfloat16, max_sequence_length=seq_len)
    return packed_vs_padded(
        model, device=device, dtype=torch.bfloat16, lengths=sizes.loss_lengths, seq_len=seq_len,
        vocab_size=shape.vocab_size, seed=seed,
        label=f"packed == padded per-token losses (bfloat16, {_auto(device, torch.bfloat16)}, "
        f"Float16Module, {shape.num_layers} layers)",
    )  # fmt: skip


def _build_main(sizes: KitSizes, device: torch.device, state: dict[str, Any]) -> Check:
    model = build_gpt(
        sizes.shape,
        device=device,
        dtype=sizes.dtype,
        max_sequence_length=max(sizes.throughput.seq_lens),
    )
    state["model"] = model
    count, expected = sum(p.numel() for p in model.parameters()), sizes.shape.parameters()
    status: Status = "passed" if count == expected else "failed"
    return Check(name=f"model: {_shape(sizes.shape)}, {str(sizes.dtype).removeprefix('torch.')}", status=status,
                 detail=f"{count:,} parameters; the FLOPs formula counts {expected:,}")  # fmt: skip


def _syncs(sizes: KitSizes, device: torch.device, state: dict[str, Any], lengths: list[int], seq_len: int,
           seed: int) -> list[Check]:  # fmt: skip
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


def _throughput(sizes: KitSizes, device: torch.device, state: dict[str, Any], mixes: dict[str, list[int]],
                report: Report, start: float, seed: int, peak: float | None) -> list[Check]:  # fmt: skip
    from megapack import Topology

    matmul = matmul_ceiling(device, sizes.dtype, n=sizes.matmul_n)
    report.notes.append(f"measured matmul: {matmul / 1e12:.1f} TFLOP/s, "
                        f"{str(sizes.dtype).removeprefix('torch.')} {sizes.matmul_n}^3, median of 10"
                        + (f" ({matmul / peak:.0%} of the bf16 peak)" if peak else ""))  # fmt: skip
    rows = run_gpu_throughput(state["model"], sizes.shape, sizes.throughput, mixes, topology=Topology.single(device),
                              deadline=start + sizes.budget_s, seed=seed)  # fmt: skip
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
    checks = [Check(name="throughput", status="passed", detail=(
        f"{len(rows)} runs: seq {', '.join(map(str, t.seq_lens))} x {len(mixes)} mixes x {len(rows) // len(mixes) // len(t.seq_lens)} "
        f"modes, {t.documents} documents, {t.rows} rows per micro-batch, {t.steps} timed steps after {t.warmup} warm-up"))]  # fmt: skip
    noisy = [
        f"{e['config']} vs {e['baseline']} ({e['spread']:.0%})"
        for e in report.throughput
        if e["noisy"]
    ]
    checks.append(Check(name="throughput spread: ratios whose (max - min) / median exceeds 10% "
                        "(verdicts read the median)", status="info",
                        detail=("NOISY: " + "; ".join(noisy)) if noisy else "none: every ratio within 10%"))  # fmt: skip
    return checks


def _profile(sizes: KitSizes, device: torch.device, state: dict[str, Any], lengths: list[int],
             report: Report, seed: int) -> list[Check]:  # fmt: skip
    """One step of each mode at the first configuration (seq, openchat) under torch.profiler."""
    import functools

    import numpy as np
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megapack import Topology
    from megapack.bench.layouts import MODES, micro_batches
    from megapack.bench.profile import profile_step
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
            time_steps(get_forward_backward_func(), step_fn, model, optimizer, batches, device,
                       width=rows * seq_len if packed else None, micro_batch_size=1 if packed else None,
                       warmup=0, steps=1)  # fmt: skip

        run()  # warm: the profiled step is a steady one
        report.profile.append(
            {"mode": mode, "micro_batches": len(batches)} | profile_step(run, device)
        )
    optimizer.zero_grad(set_to_none=True)
    report.write()
    summary = ", ".join(f"{p['mode']} {p['host_ms']:.0f} ms" for p in report.profile)
    return [Check(name=f"profile: one step per mode (openchat, seq {seq_len})", status="info",
                  detail=f"host time {summary}; see the report's profile table")]  # fmt: skip


def _graph(sizes: KitSizes, device: torch.device, state: dict[str, Any], lengths: list[int],
           seed: int) -> list[Check]:  # fmt: skip
    """The captured step (`megapack.bench.gpu_graph`): the cap from OpenChat, then the kit's model
    (reported) and a launch-bound one (the target) replayed over static packs."""
    import numpy as np

    from megapack.bench.gpu_graph import LAUNCH_BOUND, cap_check, graph_step_check

    seq_len, rows = sizes.throughput.seq_lens[0], sizes.throughput.rows
    scale = sizes.throughput.length_scale
    openchat = [max(1, round(n * scale)) for n in _openchat()]
    check, cap = cap_check(openchat, seq_len, rows)
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, sizes.shape.vocab_size, n) for n in lengths]
    checks = [check]
    checks += graph_step_check(state["model"], sizes.shape, docs, device=device, dtype=sizes.dtype,
                               seq_len=seq_len, rows=rows, cap=cap, label=_shape(sizes.shape), target=None)  # fmt: skip
    small_shape, small_seq = (
        (LAUNCH_BOUND, 1024) if sizes.shape == PRESET else (sizes.shape, seq_len // 2)
    )
    small = build_gpt(small_shape, device=device, dtype=sizes.dtype, max_sequence_length=small_seq)
    try:
        short = [d[: small_seq // 2] for d in docs]
        _, small_cap = cap_check([len(d) for d in short], small_seq, rows)
        checks += graph_step_check(small, small_shape, short, device=device, dtype=sizes.dtype,
                                   seq_len=small_seq, rows=rows, cap=small_cap,
                                   label=f"launch-bound {_shape(small_shape)}", target=REPLAY_TARGET)  # fmt: skip
    finally:
        del small
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return checks


def _auto(device: torch.device, dtype: torch.dtype) -> str:
    """The backend "auto" trains with here (what the loss checks run)."""
    from megapack.attention import choose_backend

    return f"attention {choose_backend(device, dtype, training=True)}"


def _openchat() -> list[int]:
    from megapack.bench.datasets import bundled_lengths_path, load_lengths

    return load_lengths(bundled_lengths_path())[0]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def _shape(shape: GptShape) -> str:
    return (f"{shape.parameters() / 1e6:,.1f}M-parameter GPT ({shape.num_layers} layers, hidden {shape.hidden_size}, "
            f"{shape.num_attention_heads}/{shape.num_query_groups} heads, FFN {shape.ffn_hidden_size}, vocab {shape.vocab_size})")  # fmt: skip


def _notes(sizes: KitSizes, dry_run: bool) -> list[str]:
    env = environment(backend="none", launcher="one process")  # megatron-core's version, commit
    mcore, commit = env["megatron_core"], env["commit"]
    t = sizes.throughput
    return [
        f"python {platform.python_version()}, megatron-core {mcore}, commit {commit}"
        + (", DRY RUN (CPU, toy sizes: no GPU numbers)" if dry_run else ""),
        f"model: {_shape(sizes.shape)}, {str(sizes.dtype).removeprefix('torch.')}; seq {', '.join(map(str, t.seq_lens))}; "
        f"{t.documents} documents a step, {t.rows} rows per micro-batch, {t.steps} timed steps per mode",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m megapack.bench.gpu_kit", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", default="gpu-out", help="folder of gpu-report.json and gpu-report.md")
    p.add_argument(
        "--dry-run", action="store_true", help="the same steps on CPU at toy sizes (fp32, gloo)"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_kit: error: no CUDA device here; use --dry-run to run the kit's steps on CPU",
            file=sys.stderr,
        )
        return 2
    if args.dry_run:  # toy sizes: one thread, so a loaded machine's cores never stall a step
        torch.set_num_threads(1)
    report = run_kit(Path(args.out), dry_run=args.dry_run)
    for c in report.checks:
        print(f"{c.status:8} {c.name}")
    print(f"report -> {Path(args.out) / 'gpu-report.md'}, {Path(args.out) / 'gpu-report.json'}")
    return 3 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
