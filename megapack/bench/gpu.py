"""GPU throughput at real size: real tokens/s packed vs padded, effective TFLOP/s and MFU, on one GPU.

The kit's section (d) (``bash scripts/gpu_check.sh``, `megapack.bench.gpu_kit`). One rank
(torch.distributed world of 1, megatron-core ``initialize_model_parallel(1, 1)``) trains the
`megapack.bench.gpu_model.PRESET` GPT (0.84B, bf16 through ``Float16Module``) with megatron-core's
``get_forward_backward_func`` schedule; every micro-batch reaches the model through
`megapack.get_batch_on_this_tp_rank` (tp=1) inside the pretrain_gpt-style
`megapack.harness.gpt.forward_step`. The same documents are laid out three ways
(`megapack.bench.throughput.micro_batches`, ``rows`` rows or documents per micro-batch):

* ``packed``: BFD rows of ``seq_len``, THD;
* ``padded_fixed`` ("padded to seq"): one document per row padded to ``seq_len`` (Megatron's SFT);
* ``padded_longest``: each micro-batch's documents padded to its longest.

Per (sequence length, length mix, mode): warm-up steps, then the median of timed steps, each one
schedule call over every micro-batch plus an SGD step, between two ``torch.cuda.synchronize()``.
Reported per padded mode (`summarize`): real (loss-masked) tokens/s of both, their ratio against the
theoretical slot ratio (the padded mode's token slots / the packed mode's, filler rows included:
what a perfect kernel would save), and the packed run's MFU: THD-aware training FLOPs of the real
documents (`GptShape.training_flops`) per second over the measured matmul ceiling.

Length mixes (`length_mixes`): ``openchat`` samples the bundled OpenChat V1 lengths as they are
(capped at 2,048 tokens, so a 4,096 row holds two or more documents); ``sft-short`` is lognormal
with median 200 tokens and sigma 0.8 (mean ~275). The dry run scales both down with its sequence.

Sized to fit the kit's budget: ``PRESET`` on 64 documents, 2 rows per micro-batch, 1 warm-up and 3
timed steps, seq 4,096 and 8,192: about 0.5 M token slots a step at most (padding 64 documents to
8,192), so roughly 2 minutes on an H100 at ~80k slots/s (an estimate from a colleague's H200
measurement, not a reading). A deadline skips the configurations that would not finish in time,
in the order run: (4,096, openchat) first, as the kit's targets are read there.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megapack.bench.gpu_model import GptShape
from megapack.bench.gpu_report import Check
from megapack.bench.throughput import MODES, micro_batches, slots

MIXES = ("openchat", "sft-short")
PADDED = {"padded_fixed": "padded to seq", "padded_longest": "padded to longest"}
"""Each padded mode and how the report names it."""
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
    """Timed steps per mode; the median is reported."""
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
) -> list[dict[str, Any]]:
    """One measurement per (seq_len, mix, mode), in that order; see the module docstring.

    Each row: ``seq_len``, ``mix``, ``mode``, ``slots`` (token slots of one step), ``real_tokens``
    (loss-masked), ``flops`` (training FLOPs of the documents), ``micro_batches``, ``status``
    ("ok", "error" or "skipped"), then ``tokens_per_s`` and ``step_s`` when ok, else ``detail``. A mode that fails (e.g. out of memory) is
    recorded and the next one runs. ``deadline`` (a ``time.perf_counter()`` value) skips a
    configuration whose estimated time, from the seconds per token slot measured so far, would
    pass it.
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
            layouts = {mode: micro_batches(mode, docs, seq_len, sizes.rows) for mode in MODES}
            counts = {mode: slots(batches) for mode, batches in layouts.items()}
            flops = shape.training_flops(mixes[mix])
            estimate = (
                1.5 * (sizes.warmup + sizes.steps)
                * sum(step_estimate(measured.get((mix, mode)), seq_len, total, per_slot)
                      for mode, (total, _) in counts.items())
            )  # fmt: skip
            late = deadline is not None and time.perf_counter() + estimate > deadline
            for mode, batches in layouts.items():
                total, real = counts[mode]
                row: dict[str, Any] = {
                    "seq_len": seq_len, "mix": mix, "mode": mode, "slots": total,
                    "real_tokens": real, "flops": flops, "micro_batches": len(batches),
                }  # fmt: skip
                if late:
                    rows.append(
                        row | {"status": "skipped", "detail": f"deadline: needs ~{estimate:.0f} s"}
                    )
                    continue
                try:
                    step_s = _time_steps(
                        schedule, step_fn, model, optimizer, batches, device,
                        width=sizes.rows * seq_len if mode == "packed" else seq_len,
                        micro_batch_size=1 if mode == "packed" else sizes.rows,
                        warmup=sizes.warmup, steps=sizes.steps,
                    )  # fmt: skip
                except Exception as exc:  # e.g. torch.OutOfMemoryError: record it, go on
                    rows.append(row | {"status": "error", "detail": f"{type(exc).__name__}: {exc}"})
                    optimizer.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                per_slot.append(step_s / total)
                measured[(mix, mode)] = (seq_len, total, step_s)
                rows.append(row | {"status": "ok", "tokens_per_s": real / step_s, "step_s": step_s})
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


