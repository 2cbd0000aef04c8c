"""Middle pipeline stages without a data iterator, under megatron-core's real schedules (issue 46).

Megatron-LM's ``is_dataset_built_on_rank`` builds no dataset on middle stages for plain
pretraining, and ported scripts keep that. With packed batches the middle stages then get no
``cu_seqlens``: their attention runs causal over the whole row, across documents, silently (the
losses drift by ~1e-2, the run exits 0). `megapack.lockstep_steps`' first-step agreement, which
every stage joins, must refuse that on every rank before step 0, naming the middle stage, its
global rank and the fix; unpacked (plain pretraining) data with middle stages that read nothing
must go on training exactly as if every stage read, with no error and no warning.

Each task trains 2 steps of the tiny GPT (`megapack.harness.gpt.TinyGPT`, the same weights on
every grid: `init_weights`) with the README's wiring (a `PackedDataset` with loss fields,
``fields=megapack.LOSS_FIELDS``, `lockstep_steps` around ``get_forward_backward_func()``, an SGD
step after each), at tp 1 x pp 3, tp 1 x pp 4, and tp 1 x pp 2 with 2 virtual chunks under the
interleaved schedule (its middle chunks: chunk 1 of pipeline rank 0, chunk 0 of rank 1).
"""

from __future__ import annotations

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
from megapack.harness.gpt import TinyGPT, forward_step, init_weights, micro_batch_losses
from megapack.harness.grid import grid_topology

pytestmark = pytest.mark.distributed

S = 32  # tokens a row
R = 2  # rows a micro-batch: a packed micro-batch is one [1, R x S] row
M = 2  # the schedule's num_microbatches
STEPS = 2
TIMEOUT = 10.0
DEADLINE = 120.0


class Records(logging.Handler):
    """The megapack log records of this rank, at every level (a handler inside a pool task)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> Records:
        self._logger = logging.getLogger("megapack")
        self._level = self._logger.level
        self._logger.setLevel(logging.DEBUG)
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)

    def lines(self, level: int = logging.WARNING) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


def packed_documents() -> list[Document]:
    """Documents of 3-13 tokens: several share each row of S, so attention must stop at each."""
    rng = np.random.default_rng(46)
    lengths = rng.integers(3, 14, 60)
    return [Document(tokens=rng.integers(1, 127, n), loss_mask=np.ones(n, np.float32))
            for n in lengths]  # fmt: skip


def plain_batches(count: int) -> Iterator[dict[str, torch.Tensor]]:
    """Megatron's plain pretraining micro-batches, [R, S] without attention_mask or cu_seqlens."""
    gen = torch.Generator().manual_seed(46)
    for _ in range(count):
        tokens = torch.randint(1, 127, (R, S), generator=gen)
        yield {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1),
               "loss_mask": torch.ones(R, S), "position_ids": torch.arange(S).repeat(R, 1)}  # fmt: skip


def chunk_stage(vp_stage: int | None) -> str:
    """The stage ("first", "middle", "last" or "only") of this rank's chunk ``vp_stage``."""
    topo = megapack.Topology.from_parallel_state(vp_stage=vp_stage)
    return topo.stage.value


