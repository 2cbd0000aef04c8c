"""Exact resume (issue 33): a run checkpointed at a random step, with batches prefetched ahead,
reproduces the next 1,000 micro-batches bit for bit, in both balance modes, and when the DP size
changes with the global batch kept (the same micro-batches in the same global positions)."""

from __future__ import annotations

import contextlib
import json
import logging
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


def megatron_counters(steps: int, dp: int, micro_batch_size: int) -> tuple[int, int]:
    """(``args.consumed_train_samples``, ``args.iteration``) after ``steps`` steps, as
    Megatron-LM's training loop adds them: ``dp x micro_batch_size x num_microbatches`` samples
    and one iteration a step (num_microbatches = global batch / (micro_batch_size x dp))."""
    global_batch_size = micro_batch_size * GLOBAL  # GLOBAL micro-batches a step, over every rank
    num_microbatches = global_batch_size // (micro_batch_size * dp)
    return steps * dp * micro_batch_size * num_microbatches, steps


@pytest.mark.parametrize("micro_batch_size", [1, 2])
@pytest.mark.parametrize("dp", [1, 2])
def test_state_for_is_exact_from_megatrons_counters(micro_batch_size: int, dp: int) -> None:
    """Megatron's --micro-batch-size 1 (THD: one [1, T] of ROWS packed rows is one sample) and 2
    (a sample is a row): after any number of steps, an epoch boundary crossed, the next
    micro-batches of every DP rank are those of the uninterrupted run."""
    per_epoch = dataset(0, dp, "token").padded_micro_batches // GLOBAL  # steps an epoch
    for steps in (0, 3, per_epoch, per_epoch + 2):
        consumed, iteration = megatron_counters(steps, dp, micro_batch_size)
        reference = uninterrupted(dp, "token", steps + 2)[steps:]
        states = []
        for r in range(dp):
            ds = dataset(r, dp, "token")
            state = ds.state_for(consumed_samples=consumed, micro_batch_size=micro_batch_size,
                                 global_batch_size=micro_batch_size * GLOBAL)  # fmt: skip
            assert state == ds.state_for(iterations=iteration)
            assert (state["epoch"], state["index"]) == (
                steps // per_epoch,
                steps % per_epoch * GLOBAL // dp,
            )
            states.append(state)
        resumed = Run(dp, "token", depth=0, states=states)
        assert resumed.steps(2) == reference, (steps, micro_batch_size)


def test_state_for_counts_megatron_samples_not_rows() -> None:
    """The issue's silent case: Megatron's --micro-batch-size 1 with 2 packed rows a [1, T]
    micro-batch, 4 micro-batches consumed (consumed_train_samples 4): the next is micro-batch 4,
    not 2 (counting rows resumed at 2, silently)."""
    ds = PackedDataset(DOCS, seq_len=SEQ, rows_per_micro_batch=2, micro_batches=2)
    state = ds.state_for(consumed_samples=4, micro_batch_size=1)
    assert (state["epoch"], state["index"]) == (0, 4)
    it = ds.iterate(repeat=True)
    it.load_state_dict(state)
    assert torch.equal(next(it).tokens, ds[4].tokens)
    rows = ds.state_for(consumed_samples=8, micro_batch_size=2)  # a sample a row: the same place
    assert rows == state


