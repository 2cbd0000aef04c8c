"""PackedAttention: every backend available here against a dense-mask reference, forward and backward."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megapack.attention import BACKENDS, PackedAttention, backend_available
from megapack.batch import make_packed_seq_params

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEADS, GROUPS, DIM = 4, 2, 8


def config(**overrides: Any) -> SimpleNamespace:
    base = {"num_attention_heads": HEADS, "num_query_groups": GROUPS, "kv_channels": DIM, "attention_dropout": 0.0,
            "context_parallel_size": 1, "window_size": None, "softmax_type": "vanilla"}  # fmt: skip
    return SimpleNamespace(**{**base, **overrides})


TP1 = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))


def attention(backend: str, **overrides: Any) -> PackedAttention:
    return PackedAttention(config(**overrides), 1, None, "self", pg_collection=TP1, backend=backend)


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: list[int], buffer: list[int]
) -> torch.Tensor:
    """Softmax over an explicit [T, T] mask: same document and key position <= query position."""
    total = q.shape[0]
    doc = torch.full((total,), -1)
    for i in range(len(real) - 1):
        doc[buffer[i] : buffer[i] + real[i + 1] - real[i]] = i
    pos = torch.arange(total)
    allowed = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0) & (pos[:, None] >= pos[None, :])
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1))  # padding rows: all masked -> 0
    return torch.einsum("hqk,khd->qhd", probs, vv).reshape(total, -1)


def inputs(total: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, HEADS, DIM, generator=g)
    k = torch.randn(total, GROUPS, DIM, generator=g)
    v = torch.randn(total, GROUPS, DIM, generator=g)
    return tuple(x.to(DEVICE).requires_grad_() for x in (q, k, v))


CASES = {
    "unpadded": ([0, 3, 5, 9, 16], None),
    "one-doc": ([0, 11], None),
    "aligned-padding": ([0, 3, 5, 9], [0, 4, 8, 12]),
}


def backend_param(name: str, training: bool) -> Any:
    ok = backend_available(name, DEVICE, training=training)
    reason = f"{name} cannot run {'backward' if training else 'forward'} on {DEVICE.type} here"
    return pytest.param(name, id=name, marks=pytest.mark.skipif(not ok, reason=reason))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", [backend_param(b, training=True) for b in BACKENDS])
def test_forward_and_backward_match_reference(backend: str, case: str) -> None:
    real, padded = CASES[case]
    buffer = padded or real
    q, k, v = inputs(buffer[-1], seed=len(case))
    params = make_packed_seq_params(
        torch.tensor(real, dtype=torch.int32, device=DEVICE),
        None if padded is None else torch.tensor(padded, dtype=torch.int32, device=DEVICE),
        max(b - a for a, b in itertools.pairwise(buffer)),
    )
    out = attention(backend)(q, k, v, None, packed_seq_params=params)
    grads_out = torch.autograd.grad(out.square().sum(), (q, k, v))
    q_ref, k_ref, v_ref = (x.detach().cpu().requires_grad_() for x in (q, k, v))
    ref = dense_reference(q_ref, k_ref, v_ref, real, buffer)
    assert out.shape == (buffer[-1], HEADS * DIM)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    grads_ref = torch.autograd.grad(ref.square().sum(), (q_ref, k_ref, v_ref))
    for got, want in zip(grads_out, grads_ref, strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", [backend_param(b, training=False) for b in BACKENDS])
def test_forward_only_matches_reference(backend: str) -> None:
    real = [0, 3, 5, 9, 16]
    q, k, v = (x.detach() for x in inputs(16, seed=7))
    params = make_packed_seq_params(torch.tensor(real, dtype=torch.int32, device=DEVICE), None, 7)
    with torch.no_grad():
        out = attention(backend)(q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(
        out.cpu(), dense_reference(q.cpu(), k.cpu(), v.cpu(), real, real), rtol=1e-5, atol=1e-5
    )


def test_first_token_of_each_document_sees_only_itself() -> None:
    # Worked example: documents [3, 2, 4] -> cu_seqlens [0, 3, 5, 9]. A document's first token has
    # one key (itself), so its output is its own value vector, whatever came before it.
    q, k, v = (x.detach() for x in inputs(9, seed=1))
    params = make_packed_seq_params(
        torch.tensor([0, 3, 5, 9], dtype=torch.int32, device=DEVICE), None, 4
    )
    out = attention("sdpa")(q, k, v, None, packed_seq_params=params).reshape(9, HEADS, DIM)
    for start in (0, 3, 5):
        want = v[start].repeat_interleave(HEADS // GROUPS, dim=0)
        torch.testing.assert_close(out[start], want)


def test_padded_batches_use_causal_attention_or_megatron_mask() -> None:
    s, b = 6, 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(s, b, HEADS, DIM, generator=g),
        torch.randn(s, b, GROUPS, DIM, generator=g),
        torch.randn(s, b, GROUPS, DIM, generator=g),
    )
    module = attention("sdpa")
    causal = module(q, k, v, None)
    for row in range(b):
        ref = dense_reference(q[:, row], k[:, row], v[:, row], [0, s], [0, s])
        torch.testing.assert_close(causal[:, row], ref, rtol=1e-5, atol=1e-5)
    mask = ~torch.tril(torch.ones(s, s, dtype=torch.bool)).expand(b, 1, s, s)  # True = masked out
    torch.testing.assert_close(module(q, k, v, mask), causal, rtol=1e-6, atol=1e-6)


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        attention("fast")
    with pytest.raises(ValueError, match=r"cp_layout must be one of .* got 'zigzag'"):
        PackedAttention(config(), 1, None, "self", pg_collection=TP1, cp_layout="zigzag")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="num_attention_heads=4 and num_query_groups=3 must divide by tp=2"
    ):
        PackedAttention(config(num_query_groups=3), 1, None, "self",
                        pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 2)))  # fmt: skip
    q, k, v = inputs(4, seed=0)
    params = make_packed_seq_params(torch.tensor([0, 4], dtype=torch.int32, device=DEVICE), None, 4)
    with pytest.raises(ValueError, match="attention_bias"):
        attention("sdpa")(q, k, v, None, attention_bias=torch.zeros(1), packed_seq_params=params)
    if DEVICE.type == "cpu":
        with pytest.raises(
            ValueError, match="'flex' cannot run training on cpu: its backward pass is CUDA-only"
        ):
            attention("flex")(q, k, v, None, packed_seq_params=params)
        with pytest.raises(ValueError, match="'flash_attn' cannot run"):
            attention("flash_attn")(q, k, v, None, packed_seq_params=params)
