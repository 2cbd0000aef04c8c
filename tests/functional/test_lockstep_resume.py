"""A checkpoint saved anywhere in a `megapack.lockstep_steps` loop resumes bit-exactly (issue 46).

`lockstep_steps` reads a whole step ahead, so the dataset iterator's own state taken inside the
loop counted a step the schedule had not run, and a resume skipped it silently. The lockstep's
``state_dict()`` is the position of the first micro-batch the schedule has not taken. Here,
under megatron-core's real schedule at tp 1 x pp 2 with DP 1 and 2 (the tiny GPT, fixed
weights, ``forward_only``), with prefetch depth none, 1 and 2, a 3-step loop
``zip(steps, range(3))`` (its last ``next`` reads step 3 ahead and drops it) saves global rank
0's lockstep state at every position: before the loop, before and after each step's schedule,
after the loop. Each state is loaded into fresh iterators on every TP source (every DP rank and
stage: rank 0's state), and the resumed run must hand the schedule bit for bit the micro-batches
of the uninterrupted run from there, with the same losses.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megapack
from megapack.data import Document, PackedDataset
from megapack.harness.gpt import TinyGPT, init_weights, micro_batch_losses
from megapack.megatron.loss import normalized_loss

pytestmark = pytest.mark.distributed

S = 16  # a row's tokens; one row a micro-batch
M = 2  # micro-batches a step
STEPS = 5  # steps of data per DP rank
TIMEOUT = 10.0
DEPTHS = (0, 1, 2)  # 0: no prefetch
POSITIONS = ["start", "before 0", "after 0", "before 1", "after 1", "before 2", "after 2", "end"]
TAKEN = {"start": 0, "before 0": 0, "after 0": 1, "before 1": 1, "after 1": 2, "before 2": 2,
         "after 2": 3, "end": 3}  # fmt: skip
"""Steps the schedule ran at each position."""


def documents(count: int) -> list[Document]:
    """Documents of 3-12 tokens: rows hold several, so cu_seqlens differ row to row."""
    rng = np.random.default_rng(46)
    return [Document(tokens=rng.integers(1, 127, n), loss_mask=np.ones(n, np.float32))
            for n in rng.integers(3, 13, count)]  # fmt: skip


def digest(batch: dict[str, Any]) -> str:
    """The bytes of what this stage's schedule got: every tensor field, in key order."""
    h = hashlib.blake2b(digest_size=12)
    for key in sorted(batch):
        value = batch[key]
        if isinstance(value, torch.Tensor):
            h.update(key.encode() + value.numpy().tobytes())
    return h.hexdigest()


class Loop:
    """This rank's wiring: a fresh iterator (a state loaded first), behind prefetch(depth) unless
    0, `lockstep_steps` over it, and the schedule; records what each forward step received."""

    def __init__(self, depth: int, state: Any, models: list[Any]) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.topo = megapack.Topology.from_parallel_state()
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        ds = PackedDataset(documents(40 * dp_size), S, dp_rank=dp_rank, dp_size=dp_size,
                           micro_batches=M)  # fmt: skip
        self.iterator = ds.iterate() if self.topo.is_source else None
        if self.iterator is not None and state is not None:
            self.iterator.load_state_dict(state)  # the documented way: before prefetch/lockstep
        self.prefetcher = (
            megapack.prefetch(self.iterator, topology=self.topo, depth=depth, timeout=TIMEOUT,
                              nice=0) if depth else None
        )  # fmt: skip
        self.got: list[str] = []
        self.schedule = functools.partial(
            get_forward_backward_func(), forward_step_func=self._forward, model=models,
            num_microbatches=M, seq_length=S, micro_batch_size=1, forward_only=True,
        )  # fmt: skip
        self.steps = megapack.lockstep_steps(self.prefetcher or self.iterator, micro_batches=M,
                                             timeout=TIMEOUT)  # fmt: skip

    def _forward(self, data_iterator: Any, model: Any) -> Any:
        if self.prefetcher is not None:
            batch = next(data_iterator)
        else:
            batch = megapack.get_batch_on_this_tp_rank(data_iterator, topology=self.topo,
                                                       timeout=TIMEOUT)  # fmt: skip
        self.got.append(digest(batch))
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                       labels=batch["labels"], packed_seq_params=batch["packed_seq_params"])  # fmt: skip
        return output, functools.partial(normalized_loss, batch, mode="micro_batch_mean",
                                         calculate_per_token_loss=False)  # fmt: skip

    def run_to_the_end(self) -> list[float]:
        losses = [x for step_iterator in self.steps for x in self.run(step_iterator)]
        self.close()
        return losses

    def run(self, step_iterator: Any) -> list[float]:
        return micro_batch_losses(self.schedule(data_iterator=step_iterator))

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()