def test_state_for_refuses_counts_without_their_meaning_or_that_disagree() -> None:
    ds = dataset(1, 2, "token")  # dp 2 x micro_batches 2 = 4 micro-batches a step
    with pytest.raises(TypeError, match=r"state_for\(consumed_samples=8\) needs micro_batch_size=, "
                                        r"Megatron's --micro-batch-size"):  # fmt: skip
        ds.state_for(consumed_samples=8)
    with pytest.raises(TypeError, match="state_for needs Megatron-LM's counters"):
        ds.state_for()
    with pytest.raises(ValueError, match=r"consumed_samples=6 is not a whole number of steps of "
                                         r"micro_batch_size 1 x dp_size 2 x micro_batches 2 = 4"):  # fmt: skip
        ds.state_for(consumed_samples=6, micro_batch_size=1)
    with pytest.raises(ValueError, match=r"global_batch_size=4 is not micro_batch_size 2 x dp_size 2 "
                                         r"x micro_batches 2 = 8"):  # fmt: skip
        ds.state_for(consumed_samples=8, micro_batch_size=2, global_batch_size=4)
    with pytest.raises(ValueError, match=r"consumed_samples=8 at micro_batch_size 1 is 8 micro-batches, "
                                         r"but iterations=1 x dp_size 2 x micro_batches 2 is 4"):  # fmt: skip
        ds.state_for(consumed_samples=8, micro_batch_size=1, iterations=1)
    with pytest.raises(ValueError, match="consumed_samples must be an int >= 0, got -4"):
        ds.state_for(consumed_samples=-4, micro_batch_size=1)
    with pytest.raises(TypeError, match=r"micro_batch_size must be an int >= 1, got float 1\.0"):
        ds.state_for(consumed_samples=4, micro_batch_size=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"global_batch_size= is checked against micro_batch_size"):
        ds.state_for(iterations=1, global_batch_size=4)


def epoch_rows(steps: list[list[tuple[bytes, ...]]]) -> list[bytes]:
    """Every row the micro-batches of ``steps`` hold (its tokens: documents are random)."""
    width = SEQ * ROWS
    out = []
    for step in steps:
        for bits in step:
            tokens = np.frombuffer(bits[0], dtype=np.int64)
            assert len(tokens) == width
            out += [tokens[r * SEQ : (r + 1) * SEQ].tobytes() for r in range(ROWS)]
    return sorted(out)


def test_resume_after_a_dp_change_under_compute_balance_trains_each_row_once() -> None:
    """The issue's silent case: dp 2 -> 1 mid-epoch under balance="compute" from Megatron's
    counters planned the rest of the epoch for dp 1 (rows trained twice, others never). Now the
    old plan is an argument (required), and the epoch holds every row exactly once."""
    per_epoch = dataset(0, 2, "token").padded_micro_batches // GLOBAL
    whole = epoch_rows(uninterrupted(2, "compute", per_epoch))  # one epoch, every row once
    checkpoint = per_epoch // 2
    before = uninterrupted(2, "compute", checkpoint)
    consumed, _ = megatron_counters(checkpoint, dp=2, micro_batch_size=1)
    resumed_ds = dataset(0, 1, "compute")
    with pytest.raises(TypeError, match=r"balance='compute' needs plan=\(dp_size, micro_batches\) of "
                                        r"the run that began the checkpoint's epoch.*this run's is \(1, 4\)"):  # fmt: skip
        resumed_ds.state_for(consumed_samples=consumed, micro_batch_size=1)
    state = resumed_ds.state_for(consumed_samples=consumed, micro_batch_size=1, plan=(2, 2))
    after = Run(1, "compute", depth=0, states=[state]).steps(per_epoch - checkpoint)
    assert epoch_rows(before + after) == whole
    assert len(set(whole)) > len(whole) // 2  # rows are told apart (fillers aside)
    naive = resumed_ds.state_for(consumed_samples=consumed, micro_batch_size=1, plan=(1, 4))
    wrong = Run(1, "compute", depth=0, states=[naive]).steps(per_epoch - checkpoint)
    assert epoch_rows(before + wrong) != whole  # the plan matters: the case is not vacuous
    with pytest.raises(ValueError, match=r"plan=\(2, 1\) is a global batch of 2 micro-batches, this "
                                         r"run's \(1, 4\) of 4"):  # fmt: skip
        resumed_ds.state_for(consumed_samples=consumed, micro_batch_size=1, plan=(2, 1))


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


def a_state() -> dict[str, Any]:
    it = dataset(0, 2, "token").iterate(repeat=True)
    for _ in range(2):
        next(it)
    return json.loads(json.dumps(it.state_dict()))  # as saved


STATE_KEYS = ("version", "fingerprint", "rows", "seed", "rows_per_micro_batch", "balance",
              "epoch", "index", "dp_size", "micro_batches", "plan", "cost")  # fmt: skip


