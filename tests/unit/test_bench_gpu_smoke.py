"""The GPU kit's smoke section, its parts that need neither megatron-core nor CUDA: packs A and B
(different rows, each within the static shape), the differences a replay is judged by, and a
backend that cannot train here reported with the reason before anything is built. The section
itself on CPU, and its comparison catching a replay of the wrong pack, run on the worker pool
(tests/functional/test_gpu_kit_smoke.py)."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch

from megapack.bench.gpu import smoke
from megapack.bench.gpu.model import TOY
from megapack.bench.gpu.smoke import CAP, SMOKE, backend_checks, two_packs

CPU = torch.device("cpu")


def test_docstring_examples() -> None:
    result = doctest.testmod(smoke)
    assert result.failed == 0 and result.attempted > 0


def test_packs_a_and_b_hold_different_rows_within_the_static_shape() -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 100, n) for n in rng.integers(1, 60, 64)]
    a, b = two_packs(docs, 128, rows=2, micro=2)
    assert len(a) == len(b) == 2
    rows_a = {tuple(x.tokens[0].tolist()) for x in a}
    rows_b = {tuple(x.tokens[0].tolist()) for x in b}
    assert not rows_a & rows_b  # a replay that read the wrong pack differs from eager
    for batch in (*a, *b):
        assert tuple(batch.tokens.shape) == (1, 256)  # 2 rows of 128
        assert batch.cu_seqlens.numel() - 1 <= 2 * (CAP + 1)  # each row: <= CAP documents + padding


def test_too_few_documents_for_two_packs_is_an_error_saying_so() -> None:
    docs = [np.arange(1, 40) for _ in range(5)]
    with pytest.raises(
        ValueError, match=r"the smoke's 5 documents fill \d rows of 128; packs A and B need 8"
    ):
        two_packs(docs, 128, rows=2, micro=2)


def test_a_backend_that_cannot_train_here_is_skipped_with_the_reason_before_anything_is_built() -> (
    None
):
    (check,) = backend_checks(
        "cudnn", TOY, {}, None, [], None, device=CPU, dtype=torch.float32, seq_len=128
    )
    assert (check.name, check.status) == ("smoke: cudnn", "skipped")
    assert check.detail == "cannot train float32 on cpu here: cudnn runs on CUDA only"


def test_the_smoke_model_trains_the_presets_attention_kernels() -> None:
    from megapack.bench.gpu.model import PRESET

    assert (
        SMOKE.head_dim == PRESET.head_dim == 128
        and SMOKE.num_query_groups < SMOKE.num_attention_heads
    )
    assert SMOKE.parameters() == 38_540_288
