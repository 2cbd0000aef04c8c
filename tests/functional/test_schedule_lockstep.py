"""`megapack.lockstep_steps` under megatron-core's real schedules on CPU gloo (issue 40).

Each task builds the tiny GPT on a grid (`megapack.harness.gpt.TinyGPT`, megatron-core's
``GPTModel``) and runs `megapack.lockstep_steps` around ``get_forward_backward_func()``: 1F1B at
tp 2 x pp 2 and tp 1 x pp 4, the interleaved schedule at tp 1 x pp 2 with 2 virtual chunks, and
tp 1 x pp 2 x dp 2; training and ``forward_only`` evaluation; the README's wiring (a
`PackedDataset` iterated on the TP source of every stage, `get_batch_on_this_tp_rank` in the
forward step) and `megapack.prefetch`. Faults: the data ends at a step boundary or mid-step, a TP
source's iterator raises mid-step (on the first or on a middle stage), a bad batch (read ahead
and checked by lockstep_steps, or through prefetch), DP ranks with different numbers of steps. Every rank must end the same way: the same
number of steps, then the loop's end (StopIteration) everywhere, or the source's own error there
and `RemoteDataError` naming it on every other rank, within megapack's timeout.

Without the wrapper (``run_cases(..., wrap=False)``: the schedule reads the iterator directly, as
the quickstart used to) the data-end and source-error cases hang: stage 0 leaves the schedule while
later stages wait for activations. That was checked by hand (not here: each hang costs the pool's
deadline and a restart). Here a regression shows as a failure at the deadline, never a hung suite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megapack
from megapack.data import Document, PackedDataset
from megapack.harness.gpt import TinyGPT, forward_step
from megapack.megatron.loss import normalized_loss

pytestmark = pytest.mark.distributed

S = 16  # tokens a row; one document a row, one row a micro-batch
M = 2  # the schedule's num_microbatches
TIMEOUT = 10.0  # megapack's collective timeout in these runs
DEADLINE = 120.0  # the pool's wall clock per task: a hang fails the test, the suite goes on


@dataclasses.dataclass(frozen=True)
class Case:
    """One run of a loop: what the sources hold and how the loop ends."""

    name: str
    data: str
    """"end": 3 whole steps; "partial": 5 micro-batches; "uneven": DP rank 0 3 steps, others 2;
    "error": an OSError at item ``at`` on rank ``fail``; "bad": a bad batch there;
    "schedule": 3 whole steps, but lockstep_steps told a schedule seq_length of 2 rows."""
    forward_only: bool = False
    fail: int = 0
    at: int = 3  # item 3 is step 1's second micro-batch


def documents(count: int, seed: int) -> list[Document]:
    """``count`` documents of exactly S tokens: each fills one row, so one micro-batch."""
    rng = np.random.default_rng(seed)
    return [
        Document(tokens=rng.integers(1, 127, S), loss_mask=np.ones(S, dtype=np.float32))
        for _ in range(count)
    ]


def failing(items: Iterator[Any], at: int, kind: str) -> Iterator[Any]:
    """``items``, with an OSError (kind "error") or a batch of broken cu_seqlens ("bad") at ``at``."""
    for i, item in enumerate(items):
        if i == at and kind == "error":
            raise OSError(f"shard on rank {dist.get_rank()} is unreadable at item {i}")
        if i == at:
            item = dataclasses.replace(
                item, cu_seqlens=torch.tensor([0, 9, 4, S], dtype=torch.int32)
            )
        yield item


def source_data(case: Case, dp_rank: int, dp_size: int) -> tuple[Iterator[Any], Any]:
    """(this TP source's iterator, the dataset behind it) for ``case``."""
    if (
        case.data == "partial"
    ):  # built for 1 micro-batch a step, 5 of them: the third step is partial
        ds = PackedDataset(documents(5, 0), S)
        return ds.iterate(), ds
    if case.data == "uneven":  # each DP rank its own evaluation set (prime-rl), of 3 or 2 steps
        ds = PackedDataset(documents(M * (3 if dp_rank == 0 else 2), dp_rank), S, micro_batches=M)
        return ds.iterate(), ds
    ds = PackedDataset(
        documents(3 * M * dp_size, 0), S, dp_rank=dp_rank, dp_size=dp_size, micro_batches=M
    )
    if case.data in ("error", "bad") and dist.get_rank() == case.fail:
        return failing(ds.iterate(), case.at, case.data), ds
    return ds.iterate(), ds


@contextlib.contextmanager
def logged() -> Iterator[list[logging.LogRecord]]:
    """This rank's megapack log records, INFO and above (a handler on the "megapack" logger)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("megapack")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def prefetched_step(topology: Any, data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    """A forward step fed by `megapack.prefetch`: the batch is already delivered."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], packed_seq_params=batch["packed_seq_params"])  # fmt: skip
    return output, functools.partial(normalized_loss, batch, mode="micro_batch_mean",
                                     calculate_per_token_loss=False)  # fmt: skip


def chunk_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    """The forward step of one model chunk (virtual pipelining): its own stage's topology."""
    topology = megapack.Topology.from_parallel_state(vp_stage=model.vp_stage)
    return forward_step(topology, data_iterator, model)


def run_cases(
    tp: int, pp: int, vp: int | None, cases: list[Case], prefetch: bool = False, wrap: bool = True
) -> list[dict[str, Any]]:
    """Every case on this rank, one after another, on one model; each case's outcome."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack.harness.megatron_cpu import megatron_on_cpu

    megatron_on_cpu()
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp)
    model_parallel_cuda_manual_seed(1234)
    gpt = TinyGPT(num_layers=4, max_sequence_length=S)
    models = [gpt.build(vp_stage=k) for k in range(vp)] if vp else [gpt.build()]
    for model in models:  # TinyGPT's config leaves it unset; the interleaved schedule reads it
        model.config.virtual_pipeline_model_parallel_size = vp
    results = [_run_case(case, models, vp, prefetch, wrap) for case in cases]
    try:
        dist.barrier()  # leave together (CONTRIBUTING.md)
    except RuntimeError as exc:  # a rank still in a schedule: say how every case ended here
        raise RuntimeError(f"rank {dist.get_rank()} left its cases as {results}") from exc
    return results


def _run_case(
    case: Case, models: list[Any], vp: int | None, prefetch: bool, wrap: bool
) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    topo = megapack.Topology.from_parallel_state(vp_stage=0 if vp else None)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    read = [source_data(case, dp_rank, dp_size) for _ in range(vp or 1)] if topo.is_source else []
    chunks = [it for it, _ in read] or [None] * (vp or 1)
    ahead = (
        [megapack.prefetch(it, topology=topo, depth=2, timeout=TIMEOUT) for it in chunks]
        if prefetch
        else []
    )
    data = ahead or chunks
    step = functools.partial(prefetched_step if prefetch else forward_step, topo)
    schedule = functools.partial(
        get_forward_backward_func(), forward_step_func=chunk_step if vp else step, model=models,
        num_microbatches=M, seq_length=S, micro_batch_size=1, forward_only=case.forward_only,
    )  # fmt: skip
    done, start = 0, time.perf_counter()
    with logged() as caught:
        try:
            if wrap:
                dataset = read[0][1] if read else None  # behind failing(): not found alone
                seq_length = 2 * S if case.data == "schedule" else S  # the schedule's: S
                loop = megapack.lockstep_steps(
                    data if vp else data[0], micro_batches=M, timeout=TIMEOUT, dataset=dataset,
                    seq_length=seq_length, micro_batch_size=1,
                )  # fmt: skip
                for step_iterator in loop:
                    schedule(data_iterator=step_iterator)
                    done += 1
            else:  # the old wiring: the schedule reads the source's iterator itself
                while True:
                    schedule(data_iterator=data if vp else data[0])
                    done += 1
            kind, message = "StopIteration", ""
        except StopIteration:
            kind, message = "StopIteration", ""
        except Exception as exc:
            kind, message = type(exc).__name__, str(exc)
        finally:
            for p in ahead:
                p.close()
    warned = [r.getMessage() for r in caught if r.levelno >= logging.WARNING]
    return {"rank": dist.get_rank(), "source": topo.is_source, "dp_rank": dp_rank,
            "kind": kind, "message": message, "steps": done, "seconds": time.perf_counter() - start,
            "warnings": [w for w in warned if "lockstep_steps" in w and "stopped at" not in w],
            "ended": [(r.levelname, r.getMessage()) for r in caught
                      if "lockstep_steps stopped at" in r.getMessage()]}  # fmt: skip


# ------------------------------------------------------------------ what every rank must see


def expect(case: Case, outcomes: list[dict[str, Any]], *, steps: int) -> None:
    """Every rank ran ``steps`` steps and ended as ``case`` says, within the timeout."""
    where = case.name
    assert [o["steps"] for o in outcomes] == [steps] * len(outcomes), (where, outcomes)
    for o in outcomes:
        assert o["seconds"] < steps * 20 + TIMEOUT + 5, (where, o)
        if case.data == "schedule":  # named before any p2p, on every rank
            want = f"pass seq_length={S}, micro_batch_size=1 to the schedule"
            assert o["kind"] == ("ValueError" if o["source"] else "RemoteDataError"), (where, o)
            assert want in o["message"] and f"seq_length={2 * S}" in o["message"], (where, o)
        elif case.data in ("error", "bad"):
            if o["rank"] == case.fail:
                own = "OSError" if case.data == "error" else "ValueError"
                assert o["kind"] == own, (where, o)
            else:
                assert o["kind"] == "RemoteDataError", (where, o)
                # a TP peer behind prefetch relays prefetch's own error (no step in it)
                assert o["message"].startswith(f"TP source rank {case.fail} failed"), o
                assert "failed at this step" not in o["message"], o  # a relay is no failure
                assert ("unreadable at item 3" if case.data == "error" else "cu_seqlens") in o[
                    "message"
                ], o
        else:
            assert (o["kind"], o["message"]) == ("StopIteration", ""), (where, o)


def warned(outcome: dict[str, Any], text: str) -> bool:
    return any(text in w for w in outcome["warnings"])


TRAINED = S - 1  # trained tokens a micro-batch: one document of S tokens, its last has no label


def expect_end_line(case: Case, outcomes: list[dict[str, Any]], *, steps: int, dp: int = 1) -> None:
    """Global rank 0 alone logged one line: the step, the rank and why, the steps and trained
    tokens handed to the schedule across the job (every DP rank's)."""
    assert [o["ended"] for o in outcomes[1:]] == [[]] * (len(outcomes) - 1), outcomes
    ((level, line),) = outcomes[0]["ended"]
    trained = f"trained {steps} step{'' if steps == 1 else 's'} and {steps * M * TRAINED * dp} trained tokens (loss_mask non-zero) handed to the schedule across the job"  # fmt: skip
    if case.data in ("error", "bad"):
        head = f"megapack: lockstep_steps stopped at step {steps}: rank {case.fail} failed: "
        assert level == "ERROR" and line.startswith(head) and line.endswith("; " + trained), line
        assert ("unreadable at item 3" if case.data == "error" else "cu_seqlens") in line, line
    elif case.data == "partial":
        assert (level, line) == ("WARNING", f"megapack: lockstep_steps stopped at step {steps}: the data on rank 0 ended after 1 of its {M} micro-batches (the partial step is not run); {trained}"), line  # fmt: skip
    else:
        assert level == "INFO" and line.startswith(f"megapack: lockstep_steps stopped at step {steps}: the data on rank ") and line.endswith(f" ended at the step boundary; {trained}"), line  # fmt: skip


TRAIN_END = Case("train-end", "end")
TRAIN_ERROR = Case("train-error", "error")
EVAL_PARTIAL = Case("eval-partial", "partial", forward_only=True)
EVAL_ERROR = Case("eval-error", "error", forward_only=True)


def check_common(cases: list[Case], results: list[list[dict[str, Any]]]) -> None:
    for i, case in enumerate(cases):
        outcomes = [r[i] for r in results]
        if case.data == "end":
            expect(case, outcomes, steps=3)
            assert not any(o["warnings"] for o in outcomes), outcomes
            expect_end_line(case, outcomes, steps=3)
        elif case.data in ("error", "bad"):
            expect(case, outcomes, steps=1)
            expect_end_line(case, outcomes, steps=1)
        elif case.data == "schedule":
            expect(case, outcomes, steps=0)
        elif case.data == "partial":
            expect(case, outcomes, steps=2)
            expect_end_line(case, outcomes, steps=2)
            for o in outcomes:  # the sources say what was left, and that the dataset is built for 1
                assert warned(o, "ended after 1 of step 2's 2 micro-batches") == o["source"], o
                assert warned(o, "built for micro_batches=1 a step") == o["source"], o


@pytest.mark.parametrize(
    ("tp", "pp", "cases"),
    [(2, 2, [TRAIN_END, TRAIN_ERROR, EVAL_PARTIAL, EVAL_ERROR, Case("schedule", "schedule")]),
     (1, 4, [Case("eval-end", "end", forward_only=True), TRAIN_ERROR,
             Case("train-error-middle", "error", fail=2), EVAL_PARTIAL,
             Case("train-bad-middle", "bad", fail=2)])],
    ids=["tp2-pp2", "tp1-pp4"],
)  # fmt: skip
def test_schedule_lockstep_1f1b_ends_every_rank_alike(
    dist_pool: Any, tp: int, pp: int, cases: list[Case]
) -> None:
    check_common(cases, dist_pool.run(run_cases, tp * pp, tp, pp, None, cases, timeout=DEADLINE))


def test_schedule_lockstep_interleaved_ends_every_rank_alike(dist_pool: Any) -> None:
    # megatron-core's interleaved 1F1B on CPU: tp 1 x pp 2, 2 model chunks a stage, a data
    # iterator per chunk (each read a whole step ahead)
    cases = [TRAIN_END, TRAIN_ERROR, Case("eval-error-chunks", "error", forward_only=True, fail=1)]
    check_common(cases, dist_pool.run(run_cases, 2, 1, 2, 2, cases, timeout=DEADLINE))


def test_schedule_lockstep_uneven_dp_sources(dist_pool: Any) -> None:
    # tp 1 x pp 2 x dp 2: DP rank 0's evaluation set holds 3 steps, DP rank 1's 2 (prime-rl #2636)
    cases = [Case("train-uneven", "uneven"), Case("eval-uneven", "uneven", forward_only=True),
             Case("train-error-dp1", "error", fail=3)]  # fmt: skip
    results = dist_pool.run(run_cases, 4, 1, 2, None, cases, timeout=DEADLINE)
    for i, case in enumerate(cases[:2]):
        outcomes = [r[i] for r in results]
        expect(case, outcomes, steps=2)
        for o in outcomes:  # ranks with a third step say they stop early
            assert warned(o, "still had step 2's data") == (o["dp_rank"] == 0), o
        expect_end_line(case, outcomes, steps=2, dp=2)
        assert "the data on rank 1 ended" in outcomes[0]["ended"][0][1]  # DP rank 1's source
    expect(cases[2], [r[2] for r in results], steps=1)
    expect_end_line(cases[2], [r[2] for r in results], steps=1, dp=2)


def test_schedule_lockstep_over_prefetch(dist_pool: Any) -> None:
    # tp 2 x pp 2, batches delivered ahead by megapack.prefetch on every TP rank: a bad batch is
    # found before the step too
    cases = [TRAIN_END, TRAIN_ERROR, Case("train-bad", "bad")]
    check_common(cases, dist_pool.run(run_cases, 4, 2, 2, None, cases, True, timeout=DEADLINE))