@pytest.mark.parametrize("key", STATE_KEYS)
def test_resume_refuses_a_state_missing_any_key_on_load(key: str) -> None:
    state = a_state()
    del state[key]
    it = dataset(0, 2, "token").iterate()
    with pytest.raises(ValueError, match=rf"the state has no '{key}' \(keys \["):
        it.load_state_dict(state)
    assert (it.index, it.dataset.epoch) == (0, 0)  # refused on load, nothing changed


@pytest.mark.parametrize(
    ("key", "value", "error", "message"),
    [
        ("index", -1, ValueError, r"state\['index'\] must be an int >= 0, got -1"),
        ("index", 2.0, TypeError, r"state\['index'\] must be an int >= 0, got float 2.0"),
        ("index", "2", TypeError, r"state\['index'\] must be an int >= 0, got str '2'"),
        ("epoch", -3, ValueError, r"state\['epoch'\] must be an int >= 0, got -3"),
        ("dp_size", 0, ValueError, r"state\['dp_size'\] must be an int >= 1, got 0"),
        ("micro_batches", True, TypeError, r"state\['micro_batches'\] must be an int >= 1, got bool"),
        ("rows", None, TypeError, r"state\['rows'\] must be an int >= 1, got NoneType None"),
        ("seed", [0], TypeError, r"state\['seed'\] must be an int, got list \[0\]"),
        ("rows_per_micro_batch", -2, ValueError, r"state\['rows_per_micro_batch'\] must be an int >= 1"),
        ("balance", 1, TypeError, r"state\['balance'\] must be a str, got int 1"),
        ("fingerprint", None, TypeError, r"state\['fingerprint'\] must be a str, got NoneType None"),
        ("cost", 1.0, TypeError, r"state\['cost'\] must be None or a CostModel's \{'a': \.\.\., 'b': \.\.\.\}, got 1\.0"),
        ("cost", {"a": "1", "b": 0}, TypeError, r"state\['cost'\]\['a'\] must be a number, got str '1'"),
        ("cost", {"a": 1.0, "b": 0.0}, ValueError, r"the checkpoint's dataset has cost=\{'a': 1\.0, 'b': 0\.0\}, this one has cost=None"),
        ("plan", "2,2", TypeError, r"state\['plan'\] must be a list \[dp_size, micro_batches\], got str '2,2'"),
        ("plan", [2], ValueError, r"state\['plan'\] must be \[dp_size, micro_batches\], got \[2\]"),
        ("plan", [2, -1], ValueError, r"state\['plan'\]\[1\] must be an int >= 1, got -1"),
        ("plan", [4, 2], ValueError, r"state\['plan'\]=\[4, 2\] is a global batch of 8 micro-batches"),
        ("version", 4, ValueError, r"state\['version'\]=4: written by a later megapack"),
        ("version", "2", TypeError, r"state\['version'\] must be an int >= 1, got str '2'"),
        ("index", 999, ValueError, r"state\['index'\]=999 is past the end of its epoch: each of the "
                                   r"checkpoint's 2 DP ranks has \d+ micro-batches an epoch"),
        ("rows", 5, ValueError, r"the checkpoint's dataset has rows=5, this one has rows=\d+"),
    ],
)  # fmt: skip
def test_resume_refuses_a_malformed_state_on_load(
    key: str, value: Any, error: type[Exception], message: str
) -> None:
    it = dataset(0, 2, "token").iterate(repeat=True)
    state = a_state() | {key: value}
    with pytest.raises(error, match=message):
        it.load_state_dict(state)
    assert (it.index, it.dataset.epoch) == (0, 0)
    it.load_state_dict(a_state())  # the same iterator takes a good state afterwards
    assert it.index == 2


def test_resume_refuses_what_is_not_an_iterator_state() -> None:
    it = dataset(0, 1, "token").iterate()
    with pytest.raises(TypeError, match=r"a DatasetIterator state is a dict .*, got list \[1, 2\]"):
        it.load_state_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"the state has no 'version'"):
        it.load_state_dict({})


