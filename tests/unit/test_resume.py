"""Exact resume (issue 33): a run checkpointed at a random step, with batches prefetched ahead,
reproduces the next 1,000 micro-batches bit for bit, in both balance modes, and when the DP size
changes with the global batch kept (the same micro-batches in the same global positions)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import megapack
from megapack.data import Document, PackedDataset
from megapack.packing import CostModel

SEQ, ROWS, GLOBAL = 32, 2, 4  # row length, rows per micro-batch, micro-batches per global step
CPU = megapack.Topology.single(torch.device("cpu"))


def documents() -> list[Document]:
    rng = np.random.default_rng(33)
    return [
        Document(tokens=rng.integers(1, 500, n), loss_mask=np.ones(n))
        for n in rng.integers(1, 40, 60)
    ]


DOCS = documents()


def dataset(dp_rank: int, dp_size: int, balance: str) -> PackedDataset:
    cost = CostModel(a=1.0, b=1.0) if balance == "compute" else None
    return PackedDataset(DOCS, seq_len=SEQ, rows_per_micro_batch=ROWS, dp_rank=dp_rank, dp_size=dp_size,
                         micro_batches=GLOBAL // dp_size, balance=balance, cost=cost)  # fmt: skip


class Run:
    """``dp`` ranks training step by step, each through its iterator behind prefetch(``depth``)."""

    def __init__(self, dp: int, balance: str, depth: int, states: list[Any] | None = None) -> None:
        self.dp, self.micro = dp, GLOBAL // dp
        self.iterators = []
        for r in range(dp):
            it = dataset(r, dp, balance).iterate(repeat=True)
            if states is not None:
                it.load_state_dict(json.loads(json.dumps(states[r % len(states)])))  # as saved
            self.iterators.append(it)
        self.stack = contextlib.ExitStack()
        self.sources = [
            self.stack.enter_context(megapack.prefetch(it, topology=CPU, depth=depth))
            if depth else (megapack.get_batch_on_this_tp_rank(iter([b]), topology=CPU) for b in it)
            for it in self.iterators
        ]  # fmt: skip

    def steps(self, n: int) -> list[list[tuple[bytes, ...]]]:
        """``n`` global steps, each its micro-batches in global order (j -> rank j % dp)."""
        out = []
        for _ in range(n):
            taken = [[next(src) for _ in range(self.micro)] for src in self.sources]
            out.append([_bits(taken[j % self.dp][j // self.dp]) for j in range(GLOBAL)])
        return out

    def states(self) -> list[Any]:
        return [s.state_dict()["iterator"] if hasattr(s, "state_dict") else it.state_dict()
                for s, it in zip(self.sources, self.iterators, strict=True)]  # fmt: skip

    def close(self) -> None:
        self.stack.close()


def _bits(batch: dict[str, Any]) -> tuple[bytes, ...]:
    return tuple(
        batch[k].numpy().tobytes() for k in ("tokens", "labels", "loss_mask", "cu_seqlens")
    )


def uninterrupted(dp: int, balance: str, steps: int) -> list[list[tuple[bytes, ...]]]:
    run = Run(dp, balance, depth=0)
    return run.steps(steps)


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(
    checkpoint=st.integers(1, 60),
    depth=st.integers(0, 3),
    balance=st.sampled_from(["token", "compute"]),
    dps=st.sampled_from([(2, 2), (2, 1), (1, 2), (1, 1)]),
)
@example(checkpoint=7, depth=3, balance="compute", dps=(2, 1))
@example(checkpoint=23, depth=2, balance="token", dps=(1, 2))
def test_resume_reproduces_the_next_1000_micro_batches(
    checkpoint: int, depth: int, balance: str, dps: tuple[int, int]
) -> None:
    before, after = dps
    want = 1000 // GLOBAL  # global steps: 1,000 micro-batches
    run = Run(before, balance, depth)
    run.steps(checkpoint)
    states = run.states()
    run.close()  # batches fetched ahead are dropped: the states count the used ones
    resumed = Run(after, balance, depth, states=states)
    got = resumed.steps(want)
    resumed.close()
    reference = uninterrupted(before, balance, checkpoint + want)[checkpoint:]
    per_epoch = dataset(0, before, balance).padded_micro_batches // GLOBAL
    rest = per_epoch - checkpoint % per_epoch  # steps left in the checkpoint's epoch
    if balance == "token" or before == after:
        assert got == reference  # token plan: the same order for any DP size
    else:  # the checkpoint's epoch as planned; later epochs planned for the new DP size
        assert got[:rest] == reference[:rest]
        fresh = uninterrupted(after, balance, checkpoint + want)[checkpoint:]
        assert got[rest:] == fresh[rest:]
        assert got[rest:] != reference[rest:]  # compute plans differ by DP size


def test_resume_refuses_a_checkpoint_it_cannot_honour() -> None:
    it = dataset(0, 2, "token").iterate(repeat=True)
    for _ in range(3):
        next(it)
    state = it.state_dict()
    mid_step = dataset(0, 1, "token").iterate()
    with pytest.raises(ValueError, match=r"cannot resume on dp_size 1: the checkpoint \(dp_size 2\) was "
                                         r"taken after 1 of a step's 2 micro-batches"):  # fmt: skip
        mid_step.load_state_dict(state)
    other = PackedDataset(
        DOCS, seq_len=SEQ, rows_per_micro_batch=1, dp_size=2, micro_batches=2
    ).iterate()
    with pytest.raises(
        ValueError, match="checkpoint's dataset has rows_per_micro_batch=2, this one has"
    ):
        other.load_state_dict(state)
    bigger = PackedDataset(
        DOCS, seq_len=SEQ, rows_per_micro_batch=ROWS, dp_size=2, micro_batches=4
    ).iterate()
    with pytest.raises(ValueError, match=r"global batch is dp_size 2 x micro_batches 2 = 4 micro-batches, "
                                         r"this run's 2 x 4 = 8"):  # fmt: skip
        bigger.load_state_dict(state)


def test_resume_from_megatrons_consumed_samples() -> None:
    ds = dataset(1, 2, "token")
    per_epoch = ds.padded_micro_batches * ROWS  # rows of an epoch, over every DP rank
    state = ds.state_for(consumed_samples=per_epoch + 2 * GLOBAL * ROWS)  # an epoch and 2 steps
    assert (state["epoch"], state["index"]) == (1, 2 * GLOBAL // 2)
    it = ds.iterate(repeat=True)
    it.load_state_dict(state)
    first = next(it)
    ref = dataset(1, 2, "token")
    ref.set_epoch(1)
    assert torch.equal(first.tokens, ref[2 * GLOBAL // 2].tokens)
    with pytest.raises(ValueError, match="not a whole number of global batches of 8 rows"):
        ds.state_for(consumed_samples=3)


def test_resume_prefetch_counts_the_batches_used_not_fetched() -> None:
    it = dataset(0, 1, "token").iterate()
    with megapack.prefetch(it, topology=CPU, depth=3) as ahead:
        next(ahead)
        next(ahead)
        import time

        time.sleep(0.2)  # the thread fetches three more ahead meanwhile
        assert it.index == 5
        state = ahead.state_dict()
    assert state["used"] == 2 and state["iterator"]["index"] == 2
    without = megapack.prefetch(iter([1]), topology=CPU, depth=1)  # a plain iterator: no position
    assert without.state_dict() == {"used": 0, "iterator": None}
    without.close()
