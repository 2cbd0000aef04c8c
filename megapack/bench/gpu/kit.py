"""The GPU kit: ``python -m megapack.bench.gpu.kit --out DIR [--dry-run] [--only SECTIONS] [--list]``
(``scripts/gpu_check.sh`` runs it, passing these flags through).

On one GPU, in one process (a torch.distributed world of 1, megatron-core ``parallel_state`` at
tp = pp = 1), the sections (`SECTIONS`) in this order, each run only when asked for (``--only
attention,throughput``; all of them by default):

``attention``
    every backend fwd+bwd against a float64 reference (`checks.attention_checks`), then each one's
    time on one row of 8 documents (`attention_timing.attention_timing`);
``losses``
    packed == padded per-token losses in fp32 (`FULL`: the preset's shapes with 4 layers), then in
    bf16 on the kit's model (the dry run: on a bf16 copy of its toy model);
``syncs``
    under ``torch.cuda.set_sync_debug_mode("error")``, a positive control first: get_batch,
    prefetch, a packed fwd+bwd, whole training steps (schedule, prefetch, optimizer; aligned
    padding too) and every backend that trains in bf16 (`syncs`); the 0-sync target;
``throughput``
    the bf16 matmul rate, then packing against every baseline of `megapack.bench.modes`,
    interleaved step by step (`megapack.bench.gpu.throughput`, summarized by
    `megapack.bench.baselines`), MFU against the device's bf16 peak; the throughput targets;
``profile``
    one profiled step per mode (`megapack.bench.gpu.profile`);
``graph``
    a captured training step (`megapack.bench.gpu.graph`): static-shape packs replayed by one CUDA
    graph on the kit's model and on a launch-bound one.

The model (`model.PRESET` in bf16 through ``Float16Module``, its parameter count against the FLOPs
formula's, THD attention by ``--backend``, default "auto") is built once, before the first
section that trains it. One run of the sections a change touched stays within 6 minutes on an
H100 or H200 (the last check); the whole kit fits two runs (`SECTIONS` holds each one's estimate;
``--list`` prints them and the split).

Every step's exception becomes a failed check and the next step runs; the report
(`megapack.bench.gpu.report`) is rewritten after each. Exit status: 0 when nothing failed, 3 when a
check failed (the report is complete either way), 2 on a usage error, anything else when the
process itself died.

``--dry-run`` runs the same steps on CPU (gloo, megatron-core redirected by
`megapack.harness.megatron_cpu`) at `DRY` sizes in fp32 (bf16 for the bf16 losses): the CUDA-only
checks (syncs, the targets, backends without a CPU kernel) are skipped with their reason. It takes
~15-25 s on 2 cores.
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

from megapack.bench.gpu.model import PRESET
from megapack.bench.gpu.report import Check, Report, Status
from megapack.bench.gpu.sizes import DRY, FULL, KIT_TARGET_S, KitSizes

logger = logging.getLogger("megapack.bench.gpu.kit")

SECTIONS: dict[str, tuple[float, str]] = {
    "attention": (40.0, "every backend against a float64 reference, then their fwd+bwd times"),
    "losses": (25.0, "packed == padded per-token losses, fp32 (4 layers) and bf16 (the model)"),
    "syncs": (25.0, "0 synchronizing CUDA calls: delivery, prefetch, fwd+bwd, steps, backends"),
    "throughput": (200.0, "packing against every baseline, 4 configurations interleaved; targets"),
    "profile": (60.0, "one torch.profiler step per mode (OpenChat, seq 4,096)"),
    "graph": (60.0, "a captured training step replayed over static-shape packs"),
}
"""Each section: (estimated seconds on an H100 or H200 at `FULL`, what it runs). Estimated from the
2026-11-26 H100 run (a micro-batch of 2 x 4,096 took ~0.1 s, one of the preset's smallest ~64 ms;
set-up, attention, losses and syncs ~60 s together) and this design's step sizes; profile and graph
have not run on a GPU yet (guesses)."""
MODEL_S = 15.0
"""Estimated seconds to build the model, once, for the sections that train it."""
TRAINS = ("losses", "syncs", "throughput", "profile", "graph")
"""The sections that need the kit's model."""
SPLIT = (("throughput", "profile"), ("attention", "losses", "syncs", "graph"))
"""The whole kit as two runs of at most 6 minutes each."""