def lockstep_state(*positions: Any) -> dict[str, Any]:
    return {"kind": "megapack.lockstep_steps", "version": 1, "steps": 1,
            "taken": [0] * len(positions), "iterators": list(positions)}  # fmt: skip


def test_resume_takes_a_prefetchers_and_a_locksteps_state() -> None:
    # what each wiring saves (docs/delivery.md, "Exact resume"): all resume at their position
    for state in ({"used": 2, "iterator": a_state()}, lockstep_state(a_state()),
                  lockstep_state(a_state(), a_state()), lockstep_state(None, a_state())):  # fmt: skip
        it = dataset(0, 2, "token").iterate()
        it.load_state_dict(json.loads(json.dumps(state)))
        assert it.index == 2, state


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"used": 0, "iterator": None}, "this megapack.prefetch state holds no data position "
         r"\(state\['iterator'\] is None\): it was taken on a TP rank other than the source, or "
         r"over an iterator without state_dict\(\); save the TP source's"),
        (lockstep_state(None), r"this lockstep_steps state holds no data position \(state\['iterators'\] "
         r"is \[None\]\): it was saved on a rank that reads no data \(a TP peer, or a middle stage "
         r"without data\); save global rank 0's \(the first stage's TP source\)"),
        (lockstep_state(a_state(), a_state() | {"index": 1}), "this lockstep_steps state's model "
         r"chunks are at different positions \(it was saved inside the schedule\): load "
         r"state\['iterators'\]\[k\] into model chunk k's iterator"),
    ],
    ids=["prefetch-on-a-peer", "lockstep-on-a-peer", "lockstep-chunks-apart"],
)  # fmt: skip
def test_resume_says_what_to_load_when_a_state_holds_no_position(
    state: dict[str, Any], message: str
) -> None:
    it = dataset(0, 2, "token").iterate()
    with pytest.raises(ValueError, match=message):
        it.load_state_dict(state)
    assert it.index == 0


