"""The GPU kit: ``python -m megapack.bench.gpu.kit --out DIR [--dry-run] [--plan NAME | --only
SECTIONS] [--list] [--backend NAME]`` (``scripts/gpu_check.sh`` runs it, passing these flags
through).

On one GPU, in one process (a torch.distributed world of 1, megatron-core ``parallel_state`` at
tp = pp = 1), the sections asked for (`SECTIONS`), in `SECTIONS`' order: a plan's (``--plan
first-run``: `PLANS`), those of ``--only smoke,attention-rows``, or the whole kit (`KIT`) when
neither is given:

``smoke``
    a toy `GraphStep` captured and replayed in bf16 with each of cudnn, torch_varlen and bucketed
    forced: packs A, B, A against eager, 0 syncs under torch's detector and the host-wait probe
    (cuDNN's ragged execution named: cudnn-frontend #552), bucketed's expected refusal
    (`megapack.bench.gpu.smoke`);
``attention``
    every backend fwd+bwd against a float64 reference (`checks.attention_checks`), then each one's
    time on one row of 8 documents (`attention_timing.attention_timing`);
``attention-rows``
    cudnn, torch_varlen and bucketed on the 14,398-token row and a row with zero-length documents
    and T not a multiple of 64: fwd+bwd against float64, time per FLOP, the cuDNN target
    (`megapack.bench.gpu.attention_rows`);
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
``throughput-4k``
    the same, narrowed: OpenChat at seq 4,096 only, packed against the fair grouped padding only;
``profile``
    one profiled step per mode (`megapack.bench.gpu.profile`);
``graph``
    a captured training step (`megapack.bench.gpu.graph`): static-shape packs replayed by one CUDA
    graph on the kit's model and on a launch-bound one;
``graph-launch``
    the same, narrowed to the launch-bound model (the graph targets) and fewer packs.

The model (`model.PRESET` in bf16 through ``Float16Module``, its parameter count against the FLOPs
formula's, THD attention by ``--backend``) is built once, before the first section that trains
it (`TRAINS`). ``--backend``'s default is "auto", except in the first-run plan: there "cudnn"
where cuDNN's THD attention trains here (its throughput is what the run measures), else "auto".
One run of the sections a change touched stays within 6 minutes on an H100 or H200 (the last
check); the whole kit fits two runs (`SPLIT`); the first-run plan within 5 minutes. `SECTIONS`
holds each one's estimate; ``--list`` prints them, the plans and the split.

Every step's exception becomes a failed check and the next step runs (a section that raises
outside its steps too); the report (`megapack.bench.gpu.report`) is rewritten after each. Exit
status: 0 when nothing failed, 3 when a check failed (the report is complete either way), 2 on a
usage error, anything else when the process itself died.

``--dry-run`` runs the same steps on CPU (gloo, megatron-core redirected by
`megapack.harness.megatron_cpu`) at `DRY` sizes in fp32 (bf16 for the bf16 losses): the CUDA-only
checks (syncs, captures, the targets, backends without a CPU kernel) are skipped with their
reason. The whole kit takes ~15-25 s on 2 cores, the first-run plan ~10 s.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megapack.bench.gpu.model import PRESET
from megapack.bench.gpu.report import Check, Report, Status
from megapack.bench.gpu.sizes import DRY, FIRST_RUN_S, FULL, KIT_TARGET_S, KitSizes

logger = logging.getLogger("megapack.bench.gpu.kit")

SECTIONS: dict[str, tuple[float, str]] = {
    "smoke": (40.0, "a bf16 toy GraphStep, cudnn / torch_varlen / bucketed forced: replays A, B, A "
                    "vs eager, 0 syncs (cuDNN's ragged execution named)"),
    "attention": (40.0, "every backend against a float64 reference, then their fwd+bwd times"),
    "attention-rows": (20.0, "cudnn, torch_varlen, bucketed on the 14,398-token row and a row with "
                             "zero-length documents: vs float64, time per FLOP"),
    "losses": (25.0, "packed == padded per-token losses, fp32 (4 layers) and bf16 (the model)"),
    "syncs": (25.0, "0 synchronizing CUDA calls: delivery, prefetch, fwd+bwd, steps, backends"),
    "throughput": (200.0, "packing against every baseline, 4 configurations interleaved; targets"),
    "throughput-4k": (75.0, "OpenChat seq 4,096: packed against fair grouped padding, 6 rounds "
                            "interleaved; targets"),
    "profile": (60.0, "one torch.profiler step per mode (OpenChat, seq 4,096)"),
    "graph": (60.0, "a captured training step replayed over static-shape packs"),
    "graph-launch": (45.0, "the launch-bound model only: replay vs eager, packed + graphs vs "
                           "grouped eager; targets"),
}  # fmt: skip
"""Each section: (estimated seconds on an H100 or H200 at `FULL`, what it runs), in the order the
kit runs them. attention, losses, syncs and throughput are estimated from the 2026-11-26 H100 run
(a micro-batch of 2 x 4,096 took ~0.1 s, one of the preset's smallest ~64 ms; set-up, attention,
losses and syncs ~60 s together) and this design's step sizes; the others (`GUESSED`) have not run
on a GPU yet: their estimates are guesses."""
GUESSED = frozenset(
    {"smoke", "attention-rows", "throughput-4k", "profile", "graph", "graph-launch"}
)
"""Sections whose estimate is a guess: no GPU has run them."""
MODEL_S = 15.0
"""Estimated seconds to build the model, once, for the sections that train it."""
START_S = 20.0
"""Estimated seconds before the kit's first section on a GPU machine (a guess): installing the
carried wheels, importing torch and megatron-core, CUDA and NCCL set-up."""
KIT = ("attention", "losses", "syncs", "throughput", "profile", "graph")
"""The whole kit: what runs when neither ``--plan`` nor ``--only`` is given."""
TRAINS = ("losses", "syncs", "throughput", "throughput-4k", "profile", "graph")
"""The sections that need the kit's model."""
SPLIT = (("throughput", "profile"), ("attention", "losses", "syncs", "graph"))
"""The whole kit as two runs of at most 6 minutes each."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A named run of sections: one command (``--plan NAME``)."""

    sections: tuple[str, ...]
    """The sections, in the kit's order."""
    limit_s: float
    """Its target: the run within this many seconds on the device (the last check)."""
    what: str
    """What it is for."""


