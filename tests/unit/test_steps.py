"""`megapack.lockstep_steps` in one process (no process group): reading steps ahead, where they
end, the schedule's count, argument checks, and the first step's agreement rules
(`agreement_errors`, a pure function of every rank's gathered settings). The same wrapper on
several ranks under megatron-core's schedules: tests/functional/test_schedule_lockstep.py; its
agreement across ranks: tests/functional/test_lockstep_agreement.py."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megapack
from megapack.data import Document, PackedDataset
from megapack.delivery.agreement import agreement_errors
from megapack.delivery.steps import StepIterator, StepLockstep, lockstep_steps

ONE = megapack.Topology.single()


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    assert not dist.is_initialized(), "these tests check the single-process path"


def warned(caplog: pytest.LogCaptureFixture) -> list[tuple[str, int, str]]:
    """(logger, level, message) of the megapack records at WARNING and above."""
    return [(r.name, r.levelno, r.getMessage()) for r in caplog.records
            if r.name.startswith("megapack") and r.levelno >= logging.WARNING]  # fmt: skip


def take(steps: Any) -> list[list[Any]]:
    """Each step's items, taken as a schedule takes them: exactly as many as the step holds."""
    return [items(step) for step in steps]


def items(step: StepIterator) -> list[Any]:
    return [next(step) for _ in range(len(step))]


def failing(n: int, at: int) -> Iterator[int]:
    for i in range(n):
        if i == at:
            raise OSError(f"bad shard at {i}")
        yield i


def test_lockstep_steps_yield_whole_steps_in_order_then_stop() -> None:
    steps = lockstep_steps(iter(range(6)), micro_batches=2, topology=ONE, check=False)
    assert take(steps) == [[0, 1], [2, 3], [4, 5]]
    assert steps.step == 3
    with pytest.raises(StopIteration):  # and again: it stays ended
        next(steps)


def test_lockstep_steps_partial_last_step_warns_with_the_count_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="megapack"):
        assert take(lockstep_steps(iter(range(5)), micro_batches=3, topology=ONE, check=False)) == [
            [0, 1, 2]
        ]
    assert warned(caplog)[0] == (
        "megapack.delivery",
        logging.WARNING,
        "megapack: lockstep_steps: the data on rank 0 ended after 2 of step 1's 3 micro-batches: "
        "the partial step is not run (2 micro-batch(es) left unused); every rank stops before it",
    )
    # it points at the loop (under mutation testing mutmut's trampoline adds a frame)
    assert caplog.records[0].pathname == __file__ or "MUTANT_UNDER_TEST" in os.environ


def test_lockstep_steps_whole_end_gives_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="megapack"):
        assert take(lockstep_steps(iter(range(4)), micro_batches=2, topology=ONE, check=False)) == [
            [0, 1],
            [2, 3],
        ]
    assert warned(caplog) == []


def test_lockstep_steps_a_failing_iterator_raises_its_own_error_then_ends() -> None:
    steps = lockstep_steps(failing(6, 3), micro_batches=2, topology=ONE, check=False)
    assert items(next(steps)) == [0, 1]  # type: ignore[arg-type]
    with pytest.raises(OSError, match="bad shard at 3") as caught:
        next(steps)
    assert any("raised on rank 0 at step 1" in n for n in caught.value.__notes__)
    with pytest.raises(RuntimeError, match="ended with an error at step 1"):
        next(steps)


def test_lockstep_steps_schedule_taking_fewer_items_is_an_error_at_the_next_step() -> None:
    steps = lockstep_steps(iter(range(8)), micro_batches=3, topology=ONE, check=False)
    first = next(steps)
    assert next(first) == 0  # type: ignore[call-overload]
    with pytest.raises(ValueError, match=r"the schedule took 1 of step 0's 3 micro-batches on rank 0; the rest would be lost"):  # fmt: skip
        next(steps)


def test_lockstep_steps_schedule_asking_for_more_items_is_an_error() -> None:
    step = next(lockstep_steps(iter(range(8)), micro_batches=2, topology=ONE, check=False))
    assert isinstance(step, StepIterator) and [next(step), next(step)] == [0, 1] and len(step) == 0
    with pytest.raises(ValueError, match=r"asked for micro-batch 3 of step 0, which holds 2: pass the schedule's num_microbatches"):  # fmt: skip
        next(step)


def test_lockstep_steps_read_every_chunk_of_a_virtual_pipeline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    topo = megapack.Topology(
        tp_group=None, tp_ranks=(0,), tp_rank=0, pp_size=2, vp_stage=0, vp_size=2
    )
    steps = lockstep_steps(
        [iter(range(4)), iter(range(10, 13))], micro_batches=2, topology=topo, check=False
    )
    first = next(steps)
    assert isinstance(first, list) and [items(c) for c in first] == [[0, 1], [10, 11]]  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="megapack"), pytest.raises(StopIteration):
        next(steps)
    assert "the data on rank 0 (model chunk 1) ended after 1 of step 1's 2" in warned(caplog)[0][2]


def plain(n: int) -> Iterator[dict[str, torch.Tensor]]:
    """Megatron's plain pretraining micro-batches ([1, 8], no cu_seqlens)."""
    for i in range(n):
        tokens = torch.arange(i, i + 8).view(1, 8)
        yield {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(1, 8),
               "position_ids": torch.arange(8).view(1, 8)}  # fmt: skip


