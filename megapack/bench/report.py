"""The benchmark's outputs: environment header, markdown tables with targets, JSON, PNG charts."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from megapack.bench.transfer import JSON_KEYS as TRANSFER_KEYS
from megapack.bench.transfer import table as transfer_table

TARGETS = {  # the transfer section's targets live in megapack.bench.transfer.TARGETS
    "best_openchat_efficiency": 0.9962,
}


def environment(*, backend: str, launcher: str) -> dict[str, Any]:
    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:
        mcore = "not installed"
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": mcore,
        "backend": backend,
        "launcher": launcher,
        "commit": commit or "unknown",
    }


def header(env: dict[str, Any], lengths_source: str) -> str:
    gpu = env["gpu"] or "no GPU"
    return (
        f"# megapack bench\n\nmachine {env['machine']}, {env['cpus']} CPUs, {gpu}; python {env['python']}, "
        f"torch {env['torch']}, megatron-core {env['megatron_core']}; backend {env['backend']} ({env['launcher']}); "
        f"commit {env['commit']}\nreal lengths: {lengths_source}\n"
    )


def _table(head: list[str], body: list[list[str]]) -> str:
    lines = [head, ["---"] * len(head), *body]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def verdict(value: float, target: float, *, at_most: bool) -> str:
    """``"2.34, not met"``: the value and whether it meets ``target`` (<= if ``at_most``, else >=)."""
    ok = value <= target if at_most else value >= target
    return f"{value:.2f}, {'met' if ok else 'not met'}"


def markdown(results: dict[str, Any]) -> str:
    """The README's benchmark tables, same columns and formats, with a met / not met verdict per target."""
    sections = [
        ("Transfer: one micro-batch to every TP rank (median ms, slowest rank)", _transfer),
        (
            "Throughput: packing against each baseline, real tokens/s, tiny megatron-core GPT",
            throughput_table,
        ),
        ("Packing: efficiency against the lower bound", packing_table),
    ]
    parts = []
    if results.get("settings", {}).get("quick"):
        parts.append(
            "--quick: every size is small, so timings are noisy and the verdicts only indicative; "
            "the README's numbers come from a full run"
        )
    for title, table in sections:
        key = title.split(":")[0].lower()
        if results.get(key):
            parts.append(f"## {title}\n\n" + table(results[key], results.get("settings", {})))
    return "\n\n".join(parts) + "\n"


