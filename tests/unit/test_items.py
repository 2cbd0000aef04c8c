"""megapack.core.items: what an iterator may yield, turned into one checked value per schema field
(`normalize`); every refusal names the key, its value and the fix, in full."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from megapack import BatchField, PackedBatch
from megapack.core.fields import schema_of
from megapack.core.items import normalize

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
        normalize(item, schema, **kw)
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
    ok = normalize(plain() | {"attention_mask": torch.ones(2, 1, S, S, dtype=torch.bool)}, SCHEMA)
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


# ---------------------------------------------------------------- PackedBatch extras

ADV = BatchField("adv", "token", torch.float32, "last")
OLD = BatchField("old", "token", torch.float32, "last")


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