PLANS = {
    "first-run": Plan(
        sections=("smoke", "attention-rows", "throughput-4k", "graph-launch"),
        limit_s=FIRST_RUN_S,
        what="the first run on a GPU since the cudnn backend and GraphStep landed: each one "
        "captured and replayed, cuDNN against torch varlen per FLOP, packed (cudnn) against "
        "fair grouped padding at real size, whole-step graphs against grouped eager",
    ),
}
"""The plans; each fits one device call (`Plan.limit_s`)."""


def parse_sections(text: str | None) -> tuple[str, ...]:
    """``--only``'s sections, in the kit's order; the whole kit (`KIT`) for None.

    Example:
        >>> parse_sections("throughput, attention")
        ('attention', 'throughput')
        >>> parse_sections("speed")
        Traceback (most recent call last):
        ...
        ValueError: --only: unknown section 'speed'; choose from smoke, attention, attention-rows, losses, syncs, throughput, throughput-4k, profile, graph, graph-launch
    """
    if text is None:
        return KIT
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
    """What ``--list`` prints: every section, its estimate and what it runs, the plans, then the
    whole kit's split."""
    lines = [f"sections (estimated seconds on an H100 or H200; the model adds ~{MODEL_S:.0f} s once; "
             "'guess': not run on a GPU yet):"]  # fmt: skip
    for name, (sec, what) in SECTIONS.items():
        guess = "guess" if name in GUESSED else ""
        lines.append(f"  {name:<14} ~{sec:>4.0f} s {guess:<5}  {what}")
    lines.append(f"plans (one command each; add ~{START_S:.0f} s to start, a guess):")
    for name, plan in PLANS.items():
        lines.append(f"  --plan {name}  (~{estimate_s(plan.sections):.0f} s of its "
                     f"{plan.limit_s:.0f} s target: {', '.join(plan.sections)})")  # fmt: skip
        lines.append(f"      {plan.what}")
    lines.append(f"the whole kit in two runs of <= {KIT_TARGET_S / 60:.0f} minutes:")
    lines += [f"  --only {','.join(run)}  (~{estimate_s(run):.0f} s)" for run in SPLIT]
    return "\n".join(lines)


