"""`StepLockstep.state_dict`: the data position of the first micro-batch the schedule has not
taken, wherever in the loop it is saved, with or without `megapack.prefetch` (issue 46).

`lockstep_steps` reads a whole step ahead, so the dataset iterator's own ``state_dict()`` taken
inside ``for step_iterator in steps`` counts a step the schedule has not run (``index`` 6 after 4
micro-batches trained with ``zip(steps, range(2), strict=False)``): resuming from it skipped them, silently.
One process here (no process group); on ranks under megatron-core's schedule, with DP 1 and 2:
tests/functional/test_lockstep_resume.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megapack
from megapack.data import Document, PackedDataset
from megapack.delivery.steps import StepIterator, lockstep_steps

ONE = megapack.Topology.single()
M = 2


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    assert not dist.is_initialized(), "these tests check the single-process path"


def dataset() -> PackedDataset:
    rng = np.random.default_rng(46)
    docs = [Document(tokens=rng.integers(1, 99, n), loss_mask=np.ones(n, np.float32))
            for n in rng.integers(2, 9, 40)]  # fmt: skip
    return PackedDataset(docs, 8, micro_batches=M)


def tokens(item: Any) -> list[int]:
    """A micro-batch's tokens, raw (a PackedBatch) or delivered (a prefetched dict)."""
    t = item.tokens if hasattr(item, "tokens") else item["tokens"]
    return [int(v) for v in t.flatten()]


def test_state_inside_the_loop_counts_what_the_schedule_took_not_the_step_read_ahead() -> None:
    # The numbers: zip(steps, range(2), strict=False) reads step 2 ahead before zip stops
    it = dataset().iterate()
    steps = lockstep_steps(it, micro_batches=M, topology=ONE)
    for step_iterator, _ in zip(steps, range(2), strict=False):
        assert isinstance(step_iterator, StepIterator)
        [next(step_iterator) for _ in range(M)]
    assert it.state_dict()["index"] == 6  # the iterator counts step 2, read ahead and dropped
    assert steps.state_dict()["iterators"][0]["index"] == 4  # 4 micro-batches trained
    it = dataset().iterate()
    steps = lockstep_steps(it, micro_batches=M, topology=ONE)
    for _, step_iterator in zip(range(2), steps, strict=False):
        assert isinstance(step_iterator, StepIterator)
        assert steps.state_dict()["iterators"][0]["index"] == 2 * _  # before the schedule
        [next(step_iterator) for _ in range(M)]
    assert it.state_dict()["index"] == steps.state_dict()["iterators"][0]["index"] == 4


def run(
    depth: int, state: Any = None, steps: int = 99
) -> tuple[list[list[list[int]]], list[tuple[str, Any]]]:
    """A loop of up to ``steps`` steps over a fresh iterator (``state`` loaded first), behind
    prefetch(``depth``) unless 0: each step's batches, and the lockstep state saved at every
    position: before the loop, before and after each step's schedule, after the loop."""
    it = dataset().iterate()
    if state is not None:
        it.load_state_dict(json.loads(json.dumps(state)))  # as saved
    data: Iterator[Any] = megapack.prefetch(it, topology=ONE, depth=depth, nice=0) if depth else it
    loop = lockstep_steps(data, micro_batches=M, topology=ONE)
    saved = [("start", loop.state_dict())]
    batches = []
    for n, step_iterator in zip(range(steps), loop, strict=False):
        assert isinstance(step_iterator, StepIterator)
        saved.append((f"before {n}", loop.state_dict()))
        batches.append([tokens(next(step_iterator)) for _ in range(M)])
        saved.append((f"after {n}", loop.state_dict()))
    saved.append(("end", loop.state_dict()))
    if depth:
        data.close()  # type: ignore[attr-defined]
    return batches, saved


@pytest.mark.parametrize("depth", [0, 1, 2], ids=["no-prefetch", "prefetch-1", "prefetch-2"])
def test_state_saved_anywhere_resumes_bit_exactly(depth: int) -> None:
    whole, _ = run(depth)
    assert len(whole) == len(dataset()) // M  # every step, to the end of the data
    _, saved = run(depth, steps=3)  # zip(range(3), steps): the loop ends between steps
    taken = {"start": 0, "end": 3} | {f"{w} {n}": n + (w == "after") for n in range(3) for w in ("before", "after")}  # fmt: skip
    assert [where for where, _ in saved] == ["start", "before 0", "after 0", "before 1", "after 1",
                                             "before 2", "after 2", "end"]  # fmt: skip
    for where, state in saved:
        resumed, _ = run(depth, state=state)
        assert resumed == whole[taken[where] :], (where, state)