def train(
    pp: int, vp: int | None, data: str, middle: str, packed: bool | None = None
) -> dict[str, Any]:
    """``STEPS`` training steps at tp 1 x ``pp`` (x ``vp`` chunks); ``middle`` "read" or "none"
    (the middle stages' TP sources pass None); ``data`` "packed" or "plain"; ``packed`` is passed
    to lockstep_steps and get_batch. Returns this rank's outcome."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack.harness.megatron_cpu import megatron_on_cpu

    megatron_on_cpu()
    ps.initialize_model_parallel(1, pp, virtual_pipeline_model_parallel_size=vp)
    model_parallel_cuda_manual_seed(1234)
    gpt = TinyGPT(num_layers=12, max_sequence_length=R * S)  # divides by 3, 4 and 2 x 2
    chunks = list(range(vp)) if vp else [None]
    models = [gpt.build(vp_stage=k) for k in chunks]
    for model in models:
        init_weights(model, seed=7)
        model.config.virtual_pipeline_model_parallel_size = vp
    fields = megapack.LOSS_FIELDS if data == "packed" else ()
    options: dict[str, Any] = {"fields": fields, "packed": packed}

    def source(k: int | None) -> Iterator[Any] | None:
        if middle == "none" and chunk_stage(k) == "middle":
            return None  # Megatron-LM's is_dataset_built_on_rank for plain pretraining
        if data == "plain":
            return plain_batches(M * STEPS)
        ds = PackedDataset(packed_documents(), S, rows_per_micro_batch=R, micro_batches=M,
                           loss_fields=True)  # fmt: skip
        return ds.iterate()

    iterators = [source(k) for k in chunks]

    def step(data_iterator: Any, model: Any) -> Any:
        topo = megapack.Topology.from_parallel_state(vp_stage=model.vp_stage if vp else None)
        return forward_step(topo, data_iterator, model, fields=fields)

    schedule = functools.partial(
        get_forward_backward_func(), forward_step_func=step, model=models, num_microbatches=M,
        seq_length=R * S if data == "packed" else S, micro_batch_size=1 if data == "packed" else R,
    )  # fmt: skip
    optimizer = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.5)
    losses: list[float] = []
    start, kind, message, steps = time.perf_counter(), "ok", "", 0
    with Records() as logs:
        try:
            loop = megapack.lockstep_steps(
                iterators if vp else iterators[0], micro_batches=M, timeout=TIMEOUT,
                seq_length=R * S if data == "packed" else S,
                micro_batch_size=1 if data == "packed" else R, **options,
            )  # fmt: skip
            for _, step_iterator in zip(range(STEPS), loop, strict=False):
                optimizer.zero_grad()
                reports = schedule(data_iterator=step_iterator)
                optimizer.step()
                if reports:
                    losses.append(float(np.mean(micro_batch_losses(reports))))
                steps += 1
        except Exception as exc:
            kind, message = type(exc).__name__, str(exc)
    dist.barrier()
    return {"rank": dist.get_rank(), "kind": kind, "message": message, "steps": steps,
            "losses": losses, "seconds": time.perf_counter() - start,
            "logged": logs.lines()}  # fmt: skip


def last_losses(results: list[dict[str, Any]]) -> list[float]:
    (losses,) = [r["losses"] for r in results if r["losses"]]
    return losses


# (pp, vp, the middle stages' global ranks with their places) of each pipeline depth
GRIDS = [
    (3, None, "rank 1 (pp_rank 1 of 3: data_iterator=None) is the TP source of a middle pipeline stage"),
    (4, None, "ranks 1 (pp_rank 1 of 4: data_iterator=None) and 2 (pp_rank 2 of 4: "
              "data_iterator=None) are TP sources of middle pipeline stages"),
    (2, 2, "ranks 0 (pp_rank 0 of 2, virtual chunk 1: data_iterator[1]=None) and 1 (pp_rank 1 of "
           "2, virtual chunk 0: data_iterator[0]=None) are TP sources of middle pipeline stages"),
]  # fmt: skip
IDS = ["tp1-pp3", "tp1-pp4", "tp1-pp2-vp2"]


@pytest.mark.parametrize("packed", [None, True], ids=["packed-None", "packed-True"])
@pytest.mark.parametrize(("pp", "vp", "who"), GRIDS, ids=IDS)
def test_middle_stages_without_data_refuse_packed_batches_on_every_rank(
    dist_pool: Any, pp: int, vp: int | None, who: str, packed: bool | None
) -> None:
    # Before: every rank trained, exit 0, no warning, the losses off by ~1e-2 (tp1-pp4: 4.8711,
    # 4.8605 where every stage reading gives 4.8801, 4.8784); with packed=True get_batch raised
    # inside the schedule on the middle stage, the others died on a closed connection. Now: the
    # same error everywhere, before step 0 (no rank enters the schedule, none waits).
    results = dist_pool.run(train, pp, pp, vp, "packed", "none", packed, timeout=DEADLINE)
    want = (
        f"lockstep_steps: {who} without data, but the batches are packed (rank 0 read packed "
        "micro-batches at step 0): a middle stage without data gets no cu_seqlens, so its "
        "attention would run across documents. For packed data build the dataset on TP rank 0 "
        "of every pipeline stage (Megatron-LM: is_dataset_built_on_rank must return True on "
        "middle stages too, e.g. is_dataset_built_on_rank(vp_stage, is_packed_sequence=True)) "
        "and pass its iterator there, as on the first and last stages"
    )
    for r in results:
        assert (r["kind"], r["message"], r["steps"], r["losses"]) == ("ValueError", want, 0, []), r
        assert r["seconds"] < TIMEOUT, r  # at the first step's agreement, not a timeout


@pytest.mark.parametrize(("pp", "vp", "who"), GRIDS, ids=IDS)
def test_middle_stages_without_data_train_unpacked_batches_as_if_they_read(
    dist_pool: Any, pp: int, vp: int | None, who: str
) -> None:
    # Megatron-LM's plain pretraining: middle stages need no batch fields, so they build no
    # dataset; that keeps training, bit for bit as with every stage reading, without a warning.
    read = dist_pool.run(train, pp, pp, vp, "plain", "read", timeout=DEADLINE)
    none = dist_pool.run(train, pp, pp, vp, "plain", "none", timeout=DEADLINE)
    for r in read + none:
        assert (r["kind"], r["steps"], r["logged"]) == ("ok", STEPS, []), r
    assert last_losses(none) == last_losses(read)
    assert len(last_losses(read)) == STEPS


def run_get_batch_alone(tp: int, packed: bool | None) -> list[str]:
    """tp x pp 3 without lockstep_steps, plain pretraining batches: the middle stage's TP source
    passes None; 3 calls."""
    topo = grid_topology(tp, 3)
    data = plain_batches(3) if topo.is_source and topo.stage.value != "middle" else None
    with Records() as logs:
        for _ in range(3):
            megapack.get_batch_on_this_tp_rank(data, topology=topo, packed=packed, timeout=TIMEOUT)
    dist.barrier()
    return logs.lines()


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1-pp3", "tp2-pp3"])
def test_get_batch_alone_warns_once_per_middle_tp_group(dist_pool: Any, tp: int) -> None:
    # Without lockstep_steps a middle stage cannot see what the others read: its TP source
    # warns once per TP group (not per call, not on its peers); packed=False says "unpacked".
    results = dist_pool.run(run_get_batch_alone, 3 * tp, tp, None, timeout=60)
    source = tp  # Megatron's rank order: TP ranks of a stage are contiguous
    want = (
        f"megapack: get_batch_on_this_tp_rank: data_iterator is None on TP source rank {source} "
        "of a middle pipeline stage (pp_rank 1 of 3), so this stage gets no cu_seqlens. Right "
        "for plain pretraining data; but if the other stages' batches are packed, this stage's "
        "attention runs across documents, and that cannot be seen from here. Packed data: build "
        "the dataset on TP rank 0 of every pipeline stage (Megatron-LM: "
        "is_dataset_built_on_rank(vp_stage, is_packed_sequence=True)) and pass its iterator. "
        "Unpacked data: pass packed=False to say so (this warning goes); megapack.lockstep_steps "
        "checks it across the stages"
    )
    assert results == [[want] if rank == source else [] for rank in range(3 * tp)]
    assert dist_pool.run(run_get_batch_alone, 3 * tp, tp, False, timeout=60) == [[]] * (3 * tp)
