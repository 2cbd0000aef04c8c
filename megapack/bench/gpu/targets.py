"""The GPU kit's targets, all in one place, and the throughput ones judged on the throughput
section's summary (`megapack.bench.baselines.summarize` of
`megapack.bench.gpu.throughput.run_gpu_throughput`).

    target                                                        constant             judged in
    packed / grouped >= 0.97x the executed-FLOP ideal, ...        `TARGETS`            `target_checks`
    cuDNN THD fwd+bwd <= 0.55x torch_varlen (one 14,398-token row) `CUDNN_OVER_VARLEN`  attention_timing.py
    flex fwd+bwd <= 1.5x torch_varlen                             `FLEX_OVER_VARLEN`   attention_timing.py
    a replayed whole step <= 0.5x eager (launch-bound model)      `REPLAY_TARGET`      graph.py
    packed + whole-step graphs >= 1.05x grouped eager (same)      `VS_GROUPED_TARGET`  graph_grouped.py

(a replay's losses and gradients within eager's own spread, and 0 synchronizing calls, are
checks, not ratios: graph.py, smoke.py, syncs.py).

Every throughput target reads medians of interleaved rounds and fails when it cannot be judged:
not measured (its configuration skipped or failed), or too noisy (its ratio's (max - min) / median
over the rounds above `megapack.bench.baselines.NOISY`), instead of passing on a median (`judge`).
"""

from __future__ import annotations

from typing import Any

from megapack.bench.baselines import NOISY
from megapack.bench.gpu.report import Check, Status
from megapack.bench.gpu.throughput import MIXES
from megapack.bench.modes import LABELS

TARGETS = {
    "of_ideal": 0.97,
    "vs_grouped": 1.0,
    "ideal_at_least": 1.03,
    "of_ceiling": 0.95,
    "mfu": 0.45,
}
"""The kit's throughput targets on a GPU at `PRESET`, medians of interleaved rounds, in every
configuration run (OpenChat and short SFT at seq 4,096 and 8,192): packed / grouped at least 0.97x
the executed-FLOP ideal (grouped's executed FLOPs over packing's: with equal kernels the two differ
only by their FLOPs), i.e. packing's executed FLOP/s at least 0.97x grouped's; packed at least
1.0x grouped wherever that ideal is at least 1.03; packed executed TFLOP/s at least 0.95x the THD
ceiling's; stretch: packed MFU against the bf16 peak at least 45% on OpenChat at seq 4,096. A
target whose ratio spreads over more than `NOISY` (max - min over the median) fails as too noisy
to judge."""
CUDNN_OVER_VARLEN = 0.55
"""Target: cuDNN's THD attention fwd+bwd at most this many times torch_varlen's on the timed row
(on an H200, cuDNN's sm90 kernels ran ~2.1x varlen's FlashAttention 2 per FLOP: 0.48x its time)."""
FLEX_OVER_VARLEN = 1.5
"""Target: flex's fwd+bwd time at most this many times torch_varlen's on the timed row."""
REPLAY_TARGET = 0.5
"""Target: a replayed whole step <= this x eager's, on the launch-bound model."""
VS_GROUPED_TARGET = 1.05
"""Target: packed + whole-step graphs >= this x the eager grouped baseline, launch-bound model."""
MFU_CONFIG = "openchat, seq 4096"
"""The configuration the stretch MFU target reads."""