def resume_matrix(dp: int) -> dict[str, Any]:
    """Every depth and position on this rank of tp 1 x pp 2 x ``dp``: each resumed run against
    the uninterrupted one."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack.harness.megatron_cpu import megatron_on_cpu

    megatron_on_cpu()
    ps.initialize_model_parallel(1, 2)
    model_parallel_cuda_manual_seed(1234)
    model = TinyGPT(num_layers=2, max_sequence_length=S).build()
    init_weights(model, seed=3)
    cases, own = [], []
    for depth in DEPTHS:
        whole = Loop(depth, None, [model])
        losses = whole.run_to_the_end()
        saved = _saved_states(depth, [model])
        own.append(saved.pop("iterator at the end"))
        for where in POSITIONS:
            resumed = Loop(depth, saved[where], [model])
            got_losses = resumed.run_to_the_end()
            k = TAKEN[where] * M  # micro-batches the schedule took before the save
            cases.append({"depth": depth, "where": where, "left": len(whole.got) - k,
                          "batches": resumed.got == whole.got[k:],
                          "losses": got_losses == losses[len(losses) and k:],
                          "loss_count": len(got_losses),
                          "index": saved[where]["iterators"][0]["index"]})  # fmt: skip
    dist.barrier()
    return {"rank": dist.get_rank(), "cases": cases, "own": own}


def _saved_states(depth: int, models: list[Any]) -> dict[str, Any]:
    """Global rank 0's lockstep state at every position of a 3-step loop, on every rank (and
    rank 0's iterator's own state at the end, what the issue saved)."""
    loop = Loop(depth, None, models)
    saved = {"start": loop.steps.state_dict()}
    # zip(steps, range(3)): its last next() reads step 3 ahead, then drops it
    for step_iterator, n in zip(loop.steps, range(3), strict=False):
        saved[f"before {n}"] = loop.steps.state_dict()
        loop.run(step_iterator)
        saved[f"after {n}"] = loop.steps.state_dict()
    saved["end"] = loop.steps.state_dict()
    saved["iterator at the end"] = loop.iterator.state_dict()["index"] if loop.iterator else None
    loop.close()
    box = [saved]
    dist.broadcast_object_list(box, src=0)  # as a checkpoint written by global rank 0
    return box[0]


@pytest.mark.parametrize("dp", [1, 2], ids=["dp1", "dp2"])
def test_lockstep_state_saved_anywhere_resumes_bit_exactly(dist_pool: Any, dp: int) -> None:
    results = dist_pool.run(resume_matrix, 2 * dp, dp, timeout=300)
    assert [len(r["cases"]) for r in results] == [len(DEPTHS) * len(POSITIONS)] * (2 * dp)
    for r in results:
        for case in r["cases"]:
            assert case["batches"] and case["losses"], (r["rank"], case)
            assert case["index"] == TAKEN[case["where"]] * M, case  # micro-batches trained
            assert case["left"] >= (STEPS - 3) * M, case  # the resumed run has steps to compare
    last = [c for r in results for c in r["cases"] if c["loss_count"]]  # the last stage's
    assert len(last) == len(DEPTHS) * len(POSITIONS) * dp
    # what the issue saved: the iterator's own state at the end counts step 3, read ahead, and
    # the batches prefetched ahead (8 + depth, where 6 were trained)
    assert results[0]["own"] == [4 * M + depth for depth in DEPTHS]
