"""The GPU kit: ``python -m megapack.bench.gpu.kit --out DIR [--dry-run]`` (``scripts/gpu_check.sh`` runs it).

On one GPU, in one process (a torch.distributed world of 1, megatron-core ``parallel_state`` at
tp = pp = 1), in this order:

1. attention: every backend fwd+bwd against a float64 reference (`checks.attention_checks`),
   then each one's time on one row of 8 documents and flex against varlen (`attention_timing.attention_timing`);
2. packed == padded per-token losses in fp32 (`FULL`: the preset's shapes with 4 layers);
3. the model: `model.PRESET` in bf16 through ``Float16Module``, its parameter count against the
   FLOPs formula's;
4. packed == padded in bf16 on that model (the dry run: on a bf16 copy of its toy model);
5. syncs under ``torch.cuda.set_sync_debug_mode("error")``, a positive control first: get_batch,
   prefetch, a packed fwd+bwd, whole training steps (schedule, prefetch, optimizer; aligned padding
   too) and every backend that trains in bf16 (`checks.sync_checks`);
6. the bf16 matmul rate (8,192^3), then throughput: packing against every baseline of
   `megapack.bench.layouts` (`megapack.bench.gpu.throughput`, summarized by `megapack.bench.baselines`),
   MFU against the device's bf16 peak (`megapack.bench.gpu.devices`);
7. one profiled step per mode (`megapack.bench.gpu.profile`);
8. a captured training step (`megapack.bench.gpu.graph`): static-shape packs replayed by one CUDA
   graph on the kit's model and on a launch-bound one; then the targets.

Every step's exception becomes a failed check and the next step runs; the report
(`megapack.bench.gpu.report`) is rewritten after each. Exit status: 0 when nothing failed, 3 when a
check failed (the report is complete either way), anything else when the process itself died.

``--dry-run`` runs the same steps on CPU (gloo, megatron-core redirected by
`megapack.harness.megatron_cpu`) at `DRY` sizes in fp32 (bf16 for step 4): the CUDA-only checks (syncs,
the targets, backends without a CPU kernel) are skipped with their reason. It takes ~15-25 s on 2 cores.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megapack.bench.gpu.attention_timing import attention_timing
from megapack.bench.gpu.checks import attention_checks
from megapack.bench.gpu.devices import peak_bf16_flops
from megapack.bench.gpu.model import PRESET
from megapack.bench.gpu.report import Check, Report
from megapack.bench.gpu.sizes import DRY, FULL, KIT_TARGET_S, KitSizes
from megapack.bench.gpu.steps import (
    bf16_losses,
    build_main,
    device_name,
    fp32_losses,
    graph_step,
    notes,
    openchat_lengths,
    profile_modes,
    set_up,
    shape_name,
    sync_step,
    tear_down,
    throughput_step,
)
from megapack.bench.gpu.throughput import (
    length_mixes,
    target_checks,
)

logger = logging.getLogger("megapack.bench.gpu.kit")


def run_kit(out: Path, *, dry_run: bool, sizes: KitSizes | None = None, seed: int = 0) -> Report:
    """Run every step (module docstring) and return the report, already written to ``out``."""
    start = time.perf_counter()
    cuda = torch.cuda.is_available() and not dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sizes = sizes or (FULL if cuda else DRY)
    name = device_name(device)
    peak, peak_name = peak_bf16_flops(name) if cuda else (None, "unknown device")
    report = Report(
        out=out,
        device=name,
        torch=torch.__version__,
        notes=notes(sizes, dry_run),
        peak=f"{peak_name}, {peak / 1e12:,.0f} TFLOP/s" if peak else peak_name,
    )
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

    step("set-up", lambda: set_up(device, seed))
    a = sizes.attention
    step(
        "attention",
        lambda: attention_checks(
            device,
            sizes.dtype,
            heads=a["heads"],
            groups=a["groups"],
            head_dim=a["head_dim"],
            max_len=a["max_len"],
        ),
    )
    step(
        "attention time",
        lambda: attention_timing(
            device,
            sizes.dtype,
            lengths=sizes.timing_lengths,
            heads=a["heads"],
            groups=a["groups"],
            head_dim=a["head_dim"],
            repeats=sizes.timing_repeats,
        ),
    )
    seq = sizes.throughput.seq_lens[0]
    step("packed == padded (float32)", lambda: [fp32_losses(sizes, device, seq, seed)])
    step("model", lambda: [build_main(sizes, device, state)])
    step("packed == padded (bfloat16)", lambda: [bf16_losses(sizes, device, state, seq, seed)])
    mixes = length_mixes(
        openchat_lengths(),
        sizes.throughput.documents,
        max_len=min(sizes.throughput.seq_lens),
        scale=sizes.throughput.length_scale,
        seed=seed,
    )
    step("sync", lambda: sync_step(sizes, device, state, mixes["openchat"], seq, seed))
    step(
        "throughput",
        lambda: throughput_step(sizes, device, state, mixes, report, start, seed, peak),
    )
    step("profile", lambda: profile_modes(sizes, device, state, mixes["openchat"], report, seed))
    step("graph", lambda: graph_step(sizes, device, state, mixes["openchat"], seed))
    on_preset = cuda and sizes.shape == PRESET
    why_not = f"the targets apply on a GPU at the preset size; this run: {device.type}, {shape_name(sizes.shape)}"
    step(
        "targets",
        lambda: target_checks(
            report.throughput,
            state.get("sync", []),
            seq_len=seq,
            applies=on_preset,
            why_not=why_not,
        ),
    )
    wall = time.perf_counter() - start
    report.notes.append(f"kit wall time {wall:.0f} s")
    target = f"target: the kit within {KIT_TARGET_S / 60:.0f} minutes"
    report.add(
        Check(name=target, status="skipped", detail=why_not)
        if not on_preset
        else Check(
            name=target,
            status="passed" if wall <= KIT_TARGET_S else "failed",
            detail=f"{wall:.0f} s",
        )
    )
    report.write()
    tear_down()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m megapack.bench.gpu.kit", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", default="gpu-out", help="folder of gpu-report.json and gpu-report.md")
    p.add_argument(
        "--dry-run", action="store_true", help="the same steps on CPU at toy sizes (fp32, gloo)"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "megapack.bench.gpu.kit: error: no CUDA device here; use --dry-run to run the kit's steps on CPU",
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
