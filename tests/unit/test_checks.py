"""`megapack.core.checks`: TypeError for a wrong type, ValueError for a bad value, both naming argument and value."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from megapack.core import checks
from megapack.core.checks import check_int, check_seconds


def test_check_int() -> None:
    assert check_int("n", 3, minimum=1) == 3 and check_int("n", np.int32(3)) == 3
    assert type(check_int("n", np.int64(5))) is int
    with pytest.raises(ValueError, match=r"^n must be an int >= 1, got 0$"):
        check_int("n", 0, minimum=1)
    for bad, shown in [
        (1.0, "float 1.0"),
        ("3", "str '3'"),
        (True, "bool True"),
        (None, "NoneType None"),
    ]:
        with pytest.raises(TypeError, match=rf"^n must be an int >= 1, got {shown}$"):
            check_int("n", bad, minimum=1)
    with pytest.raises(TypeError, match=r"^n must be an int, got float 2.5$"):
        check_int("n", 2.5)
    assert check_int("n", 19, minimum=0, maximum=19) == 19 and check_int("n", -4, maximum=0) == -4
    with pytest.raises(ValueError, match=r"^n must be an int from 0 to 19, got 20$"):
        check_int("n", 20, minimum=0, maximum=19)
    with pytest.raises(ValueError, match=r"^n must be an int <= 0, got 1$"):
        check_int("n", 1, maximum=0)
    with pytest.raises(TypeError, match=r"^n must be an int from 0 to 19, got bool False$"):
        check_int("n", False, minimum=0, maximum=19)


def test_check_seconds() -> None:
    assert check_seconds("timeout", 2) == 2.0 and check_seconds("timeout", 0.5) == 0.5
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"^timeout must be a positive number of seconds"):
            check_seconds("timeout", bad)
    for bad in ("5", True, None):
        with pytest.raises(TypeError, match=r"^timeout must be a positive number of seconds, got "):
            check_seconds("timeout", bad)


def test_public_functions_agree_on_exception_types() -> None:
    from megapack import PackedBatch
    from megapack.data import PackedDataset, documents_from_eos, split_document
    from megapack.data.document import Document
    from megapack.packing import align_by_kind, plan

    doc = Document(tokens=[1, 2, 3], loss_mask=[1, 1, 1])
    wrong_type = [
        lambda: PackedBatch.from_documents([[1, 2]], seq_len=8.0),
        lambda: PackedBatch.from_documents([[1, 2]], pad_to_multiple_of="2"),
        lambda: PackedDataset([doc], 64.0),
        lambda: split_document(doc, 2.0),
        lambda: align_by_kind([], 2.0, kind=str, make_padding=str),
        lambda: documents_from_eos([1, 2], eos_id=1.0),
        lambda: plan([3], 4.0),
    ]
    bad_value = [
        lambda: PackedBatch.from_documents([[1, 2]], seq_len=0),
        lambda: PackedBatch.from_documents([[1, 2]], pad_to_multiple_of=0),
        lambda: PackedDataset([doc], 0),
        lambda: split_document(doc, 0),
        lambda: align_by_kind([], 0, kind=str, make_padding=str),
        lambda: documents_from_eos([1, 2], eos_id=-1),
        lambda: plan([3], 0),
    ]
    for call in wrong_type:
        with pytest.raises(TypeError, match=r"must be an int.*, got (float|str) "):
            call()  # type: ignore[no-untyped-call]
    for call in bad_value:
        with pytest.raises(ValueError, match=r"must be an int >= -?\d, got -?\d+$"):
            call()  # type: ignore[no-untyped-call]


def test_int_arguments_of_the_batch_contract_delivery_harness_and_bench_agree() -> None:
    from megapack import prefetch
    from megapack.bench.modes import plan_step
    from megapack.core.cp_pad import cp_pad_multiple
    from megapack.core.cp_share import cp_indices
    from megapack.harness.grid import grid_topology
    from megapack.harness.pool import WorkerPool

    calls = {  # argument -> a call with that argument set to the value
        "cp_size": lambda v: cp_indices([0, 8], v, 0),
        "cp_rank": lambda v: cp_indices([0, 8], 2, v),
        "pad_to_multiple_of": lambda v: cp_pad_multiple(2, v),
        "prefetch depth": lambda v: prefetch(iter([]), depth=v),
        "prefetch nice": lambda v: prefetch(iter([]), nice=v),
        "grid_topology: pp": lambda v: grid_topology(1, v),
        "size": lambda v: WorkerPool(size=v),
        "rows": lambda v: plan_step([3], 8, v, 1),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"^{name} must be an int.*, got float 2\.0$"):
            call(2.0)
        with pytest.raises(ValueError, match=rf"^{name} must be an int.*, got -1$"):
            call(-1)


def test_docstring_examples() -> None:
    result = doctest.testmod(checks)
    assert result.failed == 0 and result.attempted > 0