def default_backend(plan: str | None, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(the model's THD attention backend when ``--backend`` is not given, why): "cudnn" in the
    first-run plan where it trains ``dtype`` on ``device``, else "auto"."""
    if plan != "first-run":
        return "auto", "the default"
    from megapack.attention.choice import installed_here, refusal

    why = refusal(
        "cudnn", device.type, dtype, training=True, dropout=0.0, installed=installed_here()
    )
    if why is None:
        return "cudnn", "the first-run plan's: cuDNN's THD attention trains here"
    return "auto", f"the first-run plan trains cudnn where it can; cudnn is unavailable here: {why}"


@dataclass(kw_only=True)
class KitRun:
    """What a run's sections share: the device, sizes, the report, the model once built."""

    device: torch.device
    sizes: KitSizes
    report: Report
    seed: int
    backend: str
    """The kit's model's THD attention backend (``--backend``, or `default_backend`)."""
    peak: float | None
    on_preset: bool
    """Whether the targets apply: on a GPU at the preset size."""
    why_not: str
    """Why they do not, when they do not."""
    mixes: dict[str, list[int]]
    """The throughput section's length mixes."""
    few: list[int]
    """The sync and graph sections' document lengths (the first of the OpenChat mix)."""
    state: dict[str, Any] = field(default_factory=dict)
    built: bool = False
    """Whether the model's build was tried (once, failed or not)."""

    def step(self, label: str, fn: Callable[[], list[Check]]) -> None:
        """Run ``fn`` and add its checks; its exception becomes a failed check ``label``."""
        logger.info("%s ...", label)
        try:
            self.report.add(*fn())
        except Exception as exc:
            stack = "\n".join(traceback.format_exc().splitlines()[-25:])
            self.report.add(
                Check(name=label, status="failed", detail=f"{type(exc).__name__}: {exc}\n{stack}")
            )

    def with_model(self, label: str, fn: Callable[[], list[Check]]) -> None:
        """`step` after the model is built (the first time: its ``model`` check)."""
        from megapack.bench.gpu import steps

        if not self.built:
            self.built = True
            self.step("model", lambda: [steps.build_main(self.sizes, self.device, self.state,
                                                         self.backend)])  # fmt: skip
        if "model" not in self.state:
            self.report.add(Check(name=label, status="failed",
                                  detail="the kit's model was not built: see the 'model' check"))  # fmt: skip
            return
        self.step(label, fn)


def run_kit(
    out: Path,
    *,
    dry_run: bool,
    sizes: KitSizes | None = None,
    seed: int = 0,
    sections: tuple[str, ...] = KIT,
    backend: str | None = None,
    plan: str | None = None,
) -> Report:
    """Run the asked ``sections`` (module docstring) and return the report, already written to
    ``out``. ``plan``: the plan they come from (its time target; `default_backend`)."""
    from megapack.bench.gpu import steps
    from megapack.bench.gpu.devices import peak_bf16_flops
    from megapack.bench.gpu.throughput import length_mixes

    start = time.perf_counter()
    cuda = torch.cuda.is_available() and not dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sizes = sizes or (FULL if cuda else DRY)
    chosen, why = (
        (backend, "--backend")
        if backend is not None
        else default_backend(plan, device, sizes.dtype)
    )
    name = steps.device_name(device)
    peak, peak_name = peak_bf16_flops(name) if cuda else (None, "unknown device")
    notes = steps.notes(sizes, dry_run, sections=sections, backend=chosen)
    notes.append(f"attention backend of the kit's models: {chosen} ({why})"
                 + (f"; plan {plan}" if plan else ""))  # fmt: skip
    report = Report(
        out=out,
        device=name,
        torch=torch.__version__,
        notes=notes,
        peak=f"{peak_name}, {peak / 1e12:,.0f} TFLOP/s" if peak else peak_name,
    )
    report.write()
    t = sizes.throughput
    mixes = length_mixes(
        steps.openchat_lengths(), t.pool, max_len=min(t.seq_lens), scale=t.length_scale, seed=seed
    )
    run = KitRun(
        device=device,
        sizes=sizes,
        report=report,
        seed=seed,
        backend=chosen,
        peak=peak,
        on_preset=cuda and sizes.shape == PRESET,
        why_not=f"the targets apply on a GPU at the preset size; this run: {device.type}, "
        f"{steps.shape_name(sizes.shape)}",
        mixes=mixes,
        few=mixes["openchat"][: t.documents],
    )
    run.step("set-up", lambda: steps.set_up(device, seed))
    for section in sections:
        logger.info("section %s", section)
        try:
            RUNNERS[section](run)
        except Exception as exc:  # a section that raises outside its steps
            stack = "\n".join(traceback.format_exc().splitlines()[-25:])
            report.add(Check(name=f"section {section}", status="failed",
                             detail=f"{type(exc).__name__}: {exc}\n{stack}"))  # fmt: skip
    wall = time.perf_counter() - start
    report.notes.append(f"kit wall time {wall:.0f} s ({', '.join(sections)})")
    report.add(_time_check(wall, sections, run.on_preset, run.why_not, plan))
    steps.tear_down()
    return report


# ------------------------------------------------------------------ the sections


def _smoke(run: KitRun) -> None:
    import numpy as np

    from megapack.bench.gpu.smoke import smoke_checks

    s = run.sizes
    rng = np.random.default_rng(run.seed)
    lengths = [min(n, s.smoke_seq_len // 2) for n in run.mixes["openchat"][:64]]
    docs = [rng.integers(1, s.smoke_shape.vocab_size, n) for n in lengths]
    run.step("smoke", lambda: smoke_checks(s.smoke_shape, docs, device=run.device, dtype=s.dtype,
                                           seq_len=s.smoke_seq_len, rows=s.throughput.rows))  # fmt: skip


def _attention(run: KitRun) -> None:
    from megapack.bench.gpu.attention_timing import attention_timing
    from megapack.bench.gpu.checks import attention_checks

    a, s = run.sizes.attention, run.sizes
    shape = {"heads": a["heads"], "groups": a["groups"], "head_dim": a["head_dim"]}
    run.step(
        "attention", lambda: attention_checks(run.device, s.dtype, **shape, max_len=a["max_len"])
    )
    run.step("attention time", lambda: attention_timing(run.device, s.dtype, lengths=s.timing_lengths,
                                                        **shape, repeats=s.timing_repeats))  # fmt: skip


def _attention_rows(run: KitRun) -> None:
    from megapack.bench.gpu.attention_rows import attention_rows

    a, s = run.sizes.attention, run.sizes
    run.step("attention-rows", lambda: attention_rows(
        run.device, s.dtype, rows=s.attention_rows, heads=a["heads"], groups=a["groups"],
        head_dim=a["head_dim"], repeats=s.timing_repeats))  # fmt: skip


def _losses(run: KitRun) -> None:
    from megapack.bench.gpu import steps

    s, seq = run.sizes, run.sizes.throughput.seq_lens[0]
    run.step("packed == padded (float32)",
             lambda: [steps.fp32_losses(s, run.device, seq, run.seed)])  # fmt: skip
    run.with_model("packed == padded (bfloat16)", lambda: [
        steps.bf16_losses(s, run.device, run.state, seq, run.seed, run.backend)])  # fmt: skip


def _syncs(run: KitRun) -> None:
    from megapack.bench.gpu import steps

    seq = run.sizes.throughput.seq_lens[0]
    run.with_model("sync", lambda: steps.sync_step(run.sizes, run.device, run.state, run.few,
                                                   seq, run.seed))  # fmt: skip


def _throughput(run: KitRun) -> None:
    from megapack.bench.gpu import steps

    run.with_model("throughput", lambda: steps.throughput_step(
        run.sizes, run.device, run.state, run.mixes, run.report, run.seed, run.peak,
        applies=run.on_preset, why_not=run.why_not))  # fmt: skip


def _throughput_4k(run: KitRun) -> None:
    from megapack.bench.gpu import steps
    from megapack.bench.gpu.throughput import length_mixes

    t = run.sizes.first_throughput
    mixes = length_mixes(steps.openchat_lengths(), t.pool, max_len=min(t.seq_lens),
                         scale=t.length_scale, seed=run.seed)  # fmt: skip
    run.with_model("throughput-4k", lambda: steps.throughput_step(
        run.sizes, run.device, run.state, {"openchat": mixes["openchat"]}, run.report, run.seed,
        run.peak, applies=run.on_preset, why_not=run.why_not, throughput=t,
        modes=("packed", "grouped"), budget_s=run.sizes.first_budget_s, label="throughput-4k"))  # fmt: skip


def _profile(run: KitRun) -> None:
    from megapack.bench.gpu import steps

    run.with_model("profile", lambda: steps.profile_modes(
        run.sizes, run.device, run.state, run.mixes["openchat"], run.report, run.seed))  # fmt: skip


def _graph(run: KitRun) -> None:
    from megapack.bench.gpu import steps

    run.with_model("graph", lambda: steps.graph_step(run.sizes, run.device, run.state, run.few,
                                                     run.seed))  # fmt: skip


def _graph_launch(run: KitRun) -> None:
    from megapack.bench.gpu import steps

    run.step("graph-launch", lambda: steps.graph_step(
        run.sizes, run.device, run.state, run.few, run.seed, launch_only=True,
        packs=run.sizes.graph_packs, backend=run.backend))  # fmt: skip


RUNNERS: dict[str, Callable[[KitRun], None]] = {
    "smoke": _smoke,
    "attention": _attention,
    "attention-rows": _attention_rows,
    "losses": _losses,
    "syncs": _syncs,
    "throughput": _throughput,
    "throughput-4k": _throughput_4k,
    "profile": _profile,
    "graph": _graph,
    "graph-launch": _graph_launch,
}
"""Each section's code, looked up when it runs (a test may swap one)."""


def _time_check(
    wall: float, sections: tuple[str, ...], on_preset: bool, why_not: str, plan: str | None = None
) -> Check:
    """The target: this run within its limit (a plan's `Plan.limit_s`, else `KIT_TARGET_S`);
    info when a run of sections asked for more than one run is meant to hold (the whole kit is
    two runs)."""
    limit = PLANS[plan].limit_s if plan is not None else KIT_TARGET_S
    what = f"the {plan} plan" if plan is not None else "one run of the kit"
    name = f"target: {what} within {limit / 60:.0f} minutes"
    if not on_preset:
        return Check(name=name, status="skipped", detail=why_not)
    if plan is None and estimate_s(sections) > KIT_TARGET_S:
        split = " and ".join(f"--only {','.join(run)}" for run in SPLIT)
        return Check(
            name=name,
            status="info",
            detail=f"{wall:.0f} s for {', '.join(sections)}: more than one run holds; run {split}",
        )
    status: Status = "passed" if wall <= limit else "failed"
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
        help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default: the whole kit, "
        f"{','.join(KIT)})",
    )
    p.add_argument(
        "--plan", choices=sorted(PLANS), help="run a plan's sections (--list shows them)"
    )
    p.add_argument(
        "--list", action="store_true", help="print the sections, plans and their time, then exit"
    )
    p.add_argument(
        "--backend",
        default=None,
        choices=["auto", *BACKENDS],
        help="THD attention backend of the kit's models (default auto; in the first-run plan "
        "cudnn where it trains)",
    )
    args = p.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    try:
        if args.plan is not None and args.only is not None:
            raise ValueError(f"give --plan or --only, not both (--plan {args.plan} runs "
                             f"{','.join(PLANS[args.plan].sections)})")  # fmt: skip
        sections = PLANS[args.plan].sections if args.plan else parse_sections(args.only)
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
    report = run_kit(Path(args.out), dry_run=args.dry_run, sections=sections,
                     backend=args.backend, plan=args.plan)  # fmt: skip
    for c in report.checks:
        print(f"{c.status:8} {c.name}")
    print(f"report -> {Path(args.out) / 'gpu-report.md'}, {Path(args.out) / 'gpu-report.json'}")
    return 3 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
