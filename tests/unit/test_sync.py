"""`megapack.distributed.sync`'s helpers that need no process group: the lockstep flag's argument
checks, the settings gather's single-process form and `disagreement`'s messages. The collective
paths run on the pool: tests/functional/test_fault_injection.py (lockstep), test_lockstep_agreement.py
and test_schedule_lockstep.py (lockstep_steps)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megapack.distributed.sync import FAILED, HAVE, OUT, disagreement, gather_settings, step_status


def test_agree_disagreement_names_both_ranks_and_values() -> None:
    entries = [
        (0, {"seed": 1, "rows": 8}),
        (2, {"seed": 1, "rows": 8}),
        (5, {"seed": 1, "rows": 9}),
    ]
    assert disagreement(entries, ["seed", "rows"]) == "rows: rank 0 has 8, rank 5 has 9"
    # the first key in the given order wins, then the first rank that differs
    entries[1][1]["seed"] = 2
    assert disagreement(entries, ["seed", "rows"]) == "seed: rank 0 has 1, rank 2 has 2"
    assert disagreement(entries, ["rows", "seed"]) == "rows: rank 0 has 8, rank 5 has 9"


def test_agree_disagreement_none_when_equal_and_missing_reads_none() -> None:
    assert disagreement([(0, {"a": 1}), (1, {"a": 1})], ["a"]) is None
    assert disagreement([], ["a"]) is None
    assert disagreement([(3, {"a": 1})], ["a", "b"]) is None
    assert disagreement([(0, {"a": 1}), (1, {})], ["a"]) == "a: rank 0 has 1, rank 1 has None"
    assert (
        disagreement([(0, {"a": "x"}), (1, {"a": "y"})], ["a"])
        == "a: rank 0 has 'x', rank 1 has 'y'"
    )


def test_agree_gather_settings_without_a_process_group_is_this_rank_as_json() -> None:
    assert not dist.is_initialized()
    got = gather_settings({"seed": 3, "plan": (2, 4), "none": None})
    assert got == [(0, {"seed": 3, "plan": [2, 4], "none": None})]  # what every rank would see
    assert gather_settings(None) == [(0, None)]


@pytest.mark.parametrize(
    ("status", "error", "message"),
    [
        (2, None, "status must be HAVE (1), OUT (0) or FAILED (-1), got 2"),
        (FAILED, None, "pass error= exactly when status is FAILED"),
        (HAVE, OSError("x"), "pass error= exactly when status is FAILED"),
        (OUT, OSError("x"), "pass error= exactly when status is FAILED"),
    ],
)
def test_lockstep_step_status_checks_its_arguments_before_any_collective(
    status: int, error: BaseException | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        step_status(status, error, 0, group=None)
