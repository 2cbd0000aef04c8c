"""The bucketed backend (megapack.attention.bucketed): equal to the per-document reference, forward
and backward (float64), with padded boundaries, zero-length documents and static tails, whether the
plan was delivered with the batch or made from the boundaries. The plan itself: test_buckets.py."""

from __future__ import annotations

import pytest
import torch

from megapack.attention import packed_attention
from megapack.attention.documents import Documents
from megapack.attention.kernels import KERNELS
from megapack.core.buckets import plan_buckets
from megapack.testing.host_reads import host_reads

CASES = {
    "unpadded": ([0, 3, 40, 41, 64], None),
    "aligned": ([0, 3, 5, 9, 30], [0, 8, 16, 24, 64]),
    "zero-length": ([0, 3, 3, 9, 9], [0, 4, 4, 12, 64]),
    "static-tail": ([0, 30, 64, 64, 64], None),
}


@pytest.mark.parametrize("case", CASES)
def test_bucketed_equals_the_per_document_reference_forward_and_backward(case: str) -> None:
    real, buffer = CASES[case]
    cu = torch.tensor(real, dtype=torch.int32)
    pad = None if buffer is None else torch.tensor(buffer, dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    base = [torch.randn(64, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
    grad = torch.randn(64, 4, 8, generator=g, dtype=torch.float64)
    results = []
    for name in ("sdpa", "bucketed"):
        q, k, v = (x.clone().requires_grad_() for x in base)
        out = packed_attention(q, k, v, cu_seqlens=cu.clone(), cu_seqlens_padded=None if pad is None else pad.clone(),
                               max_seqlen=64, backend=name)  # fmt: skip
        out.backward(grad)
        results.append((out, q.grad, k.grad, v.grad))
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_delivered_plan_gives_the_same_result_without_reading_the_host() -> None:
    cu = torch.tensor([0, 5, 12, 13, 40], dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(40, h, 8, generator=g) for h in (4, 2, 2))
    host = Documents(cu, cu, 27, 40)
    delivered = Documents(cu, cu, 27, 40)
    delivered.buckets = tuple(torch.from_numpy(b) for b in plan_buckets(cu.tolist()))
    with host_reads() as reads:
        got = KERNELS["bucketed"](q, k, v, delivered, 0.3, 0.0)
    assert reads.by_module() == {}, reads.report()
    torch.testing.assert_close(got, KERNELS["bucketed"](q, k, v, host, 0.3, 0.0))
    torch.testing.assert_close(got, KERNELS["sdpa"](q, k, v, Documents(cu, cu, 27, 40), 0.3, 0.0))
