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
    "speedup_vs_theory": 0.9,  # measured packed/padded speedup >= 0.9x the theoretical slot ratio
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


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(title for title, _, _ in columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    body = [
        "| "
        + " | ".join(
            format(row[key], fmt) if row.get(key) is not None else "" for _, key, fmt in columns
        )
        + " |"
        for row in rows
    ]
    return "\n".join([head, rule, *body])


def markdown(results: dict[str, Any]) -> str:
    parts = []
    if results["transfer"]:
        parts.append(
            "## Transfer: one micro-batch to every TP rank (median ms, slowest rank)\n\n"
            + transfer_table(results["transfer"])
        )
    if results["throughput"]:
        rows = [
            {**r, "ratio": r["measured_speedup"] / r["theoretical_speedup"]}
            for r in results["throughput"]
        ]
        parts.append("## Throughput: real tokens/s, tiny megatron-core GPT\n\n" + _table(rows, [
            ("dataset", "dataset", "s"), ("mode", "mode", "s"), ("real tokens/s", "tokens_per_s", ",.0f"),
            ("efficiency", "efficiency", ".1%"), ("theoretical speedup of packing", "theoretical_speedup", ".2f"),
            ("measured speedup of packing", "measured_speedup", ".2f"),
            (f"measured / theoretical (target >= {TARGETS['speedup_vs_theory']})", "ratio", ".2f"),
        ]))  # fmt: skip
    if results["packing"]:
        parts.append("## Packing: efficiency against the lower bound\n\n" + _table(results["packing"], [
            ("dataset", "dataset", "s"), ("algorithm", "algorithm", "s"), ("capacity", "capacity", ","), ("rows", "rows", ","),
            ("lower bound (rows)", "lower_bound", ","), ("efficiency", "efficiency", ".2%"),
            ("bound's efficiency", "lower_bound_efficiency", ".2%"), ("seconds", "seconds", ".2f"),
            ("peak MiB", "peak_mib", ".0f"),
        ]))  # fmt: skip
    return "\n\n".join(parts) + "\n"


def to_json(results: dict[str, Any]) -> dict[str, Any]:
    """``{"env", "transfer": [{tp, seq_len, megapack_ms, ..., bytes_per_stage}], "throughput": [...], "packing": [...]}``."""
    keep = {
        "transfer": TRANSFER_KEYS,
        "throughput": (
            "dataset",
            "mode",
            "tokens_per_s",
            "efficiency",
            "theoretical_speedup",
            "measured_speedup",
            "step_s",
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
        modes = ["packed", "padded_fixed", "padded_longest"]
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
            ax.bar([x + i * 0.27 for x in range(len(datasets))], values, width=0.27, label=mode)
        ax.set_xticks([x + 0.27 for x in range(len(datasets))], datasets)
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
                ("per_tensor_ms", "--s"),
                ("bare_megatron_ms", ":^"),
                ("bare_payload_ms", ":v"),
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
