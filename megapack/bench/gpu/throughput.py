"""GPU throughput at real size: packing against the baselines a practitioner picks, on one GPU.

The kit's ``throughput`` section (``bash scripts/gpu_check.sh --only throughput``,
`megapack.bench.gpu.kit`). One rank (torch.distributed world of 1, megatron-core
``initialize_model_parallel(1, 1)``) trains the `megapack.bench.gpu.model.PRESET` GPT (0.84B, bf16
through ``Float16Module``, the kit's ``--backend`` for THD attention) with megatron-core's
``get_forward_backward_func`` schedule; every micro-batch reaches the model through
`megapack.get_batch_on_this_tp_rank` (tp=1) inside the pretrain_gpt-style
`megapack.harness.gpt.forward_step`.

Per (sequence length, length mix): a step as a real run has it, ``step_tokens / (rows x seq)``
packed micro-batches from a plan over the mix's ``pool`` documents
(`megapack.bench.modes.plan_step`), laid out in every mode of `megapack.bench.modes` (packed,
padded to seq, length-grouped with the step sorted once and packing's token budget, the ceiling of
one document per row on packing's THD path, the weak "padded to the longest"); packed, grouped and
the ceiling run every micro-batch of the step, the two padded context baselines as many as packing
has. The modes are timed in turn, step by step (`megapack.bench.baselines.interleave`): warm-up
rounds, then ``steps`` timed rounds, each step one schedule call plus an SGD step between two
``torch.cuda.synchronize()``. `megapack.bench.baselines.summarize` reports each ratio's median
[min, max] and spread, the slot ratio, the executed-FLOP ideal, executed TFLOP/s, and MFU against
the device's bf16 peak (`megapack.bench.gpu.devices`), the fraction of the measured matmul beside it.

Length mixes (`length_mixes`): ``openchat`` samples the bundled OpenChat V1 lengths as they are
(capped at 2,048 tokens, so a 4,096 row holds two or more documents); ``sft-short`` is lognormal
with median 200 tokens and sigma 0.8 (mean ~275). The dry run scales both down with its sequence.

A deadline skips the configurations that would not finish in time, in the order run:
(4,096, openchat) first. `megapack.bench.gpu.targets` judges the targets on what was measured.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megapack.bench.baselines import interleave
from megapack.bench.gpu.compile_failure import compile_failure
from megapack.bench.gpu.model import GptShape
from megapack.bench.modes import (
    MODES,
    micro_batches,
    mode_cost,
    plan_step,
    schedule_shape,
    timed,
    timed_lengths,
)

MIXES = ("openchat", "sft-short")
SHORT_MEDIAN = 200
"""Median document length of the sft-short mix, in tokens (at ``scale`` 1)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ThroughputSizes:
    """How much the throughput section runs."""

    seq_lens: tuple[int, ...]
    """Row lengths, each a separate configuration, in the order run."""
    pool: int
    """Documents of each mix the plan is made over (a step is a window of it)."""
    step_tokens: int
    """Packing's token slots a step: ``step_tokens // (rows * seq_len)`` packed micro-batches."""
    documents: int
    """Documents the sync and graph sections take (the first of the OpenChat mix)."""
    rows: int
    """Micro-batch size: packed rows, or padded documents, per micro-batch."""
    warmup: int
    """Untimed rounds (every mode one step) before the timed ones."""
    steps: int
    """Timed rounds; each ratio's median, min and max over them are reported."""
    length_scale: float
    """Multiplies the mixes' lengths: 1.0 at real size, smaller for the dry run's short rows."""

    def micro_batches(self, seq_len: int) -> int:
        """Packed micro-batches a step at ``seq_len`` (at least 1): 12 at 4,096, 6 at 8,192 for
        ``step_tokens`` 98,304 and 2 rows."""
        return max(1, self.step_tokens // (self.rows * seq_len))


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
    """One row per (seq_len, mix, mode), in that order (the mixes of ``mixes``, in `MIXES`'
    order; the ``modes`` asked for); see the module docstring.

    Each row: ``config`` ("<mix>, seq <seq_len>"), ``seq_len``, ``mix``, ``mode``, of the mode's
    whole layout of the step ``slots``, ``tokens``, ``useful_flops``, ``executed_flops``,
    ``micro_batches``; of what each step ran ``timed_micro_batches``, ``timed_tokens``,
    ``timed_useful_flops``, ``timed_executed_flops``; the step's ``documents``, ``pool`` and
    packing's ``fill``; ``status`` ("ok", "error" or "skipped"), then ``step_times``, ``step_s``
    and ``tokens_per_s`` when ok, else ``detail``. A mode that fails (e.g. out of memory) is
    recorded and the others go on; one whose kernel cannot compile here is "skipped" with
    "cannot compile here: <reason>". ``deadline`` (a ``time.perf_counter()`` value) skips a
    configuration whose estimated time, from the seconds per token slot measured so far, would
    pass it.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megapack.core.buckets import BUCKET_FIELDS
    from megapack.harness.gpt import forward_step

    schedule = get_forward_backward_func()
    # the bucket plan travels with every packed batch, so the "bucketed" backend (and "auto"
    # without cudnn, which takes it only with a plan) runs with no host read
    step_fn = functools.partial(forward_step, topology, fields=BUCKET_FIELDS)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    device = topology.device
    out: list[dict[str, Any]] = []
    per_slot: list[float] = []  # seconds per token slot of every measured step
    measured: dict[tuple[str, str], tuple[int, int, float]] = {}  # (mix, mode): seq, slots, step s
    for seq_len in sizes.seq_lens:
        window = sizes.micro_batches(seq_len)
        for mix in (m for m in MIXES if m in mixes):  # a narrowed run gives fewer mixes
            step = plan_step(mixes[mix], seq_len, sizes.rows, window, seed=seed)
            rng = np.random.default_rng(seed)
            docs = [rng.integers(1, shape.vocab_size, n) for n in step.lengths]
            by_mode = {
                m: micro_batches(m, docs, seq_len, sizes.rows, packing=step.packing) for m in modes
            }
            ran = {m: timed(m, b, window) for m, b in by_mode.items()}
            rows = {
                m: _row(m, mix, seq_len, step, by_mode[m], ran[m], shape, sizes.rows, window)
                for m in modes
            }
            estimate = (
                1.5
                * (sizes.warmup + sizes.steps)
                * sum(
                    step_estimate(measured.get((mix, m)), seq_len, mode_cost(b).slots, per_slot)
                    for m, b in ran.items()
                )
            )
            if deadline is not None and time.perf_counter() + estimate > deadline:
                detail = f"deadline: needs ~{estimate:.0f} s"
                out += [r | {"status": "skipped", "detail": detail} for r in rows.values()]
                continue
            skips: dict[str, str] = {}

            def failed(mode: str, exc: Exception, skips: dict[str, str] = skips) -> None:
                why = compile_failure(exc)
                if why is not None:
                    skips[mode] = why
                optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()

            runs = {
                m: functools.partial(
                    train_step, schedule, step_fn, model, optimizer, batches, device
                )
                for m, batches in ran.items()
            }
            times, errors = interleave(
                runs, warmup=sizes.warmup, steps=sizes.steps, on_error=failed
            )
            for mode, row in rows.items():
                if mode in skips:
                    out.append(row | {"status": "skipped", "detail": skips[mode]})
                elif mode in errors:
                    out.append(row | {"status": "error", "detail": errors[mode]})
                else:
                    step_s = statistics.median(times[mode])
                    slots = mode_cost(ran[mode]).slots
                    per_slot.append(step_s / slots)
                    measured[(mix, mode)] = (seq_len, slots, step_s)
                    out.append(
                        row
                        | {
                            "status": "ok",
                            "step_times": times[mode],
                            "step_s": step_s,
                            "tokens_per_s": row["timed_tokens"] / step_s,
                        }
                    )
    optimizer.zero_grad(set_to_none=True)
    return out


def _row(
    mode: str,
    mix: str,
    seq_len: int,
    step: Any,
    batches: list[Any],
    ran: list[Any],
    shape: GptShape,
    rows: int,
    window: int,
) -> dict[str, Any]:
    lengths = timed_lengths(mode, step.lengths, rows, window)
    return {
        "config": f"{mix}, seq {seq_len}",
        "seq_len": seq_len,
        "mix": mix,
        "mode": mode,
        "slots": mode_cost(batches).slots,
        "tokens": sum(step.lengths),
        "useful_flops": shape.training_flops(step.lengths),
        "executed_flops": mode_cost(batches).executed_flops(shape),
        "micro_batches": len(batches),
        "timed_micro_batches": len(ran),
        "timed_tokens": sum(lengths),
        "timed_useful_flops": shape.training_flops(lengths),
        "timed_executed_flops": mode_cost(ran).executed_flops(shape),
        "documents": len(step.lengths),
        "pool": step.pool_size,
        "fill": step.fill(seq_len),
    }


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


def train_step(
    schedule: Any,
    step_fn: Any,
    model: Any,
    optimizer: torch.optim.Optimizer,
    batches: list[Any],
    device: torch.device,
) -> float:
    """Seconds of one training step: the schedule over ``batches`` (its shapes from the first,
    `megapack.bench.modes.schedule_shape`; megatron-core reads every micro-batch's own with
    ``variable_seq_lengths``), then SGD, between two device synchronizations."""
    size, width = schedule_shape(batches[0])
    _synchronize(device)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    schedule(
        forward_step_func=step_fn,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=width,
        micro_batch_size=size,
        forward_only=False,
    )
    optimizer.step()
    _synchronize(device)
    return time.perf_counter() - start


def time_steps(
    schedule: Any,
    step_fn: Any,
    model: Any,
    optimizer: torch.optim.Optimizer,
    batches: list[Any],
    device: torch.device,
    *,
    warmup: int,
    steps: int,
) -> list[float]:
    """Seconds of each of ``steps`` `train_step` calls after ``warmup`` untimed ones (one mode)."""
    times = [
        train_step(schedule, step_fn, model, optimizer, batches, device)
        for _ in range(warmup + steps)
    ]
    return times[warmup:]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
