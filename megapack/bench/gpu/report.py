"""The GPU kit's report: ``gpu-report.json`` (for machines) and ``gpu-report.md`` (for people).

The JSON has exactly this shape, whatever happened in the run::

    {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "peak": "H100 SXM, 989 TFLOP/s",
     "checks": [{"name": "...", "status": "passed" | "failed" | "skipped" | "info", "detail": "..."}],
     "throughput": [{"config": "openchat, seq 4096", "baseline": "length-grouped padding, token
                     budget", "ratio": ..., "ratio_min": ..., ...}],   (THROUGHPUT_KEYS)
     "profile": [{"mode": "packed", "host_ms": ..., "device_ms": ..., ...}]}      (PROFILE_KEYS)

A check passes or fails against a threshold it names; "info" lines (the backend auto chose, the
attention kernels' times) carry figures without a verdict.

`Report` rewrites both files after every check, so a run that dies part-way (a CUDA fault, the
process killed) still leaves what it measured; `record_crash` then adds the death itself as a
failed check (``scripts/gpu_check.sh`` calls it when the kit's process exits abnormally). This
module imports neither torch nor megatron, so that last step works when they are what is broken.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["passed", "failed", "skipped", "info"]
STATUSES: tuple[Status, ...] = ("passed", "failed", "skipped", "info")
CHECK_KEYS = ("name", "status", "detail")
THROUGHPUT_KEYS = (
    "config",
    "baseline",
    "packed_tokens_per_s",
    "baseline_tokens_per_s",
    "ratio",
    "ratio_min",
    "ratio_max",
    "spread",
    "noisy",
    "slot_ratio",
    "flop_ideal",
    "executed_ratio",
    "packed_tflops",
    "baseline_tflops",
    "packed_spread",
    "mfu",
    "mfu_of_matmul",
)
"""One entry of packing against one baseline (`megapack.bench.baselines.summarize`)."""
PROFILE_KEYS = ("mode", "host_ms", "device_ms", "micro_batches", "by_owner_ms", "top")
"""One profiled step (`megapack.bench.gpu.profile.profile_step`)."""
JSON_NAME, MD_NAME = "gpu-report.json", "gpu-report.md"


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """One line of the report's ``checks``."""

    name: str
    """What was checked, e.g. ``"attention: sdpa, torch.bfloat16, fwd+bwd vs fp64 reference"``."""
    status: Status
    """passed, failed, skipped, or info (figures without a threshold)."""
    detail: str
    """The numbers behind a pass, the error and stack of a failure, or why it was skipped."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Check status must be one of {STATUSES}, got {self.status!r}")


@dataclass(kw_only=True, slots=True)
class Report:
    """The run's results so far, written to ``out`` after every change."""

    out: Path
    """Folder of gpu-report.json and gpu-report.md (created)."""
    device: str
    """The device's name, e.g. ``torch.cuda.get_device_name()``."""
    torch: str
    """torch.__version__."""
    peak: str = "unknown device"
    """The device's bf16 dense peak as `megapack.bench.gpu.devices` names it, or "unknown device"."""
    notes: list[str] = field(default_factory=list)
    """Lines for the markdown header (versions, sizes, the matmul ceiling, wall time)."""
    checks: list[Check] = field(default_factory=list)
    throughput: list[dict[str, Any]] = field(default_factory=list)
    details: list[dict[str, Any]] = field(default_factory=list)
    """Per-mode throughput rows (`megapack.bench.gpu.throughput.run_gpu_throughput`), markdown only."""
    profile: list[dict[str, Any]] = field(default_factory=list)
    """One profiled step per mode (`PROFILE_KEYS`)."""

    def add(self, *checks: Check) -> None:
        self.checks.extend(checks)
        self.write()

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "torch": self.torch,
            "peak": self.peak,
            "checks": [{k: getattr(c, k) for k in CHECK_KEYS} for c in self.checks],
            "throughput": [{k: t.get(k) for k in THROUGHPUT_KEYS} for t in self.throughput],
            "profile": [{k: p.get(k) for k in PROFILE_KEYS} for p in self.profile],
        }

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / JSON_NAME).write_text(json.dumps(self.to_json(), indent=2) + "\n")
        (self.out / MD_NAME).write_text(markdown(self.to_json(), self.notes, self.details))

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "failed"]