def _time_steps(
    schedule: Any, step_fn: Any, model: Any, optimizer: torch.optim.Optimizer, batches: list[Any],
    device: torch.device, *, width: int, micro_batch_size: int, warmup: int, steps: int,
) -> float:  # fmt: skip
    """Median seconds of ``steps`` training steps (schedule + SGD) after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + steps):
        _synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        schedule(
            forward_step_func=step_fn, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=width, micro_batch_size=micro_batch_size,
            forward_only=False,
        )  # fmt: skip
        optimizer.step()
        _synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(rows: list[dict[str, Any]], ceiling_flops: float) -> list[dict[str, Any]]:
    """The report's throughput entries: packed against each padded mode, per (seq_len, mix).

    Each entry has exactly ``config``, ``packed_tokens_per_s``, ``padded_tokens_per_s``, ``ratio``
    (packed / padded tokens/s), ``theoretical_ratio`` (padded slots / packed slots) and ``mfu``
    (the packed run's effective FLOP/s over ``ceiling_flops``); a value that was not measured is
    None.

    Example:
        >>> ok = {"seq_len": 8, "mix": "m", "status": "ok", "step_s": 1.0, "flops": 50.0}
        >>> rows = [ok | {"mode": "packed", "tokens_per_s": 30.0, "slots": 32},
        ...         ok | {"mode": "padded_fixed", "tokens_per_s": 10.0, "slots": 128}]
        >>> summarize(rows, 100.0)
        [{'config': 'm, seq 8, vs padded to seq', 'packed_tokens_per_s': 30.0, 'padded_tokens_per_s': 10.0, 'ratio': 3.0, 'theoretical_ratio': 4.0, 'mfu': 0.5}]
    """
    out = []
    by_key = {(r["seq_len"], r["mix"], r["mode"]): r for r in rows}
    for seq_len, mix in dict.fromkeys((r["seq_len"], r["mix"]) for r in rows):
        packed = by_key.get((seq_len, mix, "packed"), {})
        for mode, label in PADDED.items():
            padded = by_key.get((seq_len, mix, mode))
            if padded is None:
                continue
            both = packed.get("status") == "ok" and padded.get("status") == "ok"
            out.append({
                "config": f"{mix}, seq {seq_len}, vs {label}",
                "packed_tokens_per_s": _ok(packed, "tokens_per_s"),
                "padded_tokens_per_s": _ok(padded, "tokens_per_s"),
                "ratio": packed["tokens_per_s"] / padded["tokens_per_s"] if both else None,
                "theoretical_ratio": padded["slots"] / packed["slots"] if packed else None,
                "mfu": packed["flops"] / packed["step_s"] / ceiling_flops if _ok(packed, "step_s") else None,
            })  # fmt: skip
    return out


def _ok(row: dict[str, Any], key: str) -> Any:
    return row.get(key) if row.get("status") == "ok" else None


TARGETS = {"share_of_slot_ratio": 0.95, "vs_longest": 1.1, "mfu": 0.45}
"""The kit's targets on a GPU at `PRESET`, seq 4,096, OpenChat: packed / padded-to-seq tokens/s at
least 0.95 x the slot ratio, packed at least 1.1x padded to the longest, packed MFU at least 45%,
and no synchronizing CUDA call (`megapack.bench.gpu_checks.sync_checks`)."""


def target_checks(
    summary: list[dict[str, Any]],
    sync: list[Any],
    *,
    seq_len: int,
    applies: bool,
    why_not: str = "",
) -> list[Check]:
    """Verdicts on `TARGETS` from the run's `summarize` entries and its sync checks.

    With ``applies`` False (the dry run, or a model other than the preset) every target is skipped,
    saying ``why_not``. A target whose numbers are missing fails: it was not measured.
    """
    where = f"openchat, seq {seq_len}"
    names = {
        "seq": f"target: packed / padded to seq >= {TARGETS['share_of_slot_ratio']} x slot ratio ({where})",
        "longest": f"target: packed >= {TARGETS['vs_longest']}x padded to longest ({where})",
        "mfu": f"target: packed MFU >= {TARGETS['mfu']:.0%} ({where})",
        "sync": "target: 0 synchronizing CUDA calls",
    }
    if not applies:
        return [Check(name=n, status="skipped", detail=why_not) for n in names.values()]
    entries = {e["config"]: e for e in summary}
    vs_seq = entries.get(f"{where}, vs {PADDED['padded_fixed']}", {})
    vs_longest = entries.get(f"{where}, vs {PADDED['padded_longest']}", {})
    checks = []
    if vs_seq.get("ratio") is not None and vs_seq.get("theoretical_ratio"):
        share = vs_seq["ratio"] / vs_seq["theoretical_ratio"]
        checks.append(_verdict(names["seq"], share >= TARGETS["share_of_slot_ratio"],
                               f"{vs_seq['ratio']:.2f}x of a {vs_seq['theoretical_ratio']:.2f} slot ratio = {share:.3f}"))  # fmt: skip
    else:
        checks.append(_verdict(names["seq"], False, "not measured"))
    ratio = vs_longest.get("ratio")
    checks.append(_verdict(names["longest"], ratio is not None and ratio >= TARGETS["vs_longest"],
                           "not measured" if ratio is None else f"{ratio:.2f}x"))  # fmt: skip
    mfu = vs_seq.get("mfu")
    checks.append(_verdict(names["mfu"], mfu is not None and mfu >= TARGETS["mfu"],
                           "not measured" if mfu is None else f"{mfu:.1%}"))  # fmt: skip
    failed = [c.name for c in sync if c.status != "passed"]
    checks.append(_verdict(names["sync"], bool(sync) and not failed,
                           f"not passed: {failed}" if failed else f"{len(sync)} sync checks passed"))  # fmt: skip
    return checks


def _verdict(name: str, ok: bool, detail: str) -> Check:
    return Check(name=name, status="passed" if ok else "failed", detail=detail)
