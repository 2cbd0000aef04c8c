"""megapack.core.extras: a trainer's fields laid out from documents and joined across rows, and
the refusals that name the document, the field and the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megapack import BatchField, PackedBatch
from megapack.core.extras import check_extras, join_rows

ADV = BatchField("adv", "token", torch.float32, "last", at="label")
IDS = BatchField("ids", "token", torch.int64, "first", at="label")
LOGP = BatchField("logp", "token", torch.bfloat16, "last", at="label")
WEIGHT = BatchField("weight", "sample", torch.float32, "all")
PIXELS = BatchField("pixels", "ragged", torch.float16, "first")
SPANS = BatchField("spans", "ragged", torch.int32, "first")


def docs(**extra: Any) -> list[dict[str, Any]]:
    """Documents of 3 and 2 tokens, the module docstring's example, with ``extra`` per document."""
    base = [{"tokens": [5, 6, 7]}, {"tokens": [8, 9]}]
    return [d | {k: v[i] for k, v in extra.items() if v[i] is not None} for i, d in enumerate(base)]


def test_per_token_values_keep_their_declared_dtype_and_zero_padding() -> None:
    b = PackedBatch.from_documents(
        docs(ids=[[1, 2, 3], [4, 5]], logp=[torch.tensor([0.5, -1.0, 2.0], dtype=torch.bfloat16),
                                            torch.tensor([-0.25, 3.0], dtype=torch.bfloat16)]),
        seq_len=6, fields=(IDS, LOGP),
    )  # fmt: skip
    assert b.extras["ids"].dtype == torch.int64 and b.extras["ids"].tolist() == [[1, 2, 3, 4, 5, 0]]
    assert b.extras["logp"].dtype == torch.bfloat16
    assert b.extras["logp"].tolist() == [[0.5, -1.0, 2.0, -0.25, 3.0, 0.0]]


def test_python_numbers_take_the_declared_dtype() -> None:
    spans = [[[0, 2], [4, 6]], [[1, 3]]]  # nested lists of ints for an int32 ragged field
    b = PackedBatch.from_documents(docs(weight=[1.5, 2.5], spans=spans), fields=(WEIGHT, SPANS))
    assert b.extras["weight"].dtype == torch.float32 and b.extras["weight"].tolist() == [1.5, 2.5]
    assert b.extras["spans"].dtype == torch.int32
    assert b.extras["spans"].tolist() == [[0, 2], [4, 6], [1, 3]]


def test_a_1d_ragged_value_is_its_rows_and_a_scalar_is_refused_naming_the_document() -> None:
    one_d = BatchField("marks", "ragged", torch.int64, "all")
    b = PackedBatch.from_documents(docs(marks=[[7, 8], [9]]), fields=(one_d,))
    assert b.extras["marks"].tolist() == [7, 8, 9]
    with pytest.raises(ValueError) as info:
        PackedBatch.from_documents(docs(marks=[[7], 5]), fields=(one_d,))
    assert str(info.value) == "docs[1]['marks'] is a scalar; a ragged field is [n_i, ...]"


def test_a_tensor_of_another_dtype_is_refused_in_full() -> None:
    with pytest.raises(TypeError) as info:
        PackedBatch.from_documents(
            docs(adv=[[0.0] * 3, torch.zeros(2, dtype=torch.float64)]), fields=(ADV,)
        )
    assert str(info.value) == (
        "docs[1]['adv'] has dtype torch.float64 but fields= declares torch.float32 (values "
        "travel bit-exact, never converted)"
    )


def test_a_document_that_is_not_a_dict_is_refused_naming_its_type() -> None:
    with pytest.raises(TypeError) as info:
        PackedBatch.from_documents([{"tokens": [1], "adv": [0.5]}, [2, 3]], fields=(ADV,))
    assert str(info.value) == (
        "docs[1] is a list; with fields= every document is a dict holding its 'adv'"
    )


def test_ragged_values_whose_trailing_dims_differ_are_refused_in_full() -> None:
    pixels = [torch.ones(2, 4, dtype=torch.float16), torch.ones(1, 5, dtype=torch.float16)]
    with pytest.raises(ValueError) as info:
        PackedBatch.from_documents(docs(pixels=pixels), fields=(PIXELS,))
    assert str(info.value) == (
        "'pixels' has values with trailing dims [(4,), (5,)]; every sample's [n_i, ...] must "
        "agree after n_i"
    )


def test_empty_ragged_values_fit_any_trailing_dims() -> None:
    # A document without images (absent, or [0, 3] of another width) joins rows [n_i, 4].
    empty_other = torch.empty(0, 3, dtype=torch.float16)
    image = torch.arange(8, dtype=torch.float16).reshape(2, 4)
    for first in (None, empty_other):
        b = PackedBatch.from_documents(docs(pixels=[first, image]), fields=(PIXELS,))
        assert b.extras["pixels"].shape == (2, 4) and torch.equal(b.extras["pixels"], image)


def test_rows_without_any_image_keep_the_shape_they_were_given() -> None:
    alone = PackedBatch.from_documents([{"tokens": [1, 2]}], fields=(PIXELS,))
    assert alone.extras["pixels"].shape == (0,) and alone.extras["pixels"].dtype == torch.float16
    none = torch.empty(0, 4, dtype=torch.float16)
    row = PackedBatch.from_documents(docs(pixels=[none, none]), fields=(PIXELS,))
    assert row.extras["pixels"].shape == (0, 4)
    both = PackedBatch.concat([row, row], (PIXELS,))
    assert both.extras["pixels"].shape == (0, 4)
    assert join_rows(PIXELS, [none]).shape == (0, 4)


def test_join_rows_by_declaration() -> None:
    a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0]])
    assert join_rows(ADV, [a, b]).tolist() == [[1.0, 2.0, 3.0]]  # per token: along the row
    w = join_rows(WEIGHT, [torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    assert w.tolist() == [1.0, 2.0, 3.0]  # per sample: one after another


@pytest.mark.parametrize(
    ("extras", "error", "message"),
    [
        ([("x", torch.zeros(1))], TypeError, "PackedBatch.extras must be a dict, got list"),
        ({"a-b": torch.zeros(1)}, ValueError, "PackedBatch.extras key 'a-b' is not a Python identifier"),
        ({5: torch.zeros(1)}, ValueError, "PackedBatch.extras key 5 is not a Python identifier"),
        ({"x": [1.0]}, TypeError, "PackedBatch.extras['x'] must be a torch.Tensor, got list"),
    ],
)  # fmt: skip
def test_extras_that_are_not_named_tensors_are_refused_in_full(
    extras: Any, error: type, message: str
) -> None:
    with pytest.raises(error) as info:
        check_extras(extras)
    assert str(info.value) == message
    check_extras({"x": torch.zeros(1), "y_2": torch.ones(2, 3)})  # named tensors pass
