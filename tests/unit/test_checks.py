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


def test_check_seconds() -> None:
    assert check_seconds("timeout", 2) == 2.0 and check_seconds("timeout", 0.5) == 0.5
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"^timeout must be a positive number of seconds"):
            check_seconds("timeout", bad)
    for bad in ("5", True, None):
        with pytest.raises(TypeError, match=r"^timeout must be a positive number of seconds, got "):
            check_seconds("timeout", bad)


def test_public_functions_agree_on_exception_types() -> None:
    from megapack import PackedBatch, align_by_kind
    from megapack.data import PackedDataset, documents_from_eos, split_document
    from megapack.data.document import Document
    from megapack.packing import plan

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


def test_docstring_examples() -> None:
    result = doctest.testmod(checks)
    assert result.failed == 0 and result.attempted > 0
