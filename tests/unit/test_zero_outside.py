"""Every backend of `megapack.attention.choice.BACKENDS` gives exact zeros, output and q/k/v
gradients, where no real token is (alignment padding, positions past the last boundary), and real
positions equal to the per-document reference whatever the positions past the last boundary hold
(NaN here; alignment padding holds finite values: the FlashAttention-based kernels and flex compute
those rows, so a NaN there would reach the real keys' gradients through them, as on a GPU).

Cases (issue 48's): T=40 with boundaries ending at 30; T=32 padded, a zero-length document, the
boundaries ending at 24. Run for real where this CPU can: ``sdpa`` and ``bucketed`` (float64),
``flex``'s forward (compiled, float32). Where it cannot, megapack's wrapper runs with the kernel
stubbed at its call boundary by a stand-in that behaves like the real kernel's memory: it computes
each segment it is given (per-segment SDPA, float64) and leaves every other row of its output and
of its input gradients uninitialised (NaN here), as FlashAttention's ``empty_like`` does:

    torch_varlen  torch.nn.attention.varlen.varlen_attn (torch 2.13's signature)
    flash_attn    flash_attn.flash_attn_varlen_func (a stand-in module)
    te            Transformer Engine's DotProductAttention (padding_causal: only real rows)
    flex          backward: ``run_flex`` evaluated densely from the block mask's own mask_mod
    cudnn         cuDNN's runtime (tests/unit/cudnn_standin.py; bf16 in, float64 inside)
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from megapack.attention import flex as flex_module
from megapack.attention import te as te_module
from megapack.attention.choice import BACKENDS
from megapack.attention.documents import Documents
from megapack.attention.kernels import KERNELS
from megapack.attention.te import te_attention
from tests.unit.cudnn_standin import install

CASES = {  # T, cu_seqlens, cu_seqlens_padded or None
    "T40-ends-at-30": (40, [0, 7, 19, 30], None),
    "T32-padded-zero-length-ends-at-24": (32, [0, 5, 5, 14], [0, 8, 8, 24]),
}
HEADS, GROUPS, DIM = 4, 2, 8
SCALE = 0.35


def documents(case: str) -> Documents:
    total, real, buffer = CASES[case]
    cu = torch.tensor(real, dtype=torch.int32)
    pad = cu if buffer is None else torch.tensor(buffer, dtype=torch.int32)
    return Documents(cu, pad, int(pad.diff().max()), total)


def holds_token(case: str) -> torch.Tensor:
    """[T] bool: the positions of a real token, written out from the boundaries."""
    total, real, buffer = CASES[case]
    mask = torch.zeros(total, dtype=torch.bool)
    for i in range(len(real) - 1):
        start = (buffer or real)[i]
        mask[start : start + real[i + 1] - real[i]] = True
    return mask


def inputs(case: str, dtype: torch.dtype, tail: float | None) -> tuple[torch.Tensor, ...]:
    """q, k, v, grad; ``tail``: what the positions past the last boundary hold (None: random)."""
    total, real, buffer = CASES[case]
    g = torch.Generator().manual_seed(11)
    q, k, v = (
        torch.randn(total, h, DIM, generator=g, dtype=torch.float64)
        for h in (HEADS, GROUPS, GROUPS)
    )
    grad = torch.randn(total, HEADS, DIM, generator=g, dtype=torch.float64)
    if tail is not None:
        for x in (q, k, v):
            x[(buffer or real)[-1] :] = tail
    return tuple(x.to(dtype) for x in (q, k, v, grad))


# ---- stand-ins for kernels that need CUDA: compute the segments, leave the rest uninitialised ----


class _SegmentsOnly(torch.autograd.Function):
    """Causal attention within each segment [starts[i], starts[i] + lengths[i]); every other row
    of the output and of dq/dk/dv is NaN (uninitialised memory)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int],
                lengths: list[int], scale: float) -> torch.Tensor:  # fmt: skip
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_() for x in (q, k, v)]
            pieces = []
            for a, n in zip(starts, lengths, strict=True):
                qs, ks, vs = (x[a : a + n].transpose(0, 1)[None] for x in inputs)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                   enable_gqa=qs.shape[1] != ks.shape[1])  # fmt: skip
                pieces.append(o[0].transpose(0, 1))
        out = torch.full((q.shape[0], q.shape[1], v.shape[2]), math.nan, dtype=q.dtype)
        for a, n, piece in zip(starts, lengths, pieces, strict=True):
            out[a : a + n] = piece.detach()
        ctx.inputs, ctx.pieces, ctx.rows = inputs, pieces, list(zip(starts, lengths, strict=True))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        wanted = [grad[a : a + n] for a, n in ctx.rows]
        found = torch.autograd.grad(ctx.pieces, ctx.inputs, wanted, allow_unused=True)
        grads = []
        for x, g in zip(ctx.inputs, found, strict=True):
            out = torch.full_like(x, math.nan)
            for a, n in ctx.rows:
                out[a : a + n] = 0.0 if g is None else g[a : a + n]
            grads.append(out)
        return (*grads, None, None, None)