def test_state_at_a_data_end_or_failure_is_after_the_last_step_trained() -> None:
    # 28 micro-batches, 3 a step: step 9 is partial (1 read, not run)
    it = dataset().iterate()
    assert len(it.dataset) == 28
    loop = lockstep_steps(it, micro_batches=3, topology=ONE)
    assert len([[next(s) for _ in range(3)] for s in loop]) == 9  # type: ignore[call-overload]
    assert it.index == 28 and loop.state_dict()["iterators"][0]["index"] == 27
    it = dataset().iterate()
    loop = lockstep_steps(it, micro_batches=M, topology=ONE, seq_length=4, micro_batch_size=1)
    with pytest.raises(ValueError, match="seq_length=4"):
        next(loop)  # fails at step 0, after reading an item
    assert it.index == 1 and loop.state_dict()["iterators"][0]["index"] == 0


def test_state_per_model_chunk_and_the_chunks_taken() -> None:
    topo = megapack.Topology(tp_group=None, tp_ranks=(0,), tp_rank=0, pp_size=2, vp_stage=0,
                             vp_size=2)  # fmt: skip
    loop = lockstep_steps(
        [dataset().iterate(), dataset().iterate()], micro_batches=M, topology=topo
    )
    chunks = next(loop)
    assert isinstance(chunks, list) and all(isinstance(c, StepIterator) for c in chunks)
    next(chunks[0])  # type: ignore[call-overload]  # the interleaved schedule: chunk 0 first
    state = loop.state_dict()
    assert (state["kind"], state["version"], state["steps"], state["taken"]) == (
        "megapack.lockstep_steps", 1, 1, [1, 0])  # fmt: skip
    assert [p["index"] for p in state["iterators"]] == [1, 0]
    with pytest.raises(ValueError, match="model chunks are at different positions"):
        dataset().iterate().load_state_dict(state)  # a DatasetIterator cannot tell which chunk
    fresh = [dataset().iterate(), dataset().iterate()]
    again = lockstep_steps(fresh, micro_batches=M, topology=topo)
    again.load_state_dict(state)  # each chunk its own position
    assert [it.index for it in fresh] == [1, 0]


def test_lockstep_load_state_dict_before_the_first_step_only() -> None:
    _, saved = run(0, steps=2)
    state = dict(saved)["after 0"]
    it = dataset().iterate()
    loop = lockstep_steps(it, micro_batches=M, topology=ONE)
    loop.load_state_dict(state)
    assert it.index == 2
    next(loop)
    with pytest.raises(
        ValueError, match="already read a step; load the state before its first step"
    ):
        loop.load_state_dict(state)
    prefetched = r"data_iterator is a megapack.prefetch, which read ahead when it was built: load the state into the dataset's iterator"  # fmt: skip
    with (
        megapack.prefetch(dataset().iterate(), topology=ONE) as ahead,
        pytest.raises(ValueError, match=prefetched),
    ):
        lockstep_steps(ahead, micro_batches=M, topology=ONE).load_state_dict(state)
    fresh = lockstep_steps(dataset().iterate(), micro_batches=M, topology=ONE)
    with pytest.raises(TypeError, match=r"takes a lockstep_steps state_dict\(\) \(kind "
                                        r"'megapack.lockstep_steps'\), got \{'used'"):  # fmt: skip
        fresh.load_state_dict({"used": 2, "iterator": state["iterators"][0]})
    with pytest.raises(ValueError, match=r"state\['iterators'\]\[0\] is None: the state was saved "
                                         r"on a rank that reads no data"):  # fmt: skip
        fresh.load_state_dict(state | {"iterators": [None]})
    with pytest.raises(ValueError, match=r"reads 1 data iterator\(s\)"):
        fresh.load_state_dict(state | {"iterators": [None, None]})
    with pytest.raises(ValueError, match=r"state\['version'\]=2: written by a later megapack"):
        fresh.load_state_dict(state | {"version": 2})
    middle = megapack.Topology(tp_group=None, tp_ranks=(0,), tp_rank=0, pp_rank=1, pp_size=3)
    lockstep_steps(None, micro_batches=M, topology=middle).load_state_dict(state)  # reads nothing


def test_state_without_a_state_dict_is_none_and_json_friendly() -> None:
    loop = lockstep_steps(iter(range(4)), micro_batches=M, topology=ONE, check=False)
    next(loop)
    state = loop.state_dict()
    assert state == json.loads(json.dumps(state))
    assert state["iterators"] == [None] and state["taken"] == [0]
    assert torch.equal(torch.tensor(state["taken"]), torch.tensor([0]))


def test_the_state_kind_is_one_name_in_both_layers() -> None:
    # megapack.data cannot import megapack.delivery (layering): the kind is spelt in both
    from megapack.data.resume import LOCKSTEP_KIND
    from megapack.delivery.steps import STATE_KIND

    assert STATE_KIND == LOCKSTEP_KIND == "megapack.lockstep_steps"


