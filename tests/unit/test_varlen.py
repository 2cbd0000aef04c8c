"""torch's varlen_attn in its 2.10, 2.11 and 2.13 forms, faked on CPU, against the SDPA reference.

torch's own ``varlen_attn`` runs on CUDA only (FlashAttention 2). Each stand-in here has exactly the
signature of one torch release and computes with one SDPA call per segment (bottom-right causal,
as FlashAttention aligns it); like the releases without ``enable_gqa`` it refuses key/value heads
fewer than the query heads. The varlen kernels (single row and context-parallel) must call each
form correctly and equal the SDPA reference, forward and backward, for GQA and MHA.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from megapack.attention.cp_kernels import sdpa_cross, varlen_cross
from megapack.attention.cp_plan import CpPlan
from megapack.attention.documents import Documents
from megapack.attention.kernels import sdpa_attention, varlen_attention
from megapack.attention.varlen import VarlenForm, call_varlen, repeat_kv

CALLS: list[dict[str, Any]] = []


def segments(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    *, causal: bool, scale: float | None, gqa: bool,
) -> torch.Tensor:  # fmt: skip
    if q.shape[1] != k.shape[1] and not gqa:
        raise RuntimeError(f"{q.shape[1]} query heads vs {k.shape[1]} key heads without enable_gqa")
    cq, ck = cu_q.tolist(), cu_k.tolist()
    pieces = []
    for i in range(len(cq) - 1):
        nq, nk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        allowed = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq) if causal else None
        sq, sk, sv = (x[a:b].transpose(0, 1)[None] for x, a, b in
                      ((q, cq[i], cq[i + 1]), (k, ck[i], ck[i + 1]), (v, ck[i], ck[i + 1])))  # fmt: skip
        out = F.scaled_dot_product_attention(sq, sk, sv, attn_mask=allowed, scale=scale, enable_gqa=gqa)  # fmt: skip
        pieces.append(out[0].transpose(0, 1))
    return torch.cat(pieces)


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                return_aux=None):  # fmt: skip
    CALLS.append({"is_causal": is_causal})
    return segments(query, key, value, cu_seq_q, cu_seq_k, causal=is_causal, scale=None, gqa=False)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1)):  # fmt: skip
    CALLS.append({"scale": scale, "window_size": window_size})
    assert tuple(window_size) in ((-1, -1), (-1, 0))
    causal = tuple(window_size) == (-1, 0)
    return segments(query, key, value, cu_seq_q, cu_seq_k, causal=causal, scale=scale, gqa=False)


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                block_table=None, num_splits=None):  # fmt: skip
    CALLS.append({"scale": scale, "window_size": window_size, "enable_gqa": enable_gqa})
    causal = tuple(window_size) == (-1, 0)
    return segments(
        query, key, value, cu_seq_q, cu_seq_k, causal=causal, scale=scale, gqa=enable_gqa
    )


FORMS = {"2.10": varlen_2_10, "2.11": varlen_2_11, "2.13": varlen_2_13}


@pytest.fixture(params=list(FORMS))
def torch_varlen(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    from torch.nn.attention import varlen

    monkeypatch.setattr(varlen, "varlen_attn", FORMS[request.param])
    CALLS.clear()
    return str(request.param)


def test_varlen_forms_are_read_from_signatures() -> None:
    assert VarlenForm.of(varlen_2_10) == VarlenForm(
        causal="is_causal", scale=False, enable_gqa=False
    )
    assert VarlenForm.of(varlen_2_11) == VarlenForm(
        causal="window_size", scale=True, enable_gqa=False
    )
    assert VarlenForm.of(varlen_2_13) == VarlenForm(
        causal="window_size", scale=True, enable_gqa=True
    )
    assert VarlenForm.of(lambda query, key, value: None) is None
    from torch.nn.attention.varlen import varlen_attn

    # the installed torch, against its release notes (2.11: window_size, 2.12: enable_gqa): the
    # project's 2.13 here, the GPU machine's 2.11 there
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert VarlenForm.of(varlen_attn) == VarlenForm(
        causal="window_size" if release >= (2, 11) else "is_causal",
        scale=release >= (2, 11),
        enable_gqa=release >= (2, 12),
    )


def inputs(heads: int, groups: int, total: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(total, h, 8, generator=g, requires_grad=True) for h in (heads, groups, groups)
    ]


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("scale", [None, 0.2], ids=["default-scale", "scale-0.2"])
def test_varlen_kernel_equals_sdpa_reference(torch_varlen: str, heads: int, groups: int, scale: float | None) -> None:  # fmt: skip
    real, buffer = [0, 3, 4, 8, 15], [0, 4, 8, 12, 20]  # padded; a 1-token document
    docs = Documents(torch.tensor(real, dtype=torch.int32), torch.tensor(buffer, dtype=torch.int32), 8, 20)  # fmt: skip
    softmax_scale = 1 / math.sqrt(8) if scale is None else scale
    q, k, v = inputs(heads, groups, 20, seed=heads + groups)
    out = varlen_attention(q, k, v, docs, softmax_scale, 0.0)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = sdpa_attention(q, k, v, docs, softmax_scale, 0.0)
    want = torch.autograd.grad(ref.square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    call = CALLS[-1]
    if torch_varlen == "2.10":
        assert call == {"is_causal": True}  # no scale argument: folded into q
    else:
        assert call["window_size"] == (-1, 0) and call["scale"] == softmax_scale
    if torch_varlen == "2.13":
        assert call["enable_gqa"] == (heads != groups)


def test_varlen_cp_cross_kernel_equals_sdpa_cross(torch_varlen: str) -> None:
    cu = torch.tensor([0, 4, 12, 16])
    plan = CpPlan.build(cu, cu, cp_size=2, cp_rank=1, layout="row", local_total=8)
    q = torch.randn(len(plan.q_index), 4, 8)
    k, v = torch.randn(len(plan.k_index), 2, 8), torch.randn(len(plan.k_index), 2, 8)
    torch.testing.assert_close(varlen_cross(q, k, v, plan, 0.3, 0.0), sdpa_cross(q, k, v, plan, 0.3, 0.0))  # fmt: skip


def test_varlen_missing_or_unknown_form_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.nn.attention import varlen

    monkeypatch.setattr(varlen, "varlen_attn", lambda query, key, value, cu_q, cu_k, mq, mk: None)
    x = torch.zeros(2, 1, 8)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="takes neither window_size nor is_causal"):
        call_varlen(x, x, x, cu, cu, 2, 2, scale=0.3)


def test_varlen_repeat_kv_matches_repeat_interleave() -> None:
    k = torch.randn(5, 3, 4)
    assert torch.equal(repeat_kv(k, 4), k.repeat_interleave(4, dim=1))
    assert repeat_kv(k, 1) is k