def parse_sections(text: str | None) -> tuple[str, ...]:
    """``--only``'s sections, in the kit's order; every section for None.

    Example:
        >>> parse_sections("throughput, attention")
        ('attention', 'throughput')
        >>> parse_sections("speed")
        Traceback (most recent call last):
        ...
        ValueError: --only: unknown section 'speed'; choose from attention, losses, syncs, throughput, profile, graph
    """
    if text is None:
        return tuple(SECTIONS)
    asked = [w.strip() for w in text.split(",") if w.strip()]
    if not asked:
        raise ValueError(f"--only: name at least one section of {', '.join(SECTIONS)}")
    for name in asked:
        if name not in SECTIONS:
            raise ValueError(f"--only: unknown section {name!r}; choose from {', '.join(SECTIONS)}")
    return tuple(name for name in SECTIONS if name in asked)


def estimate_s(sections: tuple[str, ...]) -> float:
    """Estimated seconds of a run of ``sections`` on a GPU (`SECTIONS`, plus the model once)."""
    model = MODEL_S if any(s in TRAINS for s in sections) else 0.0
    return model + sum(SECTIONS[s][0] for s in sections)


def listing() -> str:
    """What ``--list`` prints: every section, its estimate and what it runs, then the split."""
    lines = ["sections (estimated seconds on an H100 or H200; the model adds ~15 s once):"]
    lines += [f"  {name:<11} ~{sec:>4.0f} s  {what}" for name, (sec, what) in SECTIONS.items()]
    lines.append(f"the whole kit in two runs of <= {KIT_TARGET_S / 60:.0f} minutes:")
    lines += [f"  --only {','.join(run)}  (~{estimate_s(run):.0f} s)" for run in SPLIT]
    return "\n".join(lines)