def compute_dataset(cost: CostModel) -> PackedDataset:
    return PackedDataset(DOCS, seq_len=SEQ, rows_per_micro_batch=ROWS, dp_size=2,
                         micro_batches=GLOBAL // 2, balance="compute", cost=cost)  # fmt: skip


def test_resume_refuses_another_cost_model_under_compute_balance_naming_both() -> None:
    # The silent case: the epoch's order depends on the cost model, so a resume under
    # another one trained rows twice or never; both models are named, with the one to pass.
    flops = CostModel.from_shape(hidden=64, ffn=256, layers=2, heads=4, vocab=1000)
    tokens = CostModel.tokens()
    assert compute_dataset(flops).order().tolist() != compute_dataset(tokens).order().tolist()
    it = compute_dataset(flops).iterate()
    for _ in range(2):
        next(it)
    state = json.loads(json.dumps(it.state_dict()))
    assert state["cost"] == {"a": 973824.0, "b": 768.0}
    other = compute_dataset(tokens).iterate()
    with pytest.raises(ValueError) as caught:
        other.load_state_dict(state)
    assert str(caught.value) == (
        "cannot resume: the checkpoint's epoch was ordered with CostModel(a=973824.0, b=768.0), "
        "this run's is CostModel(a=1.0, b=0.0): with balance='compute' the epoch's order depends "
        "on the cost model, so rows would be trained twice or never; load the dataset with the "
        "checkpoint's (LoadOptions(balance='compute', cost=CostModel(a=973824.0, b=768.0)))"
    )
    assert other.index == 0
    same = compute_dataset(CostModel(a=973824, b=768)).iterate()  # the same model, ints given
    same.load_state_dict(state)
    assert torch.equal(next(same).tokens, next(it).tokens)


def test_resume_reads_a_version_2_state_where_the_cost_model_cannot_matter() -> None:
    # states written before the cost model was recorded: token balance loads as before; under
    # compute balance it cannot be checked, so it is refused, saying how to vouch for it
    state = a_state()
    del state["cost"]
    state["version"] = 2
    it = dataset(0, 2, "token").iterate()
    it.load_state_dict(state)
    assert it.index == 2
    flops = CostModel(a=2.0, b=0.5)
    compute = compute_dataset(flops).iterate()
    old = json.loads(json.dumps(compute.state_dict()))
    del old["cost"]
    old["version"] = 2
    with pytest.raises(ValueError) as caught:
        compute.load_state_dict(old)
    assert str(caught.value) == (
        "cannot resume: the state (version 2, written by an earlier megapack) records no cost "
        "model, and with balance='compute' the epoch's order depends on it; if the checkpoint's "
        "run used this one, add state['cost'] = {'a': 2.0, 'b': 0.5} and load it again"
    )
    compute.load_state_dict(old | {"cost": {"a": 2.0, "b": 0.5}})


def test_resume_index_at_the_epochs_end_is_accepted_and_rolls_over() -> None:
    """The last micro-batch of an epoch used: the index is the epoch's length (a valid state);
    the next is the next epoch's first."""
    ds = dataset(0, 1, "token")
    it = ds.iterate(repeat=True)
    state = a_state() | {
        "dp_size": 1,
        "micro_batches": GLOBAL,
        "plan": [1, GLOBAL],
        "index": len(ds),
    }
    it.load_state_dict(state)
    ref = dataset(0, 1, "token")
    ref.set_epoch(1)
    assert torch.equal(next(it).tokens, ref[0].tokens)


def test_resume_fingerprint_refuses_another_dataset_with_the_same_rows_and_seed() -> None:
    """The issue's silent case: other documents (here the same lengths, other tokens) give the
    same row count and seed; the state is refused naming both fingerprints."""
    state = a_state()
    rng = np.random.default_rng(7)
    other_docs = [
        Document(tokens=rng.integers(1, 500, len(d)), loss_mask=d.loss_mask) for d in DOCS
    ]
    other = PackedDataset(other_docs, seq_len=SEQ, rows_per_micro_batch=ROWS, dp_size=2,
                          micro_batches=GLOBAL // 2)  # fmt: skip
    assert other.meta["rows"] == state["rows"] and other.packing.seed == state["seed"]
    mine = other.meta["fingerprint"]
    assert mine != state["fingerprint"]
    with pytest.raises(ValueError, match=rf"the checkpoint's dataset has fingerprint="
                                         rf"'{state['fingerprint']}', this one has fingerprint='{mine}'"):  # fmt: skip
        other.iterate().load_state_dict(state)


def test_resume_reads_a_state_of_an_earlier_megapack_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A version-1 state (no fingerprint) is read as before, the missing check logged."""
    state = a_state()
    del state["fingerprint"]
    state["version"] = 1
    it = dataset(0, 2, "token").iterate()
    with caplog.at_level(logging.WARNING, logger="megapack.data.resume"):
        it.load_state_dict(state)
    assert it.index == 2
    assert "records no dataset fingerprint" in caplog.text
    state["version"] = 2  # a version-2 state must have one
    with pytest.raises(ValueError, match="the state has no 'fingerprint'"):
        it.load_state_dict(state)


# -- what mutation testing found unguarded (docs/records/mutation.md, 2026-11-28) ---------------
def test_state_for_errors_name_the_argument_its_value_and_the_fix() -> None:
    ds = dataset(1, 2, "token")  # dp 2 x micro_batches 2 = 4 micro-batches a step
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({}, TypeError, "state_for needs Megatron-LM's counters: consumed_samples="
         "args.consumed_train_samples with micro_batch_size=args.micro_batch_size, or "
         "iterations=args.iteration"),
        ({"consumed_samples": 8}, TypeError, "state_for(consumed_samples=8) needs "
         "micro_batch_size=, Megatron's --micro-batch-size (args.micro_batch_size): it counts "
         "that many samples per forward_step, each of which gets one micro-batch of "
         "rows_per_micro_batch=2 rows (THD: --micro-batch-size 1, a sample is a packed "
         "micro-batch)"),
        ({"consumed_samples": 6, "micro_batch_size": 1}, ValueError, "consumed_samples=6 is not "
         "a whole number of steps of micro_batch_size 1 x dp_size 2 x micro_batches 2 = 4 "
         "samples: check micro_batch_size, and that dp_size and micro_batches are the run's"),
        ({"iterations": -1}, ValueError, "iterations must be an int >= 0, got -1"),
        ({"iterations": 1, "global_batch_size": 4}, TypeError, "global_batch_size= is checked "
         "against micro_batch_size x dp_size x micro_batches: pass micro_batch_size= "
         "(args.micro_batch_size) too"),
        ({"iterations": 1, "micro_batch_size": 1, "global_batch_size": 0}, ValueError,
         "global_batch_size must be an int >= 1, got 0"),
        ({"iterations": 1, "micro_batch_size": 2, "global_batch_size": 4}, ValueError,
         "global_batch_size=4 is not micro_batch_size 2 x dp_size 2 x micro_batches 2 = 8: this "
         "dataset's dp_size and micro_batches must be the run's (micro_batches = global batch / "
         "(micro-batch size x dp_size))"),
        ({"iterations": 1, "plan": 4}, TypeError,
         "plan must be a pair (dp_size, micro_batches), got 4"),
        ({"iterations": 1, "plan": [1, 2, 2]}, TypeError,
         "plan must be a pair (dp_size, micro_batches), got [1, 2, 2]"),
        ({"iterations": 1, "plan": (0, 4)}, ValueError, "plan[0] must be an int >= 1, got 0"),
        ({"iterations": 1, "plan": (1, 2)}, ValueError, "plan=(1, 2) is a global batch of 2 "
         "micro-batches, this run's (2, 2) of 4: the counters cannot map a changed global batch"),
    ]  # fmt: skip
    for kwargs, error, message in cases:
        with pytest.raises(error) as caught:
            ds.state_for(**kwargs)
        assert str(caught.value) == message, kwargs
    with pytest.raises(TypeError) as caught:
        compute_dataset(CostModel(a=2.0, b=0.5)).state_for(iterations=1)
    assert str(caught.value) == (
        "state_for with balance='compute' needs plan=(dp_size, micro_batches) of the run that "
        "began the checkpoint's epoch: its order is balanced for that DP size and counters do "
        "not record it (this run's is (2, 2), if the DP size did not change). Or resume from "
        "DatasetIterator.state_dict(), which records it"
    )


def test_state_for_takes_both_counters_when_they_agree_and_the_least_global_batch() -> None:
    ds = dataset(1, 2, "token")  # 4 micro-batches a step
    both = ds.state_for(consumed_samples=24, micro_batch_size=2, iterations=3)
    assert both == ds.state_for(iterations=3) and both["index"] == 6
    one = PackedDataset(DOCS, seq_len=SEQ, rows_per_micro_batch=ROWS, micro_batches=1)
    state = one.state_for(consumed_samples=3, micro_batch_size=1, global_batch_size=1)
    assert (state["epoch"], state["index"]) == (0, 3)


def test_state_for_at_an_epoch_boundary_plans_the_next_epoch_for_this_run() -> None:
    """The checkpoint's plan is the epoch in progress's; an epoch not begun is this run's."""
    ds = compute_dataset(CostModel(a=2.0, b=0.5))  # dp 2 x micro_batches 2
    per_epoch = ds.padded_micro_batches // GLOBAL
    inside = ds.state_for(iterations=1, plan=(4, 1))
    assert inside["plan"] == [4, 1]
    boundary = ds.state_for(iterations=per_epoch, plan=(4, 1))
    assert (boundary["epoch"], boundary["index"], boundary["plan"]) == (1, 0, [2, 2])


def test_check_state_refuses_a_prefetchers_or_locksteps_state_passed_directly() -> None:
    from megapack.data.resume import check_state

    message = (
        "this is a megapack.prefetch or lockstep_steps state_dict, not a DatasetIterator's: pass "
        "it to DatasetIterator.load_state_dict, which takes its position "
        "(megapack.data.resume.position_of)"
    )
    for state in ({"used": 2, "iterator": a_state()}, {"used": 2, "iterator": None, "x": 1},
                  lockstep_state(a_state())):  # fmt: skip
        with pytest.raises(ValueError) as caught:
            check_state(state)
        assert str(caught.value) == message, state
    assert check_state(a_state() | {"used": 2})["index"] == 2  # "used" alone is no prefetch state


def test_check_state_names_every_missing_key_and_checks_a_version_2_fingerprint() -> None:
    from megapack.data.resume import check_state

    state = a_state()
    del state["rows"], state["seed"]
    with pytest.raises(ValueError) as caught:
        check_state(state)
    assert str(caught.value) == (
        f"the state has no 'rows', 'seed' (keys {sorted(state)}): save "
        "DatasetIterator.state_dict() whole"
    )
    old = a_state() | {"version": 2, "fingerprint": 5}
    del old["cost"]
    with pytest.raises(TypeError, match=r"^state\['fingerprint'\] must be a str, got int 5$"):
        check_state(old)
    assert check_state(old | {"fingerprint": "blake2b-128:00"})["fingerprint"] == "blake2b-128:00"


def test_malformed_values_are_shown_whole_up_to_60_characters_then_cut() -> None:
    from megapack.data.resume import check_state

    exactly = "x" * 58  # repr: 60 characters with its quotes
    longer = "y" * 100
    prefix = "a DatasetIterator state is a dict (DatasetIterator.state_dict()), got str "
    for value, shown in ((exactly, repr(exactly)), (longer, repr(longer)[:57] + "...")):
        with pytest.raises(TypeError) as caught:
            check_state(value)
        assert str(caught.value) == prefix + shown
    with pytest.raises(TypeError) as caught:
        it = dataset(0, 2, "token").iterate()
        it.load_state_dict({"kind": "megapack.lockstep_steps", "iterators": (1, 2)})
    assert str(caught.value) == (
        "state['iterators'] of a lockstep_steps state must be a list (one data position per "
        "model chunk), got (1, 2): save StepLockstep.state_dict() whole"
    )


def test_a_token_balanced_state_records_no_cost_model_even_when_one_is_given() -> None:
    ds = PackedDataset(DOCS, seq_len=SEQ, rows_per_micro_batch=ROWS, balance="token",
                       cost=CostModel(a=2.0, b=0.5))  # fmt: skip
    assert ds.iterate().state_dict()["cost"] is None


def test_an_iterator_stops_at_the_epochs_end_unless_told_to_repeat() -> None:
    ds = dataset(0, 2, "token")
    assert len(list(ds.iterate())) == len(ds)
    from megapack.data.resume import DatasetIterator

    assert len(list(DatasetIterator(ds))) == len(ds)


def test_resume_logs_the_earlier_version_and_only_for_a_state_without_fingerprint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    it = dataset(0, 2, "token").iterate()
    with caplog.at_level(logging.WARNING, logger="megapack.data.resume"):
        it.load_state_dict(a_state())
    assert caplog.records == []  # a current state: nothing to say
    old = a_state() | {"version": 1}
    del old["fingerprint"], old["cost"]
    with caplog.at_level(logging.WARNING, logger="megapack.data.resume"):
        it.load_state_dict(old)
    assert [r.getMessage() for r in caplog.records] == [
        "megapack: resuming from a state of an earlier megapack (version 1), which records no "
        "dataset fingerprint: only the rows, seed and layout are checked"
    ]


def test_resume_errors_of_the_cost_and_the_dp_change_say_the_whole_fix() -> None:
    it = dataset(0, 2, "token").iterate()
    with pytest.raises(ValueError) as caught:
        it.load_state_dict(a_state() | {"cost": {"a": 1.0, "b": 0.0}})
    assert str(caught.value) == (
        "cannot resume: the checkpoint's dataset has cost={'a': 1.0, 'b': 0.0}, this one has "
        "cost=None (a cost model is recorded with balance='compute' only)"
    )
    one = dataset(0, 1, "token").iterate()
    with pytest.raises(ValueError) as caught:
        one.load_state_dict(a_state() | {"index": 3})  # dp 2 -> 1 in the middle of a step
    assert str(caught.value) == (
        "cannot resume on dp_size 1: the checkpoint (dp_size 2) was taken after 1 of a step's 2 "
        "micro-batches; change the DP size only at a step boundary"
    )
