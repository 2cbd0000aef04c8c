"""The closing summary of ``megapack bench``: every target of the run, met or not, one line each.

Each section's tables give a verdict beside its figures; a run prints many tables, so it ends with
all of them in one place (`markdown`), in the JSON too (``"targets"``), and says what was not run:

    ## Summary: 10 of 12 targets met; not met: transfer x 1, pack x 1

    | section | target | value | verdict |
    | --- | --- | --- | --- |
    | transfer | tp 2, seq_len 4,096: prefetch, blocked in next() / bare broadcast <= 0.25 (timed) | 0.04 | met |
    ...

A target is *timed* when it reads a clock (transfer, the "best" search's time limit, BFD's time,
the pack's speed): on a shared 2-core CPU such a verdict moves with the machine's load, so the
summary marks it, and whether a target is met never changes the exit code (docs/benchmarks.md,
"Exit code"). Throughput has no target on a CPU (its ratios are reported with their spread).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SECTIONS = ("transfer", "throughput", "packing", "balance", "cp", "pack")
"""The sections of a run, as ``--skip`` names them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """One target of a run and its verdict."""

    section: str
    """The section that measured it (`SECTIONS`)."""
    target: str
    """What is required, with where it applies: "tp 2, seq_len 4,096: ... <= 0.25"."""
    value: str
    """What was measured, as the section's table prints it."""
    met: bool
    """Whether the measurement meets the target."""
    timed: bool
    """Whether it reads a clock (noisy on a shared CPU)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "section": self.section,
            "target": self.target,
            "value": self.value,
            "met": self.met,
            "timed": self.timed,
        }


TRANSFER_LABELS = {
    "blocked_vs_bare": "prefetch, blocked in next() / bare broadcast",
    "step_vs_compute": "prefetch, step / compute",
}
"""How the summary names each of `megapack.bench.transfer.TARGETS`."""


def collect(results: dict[str, Any]) -> list[Target]:
    """Every target of a run's ``results`` (as `megapack.bench.main` gathers them), in section
    order; a section that did not run gives none."""
    from megapack.bench.dp_balance import TARGET_EFFICIENCY_PT
    from megapack.bench.pack_command import MEMORY_SHARE, TARGET_RATIO, memory_check
    from megapack.bench.report import packing_target
    from megapack.bench.transfer import TARGETS, verdicts

    out: list[Target] = []
    for r in results.get("transfer", []):
        v = verdicts(r)
        for key, limit in TARGETS.items():
            out.append(
                Target(
                    section="transfer",
                    target=f"tp {r['tp']}, seq_len {r['seq_len']:,}: {TRANSFER_LABELS[key]} "
                    f"<= {limit:g}",
                    value=f"{v[key]:.2f}",
                    met=bool(v[f"{key}_met"]),
                    timed=True,
                )
            )
    settings = results.get("settings", {})
    for r in results.get("packing", []):
        found = packing_target(r, settings)
        if found is None:
            continue
        text, met, timed = found
        out.append(
            Target(
                section="packing",
                target=f"{r['dataset'].replace('-', ' ')}, {r['algorithm']}: {text}",
                value=f"{r['efficiency']:.2%}, {r['seconds']:.2f} s",
                met=met,
                timed=timed,
            )
        )
    for r in results.get("balance", []):
        if not r.get("verdict"):
            continue
        out.append(
            Target(
                section="balance",
                target=f"{r['dataset']}, dp {r['dp_size']}, {r['cost']}: compute plan imbalance "
                f"<= {r['target_imbalance']:.4f}, efficiency within {TARGET_EFFICIENCY_PT:g} pt",
                value=f"{r['imbalance_compute_plan']:.4f}, {r['efficiency_loss_pt']:+.2f} pt",
                met=r["verdict"] == "pass",
                timed=False,
            )
        )
    for r in results.get("pack", []):
        out.append(
            Target(
                section="pack",
                target=f"{r['documents']:,} documents: pack / bare <= {TARGET_RATIO:g}",
                value=f"{r['ratio']:.2f}",
                met=r["verdict"] == "ok",
                timed=True,
            )
        )
    check = memory_check(results.get("pack", []))
    if check is not None:
        out.append(
            Target(
                section="pack",
                target=f"{check['measure']} growth for {check['documents_ratio']:.0f}x the "
                f"documents < {MEMORY_SHARE:g} x the extra token array "
                f"({check['token_growth_mib']:.0f} MiB)",
                value=f"{check['growth_mib']:.0f} MiB",
                met=bool(check["met"]),
                timed=False,
            )
        )
    return out


def markdown(targets: list[Target], skipped: list[str]) -> str:
    """The summary: a headline (how many met, which sections missed some), then one line a target.

    Example:
        >>> t = Target(section="pack", target="5,000 documents: pack / bare <= 1.25",
        ...            value="1.31", met=False, timed=True)
        >>> print(markdown([t], skipped=["cp"]))
        ## Summary: 0 of 1 target met; not met: pack x 1
        <BLANKLINE>
        | section | target | value | verdict |
        | --- | --- | --- | --- |
        | pack | 5,000 documents: pack / bare <= 1.25 (timed) | 1.31 | NOT MET |
        <BLANKLINE>
        Not run: cp. A missed target is reported, never an error: the exit code is 0 whenever every
        section ran (timed targets move with the machine's load; docs/benchmarks.md, "Exit code").
    """
    met = sum(t.met for t in targets)
    missed: dict[str, int] = {}
    for t in targets:
        if not t.met:
            missed[t.section] = missed.get(t.section, 0) + 1
    head = f"## Summary: {met} of {len(targets)} target{'' if len(targets) == 1 else 's'} met"
    if missed:
        head += "; not met: " + ", ".join(f"{s} x {n}" for s, n in missed.items())
    lines = [head, "", "| section | target | value | verdict |", "| --- | --- | --- | --- |"]
    for t in targets:
        timed = " (timed)" if t.timed else ""
        lines.append(
            f"| {t.section} | {t.target}{timed} | {t.value} | {'met' if t.met else 'NOT MET'} |"
        )
    if not targets:
        lines = [head, "", "No target was measured in this run."]
    tail = f"Not run: {', '.join(skipped)}. " if skipped else ""
    lines += [
        "",
        f"{tail}A missed target is reported, never an error: the exit code is 0 whenever every\n"
        'section ran (timed targets move with the machine\'s load; docs/benchmarks.md, "Exit code").',
    ]
    return "\n".join(lines)
