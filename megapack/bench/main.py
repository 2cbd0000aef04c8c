"""``megapack bench``: what packing and megapack's transfer save, measured side by side in one run.

Sections (each a module of `megapack.bench`): `transfer` (get_batch_on_this_tp_rank vs
Megatron-style per-tensor broadcasts vs one bare broadcast), `throughput` (packing against each
baseline of `modes`, tiny megatron-core GPT), `packing_quality` (every algorithm's efficiency
against the lower bound, and planning time), `dp_balance` (token plan vs compute plan across
data-parallel ranks: imbalance, efficiency, and the slowest rank's measured step time with the
tiny GPT on CPU), `cp_padding` (the padding each context-parallel layout costs on the real lengths
at cp 2, 4, 8) and `pack_command` (``megapack pack`` of a JSONL file vs bare read + json +
encode_batch, MB/s, peak RSS).

Launched plainly, it starts its own worker processes (gloo on CPU); under ``torchrun`` it uses the
launched ranks (NCCL when CUDA is present). Output: a markdown report on stdout, ending with the
summary of every target, met or not (`megapack.bench.summary`), ``--json PATH`` (the schema in
`report.to_json`, with the targets under ``"targets"``), ``--plots DIR`` (PNG charts). ``--quick``
shrinks every section to run in about a minute; it is smoke-tested in the suite. The full run is
not a test.

Exit code: 0 when every section ran and its outputs were written, whether or not each target was
met (a missed target is in the summary and the JSON: on a shared CPU a timed target moves with the
machine's load, and speed targets belong to the bench, not to a gate); 2 for bad flags or a
refused overwrite; a section that fails raises (exit 1, its traceback). docs/benchmarks.md says
why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick", action="store_true", help="everything small: about a minute on 2 CPU cores"
    )
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--plots", help="write PNG charts into this directory")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the throughput run")
    p.add_argument("--pp", type=int, default=2, help="pipeline-parallel size of the throughput run")
    p.add_argument(
        "--transfer-tp", type=int, nargs="+", default=[2, 4], help="TP sizes of the transfer run"
    )
    p.add_argument(
        "--lengths",
        help="JSON list of real document lengths (default: the bundled OpenChat V1 lengths)",
    )
    p.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["transfer", "throughput", "packing", "balance", "cp", "pack"],
    )


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """Sizes of every section, full or quick."""
    quick = bool(args.quick)
    return {
        "quick": quick,
        "transfer_seq_lens": [4096] if quick else [4096, 32768],
        "transfer_repeats": 30 if quick else 200,
        "transfer_warmup": 5 if quick else 20,
        "throughput_seq_len": 512 if quick else 1024,
        # a step: a window of packed micro-batches from a plan over a pool of documents
        # (megapack.bench.modes.plan_step), every mode over the window's documents
        "throughput_pool": 2_000,
        "throughput_micro_batches": 4,
        # micro-batch size in rows (packed) or documents (padded), as Megatron counts it
        "throughput_rows": 4 if quick else 8,
        "throughput_steps": 2 if quick else 5,  # timed steps per mode: the ratios' min, median, max
        "throughput_warmup": 1,
        "best_search_steps": 3_000 if quick else 20_000,  # the "best" search's budget
        "best_time_limit_s": 1.0 if quick else 10.0,  # the report's target for it
        "big_n": 100_000 if quick else 1_000_000,
        "balance_long_tail_docs": 5_000 if quick else 20_000,
        "balance_timing_docs": 48 if quick else 160,
        "balance_timing_seq_len": 1024 if quick else 2048,
        "balance_timing_repeats": 1 if quick else 3,
        # two inputs 10x apart, each several reader batches of 512 (megapack.bench.pack_command)
        "pack_documents": [2_000, 20_000] if quick else [5_000, 50_000],
        "pack_repeats": 1 if quick else 3,
    }


def main(args: argparse.Namespace) -> int:
    import torch.distributed as dist  # lazy: `megapack --help` must not import torch

    from megapack.bench import report
    from megapack.bench.datasets import load_lengths, throughput_datasets

    cfg = settings(args)
    refusal = _overwrite_refusal(args)
    if refusal:
        print(f"megapack bench: error: {refusal}", file=sys.stderr)
        return 2
    lengths, source = load_lengths(args.lengths)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    env = report.environment(
        backend="nccl" if launched and _cuda() else "gloo",
        launcher="torchrun" if launched else "own workers",
    )
    results: dict[str, Any] = {
        "env": env,
        "settings": cfg,
        "transfer": [],
        "throughput": [],
        "packing": [],
        "balance": [],
        "balance_timing": [],
        "cp": [],
        "pack": [],
    }
    if launched:
        dist.init_process_group("nccl" if _cuda() else "gloo")
    rank0 = not launched or dist.get_rank() == 0
    if rank0:
        print(report.header(env, source), flush=True)
    runner = _Runner(launched, max([*args.transfer_tp, args.tp * args.pp]))
    try:
        if "transfer" not in args.skip:
            from megapack.bench.transfer import run_transfer

            for tp in args.transfer_tp:
                _step(f"transfer tp={tp}", rank0)
                results["transfer"] += runner.run(
                    run_transfer,
                    tp,
                    cfg["transfer_seq_lens"],
                    cfg["transfer_repeats"],
                    cfg["transfer_warmup"],
                )
        if "throughput" not in args.skip:
            from megapack.bench.throughput import run_throughput

            _step(f"throughput tp={args.tp} pp={args.pp}", rank0)
            data = throughput_datasets(lengths, cfg["throughput_seq_len"], cfg["throughput_pool"])
            results["throughput"] = runner.run(
                run_throughput,
                args.tp * args.pp,
                args.tp,
                args.pp,
                data,
                cfg["throughput_seq_len"],
                cfg["throughput_rows"],
                cfg["throughput_micro_batches"],
                cfg["throughput_steps"],
                cfg["throughput_warmup"],
            )
        if "balance" not in args.skip:
            from megapack.bench.dp_balance import run_balance_timing

            _step("balance timing (tiny GPT, dp=2 on one rank)", rank0)
            results["balance_timing"] = runner.run(
                run_balance_timing,
                1,
                lengths,
                cfg["balance_timing_seq_len"],
                cfg["balance_timing_docs"],
                2,
                4,
                cfg["balance_timing_repeats"],
            )
    finally:
        runner.close()
    if rank0 and "packing" not in args.skip:
        from megapack.bench.packing_quality import run_packing

        _step("packing", rank0)
        results["packing"] = run_packing(lengths, cfg["best_search_steps"], cfg["big_n"])
    if rank0 and "balance" not in args.skip:
        from megapack.bench.dp_balance import run_balance

        _step("balance", rank0)
        results["balance"] = run_balance(lengths, cfg["balance_long_tail_docs"])
    if rank0 and "cp" not in args.skip:
        from megapack.bench.cp_padding import run_cp_padding
        from megapack.bench.datasets import OPENCHAT_CAP

        _step("cp padding", rank0)
        results["cp"] = run_cp_padding(lengths, OPENCHAT_CAP)

    if rank0 and "pack" not in args.skip:
        from megapack.bench.pack_command import run_pack

        _step("pack", rank0)
        results["pack"] = run_pack(cfg["pack_documents"], cfg["pack_repeats"])
    if rank0:
        from megapack.bench.dp_balance import markdown as balance_markdown

        print(report.markdown(results), flush=True)
        print(balance_markdown(results["balance"], results["balance_timing"]) + "\n", flush=True)
        if results["cp"]:
            from megapack.bench.cp_padding import markdown as cp_markdown

            print(cp_markdown(results["cp"]), flush=True)
        if results["pack"]:
            from megapack.bench.pack_command import markdown as pack_markdown

            print(pack_markdown(results["pack"]), flush=True)
        from megapack.bench import summary

        targets = summary.collect(results)
        if args.json:
            out = report.to_json(results)
            out["balance"], out["balance_timing"] = results["balance"], results["balance_timing"]
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            out = out | {"cp": results["cp"], "pack": results["pack"]}
            out["targets"] = [t.to_json() for t in targets]
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
            print(f"JSON -> {args.json}")
        if args.plots:
            for path in report.plots(results, args.plots):
                print(f"plot -> {path}")
        skipped = [s for s in summary.SECTIONS if s in args.skip]
        print("\n" + summary.markdown(targets, skipped), flush=True)  # the last word of a run
    if launched:
        dist.destroy_process_group()
    return 0


def _overwrite_refusal(args: argparse.Namespace) -> str | None:
    """Why this run must not start: a --quick run would overwrite a full run's JSON; else None."""
    if not (args.quick and args.json and Path(args.json).is_file()):
        return None
    try:
        previous = json.loads(Path(args.json).read_text())
    except (OSError, ValueError):
        return None
    if previous.get("settings", {}).get("quick", True):
        return None
    return (
        f"{args.json} holds a full run's results; --quick would overwrite them. Write the quick "
        "run elsewhere (--json bench-out/quick/bench.json, as `bash scripts/bench.sh --quick` does)"
    )


class _Runner:
    """Runs a per-rank function on ``world_size`` ranks: the launched ones, or a pool of our own."""

    def __init__(self, launched: bool, size: int) -> None:
        self.launched = launched
        self.size = size
        self.pool: Any = None

    def run(self, fn: Any, world_size: int, *args: Any) -> list[dict[str, Any]]:
        import torch.distributed as dist

        if self.launched:
            if dist.get_world_size() != world_size:
                if dist.get_rank() == 0:
                    print(
                        f"skipped {fn.__name__} for {world_size} ranks: torchrun started {dist.get_world_size()}",
                        file=sys.stderr,
                    )
                return []
            return list(fn(*args))
        if self.pool is None:
            from megapack.harness.pool import WorkerPool

            self.pool = WorkerPool(
                size=self.size,
                preload=("torch", "megatron.core.packed_seq_params"),
                pg_timeout_s=600,
            )
        return list(self.pool.run(fn, world_size, *args, timeout=1800)[0])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _step(label: str, show: bool) -> None:
    if show:
        print(f"[{time.strftime('%H:%M:%S')}] running {label} ...", file=sys.stderr, flush=True)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