def _transfer(rows: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    return transfer_table(rows)  # the transfer section's own tables and verdicts


def throughput_table(rows: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    """Packing against each baseline of `megapack.bench.modes`, the GPU kit's columns on CPU
    (`megapack.bench.baselines.summarize`), then how each step was laid out and timed and which
    attention backend packing trained with; no target on CPU times."""
    from megapack.bench.baselines import summarize

    body = []
    for e in summarize(rows):
        ratio = "-"
        if e["ratio"] is not None:
            ratio = f"{e['ratio']:.2f} [{e['ratio_min']:.2f}, {e['ratio_max']:.2f}]"
            ratio += " noisy" if e["noisy"] else ""
        body.append(
            [
                e["config"],
                e["baseline"],
                _fmt(e["packed_tokens_per_s"], "{:,.0f}"),
                _fmt(e["baseline_tokens_per_s"], "{:,.0f}"),
                ratio,
                _fmt(e["slot_ratio"], "{:.2f}"),
                _fmt(e["flop_ideal"], "{:.2f}"),
                _fmt(e["executed_ratio"], "{:.2f}"),
                _fmt(_giga(e["packed_tflops"]), "{:.2f}"),
                _fmt(_giga(e["baseline_tflops"]), "{:.2f}"),
            ]
        )
    head = [
        "dataset",
        "baseline",
        "packed tokens/s",
        "baseline tokens/s",
        "ratio [min, max]",
        "slot ratio",
        "FLOP ideal",
        "packed / baseline GFLOP/s",
        "packed GFLOP/s",
        "baseline GFLOP/s",
    ]
    notes = [_steps_note(rows, settings), *_attention_notes(rows)]
    return _table(head, body) + "".join(f"\n\n{n}" for n in notes if n)


def _steps_note(rows: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    steps = settings.get("throughput_steps")
    if not steps:
        return ""
    note = (
        f"Ratios: the median of {steps} timed steps [min, max], the modes interleaved step by step."
    )
    windows = []
    for r in rows:
        if r.get("mode") == "packed" and "pool" in r:
            windows.append(
                f"{r['dataset']}: {r['micro_batches']} packed micro-batches ({r['documents']} "
                f"documents, {r['fill']:.1%} full) from a plan over {r['pool']:,}"
            )
    sampled = sorted(
        {
            f"{r['dataset']} {r['mode']} {r['timed_micro_batches']} of {r['micro_batches']}"
            for r in rows
            if r.get("timed_micro_batches", r.get("micro_batches")) != r.get("micro_batches")
        }
    )
    if windows:
        note += " A step: " + "; ".join(windows) + ", every mode over the same documents."
    if sampled:
        note += " Timed on their first micro-batches: " + ", ".join(sampled) + "."
    return note


def _attention_notes(rows: list[dict[str, Any]]) -> list[str]:
    chosen = [
        f"{r['dataset']}: {r['attention']}, {r['attention_choice']}"
        for r in rows
        if r.get("mode") == "packed" and "attention_choice" in r
    ]
    if not chosen:
        return []
    return [
        "Attention of packed rows and the ceiling (padded rows run dense): " + "; ".join(chosen)
    ]


def _giga(tflops: float | None) -> float | None:
    return None if tflops is None else tflops * 1e3


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def packing_target(row: dict[str, Any], settings: dict[str, Any]) -> tuple[str, bool, bool] | None:
    """The target of one packing row, whether it is met and whether it reads a clock; None for a
    row without one. Targets: the "best" search's efficiency within its time limit, streaming
    BFD's efficiency, and BFD's time on the lognormal lengths (O(n): 2 s per million)."""
    if row["dataset"] == "openchat":
        if row["algorithm"] == "best":
            best, limit = (
                TARGETS["best_openchat_efficiency"],
                settings.get("best_time_limit_s", 10.0),
            )
            ok = row["efficiency"] >= best and row["seconds"] <= limit * 1.1
            return f">= {best:.2%} within {limit:g} s", ok, True
        if row["algorithm"].startswith("streaming"):
            return ">= 99%", row["efficiency"] >= 0.99, False
        return None
    seconds_limit = 2.0 * _lognormal_size(row) / 1_000_000
    return f"< {seconds_limit:g} s (2 s per 1M lengths), O(n)", row["seconds"] < seconds_limit, True


def _lognormal_size(row: dict[str, Any]) -> int:
    """``"lognormal-1,000,000"`` -> 1000000."""
    return int(row["dataset"].rsplit("-", 1)[1].replace(",", ""))


def packing_table(rows: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    body = []
    for r in rows:
        target = packing_target(r, settings)
        verdict = "" if target is None else f"{target[0]}: {'met' if target[1] else 'not met'}"
        if r["dataset"] == "openchat":
            body.append(
                [
                    r["dataset"],
                    r["algorithm"],
                    f"{r['rows']:,}",
                    f"{r['efficiency']:.2%}",
                    f"{r['seconds']:.2f}",
                    verdict,
                ]
            )
        else:  # the O(n) row: lognormal lengths, bfd, memory traced
            body.append(
                [
                    f"lognormal {_lognormal_size(r):,} (capacity {r['capacity']:,})",
                    r["algorithm"],
                    f"{r['rows']:,} (bound {r['lower_bound']:,})",
                    f"{r['efficiency']:.3%}",
                    f"{r['seconds']:.2f}, {r['peak_mib']:.0f} MiB peak",
                    verdict,
                ]
            )
    return _table(["dataset", "algorithm", "rows", "efficiency", "seconds", "target"], body)


def to_json(results: dict[str, Any]) -> dict[str, Any]:
    """``{"env", "transfer": [{tp, seq_len, megapack_ms, ..., bytes_per_stage}], "throughput": [...], "packing": [...]}``."""
    keep = {
        "transfer": TRANSFER_KEYS,
        "throughput": (
            "dataset",
            "mode",
            "tokens_per_s",
            "efficiency",
            "step_s",
            "step_times",
            "slots",
            "tokens",
            "useful_flops",
            "executed_flops",
            "timed_tokens",
            "timed_useful_flops",
            "timed_executed_flops",
            "timed_micro_batches",
            "micro_batches",
            "documents",
            "pool",
            "fill",
            "attention",
            "attention_choice",
        ),
        "packing": (
            "dataset",
            "algorithm",
            "efficiency",
            "lower_bound_efficiency",
            "seconds",
            "rows",
            "lower_bound",
            "capacity",
        ),
    }
    out: dict[str, Any] = {"env": results["env"], "settings": results["settings"]}
    for section, keys in keep.items():
        out[section] = [{k: r[k] for k in keys if k in r} for r in results[section]]
    return out


def plots(results: dict[str, Any], directory: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if results["throughput"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        datasets = sorted({r["dataset"] for r in results["throughput"]})
        from megapack.bench.modes import MODES as modes

        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            values = [
                next(
                    (
                        r["tokens_per_s"]
                        for r in results["throughput"]
                        if r["dataset"] == d and r["mode"] == mode
                    ),
                    0,
                )
                for d in datasets
            ]
            ax.bar([x + i * width for x in range(len(datasets))], values, width=width, label=mode)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(datasets))], datasets)
        ax.set(ylabel="real tokens / s", title="training throughput, same documents")
        ax.legend()
        written.append(_save(fig, out / "throughput.png", plt))
    if results["transfer"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        for seq_len in sorted({r["seq_len"] for r in results["transfer"]}):
            rows = sorted(
                (r for r in results["transfer"] if r["seq_len"] == seq_len), key=lambda r: r["tp"]
            )
            for key, style in (
                ("megapack_ms", "-o"),
                ("megapack_collectives_ms", "-.x"),
                ("megapack_fields_ms", "-v"),
                ("per_tensor_ms", "--s"),
                ("bare_megatron_ms", ":^"),
            ):
                ax.plot(
                    [r["tp"] for r in rows],
                    [r[key] for r in rows],
                    style,
                    label=f"{key.removesuffix('_ms')} {seq_len:,}",
                )
        ax.set(
            xlabel="tensor-parallel size",
            ylabel="ms per micro-batch (median)",
            title="batch transfer latency",
        )
        ax.legend(fontsize=8)
        written.append(_save(fig, out / "transfer.png", plt))
    if results["packing"]:
        rows = [
            r
            for r in results["packing"]
            if r["dataset"] == "openchat" and not r["algorithm"].startswith("streaming")
        ]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar(
            [r["algorithm"] for r in rows], [100 * r["efficiency"] for r in rows], color="#4c72b0"
        )
        if rows:
            ax.axhline(
                100 * rows[0]["lower_bound_efficiency"],
                color="#c44e52",
                linestyle="--",
                label="lower bound's efficiency",
            )
            ax.set_ylim(min(100 * r["efficiency"] for r in rows) - 2, 100)
        ax.set(ylabel="efficiency (%)", title="packing efficiency, OpenChat V1 at 2,048")
        ax.legend()
        written.append(_save(fig, out / "packing.png", plt))
    return written


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
