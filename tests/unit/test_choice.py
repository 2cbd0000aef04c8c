"""backend="auto" as a pure function of (device type, dtype, training, dropout, what is installed).

The rule (megapack.attention.choice): CUDA float16/bfloat16 below sm90 -> flash_attn > te >
torch_varlen > flex > bucketed (with a delivered plan) > sdpa (sm90+: tests/unit/test_cudnn.py);
CUDA float32 -> flex, else bucketed (planned), else sdpa; anything else -> bucketed; never a kernel
that refuses the inputs. An explicit backend that cannot take them is a ValueError naming backend, device, dtype, why
and the fix.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import pytest
import torch

from megapack.attention import choice
from megapack.attention.choice import (
    BACKENDS,
    Installed,
    choose,
    preference,
    refusal,
    resolve_backend,
)
from megapack.attention.varlen import VarlenForm

V210 = VarlenForm(causal="is_causal", scale=False, enable_gqa=False)
V211 = VarlenForm(causal="window_size", scale=True, enable_gqa=False)
V213 = VarlenForm(causal="window_size", scale=True, enable_gqa=True)
BARE = Installed(cuda=True, flash_attn=False, te=False, varlen=V211, flex=True)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def have(**changes: object) -> Installed:
    fields = {"cuda": True, "flash_attn": False, "te": False, "varlen": V211, "flex": True}
    return Installed(**{**fields, **changes})  # type: ignore[arg-type]


CASES = [  # (device, dtype, training, dropout, installed, expected)
    ("cpu", FP32, True, 0.0, have(flash_attn=True, te=True), "bucketed"),
    ("cpu", BF16, False, 0.0, have(), "bucketed"),
    ("mps", FP16, True, 0.0, have(), "bucketed"),
    ("cuda", BF16, True, 0.0, have(flash_attn=True, te=True), "flash_attn"),
    ("cuda", FP16, True, 0.0, have(te=True), "te"),
    ("cuda", BF16, True, 0.0, have(), "torch_varlen"),
    ("cuda", BF16, True, 0.0, have(varlen=V210), "torch_varlen"),
    ("cuda", BF16, True, 0.0, have(varlen=None), "flex"),  # torch < 2.10
    ("cuda", BF16, True, 0.1, have(), "sdpa"),  # varlen_attn and flex have no dropout
    ("cuda", BF16, True, 0.1, have(flash_attn=True), "flash_attn"),
    (
        "cuda",
        FP32,
        True,
        0.0,
        have(flash_attn=True, te=True),
        "flex",
    ),  # FlashAttention refuses fp32
    ("cuda", FP32, True, 0.0, have(flex=False), "sdpa"),
    ("cuda", FP32, False, 0.1, have(), "sdpa"),
    ("cuda", BF16, True, 0.0, have(varlen=None, flex=False), "sdpa"),
]


@pytest.mark.parametrize("device,dtype,training,dropout,installed,expected", CASES)
def test_varlen_choice_rule(device: str, dtype: torch.dtype, training: bool, dropout: float, installed: Installed, expected: str) -> None:  # fmt: skip
    name, _ = choose(device, dtype, training=training, dropout=dropout, installed=installed)
    assert name == expected


def test_varlen_choice_never_picks_a_kernel_that_refuses_the_inputs() -> None:
    forms = [None, V210, V211, V213]
    for device, dtype, training, dropout, flash, te, varlen, flex, sm, frontend, planned in itertools.product(
        ["cpu", "cuda", "mps"], [FP32, FP16, BF16], [True, False], [0.0, 0.1], [True, False],
        [True, False], forms, [True, False], [80, 90], [True, False], [True, False],
    ):  # fmt: skip
        installed = Installed(cuda=True, flash_attn=flash, te=te, varlen=varlen, flex=flex,
                              sm=sm, cudnn_frontend=frontend, cudnn_version=91900)  # fmt: skip
        name, _ = choose(device, dtype, training=training, dropout=dropout, installed=installed,
                         planned=planned)  # fmt: skip
        args: dict[str, Any] = {"training": training, "dropout": dropout, "installed": installed}
        assert refusal(name, device, dtype, **args) is None, (name, device, dtype, args)
        # and it is the first in the preference order that takes them
        order = preference(device, dtype, installed)
        assert set(order) <= set(BACKENDS)
        takers = [b for b in order if refusal(b, device, dtype, **args) is None
                  and (b != "bucketed" or planned or device != "cuda")]  # fmt: skip
        assert name == takers[0]


def test_varlen_choice_reasons_name_what_is_missing_and_the_gqa_repeat() -> None:
    _, why = choose("cuda", BF16, training=True, dropout=0.0, installed=have())
    assert why == (
        "flash_attn not installed, te not installed; varlen_attn without enable_gqa: K/V heads repeated"
    )
    _, why = choose("cuda", BF16, training=True, dropout=0.0, installed=have(varlen=V213))
    assert why == "flash_attn not installed, te not installed"
    _, why = choose("cuda", FP32, training=True, dropout=0.0, installed=have(flash_attn=True))
    assert why.startswith("float32: FlashAttention kernels take float16/bfloat16 only")


def test_varlen_choice_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(choice, "_installed", lambda: have())
    choice._log_choice.cache_clear()
    with caplog.at_level(logging.INFO, logger="megapack.attention"):
        for _ in range(3):
            assert resolve_backend("auto", "cuda", training=True, dtype=BF16) == "torch_varlen"
    messages = [r.getMessage() for r in caplog.records if r.name == "megapack.attention"]
    assert messages == [
        "attention backend torch_varlen for cuda bfloat16 training (flash_attn not installed, "
        "te not installed; varlen_attn without enable_gqa: K/V heads repeated)"
    ]


def test_varlen_auto_never_picks_an_excluded_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(choice, "_installed", lambda: have())
    monkeypatch.setattr(choice, "_failed", {})
    assert resolve_backend("auto", "cpu", training=True) == "bucketed"
    cp = choice.NO_CONTEXT_PARALLEL
    assert resolve_backend("auto", "cpu", training=True, excluded=cp) == "sdpa"
    varlen = frozenset({"torch_varlen"})
    assert resolve_backend("auto", "cuda", training=True, dtype=BF16, excluded=varlen) == "flex"
    assert resolve_backend("sdpa", "cpu", training=True, excluded=cp) == "sdpa"  # auto's only


def test_varlen_explicit_backend_that_refuses_the_inputs_names_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(choice, "_installed", lambda: have())
    with pytest.raises(
        ValueError,
        match=r"attention backend 'torch_varlen' cannot run training on cuda float32: torch_varlen "
        r"is FlashAttention-based and takes float16/bfloat16 only; use backend='auto' \(here: "
        r"'flex'\) or bfloat16 tensors",
    ):
        choice.resolve_backend("torch_varlen", "cuda", training=True, dtype=FP32)
    with pytest.raises(ValueError, match=r"'flash_attn' cannot run on cuda bfloat16: flash-attn is not installed"):  # fmt: skip
        choice.resolve_backend("flash_attn", "cuda", training=False, dtype=BF16)
    with pytest.raises(ValueError, match=r"'flex' cannot run training on cuda bfloat16: flex has no attention dropout"):  # fmt: skip
        choice.resolve_backend("flex", "cuda", training=True, dtype=BF16, dropout=0.1)
    assert (
        choice.resolve_backend("torch_varlen", "cuda", training=True, dtype=BF16) == "torch_varlen"
    )
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        choice.resolve_backend("fast", "cuda", training=True, dtype=BF16)
