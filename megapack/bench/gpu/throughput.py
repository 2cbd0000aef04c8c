"""GPU throughput at real size: packing against the baselines a practitioner picks, on one GPU.

The kit's throughput section (``bash scripts/gpu_check.sh``, `megapack.bench.gpu.kit`). One rank
(torch.distributed world of 1, megatron-core ``initialize_model_parallel(1, 1)``) trains the
`megapack.bench.gpu.model.PRESET` GPT (0.84B, bf16 through ``Float16Module``) with megatron-core's
``get_forward_backward_func`` schedule; every micro-batch reaches the model through
`megapack.get_batch_on_this_tp_rank` (tp=1) inside the pretrain_gpt-style
`megapack.harness.gpt.forward_step`. The same documents are laid out in every mode of
`megapack.bench.layouts` (packed, padded to seq, length-grouped with a token budget, the ceiling
of unbroken rows, and the weak "padded to the longest" kept by name).

Per (sequence length, length mix, mode): warm-up steps, then ``steps`` timed steps, each one
schedule call over every micro-batch plus an SGD step, between two ``torch.cuda.synchronize()``;
every step's seconds are kept, and `megapack.bench.baselines.summarize` reports the ratios' median,
min and max, the slot ratio and the executed-FLOP ideal, executed TFLOP/s, and MFU against the
device's bf16 peak (`megapack.bench.gpu.devices`) with the fraction of the measured matmul beside it.

Length mixes (`length_mixes`): ``openchat`` samples the bundled OpenChat V1 lengths as they are
(capped at 2,048 tokens, so a 4,096 row holds two or more documents); ``sft-short`` is lognormal
with median 200 tokens and sigma 0.8 (mean ~275). The dry run scales both down with its sequence.

A deadline skips the configurations that would not finish in time, in the order run:
(4,096, openchat) first, as the kit's targets are read there.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megapack.bench.gpu.model import GptShape
from megapack.bench.gpu.report import Check
from megapack.bench.layouts import LABELS, MODES, layout_cost, micro_batches

MIXES = ("openchat", "sft-short")
SHORT_MEDIAN = 200
"""Median document length of the sft-short mix, in tokens (at ``scale`` 1)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ThroughputSizes:
    """How much the throughput section runs."""

    seq_lens: tuple[int, ...]
    """Row lengths, each a separate configuration, in the order run."""
    documents: int
    """Documents per step (the same documents in every mode)."""
    rows: int
    """Micro-batch size: packed rows, or padded documents, per micro-batch."""
    warmup: int
    """Untimed steps before each mode's timed ones."""
    steps: int
    """Timed steps per mode; their median, min and max are reported."""
    length_scale: float
    """Multiplies the mixes' lengths: 1.0 at real size, smaller for the dry run's short rows."""


def length_mixes(
    openchat: list[int], n_docs: int, *, max_len: int, scale: float = 1.0, seed: int = 0
) -> dict[str, list[int]]:
    """``n_docs`` lengths of each mix, each in [1, ``max_len``] (see the module docstring).

    Example:
        >>> mixes = length_mixes([2048, 100, 7], 4, max_len=4096)
        >>> sorted(mixes), all(n in (2048, 100, 7) for n in mixes["openchat"])
        (['openchat', 'sft-short'], True)
    """
    rng = np.random.default_rng(seed)
    sample = rng.choice(np.asarray(openchat), size=n_docs, replace=len(openchat) < n_docs)
    real = np.clip(np.round(sample * scale), 1, max_len).astype(int)
    short = rng.lognormal(np.log(SHORT_MEDIAN * scale), 0.8, n_docs)
    return {
        "openchat": real.tolist(),
        "sft-short": np.clip(np.round(short), 1, max_len).astype(int).tolist(),
    }