LAST_VP = megapack.Topology(
    tp_group=None, tp_ranks=(0,), tp_rank=0, pp_rank=1, pp_size=2, vp_stage=0, vp_size=2
)  # the last pipeline rank of 2 x 2 chunks: chunk 0 is a middle stage, chunk 1 the last


def test_lockstep_steps_read_the_chunks_that_have_data_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # plain pretraining: the middle chunk has no dataset (Megatron-LM's is_dataset_built_on_rank)
    with caplog.at_level(logging.DEBUG, logger="megapack"):
        first = next(lockstep_steps([None, plain(4)], micro_batches=2, topology=LAST_VP))
    assert isinstance(first, list) and first[0] is None and len(items(first[1])) == 2  # type: ignore[arg-type]
    assert warned(caplog) == []  # unpacked: right, and nothing to warn about


def test_lockstep_steps_refuse_a_middle_chunk_without_data_when_batches_are_packed() -> None:
    # the silent case: the middle chunk would get no cu_seqlens (attention across
    # documents); refused before step 0, naming the stage, the rank and the fix
    ds = PackedDataset(documents(4), 8, micro_batches=2)
    steps = lockstep_steps([None, ds.iterate()], micro_batches=2, topology=LAST_VP)
    with pytest.raises(ValueError) as caught:
        next(steps)
    assert str(caught.value) == (
        "lockstep_steps: rank 0 (pp_rank 1 of 2, virtual chunk 0: data_iterator[0]=None) is the TP "
        "source of a middle pipeline stage without data, but the batches are packed (rank 0 read "
        "packed micro-batches at step 0): a middle stage without data gets no cu_seqlens, so its "
        "attention would run across documents. For packed data build the dataset on TP rank 0 of "
        "every pipeline stage (Megatron-LM: is_dataset_built_on_rank must return True on middle "
        "stages too, e.g. is_dataset_built_on_rank(vp_stage, is_packed_sequence=True)) and pass its "
        "iterator there, as on the first and last stages"
    )
    with pytest.raises(ValueError, match=r"\(rank 0 passed packed=True\)"):  # declared, none read
        next(lockstep_steps([None, plain(0)], micro_batches=2, topology=LAST_VP, packed=True))