def run_kit(
    out: Path,
    *,
    dry_run: bool,
    sizes: KitSizes | None = None,
    seed: int = 0,
    sections: tuple[str, ...] = tuple(SECTIONS),
    backend: str = "auto",
) -> Report:
    """Run the asked ``sections`` (module docstring) and return the report, already written to ``out``."""
    from megapack.bench.gpu import steps
    from megapack.bench.gpu.devices import peak_bf16_flops
    from megapack.bench.gpu.throughput import length_mixes

    start = time.perf_counter()
    cuda = torch.cuda.is_available() and not dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sizes = sizes or (FULL if cuda else DRY)
    name = steps.device_name(device)
    peak, peak_name = peak_bf16_flops(name) if cuda else (None, "unknown device")
    report = Report(
        out=out,
        device=name,
        torch=torch.__version__,
        notes=steps.notes(sizes, dry_run, sections=sections, backend=backend),
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

    on_preset = cuda and sizes.shape == PRESET
    why_not = (
        f"the targets apply on a GPU at the preset size; this run: {device.type}, "
        f"{steps.shape_name(sizes.shape)}"
    )
    t, seq = sizes.throughput, sizes.throughput.seq_lens[0]
    mixes = length_mixes(
        steps.openchat_lengths(), t.pool, max_len=min(t.seq_lens), scale=t.length_scale, seed=seed
    )
    few = mixes["openchat"][: t.documents]  # the sync and graph sections' documents
    step("set-up", lambda: steps.set_up(device, seed))
    if "attention" in sections:
        _attention(step, device, sizes)
    if "losses" in sections:
        step("packed == padded (float32)", lambda: [steps.fp32_losses(sizes, device, seq, seed)])
    if any(s in TRAINS for s in sections):
        step("model", lambda: [steps.build_main(sizes, device, state, backend)])
    if "losses" in sections:
        step(
            "packed == padded (bfloat16)",
            lambda: [steps.bf16_losses(sizes, device, state, seq, seed, backend)],
        )
    if "syncs" in sections:
        step("sync", lambda: steps.sync_step(sizes, device, state, few, seq, seed))
    if "throughput" in sections:
        step(
            "throughput",
            lambda: steps.throughput_step(
                sizes, device, state, mixes, report, seed, peak, applies=on_preset, why_not=why_not
            ),
        )
    if "profile" in sections:
        step(
            "profile",
            lambda: steps.profile_modes(sizes, device, state, mixes["openchat"], report, seed),
        )
    if "graph" in sections:
        step("graph", lambda: steps.graph_step(sizes, device, state, few, seed))
    wall = time.perf_counter() - start
    report.notes.append(f"kit wall time {wall:.0f} s ({', '.join(sections)})")
    report.add(_time_check(wall, sections, on_preset, why_not))
    steps.tear_down()
    return report


def _attention(step: Callable[..., None], device: torch.device, sizes: KitSizes) -> None:
    from megapack.bench.gpu.attention_timing import attention_timing
    from megapack.bench.gpu.checks import attention_checks

    a = sizes.attention
    shape = {"heads": a["heads"], "groups": a["groups"], "head_dim": a["head_dim"]}
    step(
        "attention",
        lambda: attention_checks(device, sizes.dtype, **shape, max_len=a["max_len"]),
    )
    step(
        "attention time",
        lambda: attention_timing(
            device,
            sizes.dtype,
            lengths=sizes.timing_lengths,
            **shape,
            repeats=sizes.timing_repeats,
        ),
    )


def _time_check(wall: float, sections: tuple[str, ...], on_preset: bool, why_not: str) -> Check:
    """The target: this run within `KIT_TARGET_S`; info when the run asked for more sections than
    one run is meant to hold (the whole kit is two runs)."""
    name = f"target: one run of the kit within {KIT_TARGET_S / 60:.0f} minutes"
    if not on_preset:
        return Check(name=name, status="skipped", detail=why_not)
    if estimate_s(sections) > KIT_TARGET_S:
        split = " and ".join(f"--only {','.join(run)}" for run in SPLIT)
        return Check(
            name=name,
            status="info",
            detail=f"{wall:.0f} s for {', '.join(sections)}: more than one run holds; run {split}",
        )
    status: Status = "passed" if wall <= KIT_TARGET_S else "failed"
    return Check(name=name, status=status, detail=f"{wall:.0f} s for {', '.join(sections)}")


def main(argv: list[str] | None = None) -> int:
    from megapack.attention import BACKENDS

    p = argparse.ArgumentParser(
        prog="python -m megapack.bench.gpu.kit", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", default="gpu-out", help="folder of gpu-report.json and gpu-report.md")
    p.add_argument(
        "--dry-run", action="store_true", help="the same steps on CPU at toy sizes (fp32, gloo)"
    )
    p.add_argument(
        "--only",
        metavar="SECTIONS",
        help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default: all)",
    )
    p.add_argument(
        "--list", action="store_true", help="print the sections and their time, then exit"
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", *BACKENDS],
        help="THD attention backend of the kit's model (throughput, profile, ...; default auto)",
    )
    args = p.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    try:
        sections = parse_sections(args.only)
    except ValueError as exc:
        print(f"megapack.bench.gpu.kit: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "megapack.bench.gpu.kit: error: no CUDA device here; use --dry-run to run the kit's steps on CPU",
            file=sys.stderr,
        )
        return 2
    if args.dry_run:  # toy sizes: one thread, so a loaded machine's cores never stall a step
        torch.set_num_threads(1)
    report = run_kit(Path(args.out), dry_run=args.dry_run, sections=sections, backend=args.backend)
    for c in report.checks:
        print(f"{c.status:8} {c.name}")
    print(f"report -> {Path(args.out) / 'gpu-report.md'}, {Path(args.out) / 'gpu-report.json'}")
    return 3 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
