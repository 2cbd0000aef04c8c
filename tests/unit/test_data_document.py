"""Document: conversions, read-only arrays, validation errors, equality, and use in PackedBatch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from megapack import PackedBatch
from megapack.data import Document


def test_converts_dtypes_and_exposes_length() -> None:
    doc = Document(
        tokens=np.array([5, 6, 7], dtype=np.uint16),
        loss_mask=[False, True, True],
        boundaries=(np.int64(1),),
        source="a.jsonl:3",
    )
    assert doc.tokens.dtype == np.int64 and doc.tokens.tolist() == [5, 6, 7]
    assert doc.loss_mask.dtype == np.float32 and doc.loss_mask.tolist() == [0, 1, 1]
    assert doc.boundaries == (1,) and type(doc.boundaries[0]) is int
    assert len(doc) == 3 and doc.num_learned == 2
    assert repr(doc) == (
        "Document(source='a.jsonl:3', num_tokens=3, num_learned=2, boundaries=(1,), tokens=[5, 6, 7])"
    )


def test_arrays_are_read_only_but_the_callers_stay_writeable() -> None:
    mine = np.array([1, 2, 3], dtype=np.int64)
    doc = Document(tokens=mine, loss_mask=np.ones(3))
    with pytest.raises(ValueError, match="read-only"):
        doc.tokens[0] = 9
    with pytest.raises(ValueError, match="read-only"):
        doc.loss_mask[0] = 0
    mine[0] = 4  # the caller's array is untouched (and shared: no copy when the dtype fits)
    assert mine.flags.writeable
    with pytest.raises(AttributeError):
        doc.source = "x"  # type: ignore[misc]


def test_equality_compares_contents() -> None:
    a = Document(tokens=[1, 2], loss_mask=[1, 1], source="s")
    assert a == Document(tokens=np.array([1, 2]), loss_mask=np.ones(2), source="s")
    assert a != Document(tokens=[1, 2], loss_mask=[0, 1], source="s")
    assert a != Document(tokens=[1, 3], loss_mask=[1, 1], source="s")
    assert a != Document(tokens=[1, 2], loss_mask=[1, 1], source="t")
    assert a != Document(tokens=[1, 2], loss_mask=[1, 1], boundaries=(1,), source="s")
    with pytest.raises(TypeError, match="unhashable"):
        hash(a)


BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"tokens": [1.0, 2.0]}, TypeError, "tokens has dtype float64; expected integer token ids"),
    ({"tokens": [True, False]}, TypeError, "tokens has dtype bool"),
    ({"tokens": [[1, 2]]}, ValueError, r"non-empty 1-D array, got shape \(1, 2\)"),
    ({"tokens": np.array([], dtype=np.int64)}, ValueError, r"got shape \(0,\)"),
    ({"tokens": [3, -1]}, ValueError, r"tokens\[1\] is -1; token ids must be >= 0"),
    ({"loss_mask": [1, 1]}, ValueError, r"loss_mask has shape \(2,\) but tokens has \(3,\)"),
    ({"loss_mask": ["a", "b", "c"]}, TypeError, "loss_mask has dtype <U1"),
    (
        {"boundaries": (0,)},
        ValueError,
        r"boundaries\[0\] is 0; a segment start must satisfy 0 < b < 3",
    ),
    ({"boundaries": (3,)}, ValueError, r"boundaries\[0\] is 3"),
    ({"boundaries": (2, 1)}, ValueError, r"boundaries\[1\] is 1 after 2; .* strictly increasing"),
    ({"boundaries": (1.5,)}, TypeError, r"boundaries\[0\] is 1.5; expected an int"),
    ({"source": 5}, TypeError, "Document.source must be a str"),
]


@pytest.mark.parametrize(("change", "error", "pattern"), BAD)
def test_bad_fields_are_named(change: dict[str, Any], error: type[Exception], pattern: str) -> None:
    fields: dict[str, Any] = {"tokens": [1, 2, 3], "loss_mask": [1, 1, 1], "source": "f.jsonl:9"}
    fields.update(change)
    if "tokens" in change and "loss_mask" not in change:
        fields["loss_mask"] = np.ones(np.shape(change["tokens"]))
    with pytest.raises(error, match=pattern):
        Document(**fields)


def test_as_dict_feeds_packed_batch() -> None:
    docs = [
        Document(tokens=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1]),
        Document(tokens=[1, 2], loss_mask=[1, 1]),
    ]
    batch = PackedBatch.from_documents([d.as_dict() for d in docs], seq_len=8)
    assert batch.tokens.tolist() == [[5, 6, 7, 8, 1, 2, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 1, 0, 0, 0]]
    assert batch.cu_seqlens.tolist() == [0, 4, 6, 8]