def target_checks(
    summary: list[dict[str, Any]],
    *,
    seq_lens: tuple[int, ...],
    applies: bool,
    why_not: str = "",
    mixes: tuple[str, ...] = MIXES,
    ceiling: bool = True,
) -> list[Check]:
    """Verdicts on `TARGETS` from the run's `megapack.bench.baselines.summarize` entries: for each
    configuration (``mixes`` x ``seq_lens``) the ideal, the grouped and (with ``ceiling``: the
    run timed the ceiling mode) the ceiling target, then the stretch MFU target (`MFU_CONFIG`).

    With ``applies`` False (the dry run, or a model other than the preset) every target is skipped,
    saying ``why_not``. A target whose numbers are missing fails (not measured); one whose ratio is
    noisy fails, too noisy to judge; the grouped target is skipped where the ideal is under
    ``TARGETS["ideal_at_least"]``.
    """
    configs = [f"{mix}, seq {seq}" for seq in seq_lens for mix in mixes]
    t = TARGETS
    names = {}
    for c in configs:
        names[(c, "ideal")] = (
            f"target: packed / grouped >= {t['of_ideal']}x the executed-FLOP ideal ({c})"
        )
        names[(c, "grouped")] = (
            f"target: packed >= {t['vs_grouped']}x grouped where the ideal >= {t['ideal_at_least']} ({c})"
        )
        names[(c, "ceiling")] = (
            f"target: packed executed TFLOP/s >= {t['of_ceiling']}x the THD ceiling's ({c})"
        )
        if not ceiling:
            del names[(c, "ceiling")]
    mfu_name = f"target (stretch): packed MFU (bf16 peak) >= {t['mfu']:.0%} ({MFU_CONFIG})"
    if not applies:
        return [
            Check(name=n, status="skipped", detail=why_not) for n in [*names.values(), mfu_name]
        ]
    entries = {(e["config"], e["baseline"]): e for e in summary}
    checks = []
    for c in configs:
        grouped = entries.get((c, LABELS["grouped"]), {})
        top = entries.get((c, LABELS["ceiling"]), {})
        ideal = grouped.get("flop_ideal")
        against = f"packed / grouped {_ratio(grouped)}, ideal {_num(ideal)}"
        checks.append(
            judge(
                names[(c, "ideal")],
                grouped.get("executed_ratio"),
                t["of_ideal"],
                grouped.get("spread"),
                f"{against}: the executed FLOP/s ratio",
            )
        )
        if ideal is not None and ideal < t["ideal_at_least"]:
            why = f"the ideal is {ideal:.3f} < {t['ideal_at_least']}: the ideal target judges it"
            checks.append(Check(name=names[(c, "grouped")], status="skipped", detail=why))
        else:
            checks.append(
                judge(
                    names[(c, "grouped")],
                    grouped.get("ratio"),
                    t["vs_grouped"],
                    grouped.get("spread"),
                    against,
                )
            )
        if (c, "ceiling") in names:
            packed_rate = _num(top.get("packed_tflops"), "{:.0f}")
            top_rate = _num(top.get("baseline_tflops"), "{:.0f}")
            checks.append(
                judge(
                    names[(c, "ceiling")],
                    top.get("executed_ratio"),
                    t["of_ceiling"],
                    top.get("spread"),
                    f"packed {packed_rate} / ceiling {top_rate} TFLOP/s, median of the rounds' ratios",
                )
            )
    any_entry = next((e for e in summary if e["config"] == MFU_CONFIG), {})
    mfu = any_entry.get("mfu")
    if mfu is None and any_entry.get("packed_tflops") is not None:
        checks.append(
            Check(name=mfu_name, status="failed", detail="an unknown device: no bf16 peak")
        )
    else:
        what = "packed's model FLOP/s over the peak, median step"
        spread = any_entry.get("packed_spread")
        checks.append(judge(mfu_name, mfu, t["mfu"], spread, what, fmt="{:.1%}"))
    return checks


def judge(
    name: str,
    value: float | None,
    at_least: float,
    spread: float | None,
    what: str,
    *,
    fmt: str = "{:.3f}",
) -> Check:
    """A target's check: failed when not measured (``value`` None), failed as too noisy to judge
    when ``spread`` exceeds `NOISY`, else passed when ``value >= at_least``.

    Example:
        >>> judge("t", 0.99, 0.97, 0.12, "x").detail
        'TOO NOISY TO JUDGE: spread 12% > 10% (median 0.990 against >= 0.97); x'
    """
    if value is None:
        return Check(name=name, status="failed", detail=f"not measured; {what}")
    shown = f"{fmt.format(value)} against >= {at_least:g}"
    if spread is None or spread > NOISY:
        how = "no spread" if spread is None else f"spread {spread:.0%} > {NOISY:.0%}"
        return Check(
            name=name, status="failed", detail=f"TOO NOISY TO JUDGE: {how} (median {shown}); {what}"
        )
    status: Status = "passed" if value >= at_least else "failed"
    verdict = "met" if status == "passed" else "NOT MET"
    return Check(
        name=name, status=status, detail=f"{verdict}: {shown} (spread {spread:.0%}); {what}"
    )


def _ratio(entry: dict[str, Any]) -> str:
    if entry.get("ratio") is None:
        return "not measured"
    return f"{entry['ratio']:.3f}x [{entry['ratio_min']:.3f}, {entry['ratio_max']:.3f}]"


def _num(value: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)