def markdown(
    report: dict[str, Any], notes: Sequence[str] = (), details: Sequence[dict[str, Any]] = ()
) -> str:
    """The report as markdown: header notes, the checks, packing against each baseline, the
    profile, per-mode rows."""
    lines = [
        "# megapack GPU kit",
        "",
        f"device: {report['device']} (bf16 peak: {report.get('peak', 'unknown device')}); "
        f"torch {report['torch']}",
    ]
    lines += [f"{n}" for n in notes]
    counts = {s: sum(c["status"] == s for c in report["checks"]) for s in STATUSES}
    lines += ["", "## Checks", "", ", ".join(f"{n} {s}" for s, n in counts.items()), ""]
    lines += ["| check | status | detail |", "| --- | --- | --- |"]
    for c in report["checks"]:
        detail = c["detail"].replace("|", "\\|").replace("\n", "<br>")
        lines.append(f"| {c['name']} | {c['status']} | {detail} |")
    if report["throughput"]:
        lines += [
            "",
            "## Packing against each baseline (real tokens/s, the same documents)",
            "",
            "Ratio: packed tokens/s over the baseline's, round by round (the modes interleaved), "
            "the median of the timed rounds [min, max], NOISY where (max - min) / median exceeds "
            "10%; slot ratio and FLOP ideal: the baseline's token slots and executed FLOPs over "
            "packing's, the same documents; packed / baseline executed FLOP/s: the median of the "
            "rounds' ratios (ratio over ideal); MFU: packing's model FLOPs/s over the device's "
            "bf16 peak (beside it, over the measured matmul).",
            "",
        ]
        lines += [
            "| config | baseline | packed tokens/s | baseline tokens/s | ratio [min, max] | slot ratio | FLOP ideal | packed / baseline executed FLOP/s | packed TFLOP/s | baseline TFLOP/s | MFU (peak) | MFU (matmul) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for t in report["throughput"]:
            ratio = "-"
            if t["ratio"] is not None:
                ratio = f"{t['ratio']:.2f} [{t['ratio_min']:.2f}, {t['ratio_max']:.2f}]"
                ratio += " NOISY" if t["noisy"] else ""
            share = t.get("executed_ratio")
            cells = [
                t["baseline"],
                _num(t["packed_tokens_per_s"], "{:,.0f}"),
                _num(t["baseline_tokens_per_s"], "{:,.0f}"),
                ratio,
                _num(t["slot_ratio"], "{:.2f}"),
                _num(t["flop_ideal"], "{:.2f}"),
                _num(share, "{:.3f}"),
                _num(t["packed_tflops"], "{:.1f}"),
                _num(t["baseline_tflops"], "{:.1f}"),
                _num(t["mfu"], "{:.1%}"),
                _num(t["mfu_of_matmul"], "{:.1%}"),
            ]
            lines.append(f"| {t['config']} | " + " | ".join(cells) + " |")
    if report.get("profile"):
        lines += [
            "",
            "## Where a step's time goes (torch.profiler, one step per mode)",
            "",
            "| mode | micro-batches | host ms | device busy ms | self CPU ms by owner | top kernels or ops (self ms) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for p in report["profile"]:
            owners = ", ".join(f"{k} {v:.1f}" for k, v in p["by_owner_ms"].items())
            top = "; ".join(f"{name} {ms:.2f}" for name, ms in p["top"])
            cells = [
                p["mode"],
                str(p["micro_batches"]),
                f"{p['host_ms']:.1f}",
                _num(p["device_ms"], "{:.1f}"),
                owners,
                top.replace("|", "\\|"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    if details:
        lines += ["", "### Every mode", ""]
        lines += [
            "| seq | mix | mode | status | real tokens/s | step s (median) | micro-batches (timed) | token slots | tokens | executed TFLOP/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in details:
            ok = r.get("status") == "ok"
            executed = r.get("timed_executed_flops") or r["executed_flops"]
            tflops = executed / r["step_s"] / 1e12 if ok else None
            ran = r.get("timed_micro_batches", r["micro_batches"])
            count = str(r["micro_batches"]) + (f" ({ran})" if ran != r["micro_batches"] else "")
            cells = [
                str(r["seq_len"]),
                r["mix"],
                r["mode"],
                r["status"] if ok else f"{r['status']}: {r.get('detail', '')}",
                _num(r.get("tokens_per_s"), "{:,.0f}"),
                _num(r.get("step_s"), "{:.3f}"),
                count,
                f"{r['slots']:,}",
                f"{r['tokens']:,}",
                _num(tflops, "{:.1f}"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def record_crash(out: Path, returncode: int, log: Path | None) -> Report:
    """Add the kit process's abnormal exit to the report in ``out`` (or start one) as a failed check."""
    path = out / JSON_NAME
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {"device": "unknown", "torch": "unknown", "checks": [], "throughput": []}
    report = Report(
        out=out, device=data["device"], torch=data["torch"], peak=data.get("peak", "unknown device")
    )
    report.checks = [Check(**{k: c[k] for k in CHECK_KEYS}) for c in data["checks"]]
    report.throughput = list(data["throughput"])
    report.profile = list(data.get("profile", []))
    tail = ""
    if log is not None and log.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    how = f"killed by signal {returncode - 128}" if returncode > 128 else f"exited {returncode}"
    report.add(
        Check(
            name="kit process",
            status="failed",
            detail=f"the kit's Python process {how} before finishing; last lines:\n{tail}",
        )
    )
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m megapack.bench.gpu.report --record-crash RC --out DIR [--log FILE]``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m megapack.bench.gpu.report")
    p.add_argument(
        "--record-crash", type=int, required=True, metavar="RC", help="the kit's exit status"
    )
    p.add_argument("--out", required=True, help="the kit's report folder")
    p.add_argument("--log", help="the kit's log; its last lines go into the failed check")
    args = p.parse_args(argv)
    record_crash(Path(args.out), args.record_crash, Path(args.log) if args.log else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
