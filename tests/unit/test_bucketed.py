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
    delivered.buckets = tuple(torch.from_numpy(b) for b in plan_buckets(cu.tolist(), total=40))
    with host_reads() as reads:
        got = KERNELS["bucketed"](q, k, v, delivered, 0.3, 0.0)
    assert reads.by_module() == {}, reads.report()
    torch.testing.assert_close(got, KERNELS["bucketed"](q, k, v, host, 0.3, 0.0))
    torch.testing.assert_close(got, KERNELS["sdpa"](q, k, v, Documents(cu, cu, 27, 40), 0.3, 0.0))


# ---- boundaries that end before T (issue 48) ---------------------------------------------------

TAILS = {  # total T, real boundaries, buffer boundaries: the last boundary below T
    "T40-ends-at-30": (40, [0, 7, 19, 30], None),
    "T32-padded-zero-length-ends-at-24": (32, [0, 5, 5, 14], [0, 8, 8, 24]),
}


def tail_run(case: str, plan: str, tail: str) -> tuple[torch.Tensor, ...]:
    """bucketed's (out, dq, dk, dv), float64, 4 query / 2 KV heads; ``plan``: "host" (made from
    the boundaries), "delivered" (marked with T) or "last-boundary" (a trainer's plan marked with
    the last boundary); ``tail``: what the positions past the last boundary hold."""
    total, real, buffer = TAILS[case]
    end = (buffer or real)[-1]
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(total, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    grad = torch.randn(total, 4, 8, generator=g, dtype=torch.float64)
    for x in (q, k, v):
        x[end:] = {"random": x[end:], "huge": 1e6, "nan": float("nan")}[tail]
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cu = torch.tensor(real, dtype=torch.int32)
    pad = cu if buffer is None else torch.tensor(buffer, dtype=torch.int32)
    docs = Documents(cu, pad, int(pad.diff().max()), total)
    if plan != "host":
        sentinel = total if plan == "delivered" else end
        planned = plan_buckets(pad.tolist(), None if buffer is None else real, total=sentinel)
        docs.buckets = tuple(torch.from_numpy(b) for b in planned)
    out = KERNELS["bucketed"](q, k, v, docs, 0.35, 0.0)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def tail_reference(case: str) -> tuple[torch.Tensor, ...]:
    total, real, buffer = TAILS[case]
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(total, h, 8, generator=g, dtype=torch.float64).requires_grad_()
               for h in (4, 2, 2))  # fmt: skip
    grad = torch.randn(total, 4, 8, generator=g, dtype=torch.float64)
    cu = torch.tensor(real, dtype=torch.int32)
    pad = cu if buffer is None else torch.tensor(buffer, dtype=torch.int32)
    out = KERNELS["sdpa"](q, k, v, Documents(cu, pad, int(pad.diff().max()), total), 0.35, 0.0)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("tail", ["random", "huge", "nan"])
@pytest.mark.parametrize("plan", ["host", "delivered", "last-boundary"])
@pytest.mark.parametrize("case", list(TAILS))
def test_boundaries_ending_before_t_give_the_reference_and_a_zero_tail(
    case: str, plan: str, tail: str
) -> None:
    """Padding slots marked with the last boundary aliased a real tail position (issue 48): the
    tail's outputs and gradients were not zero and the real positions' K/V gradients were off the
    per-document reference and moved with the tail's contents. Whatever the tail holds (NaN
    included) and whichever sentinel a delivered plan used, the real positions now equal the
    reference and the tail is exactly zero."""
    end = (TAILS[case][2] or TAILS[case][1])[-1]
    got = tail_run(case, plan, tail)
    want = tail_reference(case)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(a[end:], torch.zeros_like(a[end:])), f"{name} past the last boundary"
        torch.testing.assert_close(a[:end], b[:end], rtol=1e-12, atol=1e-12, msg=name)


# ---- what mutation testing found unguarded (docs/records/mutation.md, 2026-11-28) -------------


def test_grouped_query_attention_whatever_the_head_dim() -> None:
    """4 query heads over 2 K/V heads with a head dim of 4 (equal to the query heads): grouped,
    as the reference computes it."""
    cu = torch.tensor([0, 5, 12, 13, 24], dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(24, h, 4, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    got = KERNELS["bucketed"](q, k, v, Documents(cu, cu, 11, 24), 0.5, 0.0)
    want = KERNELS["sdpa"](q, k, v, Documents(cu, cu, 11, 24), 0.5, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_attention_dropout_is_applied() -> None:
    cu = torch.tensor([0, 20, 40], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(40, 2, 8, generator=g) for _ in range(3))
    plain = KERNELS["bucketed"](q, k, v, Documents(cu, cu, 20, 40), 0.3, 0.0)
    torch.manual_seed(0)
    dropped = KERNELS["bucketed"](q, k, v, Documents(cu, cu, 20, 40), 0.3, 0.5)
    torch.manual_seed(0)
    again = KERNELS["bucketed"](q, k, v, Documents(cu, cu, 20, 40), 0.3, 0.5)
    assert not torch.allclose(dropped, plain) and torch.equal(dropped, again)


def test_the_plan_is_made_once_per_micro_batch_however_many_layers_attend() -> None:
    """Without a delivered plan the first layer reads the boundaries from the host; the next
    layers of the micro-batch (the same Documents) reuse its plan and read nothing."""
    cu = torch.tensor([0, 5, 12, 13, 40], dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(40, h, 8, generator=g) for h in (4, 2, 2))
    docs = Documents(cu, cu, 27, 40)
    with host_reads() as first:
        one = KERNELS["bucketed"](q, k, v, docs, 0.3, 0.0)
    assert first.by_module() != {}
    with host_reads() as later:
        two = KERNELS["bucketed"](q, k, v, docs, 0.3, 0.0)
    assert later.by_module() == {}, later.report()
    torch.testing.assert_close(one, two, rtol=0, atol=0)


def test_bucketed_refuses_a_capture_naming_itself_why_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megapack.core import capture
    from megapack.core.errors import CaptureError

    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    q, k, v = (torch.zeros(8, 2, 8) for _ in range(3))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(capture, "_runtime_capture_id", lambda: 9)
    with pytest.raises(CaptureError) as caught:
        KERNELS["bucketed"](q, k, v, Documents(cu, cu, 5, 8), 0.3, 0.0)
    assert str(caught.value) == (
        "attention backend 'bucketed' cannot run inside a CUDA-graph capture: its bucket shapes "
        "change with every micro-batch; capture with backend 'cudnn' and a megapack.StaticShape"
    )


def test_bucket_shapes_are_the_delivered_plans_or_none() -> None:
    from megapack.attention.bucketed import bucket_shapes

    cu = torch.tensor([0, 5, 12, 13, 40], dtype=torch.int32)
    docs = Documents(cu, cu, 27, 40)
    assert bucket_shapes(docs) is None
    docs.buckets = tuple(torch.from_numpy(b) for b in plan_buckets(cu.tolist(), total=40))
    assert bucket_shapes(docs) == [tuple(b.shape) for b in docs.buckets] != []
