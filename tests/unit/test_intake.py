"""megapack.core.intake: what an iterator may yield, made a `Batch` of one checked value per schema
field (`to_batch`); every refusal names the key, its value and the fix, in full."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from megapack import BatchField, PackedBatch
from megapack.core.fields import schema_of
from megapack.core.intake import BatchForm, to_batch

S = 8
SCHEMA = schema_of()


def plain(b: int = 2) -> dict[str, Any]:
    """Megatron pretraining rows [b, s=8] without cu_seqlens."""
    tokens = torch.arange(b * S).reshape(b, S)
    return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(b, S),
            "position_ids": torch.arange(S).repeat(b, 1)}  # fmt: skip


def sft(b: int = 2) -> dict[str, Any]:
    """Megatron SFT rows of s=8, each two documents [3, 5]."""
    return plain(b) | {"cu_seqlens": torch.tensor([[0, 3, 8]] * b, dtype=torch.int32)}


def refusal(item: Any, schema: Any = SCHEMA, error: type = ValueError, **kw: Any) -> str:
    with pytest.raises(error) as info:
        to_batch(item, schema, **kw)
    return str(info.value)


# ---------------------------------------------------------------- regressions


@pytest.mark.parametrize(
    "shape", [(2, 1, 3, 8), (2, 4, 8, 8), (1, 1, 8, 8), (3, 1, 8, 8)], ids=str
)  # fmt: skip
def test_regression_an_attention_mask_not_b_1_s_s_is_refused(shape: tuple[int, ...]) -> None:
    # Megatron's receivers expect [micro_batch_size, 1, s, s]; only the last dim was checked, so a
    # [2, 1, 3, 8] mask travelled (and a CP share of it failed with an IndexError).
    mask = torch.ones(shape, dtype=torch.bool)
    assert refusal(plain() | {"attention_mask": mask}) == (
        f"batch['attention_mask'] is {shape}; expected a [b, 1, s, s] tensor with b=2 and s=8"
    )
    ok = to_batch(plain() | {"attention_mask": torch.ones(2, 1, S, S, dtype=torch.bool)}, SCHEMA)
    assert ok.values["attention_mask"].shape == (2, 1, S, S)


@pytest.mark.parametrize("make", [plain, sft], ids=["plain", "sft"])
def test_regression_a_batch_without_rows_or_tokens_is_refused(make: Any) -> None:
    # A plain [0, s] batch was delivered as an empty micro-batch, an SFT one failed in numpy
    # ("zero-size array to reduction operation maximum").
    for rows, cols in ((0, S), (2, 0)):
        item = {k: v[:rows, :cols] if k != "cu_seqlens" else v for k, v in make().items()}
        assert refusal(item) == (
            f"batch['tokens'] has shape ({rows}, {cols}); a micro-batch needs at least one row "
            "of at least one token"
        )


# ---------------------------------------------------------------- what to_batch keeps

ADV = BatchField("adv", "token", torch.float32, "last", at="label")
OLD = BatchField("old", "token", torch.float32, "last", at="label")
WEIGHT = BatchField("w", "sample", torch.float32, "all")
PIXELS = BatchField("pixels", "ragged", torch.float16, "first")
DECLARED = schema_of((ADV, WEIGHT, PIXELS))


def rl(b: int = 2) -> dict[str, Any]:
    """SFT rows with a value for every DECLARED field."""
    return sft(b) | {"adv": torch.zeros(b, S), "w": torch.ones(b),
                     "pixels": [torch.ones(2, 4, dtype=torch.float16)] * b}  # fmt: skip


def test_a_packed_batch_gives_a_value_for_every_schema_field() -> None:
    item = PackedBatch.from_documents([[5, 6, 7], [8, 9]])
    batch = to_batch(item, SCHEMA)
    assert batch.form == BatchForm.PACKED and list(batch.values) == list(SCHEMA.names)
    for name in ("attention_mask", "cu_seqlens_padded", "dataset_id", "local_cp_size"):
        assert batch.values[name] is None, name
    assert batch.values["tokens"] is item.tokens and batch.values["max_seqlen"] == 3


def test_plain_rows_are_kept_and_checked_against_the_tokens_shape() -> None:
    batch = to_batch(plain(), SCHEMA)
    assert batch.form == BatchForm.PLAIN and batch.values["tokens"].shape == (2, S)
    bad = plain() | {"labels": torch.zeros(2, 7, dtype=torch.long)}
    assert refusal(bad) == "batch['labels'] has shape (2, 7) but tokens has (2, 8)"


def test_a_declared_1d_ragged_tensor_or_list_of_1d_tensors_is_accepted() -> None:
    marks = BatchField("marks", "ragged", torch.int64, "all")
    schema = schema_of((marks,))
    got = to_batch(sft() | {"marks": torch.tensor([1, 2, 3])}, schema).values["marks"]
    assert got.tolist() == [1, 2, 3]
    parts = [torch.tensor([4]), torch.tensor([5, 6])]
    assert to_batch(sft() | {"marks": parts}, schema).values["marks"].tolist() == [4, 5, 6]


def test_a_sample_field_of_six_dims_travels() -> None:
    six = to_batch(rl() | {"w": torch.ones(2, 1, 1, 1, 1, 3)}, DECLARED).values["w"]
    assert six.shape == (2, 1, 1, 1, 1, 3)


# ---------------------------------------------------------------- refusals in full


def test_an_item_of_another_type_is_refused_in_full() -> None:
    assert refusal([1, 2], error=TypeError) == (
        "data_iterator yielded list; expected a megapack.PackedBatch or a dict of tensors "
        "(Megatron SFT-style with cu_seqlens, or a plain pretraining batch)"
    )


def test_packed_must_match_the_data_in_full() -> None:
    fix = ": pass packed= matching the data (Megatron: --sft or inter-document masking)"
    assert refusal(plain(), packed=True) == (
        f"get_batch_on_this_tp_rank(packed=True) but the batch has no cu_seqlens{fix}"
    )
    assert refusal(sft(), packed=False) == (
        f"get_batch_on_this_tp_rank(packed=False) but the batch has cu_seqlens{fix}"
    )


PLAIN_KEYS = "['attention_mask', 'dataset_id', 'labels', 'loss_mask', 'position_ids', 'tokens']"


def test_undeclared_keys_in_full_with_the_packed_hint_only_for_packed_keys() -> None:
    assert refusal(plain() | {"text": torch.zeros(2)}) == (
        f"batch has undeclared keys ['text']; megapack transfers {PLAIN_KEYS} and the fields= "
        "declarations (none): declare a trainer's own field with "
        "fields=(megapack.BatchField('text', per, dtype, stages), ...) or drop it"
    )
    packed_only = {"local_cp_size": 2, "cu_seqlens_padded": torch.zeros(2, 3, dtype=torch.int32)}
    assert refusal(plain() | packed_only, DECLARED) == (
        f"batch has undeclared keys ['cu_seqlens_padded', 'local_cp_size']; megapack transfers "
        f"{PLAIN_KEYS} and the fields= declarations (['adv', 'pixels', 'w']): declare a trainer's "
        "own field with fields=(megapack.BatchField('cu_seqlens_padded', per, dtype, stages), "
        "...) or drop it; cu_seqlens_padded and local_cp_size need cu_seqlens (a packed batch)"
    )


def test_a_dense_mask_on_a_packed_dict_in_full() -> None:
    mask = torch.ones(2, 1, S, S, dtype=torch.bool)
    assert refusal(sft() | {"attention_mask": mask}) == (
        "batch has both cu_seqlens and a dense attention_mask: packed batches mask by document "
        "from cu_seqlens, so the mask would be dropped; turn off "
        "create_attention_mask_in_dataloader (--no-create-attention-mask-in-dataloader) or drop "
        "'attention_mask' from the batch"
    )


def test_a_plain_mask_that_is_not_a_tensor_names_its_type() -> None:
    assert refusal(plain() | {"attention_mask": [[1]]}) == (
        "batch['attention_mask'] is list; expected a [b, 1, s, s] tensor with b=2 and s=8"
    )


def test_packed_batch_extras_refusals_in_full() -> None:
    row = PackedBatch.from_documents([{"tokens": [1, 2], "adv": [0.5, 1.5]}], fields=(ADV,))
    schema = schema_of((ADV,))
    assert refusal(row, SCHEMA) == (
        "PackedBatch.extras has undeclared keys ['adv']: declare each with "
        "fields=(megapack.BatchField(name, per, dtype, stages), ...) or drop it"
    )
    assert refusal(row, schema_of((ADV, OLD))) == (
        "PackedBatch.extras has no 'old', declared in fields= (extras: ['adv'])"
    )
    wide = dataclasses.replace(row, extras={"adv": row.extras["adv"].double()})
    assert refusal(wide, schema, TypeError) == (
        "PackedBatch.extras['adv'] has dtype torch.float64 but fields= declares torch.float32 "
        "(values travel bit-exact, never converted: pass torch.float32)"
    )


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"adv": [[0.0] * S] * 2}, TypeError, "batch['adv'] must be a torch.Tensor, got list"),
        ({"adv": torch.zeros(2, 7)}, ValueError,
         "batch['adv'] has shape (2, 7) but tokens has (2, 8): a per-token field has the tokens' shape"),
        ({"w": torch.ones(2, 1, 1, 1, 1, 1, 1)}, ValueError, "batch['w'] has 7 dimensions; at most 6 travel"),
        ({"w": torch.tensor(1.0)}, ValueError,
         "batch['w'] has shape (); a per-sample field is [b, ...] with b=2 like tokens' rows"),
        ({"pixels": torch.tensor(1.0, dtype=torch.float16)}, ValueError,
         "batch['pixels'] is a scalar; a ragged field is [sum n_i, ...]"),
        ({"pixels": [torch.ones(1, 4, dtype=torch.float16), [1.0]]}, TypeError,
         "batch['pixels'][1] must be a tensor [n_i, ...], got list"),
        ({"pixels": [torch.tensor(1.0, dtype=torch.float16)] * 2}, TypeError,
         "batch['pixels'][0] must be a tensor [n_i, ...], got a 0-d tensor"),
        ({"pixels": [torch.ones(1, 4, dtype=torch.float16), torch.ones(1, 4)]}, TypeError,
         "batch['pixels'][1] has dtype torch.float32 but fields= declares torch.float16"),
    ],
    ids=["not-a-tensor", "token-shape", "seven-dims", "sample-scalar", "ragged-scalar",
         "ragged-part-type", "ragged-part-scalar", "ragged-part-dtype"],
)  # fmt: skip
def test_declared_field_refusals_in_full(change: dict, error: type, message: str) -> None:
    assert refusal(rl() | change, DECLARED, error) == message


@pytest.mark.parametrize(
    ("value", "rows", "error", "message"),
    [
        ([3, 1], 2, TypeError,
         "batch['dataset_id'] must be a tensor of integers (one per sample), got list"),
        (torch.tensor([True, False]), 2, TypeError, "batch['dataset_id'] has dtype torch.bool; expected integers"),
        (torch.tensor([1j, 2j]), 2, TypeError, "batch['dataset_id'] has dtype torch.complex64; expected integers"),
        (torch.tensor([1.0, 2.0]), 2, TypeError, "batch['dataset_id'] has dtype torch.float32; expected integers"),
        (torch.tensor([[3, 1]]), 2, ValueError,
         "batch['dataset_id'] has shape (1, 2); expected [2], one per sample like tokens' rows"),
        (torch.tensor([[3, 1], [0, 2]]), 4, ValueError,
         "batch['dataset_id'] has shape (2, 2); expected [4], one per sample like tokens' rows"),
    ],
    ids=["list", "bool", "complex", "float", "1-by-b", "2-by-2-for-4-rows"],
)  # fmt: skip
def test_dataset_id_refusals_in_full(value: Any, rows: int, error: type, message: str) -> None:
    assert refusal(sft(rows) | {"dataset_id": value}, error=error) == message
    ok = torch.arange(rows).reshape(rows, 1)  # [b, 1], as collated from [1]-shaped items
    assert to_batch(sft(rows) | {"dataset_id": ok}, SCHEMA).values["dataset_id"].shape == (rows,)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (True, TypeError, "batch['local_cp_size'] must be an int >= 1, got bool True"),
        (2.0, TypeError, "batch['local_cp_size'] must be an int >= 1, got float 2.0"),
        (0, ValueError, "batch['local_cp_size'] must be an int >= 1, got 0"),
        (torch.tensor([2.0]), TypeError,
         "batch['local_cp_size'] must be one integer, got a torch.float32 tensor of shape (1,)"),
        (torch.tensor([True]), TypeError,
         "batch['local_cp_size'] must be one integer, got a torch.bool tensor of shape (1,)"),
        (torch.tensor([1, 1]), ValueError,
         "batch['local_cp_size'] must be one integer, got a torch.int64 tensor of shape (2,)"),
    ],
    ids=["bool", "float", "zero", "float-tensor", "bool-tensor", "two-values"],
)  # fmt: skip
def test_local_cp_size_refusals_in_full(value: Any, error: type, message: str) -> None:
    assert refusal(sft() | {"local_cp_size": value}, error=error) == message
    assert to_batch(sft() | {"local_cp_size": torch.tensor(2)}, SCHEMA).values["local_cp_size"] == 2