# -- what mutation testing found unguarded (docs/records/mutation.md, 2026-11-28) ---------------
def a_state() -> dict[str, Any]:
    return dict(run(0, steps=2)[1])["after 0"]


def test_load_state_dict_errors_name_the_state_and_the_fix_in_full() -> None:
    state = a_state()
    fresh = lockstep_steps(dataset().iterate(), micro_batches=M, topology=ONE)
    long = {"used": 2, "iterator": "x" * 80}
    cases: list[tuple[Any, type[Exception], str]] = [
        (long, TypeError, "StepLockstep.load_state_dict takes a lockstep_steps state_dict() "
         f"(kind 'megapack.lockstep_steps'), got {repr(long)[:57]}...; load a DatasetIterator's "
         "or a prefetcher's state into the dataset's iterator (DatasetIterator.load_state_dict)"),
        (state | {"version": 0}, ValueError, "state['version'] must be an int >= 1, got 0"),
        (state | {"iterators": [None, None]}, ValueError, "state['iterators'] holds [None, None], "
         "but this lockstep_steps reads 1 data iterator(s): save and load the state of a "
         "lockstep_steps built alike (one position per model chunk)"),
        (state | {"iterators": [None]}, ValueError, "state['iterators'][0] is None: the state was "
         "saved on a rank that reads no data there (a TP peer, or a middle stage without data); "
         "save global rank 0's (the first stage's TP source)"),
    ]  # fmt: skip
    sixty = {"used": 2, "iterator": "x" * 33}  # its repr: 60 characters, shown whole
    assert len(repr(sixty)) == 60
    cases.append((sixty, TypeError, "StepLockstep.load_state_dict takes a lockstep_steps "
                  f"state_dict() (kind 'megapack.lockstep_steps'), got {sixty!r}; load a "
                  "DatasetIterator's or a prefetcher's state into the dataset's iterator "
                  "(DatasetIterator.load_state_dict)"))  # fmt: skip
    for bad, error, message in cases:
        with pytest.raises(error) as caught:
            fresh.load_state_dict(bad)
        assert str(caught.value) == message
    with (
        megapack.prefetch(dataset().iterate(), topology=ONE) as ahead,
        pytest.raises(ValueError) as caught,
    ):
        lockstep_steps([ahead], micro_batches=M, topology=ONE).load_state_dict(state)
    assert str(caught.value) == (
        "StepLockstep.load_state_dict: data_iterator[0] is a megapack.prefetch, which read ahead "
        "when it was built: load the state into the dataset's iterator (it.load_state_dict(state)) "
        "before building the prefetcher over it"
    )


def test_load_state_dict_after_a_read_is_refused_even_before_a_step() -> None:
    state = a_state()
    ended = lockstep_steps(iter([]), micro_batches=M, topology=ONE, check=False)
    with pytest.raises(StopIteration):
        next(ended)  # read at step 0, no step given out
    with pytest.raises(ValueError) as caught:
        ended.load_state_dict(state)
    assert str(caught.value) == (
        "StepLockstep.load_state_dict: this lockstep_steps already read a step; load the state "
        "before its first step (or into a fresh dataset.iterate() before building it)"
    )


def test_load_state_dict_loads_every_chunk_read_here_past_one_that_is_not() -> None:
    state = a_state()
    it = dataset().iterate()
    lockstep_steps([None, it], micro_batches=M, topology=ONE).load_state_dict(
        state | {"iterators": [None, state["iterators"][0]], "taken": [0, 0]}
    )
    assert it.index == 2
    plain = lockstep_steps([None, iter(range(4))], micro_batches=M, topology=ONE, check=False)
    with pytest.raises(TypeError) as caught:
        plain.load_state_dict(state | {"iterators": [None, {"index": 2}]})
    assert str(caught.value) == (
        "StepLockstep.load_state_dict: data_iterator[1] (range_iterator) has no "
        "load_state_dict(); resume it your own way"
    )


def test_positions_before_any_step_and_of_iterators_without_a_callable_state() -> None:
    loop = lockstep_steps(dataset().iterate(), micro_batches=M, topology=ONE)
    assert loop.state_dict()["taken"] == [0] and loop.state_dict()["steps"] == 0

    class Odd:
        state_dict = "not callable"  # an attribute that happens to have the name

        def __iter__(self) -> Odd:
            return self

        def __next__(self) -> int:
            return 1

    odd = lockstep_steps(Odd(), micro_batches=M, topology=ONE, check=False)
    next(odd)
    assert odd.state_dict()["iterators"] == [None]
    assert StepIterator([1, 2], 0).position() is None  # no positions kept: none to say
