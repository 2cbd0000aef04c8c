"""megapack.packing.cost: the row cost formula on worked examples, model shapes, argument errors."""

from __future__ import annotations

import doctest
import importlib
from types import SimpleNamespace

import numpy as np
import pytest

from megapack.packing import CostModel, plan

TINY = {"hidden": 64, "ffn": 256, "layers": 2, "heads": 4, "vocab": 1000}


def test_cost_worked_example_tiny_shape() -> None:
    m = CostModel.from_shape(**TINY)
    # per layer: QKV 2*64*(64+2*64), output 2*64*64, MLP 2*2*64*256; LM head 2*64*1000; x3 training
    assert m.a == 3 * (2 * (24_576 + 8_192 + 65_536) + 128_000) == 973_824
    assert m.b == 3 * 2 * 2 * 64 == 768
    assert m.row_cost([3, 2, 4]) == 973_824 * 9 + 768 * 29 == 8_786_688


def test_cost_gqa_gated_and_head_dim() -> None:
    m = CostModel.from_shape(
        hidden=16, ffn=32, layers=1, heads=4, kv_heads=2, head_dim=8, vocab=0, gated=True
    )
    q, kv = 4 * 8, 2 * 8
    assert m.a == 3 * 2 * (16 * (q + 2 * kv) + q * 16 + 3 * 16 * 32)
    assert m.b == 3 * 2 * q
    # GQA shrinks only K and V: fewer FLOPs per token than full multi-head attention
    full = CostModel.from_shape(
        hidden=16, ffn=32, layers=1, heads=4, head_dim=8, vocab=0, gated=True
    )
    assert full.a - m.a == 3 * 2 * 16 * 2 * (q - kv) and full.b == m.b


def test_cost_token_model_is_token_count() -> None:
    assert CostModel.tokens().row_cost([3, 2, 4]) == 9.0
    assert CostModel(a=0, b=1).row_cost([3, 2, 4]) == 29.0
    assert CostModel(a=2, b=0.5).row_cost([]) == 0.0


def test_cost_of_bins_matches_row_cost() -> None:
    lengths = [12, 3, 7, 1, 5, 5]
    p = plan(lengths, 5)  # 12 -> 5 + 5 + 2 and 7 -> 5 + 2: each slice attends only to itself
    m = CostModel(a=1.5, b=0.25)
    got = m.bin_costs(p.slices, p.bin_offsets)
    want = [m.row_cost([stop - start for _, start, stop in b]) for b in p.bins]
    np.testing.assert_allclose(got, want)
    squares = (25 + 25 + 4) + 9 + (25 + 4) + 1 + 25 + 25
    assert got.sum() == pytest.approx(1.5 * 33 + 0.25 * squares) == 85.25


def test_cost_from_transformer_config_plain_object() -> None:
    config = SimpleNamespace(
        hidden_size=64, ffn_hidden_size=256, num_layers=2, num_attention_heads=4,
        num_query_groups=None, kv_channels=None, gated_linear_unit=False,
    )  # fmt: skip
    assert CostModel.from_transformer_config(config, vocab=1000) == CostModel.from_shape(**TINY)


def test_cost_from_megatron_transformer_config() -> None:
    core = pytest.importorskip("megatron.core.transformer.transformer_config")
    config = core.TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=256, gated_linear_unit=True,
    )  # fmt: skip
    got = CostModel.from_transformer_config(config, vocab=1000)
    assert got == CostModel.from_shape(**TINY, kv_heads=2, gated=True)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"a": -1.0, "b": 0.0}, ValueError, "CostModel.a"),
        ({"a": 1.0, "b": float("nan")}, ValueError, "CostModel.b"),
        ({"a": 0.0, "b": 0.0}, ValueError, "tokens()"),
        ({"a": "1", "b": 0.0}, TypeError, "CostModel.a"),
    ],
)
def test_cost_model_rejects_bad_values(kwargs: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        CostModel(**kwargs)


@pytest.mark.parametrize(
    "override, words",
    [
        ({"hidden": 0}, "hidden"),
        ({"layers": 1.5}, "layers"),
        ({"kv_heads": 3}, "multiple of kv_heads"),
        ({"vocab": -1}, "vocab"),
        ({"hidden": 2, "heads": 4}, "head_dim"),
    ],
)
def test_cost_from_shape_rejects_bad_sizes(override: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        CostModel.from_shape(**{**TINY, **override})


def test_cost_docstrings() -> None:
    module = importlib.import_module("megapack.packing.cost")
    assert doctest.testmod(module).failed == 0


def test_cost_head_dim_from_the_config_and_the_default() -> None:
    """``kv_channels`` is the head width when set; otherwise ``hidden // heads`` (floored)."""
    config = SimpleNamespace(
        hidden_size=16, ffn_hidden_size=32, num_layers=1, num_attention_heads=4,
        num_query_groups=2, kv_channels=8, gated_linear_unit=True,
    )  # fmt: skip
    shape = {"hidden": 16, "ffn": 32, "layers": 1, "heads": 4, "kv_heads": 2, "gated": True}
    got = CostModel.from_transformer_config(config, vocab=0)
    assert got == CostModel.from_shape(**shape, head_dim=8, vocab=0)
    assert got.b == 3 * 2 * 4 * 8 != CostModel.from_shape(**shape, vocab=0).b  # default: 16 // 4
    odd = CostModel.from_shape(hidden=66, ffn=8, layers=1, heads=4, vocab=0)  # 66 // 4 = 16
    assert odd.b == 3 * 2 * 4 * 16 and odd.a == 3 * 2 * (66 * 3 * 64 + 64 * 66 + 2 * 66 * 8)
    assert CostModel.from_shape(hidden=4, ffn=8, layers=1, heads=4, vocab=0).b == 3 * 2 * 4


@pytest.mark.parametrize(
    "override, message",
    [
        ({"hidden": 0}, "hidden must be an int >= 1, got 0"),
        ({"ffn": 0}, "ffn must be an int >= 1, got 0"),
        ({"layers": 0}, "layers must be an int >= 1, got 0"),
        ({"heads": 0}, "heads must be an int >= 1, got 0"),
        ({"kv_heads": 0}, "kv_heads must be an int >= 1, got 0"),
        ({"vocab": -1}, "vocab must be an int >= 0, got -1"),
        ({"head_dim": -1}, "head_dim must be an int >= 1, got -1"),
        ({"hidden": 2, "heads": 4}, "hidden=2 < heads=4: pass head_dim explicitly"),
    ],
)
def test_cost_from_shape_names_the_bad_size(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        CostModel.from_shape(**{**TINY, **override})


def test_cost_model_messages() -> None:
    with pytest.raises(TypeError, match=r"^CostModel\.a must be a number, got str$"):
        CostModel(a="1", b=0.0)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"^CostModel needs a > 0 or b > 0; CostModel\.tokens\(\) balances tokens$"
    ):
        CostModel(a=0, b=0)