def segments_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                  ends: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    a, b = starts.tolist(), ends.tolist()
    return _SegmentsOnly.apply(q, k, v, a, [e - s for s, e in zip(a, b, strict=True)], scale)


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
                num_splits=None):  # fmt: skip
    assert tuple(window_size) == (-1, 0) and torch.equal(cu_seq_q, cu_seq_k)
    return segments_only(query, key, value, cu_seq_q[:-1], cu_seq_q[1:], scale)


def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None,
                           causal=False):  # fmt: skip
    assert causal and torch.equal(cu_q, cu_k)
    return segments_only(q, k, v, cu_q[:-1], cu_q[1:], softmax_scale)


class _TeModule:
    """DotProductAttention(qkv_format="thd", attn_mask_type="padding_causal"): real rows only.
    As TE >= 2.2, it takes ``pad_between_seqs`` (megapack must pass it: it knows on the host)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def train(self, mode: bool) -> None:
        pass

    def __call__(self, q, k, v, *, qkv_format, attn_mask_type, cu_seqlens_q, cu_seqlens_kv,
                 cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv,
                 pad_between_seqs):  # fmt: skip
        assert qkv_format == "thd" and attn_mask_type == "padding_causal"
        assert pad_between_seqs == (cu_seqlens_q_padded is not cu_seqlens_q)
        lengths = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        starts = cu_seqlens_q_padded[:-1]
        out = segments_only(q, k, v, starts, starts + lengths, self.scale)
        return out.reshape(q.shape[0], -1)


def dense_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any,
               scale: float) -> torch.Tensor:  # fmt: skip
    """flex_attention evaluated densely from the block mask's own mask_mod (CPU has no flex
    backward)."""
    qi, ki = torch.arange(q.shape[0])[:, None], torch.arange(k.shape[0])[None, :]
    allowed = block_mask.mask_mod(0, 0, qi, ki)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], attn_mask=allowed, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])  # fmt: skip
    return out[0].transpose(0, 1)


def run_backend(backend: str, case: str, outside: float | None,
                monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(out, dq, dk, dv) of megapack's wrapper for ``backend``, kernel stubbed where needed."""
    dtype = torch.bfloat16 if backend == "cudnn" else torch.float64
    if backend == "torch_varlen":
        from torch.nn.attention import varlen

        monkeypatch.setattr(varlen, "varlen_attn", varlen_2_13)
    elif backend == "flash_attn":
        monkeypatch.setitem(sys.modules, "flash_attn",
                            types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))  # fmt: skip
    elif backend == "flex":
        monkeypatch.setattr(flex_module, "run_flex", dense_flex)
    elif backend == "te":
        monkeypatch.setattr(te_module, "_module", lambda *args: _TeModule(args[3]))
    elif backend == "cudnn":
        pytest.importorskip("cudnn", reason="the stand-in describes graphs with the real frontend")
        install(monkeypatch)
    q, k, v, grad = (x.requires_grad_(i < 3) for i, x in enumerate(inputs(case, dtype, outside)))
    docs = documents(case)
    if backend == "te":
        out = te_attention(q, k, v, docs, scale=SCALE, dropout=0.0, training=True)
    else:
        out = KERNELS[backend](q, k, v, docs, SCALE, 0.0)
    out.backward(grad)
    return tuple(x.detach().double() for x in (out, q.grad, k.grad, v.grad))  # type: ignore[union-attr]


def reference(case: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    q, k, v, grad = (
        x.double().requires_grad_(i < 3) for i, x in enumerate(inputs(case, dtype, None))
    )
    out = KERNELS["sdpa"](q, k, v, documents(case), SCALE, 0.0)
    out.backward(grad)
    return tuple(x.detach() for x in (out, q.grad, k.grad, v.grad))  # type: ignore[union-attr]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_real_token_means_zeros_whatever_is_there(
    backend: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    got = run_backend(backend, case, math.nan, monkeypatch)
    want = reference(case, torch.bfloat16 if backend == "cudnn" else torch.float64)
    keep = holds_token(case)
    rtol, atol = (0.0, 2e-2) if backend == "cudnn" else (1e-10, 1e-10)  # cudnn: bf16 in
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(a[~keep], torch.zeros_like(a[~keep])), f"{backend} {name}: not zero"
        torch.testing.assert_close(a[keep], b[keep], rtol=rtol, atol=atol, msg=f"{backend} {name}")


def test_every_backend_is_checked_here() -> None:
    assert set(BACKENDS) == {
        "te",
        "cudnn",
        "bucketed",
        "flash_attn",
        "torch_varlen",
        "flex",
        "sdpa",
    }


@pytest.mark.parametrize("case", list(CASES))
def test_flex_forward_compiled_on_this_cpu(case: str) -> None:
    """flex for real (CPU: forward only): zeros off the documents, the reference elsewhere."""
    q, k, v, _ = inputs(case, torch.float32, math.nan)
    with torch.no_grad():
        out = KERNELS["flex"](q, k, v, documents(case), SCALE, 0.0)
    want = reference(case, torch.float32)[0].float()
    keep = holds_token(case)
    assert torch.equal(out[~keep], torch.zeros_like(out[~keep]))
    torch.testing.assert_close(out[keep], want[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_kept_is_true_exactly_at_the_real_tokens(case: str) -> None:
    assert torch.equal(documents(case).kept(), holds_token(case))