def test_lockstep_steps_refuse_what_a_schedule_cannot_take() -> None:
    vp = megapack.Topology(
        tp_group=None, tp_ranks=(0,), tp_rank=0, pp_size=2, vp_stage=0, vp_size=2
    )
    with pytest.raises(ValueError, match=r"virtual pipelining is on \(vp_size=2\): pass a list of 2 data iterators"):  # fmt: skip
        lockstep_steps(iter([]), micro_batches=1, topology=vp)
    with pytest.raises(ValueError, match="lists 3 iterators but virtual pipelining has vp_size=2"):
        lockstep_steps([iter([])] * 3, micro_batches=1, topology=vp)
    with pytest.raises(ValueError, match="data_iterator is an empty list"):
        lockstep_steps([], micro_batches=1, topology=ONE)
    with pytest.raises(TypeError, match=r"data_iterator\[0\] must be an iterator .* got list"):
        lockstep_steps([[1, 2]], micro_batches=1, topology=ONE)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"data_iterator must be an iterator .* got tuple"):
        lockstep_steps((1, 2), micro_batches=1, topology=ONE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1, got 0"):
        lockstep_steps(iter([]), micro_batches=0, topology=ONE)
    with pytest.raises(TypeError, match="micro_batches must be an int >= 1, got str"):
        lockstep_steps(iter([]), micro_batches="2", topology=ONE)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dataset must have a settings\(\) method .* got list"):
        lockstep_steps(iter([]), micro_batches=1, topology=ONE, dataset=[1])


def test_lockstep_steps_source_without_data_on_an_end_stage_is_an_error_before_any_step() -> None:
    with pytest.raises(ValueError, match=r"rank 0 is the TP source of a 'only' pipeline stage but passed data_iterator=None"):  # fmt: skip
        next(lockstep_steps(None, micro_batches=1, topology=ONE))
    middle = megapack.Topology(tp_group=None, tp_ranks=(0,), tp_rank=0, pp_rank=1, pp_size=3)
    with pytest.raises(ValueError, match="no rank reads data"):  # a middle stage may have none
        next(lockstep_steps(None, micro_batches=1, topology=middle))


def documents(n: int) -> list[Document]:
    return [Document(tokens=np.arange(1, 9), loss_mask=np.ones(8, np.float32))] * n


def test_agree_dataset_behind_the_iterator_is_checked_against_the_schedule(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fields = PackedDataset(documents(6), 8, micro_batches=3, loss_fields=True)
    with pytest.raises(ValueError, match=r"dataset is built for micro_batches=3 a step but the schedule runs micro_batches=2, and its loss fields count"):  # fmt: skip
        next(lockstep_steps(fields.iterate(), micro_batches=2, topology=ONE))
    plain = PackedDataset(documents(6), 8, micro_batches=3)
    with caplog.at_level(logging.WARNING, logger="megapack"):
        next(lockstep_steps(plain.iterate(), micro_batches=2, topology=ONE))
    assert warned(caplog) == [("megapack.delivery", logging.WARNING, "megapack: lockstep_steps: rank 0's dataset is built for micro_batches=3 a step but the schedule runs micro_batches=2: its epoch is padded to whole steps of its own (build it with micro_batches=num_microbatches)")]  # fmt: skip
    # found behind a prefetcher too (tp = 1: no group needed)
    with (
        megapack.prefetch(fields.iterate(), topology=ONE) as ahead,
        pytest.raises(ValueError, match="its loss fields count"),
    ):
        next(lockstep_steps(ahead, micro_batches=2, topology=ONE))


# ------------------------------------------------------------------ agreement_errors: the rules


def rank(micro_batches: int = 2, *datasets: dict[str, Any], dp: list[int] | None = None,
         reads: bool = True, problems: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    return {"micro_batches": micro_batches, "reads": reads, "problems": list(problems),
            "datasets": list(datasets), "dp": dp}  # fmt: skip


def ds(**changes: Any) -> dict[str, Any]:
    settings = {"version": 1, "fingerprint": "blake2b-128:aa", "rows": 86, "seed": 0,
                "rows_per_micro_batch": 2, "balance": "token", "dp_rank": 0, "dp_size": 1,
                "micro_batches": 2, "loss_fields": False, "seq_len": 64}  # fmt: skip
    return {**settings, **changes}


def test_agree_rules_pass_for_a_consistent_job() -> None:
    everyone = [(r, rank(2, ds(dp_rank=r % 2, dp_size=2), dp=[r % 2, 2])) for r in range(4)]
    everyone += [(4 + r, rank(2, reads=False, dp=[r % 2, 2])) for r in range(4)]  # TP peers
    assert agreement_errors(everyone) == ([], [])


def test_agree_rules_schedule_counts_and_readers() -> None:
    errors, _ = agreement_errors([(0, rank(2, reads=True)), (1, rank(4, reads=False))])
    assert errors == ["ranks disagree on the schedule's micro-batches a step, micro_batches: rank 0 has 2, rank 1 has 4"]  # fmt: skip
    errors, _ = agreement_errors([(0, rank(reads=False)), (1, rank(reads=False))])
    assert len(errors) == 1 and errors[0].startswith("no rank reads data")
    errors, _ = agreement_errors([(r, rank(problems=(f"rank {r} is wrong",))) for r in range(5)])
    assert errors == ["rank 0 is wrong", "rank 1 is wrong", "rank 2 is wrong", "and 2 more"]


@pytest.mark.parametrize("key", ["rows_per_micro_batch", "micro_batches", "dp_size", "loss_fields"])
def test_agree_rules_step_shape_must_match_on_every_rank(key: str) -> None:
    other = {"rows_per_micro_batch": 1, "micro_batches": 4, "dp_size": 2, "loss_fields": True}[key]
    everyone = [(0, rank(2, ds())), (3, rank(2, ds(**{key: other})))]
    errors, _ = agreement_errors(everyone)
    mine = ds()[key]
    assert errors == [f"the datasets disagree on {key}: rank 0 has {mine!r}, rank 3 has {other!r} (every rank must build its dataset alike)"]  # fmt: skip


@pytest.mark.parametrize(
    ("key", "other"), [("seed", 1), ("fingerprint", "blake2b-128:bb"), ("rows", 87)]
)
def test_agree_rules_dp_shards_share_the_dataset_identity(key: str, other: Any) -> None:
    everyone = [(0, rank(2, ds(dp_size=2))), (1, rank(2, ds(dp_size=2, dp_rank=1, **{key: other})))]
    errors, _ = agreement_errors(everyone)
    assert errors == [f"the DP shards read different datasets, {key}: rank 0 has {ds()[key]!r}, rank 1 has {other!r} (every DP rank must load the same packed data, with its own dp_rank)"]  # fmt: skip
    # per-rank datasets (dp_size 1 each, e.g. evaluation sets packed per rank) may differ
    everyone = [(0, rank(2, ds())), (1, rank(2, ds(**{key: other})))]
    assert agreement_errors(everyone) == ([], [])


def test_agree_rules_with_megatron_parallel_state() -> None:
    # tp 1 x pp 2 x dp 2: ranks 0, 1 are stage 0 of DP ranks 0, 1; ranks 2, 3 stage 1
    good = [(r, rank(2, ds(dp_rank=r % 2, dp_size=2), dp=[r % 2, 2])) for r in range(4)]
    assert agreement_errors(good) == ([], [])
    wrong = [
        *good[:3],
        (3, rank(2, ds(dp_rank=0, dp_size=2), dp=[1, 2])),
    ]  # stage 1 of DP 1 reads shard 0
    errors, _ = agreement_errors(wrong)
    assert errors[0].startswith("rank 3's dataset is DP shard 0 of 2 but megatron-core's parallel_state puts rank 3 at DP rank 1 of 2")  # fmt: skip
    assert errors[1] == "the pipeline stages and CP ranks of DP rank 1 read different data, dp_rank: rank 1 has 1, rank 3 has 0 (they must read the same micro-batches)"  # fmt: skip
    # per-rank datasets: a pipeline's stages must still read the same one
    split = [(0, rank(2, ds(), dp=[0, 2])), (1, rank(2, ds(seed=1), dp=[1, 2])),
             (2, rank(2, ds(), dp=[0, 2])), (3, rank(2, ds(seed=2), dp=[1, 2]))]  # fmt: skip
    errors, _ = agreement_errors(split)
    assert errors == ["the pipeline stages and CP ranks of DP rank 1 read different data, seed: rank 1 has 1, rank 3 has 2 (they must read the same micro-batches)"]  # fmt: skip


def test_agree_rules_warn_when_every_dp_rank_reads_the_same_data() -> None:
    same = [(r, rank(2, ds(), dp=[r % 2, 2])) for r in range(4)]  # forgot dp_rank/dp_size
    errors, cautions = agreement_errors(same)
    assert errors == [] and len(cautions) == 1
    ranks, text = cautions[0]
    assert ranks == {0, 1, 2, 3} and text.startswith("ranks [0, 1] are on different DP ranks but read the same dataset with dp_size=1")  # fmt: skip
    differ = [(r, rank(2, ds(fingerprint=f"blake2b-128:{r % 2}"), dp=[r % 2, 2])) for r in range(4)]
    assert agreement_errors(differ) == ([], [])


def test_agree_rules_dataset_steps_against_the_schedule() -> None:
    errors, cautions = agreement_errors(
        [(0, rank(2, ds(micro_batches=3))), (1, rank(2, reads=False))]
    )
    assert errors == [] and cautions == [({0}, "rank 0's dataset is built for micro_batches=3 a step but the schedule runs micro_batches=2: its epoch is padded to whole steps of its own (build it with micro_batches=num_microbatches)")]  # fmt: skip
    errors, cautions = agreement_errors([(0, rank(2, ds(micro_batches=3, loss_fields=True)))])
    assert (
        len(errors) == 1 and "every loss denominator would be wrong" in errors[0] and cautions == []
    )


# ---- the schedule's seq_length and micro_batch_size


def test_schedule_shape_of_every_kind_of_item() -> None:
    import torch

    from megapack.delivery.agreement import schedule_shape

    row = megapack.PackedBatch.from_documents([[1, 2, 3], [4, 5]], seq_len=8)
    two_rows = megapack.PackedBatch.concat([row, row])
    assert schedule_shape(two_rows) == (16, 1, True)  # one [1, 2 x seq_len] row
    sft = {
        "tokens": torch.zeros(2, 8, dtype=torch.long),
        "cu_seqlens": torch.tensor([[0, 8], [0, 8]]),
    }
    assert schedule_shape(sft) == (16, 1, True)  # Megatron SFT rows merge into one THD row
    assert schedule_shape({"tokens": torch.zeros(4, 8, dtype=torch.long)}) == (8, 4, False)
    delivered = megapack.get_batch_on_this_tp_rank(iter([two_rows]), topology=ONE)
    assert schedule_shape(delivered, cp_size=2) == (32, 1, True)  # a CP share of a 32-token row
    assert schedule_shape({"tokens": None, "packed_seq_params": object()}) is None  # a middle stage


def test_a_schedule_of_another_shape_is_named_before_the_step() -> None:
    ds = PackedDataset(documents(8), 16, rows_per_micro_batch=2, micro_batches=2)
    with pytest.raises(
        ValueError,
        match=r"micro-batch 0 of step 0: the schedule's seq_length=16, micro_batch_size=2 do not "
        r"fit it: a packed micro-batch is one \[1, 32\] row .* pass seq_length=32, "
        r"micro_batch_size=1 to the schedule",
    ):
        next(lockstep_steps(ds.iterate(), micro_batches=2, topology=ONE, seq_length=16,
                            micro_batch_size=2))  # fmt: skip
    good = lockstep_steps(ds.iterate(), micro_batches=2, topology=ONE, seq_length=32,
                          micro_batch_size=1)  # fmt: skip
    assert len(items(next(good))) == 2
    with pytest.raises(
        ValueError, match="give the schedule's seq_length and micro_batch_size together"
    ):
        lockstep_steps(ds.iterate(), micro_batches=2, topology=ONE, seq_length=32)
    with pytest.raises(TypeError, match="seq_length must be an int"):
        lockstep_steps(ds.iterate(), micro_batches=2, topology=ONE, seq_length=32.0,  # type: ignore[arg-type]
                       micro_batch_size=1)  # fmt: skip


# ------------------------------------------------------------------ checking batches before the step


def broken_at(batches: Iterator[Any], at: int) -> Iterator[Any]:
    """``batches`` with item ``at``'s boundaries out of order (what get_batch refuses)."""
    for i, item in enumerate(batches):
        if i == at:
            item = dataclasses.replace(
                item, cu_seqlens=torch.tensor([0, 6, 3, 8], dtype=torch.int32)
            )
        yield item


def test_lockstep_steps_a_bad_batch_stops_before_its_step() -> None:
    # without prefetch the source used to find it only inside the schedule (later stages waiting)
    steps = lockstep_steps(
        broken_at(PackedDataset(documents(6), 8).iterate(), 3), micro_batches=2, topology=ONE
    )
    assert len(items(next(steps))) == 2  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cu_seqlens") as caught:
        next(steps)
    # in the message itself: other ranks get only str(exc), as RemoteDataError
    assert str(caught.value).startswith(
        "lockstep_steps: micro-batch 1 of step 1, checked before the step as "
        "get_batch_on_this_tp_rank's source will: PackedBatch.cu_seqlens"
    )
    with pytest.raises(RuntimeError, match="ended with an error at step 1"):
        next(steps)
    # check=False hands it on as it is (a forward step of the trainer's own reads it)
    unchecked = lockstep_steps(
        broken_at(PackedDataset(documents(6), 8).iterate(), 1),
        micro_batches=2,
        topology=ONE,
        check=False,
    )
    assert len(items(next(unchecked))) == 2  # type: ignore[arg-type]


def test_lockstep_steps_dataset_given_is_the_one_checked() -> None:
    # behind a generator the dataset is not found; given, its settings meet the schedule's
    loss = PackedDataset(documents(6), 8, micro_batches=3, loss_fields=True)
    hidden = (b for b in loss.iterate())
    with pytest.raises(ValueError, match="its loss fields count"):
        next(lockstep_steps(hidden, micro_batches=2, topology=ONE, dataset=loss, check=False))
    fits = PackedDataset(documents(4), 8, micro_batches=2, loss_fields=True)
    steps = lockstep_steps(
        fits.iterate(), micro_batches=2, topology=ONE, dataset=fits, fields=megapack.LOSS_FIELDS
    )
    assert len(items(next(steps))) == 2  # type: ignore[arg-type]


def test_lockstep_steps_check_with_get_batch_s_options() -> None:
    loss = PackedDataset(documents(4), 8, micro_batches=2, loss_fields=True)
    with pytest.raises(ValueError, match=r"undeclared keys \['loss_documents', 'loss_step'\]"):
        next(lockstep_steps(loss.iterate(), micro_batches=2, topology=ONE))
    declared = lockstep_steps(
        loss.iterate(), micro_batches=2, topology=ONE, fields=megapack.LOSS_FIELDS
    )
    assert len(items(next(declared))) == 2  # type: ignore[arg-type]
    # a micro-batch over the static cap (3 rows of one document: 3 segments) is named before the step
    three = PackedDataset(documents(6), 8, rows_per_micro_batch=3, micro_batches=2)
    with pytest.raises(ValueError, match="max_segments"):
        next(
            lockstep_steps(
                three.iterate(),
                micro_batches=2,
                topology=ONE,
                static=megapack.StaticShape(max_segments=2, max_seqlen=8),
            )
        )
    with pytest.raises(ValueError, match="packed=False"):  # packed batches, plain expected
        next(lockstep_steps(three.iterate(), micro_batches=2, topology=ONE, packed=False))


def test_lockstep_steps_refuse_bad_check_options_on_creation() -> None:
    with pytest.raises(
        TypeError, match="lockstep_steps: packed must be True, False or None, got 'yes'"
    ):
        lockstep_steps(iter([]), micro_batches=1, topology=ONE, packed="yes")
    with pytest.raises(ValueError, match="lockstep_steps: cp_layout must be one of"):
        lockstep_steps(iter([]), micro_batches=1, topology=ONE, cp_layout="rows")
    with pytest.raises(TypeError, match="unexpected keyword argument 'field'"):
        lockstep_steps(iter([]), micro_batches=1, topology=ONE, field=())
    with pytest.raises(TypeError, match="check must be True or False, got 'no'"):
        lockstep_steps(iter([]), micro_batches=1, topology=ONE, check="no")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["seq_length", "micro_batch_size"])
def test_lockstep_steps_schedule_sizes_must_be_positive(name: str) -> None:
    sizes = {"seq_length": 16, "micro_batch_size": 1} | {name: 0}
    with pytest.raises(ValueError, match=f"^{name} must be an int >= 1, got 0$"):
        lockstep_steps(iter([]), micro_batches=1, topology=ONE, **sizes)
    assert lockstep_steps(iter([]), micro_batches=1, topology=ONE, **(sizes | {name: 1}))


def test_step_lockstep_made_directly_checks_batches_too() -> None:
    steps = StepLockstep(
        broken_at(PackedDataset(documents(4), 8).iterate(), 0), micro_batches=2, topology=ONE
    )
    with pytest.raises(ValueError, match="cu_seqlens"):
        next(steps)


# ------------------------------------------------------------------ errors that name the fix


def test_lockstep_steps_without_fields_over_loss_fields_names_itself_and_the_fix() -> None:
    # the case: a loss_fields=True dataset, lockstep_steps without fields=. The message
    # (all that other ranks receive, as RemoteDataError) names lockstep_steps and the fix.
    from megapack.core.fields import schema_of
    from megapack.core.intake import to_batch

    loss = PackedDataset(documents(4), 8, micro_batches=2, loss_fields=True)
    with pytest.raises(ValueError) as caught:
        next(lockstep_steps(loss.iterate(), micro_batches=2, topology=ONE))
    with pytest.raises(ValueError) as inner:  # what get_batch's own check says of the batch
        to_batch(loss[0], schema_of(()), packed=None)
    assert str(caught.value) == (
        "lockstep_steps: micro-batch 0 of step 0, checked before the step as "
        f"get_batch_on_this_tp_rank's source will: {inner.value}"
    )
    assert "fields=megapack.LOSS_FIELDS" in str(caught.value)


# ------------------------------------------------------------------ the loop says how it ended


def records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if "stopped at step" in r.getMessage()]  # fmt: skip


def test_lockstep_steps_log_one_line_when_the_data_ends(caplog: pytest.LogCaptureFixture) -> None:
    # 4 rows of 8 tokens (7 trained each: a document's last token has no label), 2 a step
    ds = PackedDataset(documents(4), 8, micro_batches=2)
    with caplog.at_level(logging.INFO, logger="megapack"):
        assert len(take(lockstep_steps(ds.iterate(), micro_batches=2, topology=ONE))) == 2
    assert records(caplog) == [(logging.INFO, (
        "megapack: lockstep_steps stopped at step 2: the data on rank 0 ended at the step "
        "boundary; trained 2 steps and 28 trained tokens (loss_mask non-zero) handed to the "
        "schedule across the job"))]  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megapack"):  # a partial step: a warning
        assert len(take(lockstep_steps(ds.iterate(), micro_batches=3, topology=ONE))) == 1
    assert records(caplog) == [(logging.WARNING, (
        "megapack: lockstep_steps stopped at step 1: the data on rank 0 ended after 1 of its 3 "
        "micro-batches (the partial step is not run); trained 1 step and 21 trained tokens "
        "(loss_mask non-zero) handed to the schedule across the job"))]  # fmt: skip


def test_lockstep_steps_log_one_line_when_the_data_fails(caplog: pytest.LogCaptureFixture) -> None:
    ds = PackedDataset(documents(6), 8, micro_batches=2)
    steps = lockstep_steps(broken_at(ds.iterate(), 3), micro_batches=2, topology=ONE)
    with caplog.at_level(logging.INFO, logger="megapack"), pytest.raises(ValueError) as caught:
        take(steps)
    assert records(caplog) == [(logging.ERROR, (
        f"megapack: lockstep_steps stopped at step 1: rank 0 failed: ValueError: {caught.value}; "
        "trained 1 step and 14 trained tokens (loss_mask non-zero) handed to the schedule across "
        "the job"))]  # fmt: skip


def test_lockstep_steps_count_only_what_the_schedule_took(caplog: pytest.LogCaptureFixture) -> None:
    # items read ahead but not taken are not trained: the count follows the schedule
    ds = PackedDataset(documents(4), 8, micro_batches=2)
    steps = lockstep_steps(ds.iterate(), micro_batches=2, topology=ONE)
    first = next(steps)
    next(first)  # type: ignore[call-overload]
    with caplog.at_level(logging.INFO, logger="megapack"), pytest.raises(ValueError):
        next(steps)  # took 1 of 2: an error at the next step
    assert "trained 1 step and 7 trained tokens" in records(caplog)[0][1]


def test_agree_middle_stages_without_data_only_when_batches_are_packed() -> None:
    def middle(r: int, pp: int = 8) -> dict[str, Any]:
        return rank(reads=False) | {"middle": [[r, pp, "data_iterator=None", None]]}

    plain = [(0, rank() | {"packed": False}), *[(r, middle(r)) for r in range(1, 7)]]
    assert agreement_errors(plain) == ([], [])  # plain pretraining: nothing to send them
    unknown = [(0, rank() | {"packed": None}), (1, middle(1))]  # items that do not say
    assert agreement_errors(unknown) == ([], [])
    packed = [(0, rank() | {"packed": True}), *[(r, middle(r)) for r in range(1, 7)]]
    (error,) = agreement_errors(packed)[0]
    assert error.startswith(
        "ranks 1 (pp_rank 1 of 8: data_iterator=None), 2 (pp_rank 2 of 8: data_iterator=None), "
        "3 (pp_rank 3 of 8: data_iterator=None), 4 (pp_rank 4 of 8: data_iterator=None) and 2 "
        "more are TP sources of middle pipeline stages without data, but the batches are packed "
        "(rank 0 read packed micro-batches at step 0): "
    )
    declared = [(0, rank() | {"packed_option": True}), (1, middle(1))]
    assert "(rank 0 passed packed=True)" in agreement_errors(declared)[0][0]


# ------------------------------------------------------------------ what mutation testing found unguarded
# (docs/records/mutation.md, 2026-11-28)


def test_a_bad_batch_says_what_to_pass_unless_the_intake_named_megapacks_fields() -> None:
    bad = dataclasses.replace(PackedDataset(documents(4), 8)[0],
                              cu_seqlens=torch.tensor([0, 6, 3, 8], dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError) as caught:
        next(lockstep_steps(iter([bad, bad]), micro_batches=2, topology=ONE))
    assert str(caught.value) == (
        "lockstep_steps: micro-batch 0 of step 0, checked before the step as "
        "get_batch_on_this_tp_rank's source will: PackedBatch.cu_seqlens is not strictly "
        "increasing: 3 follows 6 at index 2 (pass get_batch's fields=/packed=/static= to "
        "lockstep_steps too; check=False: not a megapack batch)"
    )
    assert caught.value.__traceback__ is not None


def test_an_item_the_check_cannot_read_keeps_its_error_with_a_note() -> None:
    class Unreadable(dict):  # type: ignore[type-arg]
        """A batch dict whose storage is gone: every read raises."""

        def __getitem__(self, key: Any) -> Any:
            raise RuntimeError("storage gone")

        def get(self, key: Any, default: Any = None) -> Any:
            raise RuntimeError("storage gone")

    item = Unreadable(tokens=torch.zeros(1, 8, dtype=torch.long), cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(RuntimeError) as caught:
        next(lockstep_steps(iter([item, item]), micro_batches=2, topology=ONE))
    assert str(caught.value) == "storage gone"
    assert caught.value.__notes__[0] == (
        "megapack.lockstep_steps: micro-batch 0 of step 0, checked before the step as "
        "get_batch_on_this_tp_rank's source will (check=False: not a megapack batch; pass "
        "get_batch's fields=/packed=/static= here too)"
    )


def test_an_ended_lockstep_stays_ended_whatever_its_iterator_does_next() -> None:
    class Pausing:
        """Ends once after 3 items, then goes on (a stream that refills)."""

        def __init__(self) -> None:
            self.values, self.paused = list(range(8)), False

        def __iter__(self) -> Pausing:
            return self

        def __next__(self) -> int:
            if len(self.values) == 5 and not self.paused:
                self.paused = True
                raise StopIteration
            return self.values.pop(0)

    source = Pausing()
    steps = lockstep_steps(source, micro_batches=2, topology=ONE, check=False)
    assert take(steps) == [[0, 1]]  # 2 then the pause: a partial step, not run
    with pytest.raises(StopIteration):
        next(steps)
    assert source.values == [3, 4, 5, 6, 7]  # nothing read after the end


def test_the_schedule_taking_fewer_items_names_the_model_chunk() -> None:
    steps = lockstep_steps([iter(range(8))], micro_batches=2, topology=ONE, check=False)
    first = next(steps)
    next(first[0])  # type: ignore[index,call-overload]
    with pytest.raises(ValueError) as caught:
        next(steps)
    assert str(caught.value) == (
        "lockstep_steps(micro_batches=2): the schedule took 1 of step 0's 2 micro-batches of "
        "model chunk 0 on rank 0; the rest would be lost: pass the schedule's num_microbatches "
        "as micro_batches="
    )


def test_wrong_lists_of_iterators_are_named_with_the_fix() -> None:
    with pytest.raises(ValueError) as caught:
        lockstep_steps([], micro_batches=2, topology=ONE)
    assert str(caught.value) == (
        "lockstep_steps: data_iterator is an empty list; give one per chunk"
    )
    vp = dataclasses.replace(ONE, vp_stage=0, vp_size=2)
    with pytest.raises(ValueError) as caught:
        lockstep_steps(iter(range(4)), micro_batches=2, topology=vp)
    assert str(caught.value) == (
        "lockstep_steps: virtual pipelining is on (vp_size=2): pass a list of 2 data iterators, "
        "one per model chunk, as megatron-core's interleaved schedule takes"
    )


class Group:
    """A process group's stand-in where a topology only names one (nothing collective runs)."""


def test_a_tp_peers_iterator_is_ignored_with_a_warning_and_has_no_position(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def peer() -> megapack.Topology:  # a TP group of its own: the warning is once per group
        return megapack.Topology(tp_group=Group(), tp_ranks=(0, 1), tp_rank=1)

    ds = PackedDataset(documents(4), 8, micro_batches=2)
    with caplog.at_level(logging.WARNING, logger="megapack"):
        steps = lockstep_steps(ds.iterate(), micro_batches=2, topology=peer())
    assert warned(caplog) == [("megapack.delivery", logging.WARNING, (
        "megapack: lockstep_steps: rank 1 is TP rank 1, not its group's TP source (global rank "
        "0): its data_iterator is ignored. Only the TP source reads data and sends every TP "
        "rank the same batch; pass data_iterator=None on the other TP ranks (as Megatron builds "
        "the data iterator only on TP rank 0)"))]  # fmt: skip
    assert steps.state_dict()["iterators"] == [None]
    caplog.clear()
    source = megapack.Topology(tp_group=Group(), tp_ranks=(0, 1), tp_rank=0)
    with caplog.at_level(logging.WARNING, logger="megapack"):
        lockstep_steps(None, micro_batches=2, topology=peer())  # nothing given: nothing to say
        lockstep_steps(ds.iterate(), micro_batches=2, topology=source)  # the source reads it
    assert warned(caplog) == []


def test_the_last_pipeline_stage_counts_the_trained_tokens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every micro-batch is counted once in the job: on its last stage's TP source (with
    virtual pipelining the chunk of the last stage; a list without it: unknown, none)."""
    ds = PackedDataset(documents(4), 8, micro_batches=2)  # 2 steps of 14 trained tokens

    def trained(data: Any, **place: Any) -> str:
        topo = megapack.Topology(tp_group=None, tp_ranks=(0,), tp_rank=0, **place)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megapack"):
            for step in lockstep_steps(data, micro_batches=2, topology=topo):
                for chunk in step if isinstance(step, list) else [step]:
                    if chunk is not None:
                        items(chunk)
        return records(caplog)[0][1].split("; trained ")[1].split(" (")[0]

    assert trained(ds.iterate()) == "2 steps and 28 trained tokens"
    assert trained(ds.iterate(), pp_rank=0, pp_size=2) == "2 steps and 0 trained tokens"
    assert trained(ds.iterate(), pp_rank=1, pp_size=2) == "2 steps and 28 trained tokens"
    chunks = {"pp_rank": 1, "pp_size": 2, "vp_stage": 0, "vp_size": 2}
    assert trained([ds.iterate(), ds.iterate()], **chunks) == "2 steps and 28 trained tokens"
    assert trained([ds.iterate()]) == "2 steps and 0 trained tokens"  # which chunk: unknown
    # a chunk without data in a list without virtual pipelining: not known to be an error
    assert trained([None, ds.iterate()]) == "2 steps and 0 trained tokens"


def test_the_trained_tokens_of_whole_rows_count_on_cp_rank_0_and_of_shares_on_every_rank(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A data iterator's rows are read whole on every CP rank: counted once, on CP rank 0; a
    delivered batch (`megapack.prefetch`'s dict) is this rank's share: counted everywhere."""
    rows = PackedDataset(documents(4), 8, micro_batches=2)
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    shares = [{"packed_seq_params": None, "loss_mask": mask}] * 2
    cases = [(0, list(rows.iterate())[:2], 14), (1, list(rows.iterate())[:2], 0),
             (1, shares, 6), (0, shares, 6)]  # fmt: skip
    for cp_rank, source, trained in cases:
        topo = megapack.Topology(tp_group=None, tp_ranks=(0,), tp_rank=0, cp_group=Group(),
                                 cp_ranks=(0, 1), cp_rank=cp_rank)  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megapack"):
            assert len(take(lockstep_steps(iter(source), micro_batches=2, topology=topo,
                                           check=False))) == 1  # fmt: skip
        assert f"trained 1 step and {trained} trained tokens" in records(caplog)[0][1], (
            cp_rank,
            trained,
        )


def test_the_datasets_of_every_chunk_are_checked() -> None:
    fits = PackedDataset(documents(4), 8, micro_batches=2)
    other = PackedDataset(documents(6), 8, micro_batches=3, loss_fields=True)
    with pytest.raises(ValueError, match=r"the datasets disagree on micro_batches: rank 0 has 2, "
                                         r"rank 0 has 3 \(every rank must build its dataset"):  # fmt: skip
        next(lockstep_steps([fits.iterate(), other.iterate()], micro_batches=2, topology=ONE,
                            check=False))  # fmt: skip


def test_a_failed_agreement_notes_that_the_read_failed_too() -> None:
    loss = PackedDataset(documents(6), 8, micro_batches=3, loss_fields=True)
    with pytest.raises(ValueError) as caught:
        next(lockstep_steps(failing(4, 0), micro_batches=2, topology=ONE, dataset=loss,
                            check=False))  # fmt: skip
    assert "its loss fields count" in str(caught.value)
    assert [n for n in getattr(caught.value, "__notes__", []) if "read of step 0" in n] == [
        "megapack.lockstep_steps: this rank's read of step 0 failed too: OSError('bad shard at 0')"
    ]
    with pytest.raises(ValueError) as caught:  # the read went well: no such note
        next(lockstep_steps(iter(range(4)), micro_batches=2, topology=ONE, dataset=loss,
                            check=False))  # fmt: skip
    assert not [n for n in getattr(caught.value, "__notes__", []) if "read of step 0" in n]


@pytest.mark.parametrize("end", ["boundary", "partial", "failure"])
def test_one_rank_of_a_process_group_runs_the_steps_and_reports_the_end(
    world: Any, caplog: pytest.LogCaptureFixture, end: str
) -> None:
    """The step status and the end report go through the group's collectives (one rank here;
    many: tests/functional/test_schedule_lockstep.py, test_lockstep_agreement.py)."""
    ds = PackedDataset(documents(6), 8, micro_batches=2)
    source = {"boundary": ds.iterate(), "partial": iter(list(ds.iterate())[:5]),
              "failure": broken_at(ds.iterate(), 3)}[end]  # fmt: skip
    steps = lockstep_steps(source, micro_batches=2, topology=ONE, group=world, timeout=30.0)
    with caplog.at_level(logging.INFO, logger="megapack"):
        got = []
        try:
            for step in steps:
                got.append(items(step))  # type: ignore[arg-type]
        except ValueError as exc:
            assert end == "failure" and "cu_seqlens" in str(exc)
    trained = (
        f"trained {len(got)} step{'' if len(got) == 1 else 's'} and {14 * len(got)} trained tokens"
    )
    (level, line), = records(caplog)  # fmt: skip
    if end == "boundary":
        assert len(got) == 3 and level == logging.INFO
        assert line.startswith("megapack: lockstep_steps stopped at step 3: the data on rank 0 "
                               "ended at the step boundary; " + trained)  # fmt: skip
    elif end == "partial":
        assert len(got) == 2 and level == logging.WARNING
        assert line.startswith("megapack: lockstep_steps stopped at step 2: the data on rank 0 "
                               "ended after 1 of its 2 micro-batches (the partial step is not "
                               "run); " + trained)  # fmt: skip
    else:
        assert len(got) == 1 and level == logging.ERROR
        assert line.startswith("megapack: lockstep_steps stopped at step 1: rank 0 failed: "
                               "ValueError: lockstep_steps: micro-batch 1 of step 1")  # fmt: skip
        assert line.endswith(
            trained + " (loss_mask non-zero) handed to the schedule across the job"
        )
    with pytest.raises((StopIteration, RuntimeError)):
        next(steps)  # it stays ended
