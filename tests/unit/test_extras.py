"""megapack.core.extras: a trainer's fields laid out from documents and joined across rows, and
the refusals that name the document, the field and the fix."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
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


# -- the undeclared-keys error names megapack's own declarations (issue 46) ------------------------
LOSS_HINT = (
    "megapack's loss fields (which loss_fields=True or with_loss_fields adds): pass "
    "fields={fields} to get_batch_on_this_tp_rank, lockstep_steps and prefetch alike"
)


def loss_batch(**extra: Any) -> PackedBatch:
    """The first micro-batch of a dataset loaded with loss_fields=True, ``extra`` in its extras."""
    from megapack.data import Document, PackedDataset

    docs = [Document(tokens=np.array(t), loss_mask=np.ones(len(t))) for t in ([1, 2, 3], [4, 5])]
    batch = PackedDataset(docs, seq_len=8, loss_fields=True)[0]
    return dataclasses.replace(batch, extras={**batch.extras, **extra})


def refusal(batch: PackedBatch, fields: tuple[BatchField, ...] = ()) -> str:
    """What the TP source raises, on one rank, for ``batch`` under ``fields=``."""
    from megapack import Topology, get_batch_on_this_tp_rank

    with pytest.raises(ValueError) as info:
        get_batch_on_this_tp_rank(iter([batch]), topology=Topology.single(), fields=fields)
    return str(info.value)


def test_undeclared_loss_fields_name_loss_fields_in_full() -> None:
    assert refusal(loss_batch()) == (
        "PackedBatch.extras has undeclared keys ['loss_documents', 'loss_step']: "
        + LOSS_HINT.format(fields="megapack.LOSS_FIELDS")
    )
    adv = torch.zeros(1, 8)
    assert refusal(loss_batch(adv=adv), (ADV,)) == (  # add them to the fields already given
        "PackedBatch.extras has undeclared keys ['loss_documents', 'loss_step']: "
        + LOSS_HINT.format(fields="(*megapack.LOSS_FIELDS, *your_fields)")
    )
    assert (
        refusal(loss_batch(adv=adv))
        == (  # and a key of the trainer's own
            "PackedBatch.extras has undeclared keys ['adv', 'loss_documents', 'loss_step']: "
            + LOSS_HINT.format(fields="(*megapack.LOSS_FIELDS, *your_fields)")
            + "; declare each other key (['adv']) with fields=(megapack.BatchField(name, per, "
            "dtype, stages), ...) or drop it"
        )
    )


def test_undeclared_bucket_fields_name_bucket_fields_in_full() -> None:
    from megapack import BUCKET_FIELDS, LOSS_FIELDS

    plan = {f.name: torch.zeros(0, dtype=torch.int32) for f in BUCKET_FIELDS}
    row = dataclasses.replace(PackedBatch.from_documents([[1, 2, 3]]), extras=plan)
    assert refusal(row) == (
        f"PackedBatch.extras has undeclared keys {sorted(plan)}: megapack's attention bucket "
        "plan: pass fields=megapack.BUCKET_FIELDS to get_batch_on_this_tp_rank, lockstep_steps "
        "and prefetch alike"
    )
    assert refusal(loss_batch(**plan), LOSS_FIELDS).endswith(
        "megapack's attention bucket plan: pass fields=(*megapack.BUCKET_FIELDS, *your_fields) "
        "to get_batch_on_this_tp_rank, lockstep_steps and prefetch alike"
    )
    both = refusal(loss_batch(**plan))
    assert ("megapack's loss fields (which loss_fields=True or with_loss_fields adds) and "
            "megapack's attention bucket plan: pass fields=(*megapack.LOSS_FIELDS, "
            "*megapack.BUCKET_FIELDS) to ") in both  # fmt: skip


def test_a_megatron_dict_with_loss_fields_names_loss_fields_in_full() -> None:
    from megapack import with_loss_fields

    tokens = torch.arange(8).reshape(1, 8)
    sft = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(1, 8),
           "position_ids": torch.arange(8)[None], "cu_seqlens": torch.tensor([[0, 3, 8]])}  # fmt: skip
    (item,) = with_loss_fields([sft], micro_batches=1, group=None)
    message = refusal(item)  # type: ignore[arg-type]
    assert message.startswith("batch has undeclared keys ['loss_documents', 'loss_step']; ")
    assert message.endswith(
        "and the fields= declarations (none): " + LOSS_HINT.format(fields="megapack.LOSS_FIELDS")
    )


def test_docstring_examples_of_the_undeclared_keys_message() -> None:
    import doctest

    from megapack.core import intake  # where the message for undeclared keys is made

    result = doctest.testmod(intake, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0