def run_gpu_throughput(
    model: Any,
    shape: GptShape,
    sizes: ThroughputSizes,
    mixes: dict[str, list[int]],
    *,
    topology: Any,
    deadline: float | None = None,
    seed: int = 0,
    modes: tuple[str, ...] = MODES,
) -> list[dict[str, Any]]:
    """One measurement per (seq_len, mix, mode), in that order; see the module docstring.

    Each row: ``config`` ("<mix>, seq <seq_len>"), ``seq_len``, ``mix``, ``mode``, ``slots``,
    ``tokens`` (the documents' tokens), ``useful_flops`` and ``executed_flops`` of one step,
    ``micro_batches``, ``status`` ("ok", "error" or "skipped"), then ``step_times`` and
    ``tokens_per_s`` (median step) when ok, else ``detail``. A mode that fails (e.g. out of
    memory) is recorded and the next one runs. ``deadline`` (a ``time.perf_counter()`` value)
    skips a configuration whose estimated time, from the seconds per token slot measured so far,
    would pass it.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megapack.harness.gpt import forward_step

    schedule = get_forward_backward_func()
    step_fn = functools.partial(forward_step, topology)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    device = topology.device
    rows: list[dict[str, Any]] = []
    per_slot: list[float] = []  # seconds per token slot of every measured step
    measured: dict[tuple[str, str], tuple[int, int, float]] = {}  # (mix, mode): seq, slots, step s
    for seq_len in sizes.seq_lens:
        for mix in MIXES:
            rng = np.random.default_rng(seed)
            docs = [rng.integers(1, shape.vocab_size, n) for n in mixes[mix]]
            layouts = {m: micro_batches(m, docs, seq_len, sizes.rows, seed=seed) for m in modes}
            costs = {m: layout_cost(batches) for m, batches in layouts.items()}
            estimate = (
                1.5
                * (sizes.warmup + sizes.steps)
                * sum(
                    step_estimate(measured.get((mix, m)), seq_len, c.slots, per_slot)
                    for m, c in costs.items()
                )
            )
            late = deadline is not None and time.perf_counter() + estimate > deadline
            for mode, batches in layouts.items():
                cost = costs[mode]
                row: dict[str, Any] = {
                    "config": f"{mix}, seq {seq_len}",
                    "seq_len": seq_len,
                    "mix": mix,
                    "mode": mode,
                    "slots": cost.slots,
                    "tokens": sum(mixes[mix]),
                    "useful_flops": shape.training_flops(mixes[mix]),
                    "executed_flops": cost.executed_flops(shape),
                    "micro_batches": len(batches),
                }
                if late:
                    rows.append(
                        row | {"status": "skipped", "detail": f"deadline: needs ~{estimate:.0f} s"}
                    )
                    continue
                try:
                    times = time_steps(
                        schedule,
                        step_fn,
                        model,
                        optimizer,
                        batches,
                        device,
                        width=sizes.rows * seq_len if mode == "packed" else None,
                        micro_batch_size=1 if mode == "packed" else None,
                        warmup=sizes.warmup,
                        steps=sizes.steps,
                    )
                except Exception as exc:  # e.g. torch.OutOfMemoryError: record it, go on
                    rows.append(row | {"status": "error", "detail": f"{type(exc).__name__}: {exc}"})
                    optimizer.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                step_s = statistics.median(times)
                per_slot.append(step_s / cost.slots)
                measured[(mix, mode)] = (seq_len, cost.slots, step_s)
                rows.append(
                    row
                    | {
                        "status": "ok",
                        "step_times": times,
                        "step_s": step_s,
                        "tokens_per_s": row["tokens"] / step_s,
                    }
                )
    optimizer.zero_grad(set_to_none=True)
    return rows


def step_estimate(
    earlier: tuple[int, int, float] | None, seq_len: int, slots: int, per_slot: list[float]
) -> float:
    """Seconds one step of a mode is expected to take, for the deadline: from the same mix and
    mode at a shorter ``seq_len`` (``earlier``: its seq_len, slots, step seconds), scaled by the
    slots and, for attention's quadratic part, by the sequence length (an upper bound); else from
    the slowest seconds per slot measured so far (small steps are slow per slot: an upper bound)."""
    if earlier is None:
        return max(per_slot, default=0.0) * slots
    seq_before, slots_before, step_s = earlier
    return step_s * slots / slots_before * max(1.0, seq_len / seq_before)


def time_steps(
    schedule: Any,
    step_fn: Any,
    model: Any,
    optimizer: torch.optim.Optimizer,
    batches: list[Any],
    device: torch.device,
    *,
    width: int | None,
    micro_batch_size: int | None,
    warmup: int,
    steps: int,
) -> list[float]:
    """Seconds of each of ``steps`` training steps (schedule + SGD) after ``warmup`` untimed ones.

    ``width`` / ``micro_batch_size`` None: each step's from its first plain micro-batch (the
    schedule's shapes; megatron-core reads every micro-batch's own with ``variable_seq_lengths``).
    """
    if width is None or micro_batch_size is None:
        micro_batch_size, width = (int(n) for n in batches[0]["tokens"].shape)
    times = []
    for i in range(warmup + steps):
        _synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        schedule(
            forward_step_func=step_fn,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=len(batches),
            seq_length=width,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )
        optimizer.step()
        _synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


TARGETS = {"vs_grouped": 1.0, "of_ceiling": 0.95, "mfu": 0.40}
"""The kit's targets on a GPU at `PRESET`, seq 4,096, OpenChat, medians of the timed steps: packed
at least 1.0x the length-grouped token-budget padding in real tokens/s, packed executed TFLOP/s at
least 0.95x the ceiling's (packing costs at most 5%), packed MFU against the device's bf16 peak at
least 40%; and no synchronizing CUDA call over a whole step, with the positive control tripping
(`megapack.bench.gpu.checks.sync_checks`)."""


def target_checks(
    summary: list[dict[str, Any]],
    sync: list[Any],
    *,
    seq_len: int,
    applies: bool,
    why_not: str = "",
) -> list[Check]:
    """Verdicts on `TARGETS` from the run's `megapack.bench.baselines.summarize` entries and its
    sync checks.

    With ``applies`` False (the dry run, or a model other than the preset) every target is skipped,
    saying ``why_not``. A target whose numbers are missing fails: it was not measured.
    """
    where = f"openchat, seq {seq_len}"
    names = {
        "grouped": f"target: packed >= {TARGETS['vs_grouped']}x length-grouped padding, median ({where})",
        "ceiling": f"target: packed executed TFLOP/s >= {TARGETS['of_ceiling']} x the ceiling's ({where})",
        "mfu": f"target: packed MFU (bf16 peak) >= {TARGETS['mfu']:.0%} ({where})",
        "sync": "target: 0 synchronizing CUDA calls over a whole step, the positive control tripping",
    }
    if not applies:
        return [Check(name=n, status="skipped", detail=why_not) for n in names.values()]
    entries = {(e["config"], e["baseline"]): e for e in summary}
    grouped = entries.get((where, LABELS["grouped"]), {})
    ceiling = entries.get((where, LABELS["ceiling"]), {})
    checks = []
    ratio = grouped.get("ratio")
    checks.append(
        _verdict(
            names["grouped"],
            ratio is not None and ratio >= TARGETS["vs_grouped"],
            "not measured" if ratio is None else _spread(grouped),
        )
    )
    packed, top = ceiling.get("packed_tflops"), ceiling.get("baseline_tflops")
    if packed is not None and top:
        checks.append(
            _verdict(
                names["ceiling"],
                packed / top >= TARGETS["of_ceiling"],
                f"{packed:.0f} / {top:.0f} TFLOP/s = {packed / top:.3f}",
            )
        )
    else:
        checks.append(_verdict(names["ceiling"], False, "not measured"))
    mfu = grouped.get("mfu")
    detail = "not measured (or an unknown device: no peak)" if mfu is None else f"{mfu:.1%}"
    checks.append(_verdict(names["mfu"], mfu is not None and mfu >= TARGETS["mfu"], detail))
    failed = [c.name for c in sync if c.status != "passed"]
    checks.append(
        _verdict(
            names["sync"],
            bool(sync) and not failed,
            f"not passed: {failed}" if failed else f"{len(sync)} sync checks passed",
        )
    )
    return checks


def _spread(entry: dict[str, Any]) -> str:
    noisy = "; NOISY: the spread exceeds 10%" if entry.get("noisy") else ""
    return (
        f"median {entry['ratio']:.2f}x (min {entry['ratio_min']:.2f}, max {entry['ratio_max']:.2f})"
        f"{noisy}"
    )


def _verdict(name: str, ok: bool, detail: str) -> Check:
    return Check(name=name, status="passed" if ok else "failed", detail=detail)
