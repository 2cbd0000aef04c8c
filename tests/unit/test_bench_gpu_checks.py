"""The GPU kit's checks can fail: each is shown a planted fault on CPU and must report it.

(a) the attention check against a leaking, padding-writing, NaN-producing or gradient-losing
kernel; (b) packed == padded against a model whose tokens see the previous documents; (c) the sync
check against a planted synchronizing call in the forward, the backward and the prefetch thread,
with a guard that stands in for ``torch.cuda.set_sync_debug_mode("error")``. No megatron-core here:
fake models take GPTModel's call. The real model and the real guard run in test_gpu_kit.py.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from megapack import PackedBatch
from megapack.attention import packed_attention
from megapack.bench.gpu.attention_timing import attention_timing, cudnn_target, flex_target
from megapack.bench.gpu.checks import (
    attention_cases,
    boundaries,
    check_backend,
    packed_vs_padded,
    reference_attention,
)
from megapack.bench.gpu.syncs import (
    positive_control,
    sync_checks,
)

CPU = torch.device("cpu")
SIZES = {"heads": 4, "groups": 2, "head_dim": 8, "max_len": 16}


# -- (a) attention ---------------------------------------------------------------------------------
def test_reference_attention_worked_example() -> None:
    """Documents [1, 2] padded to 4 each: a 1-token document returns its value, padding is 0."""
    cu_real, cu_buffer = boundaries([1, 2], 4)
    assert (cu_real, cu_buffer) == ([0, 1, 3], [0, 4, 8])
    q, k, v = torch.randn(8, 2, 3), torch.randn(8, 1, 3), torch.randn(8, 1, 3)
    out = reference_attention(q, k, v, cu_real, cu_buffer, scale=0.5)
    assert torch.equal(out[0], v[0].expand(2, 3))  # one key: weight 1
    assert torch.equal(out[4], v[4].expand(2, 3))  # second document's first token sees itself only
    w = torch.softmax(
        torch.stack([q[5] @ k[4, 0], q[5] @ k[5, 0]], dim=-1) * 0.5, dim=-1
    )  # [heads, 2]
    assert torch.allclose(out[5], w[:, :1] * v[4] + w[:, 1:] * v[5])
    assert not out[1:4].any() and not out[6:].any()
    labels = [label for label, _, _ in attention_cases(16)]
    assert len(labels) == 5 and "padded to a multiple of 8" in labels[1]
    assert all("zero-length" in label for label in labels[3:])  # static shapes: every backend


def test_zero_length_documents_in_the_kits_attention_check_cpu() -> None:
    from megapack.bench.gpu.checks import attention_checks

    checks = attention_checks(CPU, torch.float32, heads=4, groups=2, head_dim=8, max_len=16)
    ran = [c for c in checks if c.status != "skipped" and not c.name.startswith("attention: auto")]
    assert ran and all(c.status == "passed" for c in ran), ran


def test_attention_check_passes_the_reference_kernel() -> None:
    check = check_backend(
        "sdpa", functools.partial(packed_attention, backend="sdpa"), CPU, torch.float32, **SIZES
    )
    assert check.status == "passed", check.detail
    assert "dq" in check.detail and "dv" in check.detail


def leaky(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens: torch.Tensor, cu_seqlens_padded: Any, max_seqlen: int) -> torch.Tensor:  # fmt: skip
    """Ignores document boundaries: the whole buffer is one causal document."""
    whole = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    return packed_attention(q, k, v, cu_seqlens=whole, max_seqlen=q.shape[0], backend="sdpa")


def writes_padding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens: torch.Tensor, cu_seqlens_padded: Any, max_seqlen: int) -> torch.Tensor:  # fmt: skip
    """Right within rounding, but writes 1e-7 (not 0) at alignment padding."""
    out = packed_attention(q, k, v, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded,
                           max_seqlen=max_seqlen, backend="sdpa")  # fmt: skip
    if cu_seqlens_padded is None:
        return out
    pad = torch.zeros(q.shape[0], 1, 1)
    for i in range(len(cu_seqlens) - 1):
        real_end = int(cu_seqlens_padded[i] + cu_seqlens[i + 1] - cu_seqlens[i])
        pad[real_end : int(cu_seqlens_padded[i + 1])] = 1e-7
    return out + pad


def nan_at_end(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    out = packed_attention(q, k, v, backend="sdpa", **kw)
    return torch.cat([out[:-1], out[-1:] * float("nan")])


def drops_key_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    return packed_attention(q, k.detach(), v, backend="sdpa", **kw)


@pytest.mark.parametrize(
    ("attend", "expected"),
    [(leaky, "relative error"), (writes_padding, "not 0 where no token is"),
     (nan_at_end, "NaN or inf"), (drops_key_grad, "dk has shape None")],
    ids=["leaks-across-documents", "writes-padding", "nan", "no-key-gradient"],
)  # fmt: skip
def test_attention_check_catches_a_broken_kernel(attend: Any, expected: str) -> None:
    check = check_backend("broken", attend, CPU, torch.float32, **SIZES)
    assert check.status == "failed" and expected in check.detail, check.detail


# -- (b) packed == padded ----------------------------------------------------------------------------
class TokenLoss(torch.nn.Module):
    """Takes GPTModel's call; a token's "loss" depends on its token and position, or, leaking, on
    the running sum of every token before it in the row (other documents included)."""

    def __init__(self, leak: bool) -> None:
        super().__init__()
        self.leak = leak

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, attention_mask: Any, *,
                labels: torch.Tensor, packed_seq_params: Any) -> torch.Tensor:  # fmt: skip
        x = tokens.float()
        seen = x.cumsum(dim=-1) if self.leak else x
        return 1e-3 * seen + 1e-2 * position_ids.float() + 1e-4 * labels.float()


@pytest.mark.parametrize("leak", [False, True], ids=["documents-apart", "documents-leak"])
def test_packed_vs_padded(leak: bool) -> None:
    check = packed_vs_padded(TokenLoss(leak), device=CPU, dtype=torch.float32, lengths=[1, 5, 3, 9],
                             seq_len=24, vocab_size=50, label="losses")  # fmt: skip
    assert check.status == ("failed" if leak else "passed"), check.detail
    assert (
        "4 documents (1-9 tokens) in one 24-token row vs padded to 9; 14 trained tokens"
        in check.detail
    )


# -- (c) syncs -------------------------------------------------------------------------------------
ARMED = {"on": False}
"""Set while the stand-in guard is active: a planted call raises only inside it, as a sync would."""


@contextlib.contextmanager
def stand_in_guard(device: torch.device) -> Iterator[bool]:
    """Raises where a planted sync or a ``.item()`` runs, as ``set_sync_debug_mode("error")`` does."""
    ARMED["on"] = True
    real_item, own = torch.Tensor.item, "item" in torch.Tensor.__dict__

    def item(self: torch.Tensor) -> Any:
        planted_sync()
        return real_item(self)

    torch.Tensor.item = item  # type: ignore[method-assign]
    try:
        yield True
    finally:
        if own:
            torch.Tensor.item = real_item  # type: ignore[method-assign]
        else:  # inherited from torch's C base: leave no attribute of our own behind
            del torch.Tensor.item
        ARMED["on"] = False


@contextlib.contextmanager
def blind_guard(device: torch.device) -> Iterator[bool]:
    """Claims to detect syncs and detects nothing: the positive control must catch it."""
    yield True


def planted_sync() -> None:
    if ARMED["on"]:
        raise RuntimeError("called a synchronizing CUDA operation (planted)")


class _SyncInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        planted_sync()
        return grad


class TinyLM(torch.nn.Module):
    """A per-token loss from an embedding, with a planted sync in its forward or backward."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(64, 1)
        self.where = where

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, attention_mask: Any, *,
                labels: torch.Tensor, packed_seq_params: Any) -> torch.Tensor:  # fmt: skip
        if self.where == "forward":
            planted_sync()
        out = self.embedding(tokens)[..., 0]
        return _SyncInBackward.apply(out) if self.where == "backward" else out


def batches(count: int = 9) -> list[PackedBatch]:
    rng = np.random.default_rng(0)
    return [PackedBatch.from_documents([rng.integers(1, 64, 5), rng.integers(1, 64, 3)], seq_len=12)
            for _ in range(count)]  # fmt: skip


class PlantedIterator:
    """Yields batches; the ones read while the guard is armed carry a planted sync (prefetch thread)."""

    def __init__(self, items: list[PackedBatch]) -> None:
        self.items = iter(items)

    def __iter__(self) -> PlantedIterator:
        return self

    def __next__(self) -> PackedBatch:
        planted_sync()
        return next(self.items)


def statuses(checks: list[Any]) -> list[str]:
    return [c.status for c in checks]


def test_sync_checks_pass_without_a_planted_sync() -> None:
    checks = sync_checks(TinyLM("nowhere"), batches(), device=CPU, guard=stand_in_guard)
    assert statuses(checks) == ["passed"] * 4, checks
    assert (
        checks[0].name.startswith("sync: positive control")
        and checks[0].detail == "the planted .item() raised"
    )


def test_sync_positive_control_fails_a_guard_that_detects_nothing() -> None:
    control = positive_control(CPU, blind_guard)
    assert (
        control.status == "failed"
        and "did not raise: the sync checks detect nothing" in control.detail
    )
    checks = sync_checks(TinyLM("forward"), batches(), device=CPU, guard=blind_guard)
    assert statuses(checks) == [
        "failed",
        "passed",
        "passed",
        "passed",
    ]  # blind: only the control sees it
    assert positive_control(CPU).status == "skipped"  # the real guard, without CUDA


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_sync_check_reports_a_sync_in_the_model_with_its_stack(where: str) -> None:
    checks = sync_checks(TinyLM(where), batches(), device=CPU, guard=stand_in_guard)
    assert statuses(checks) == ["passed", "passed", "passed", "failed"], checks
    detail = checks[3].detail
    assert detail.startswith("RuntimeError: called a synchronizing CUDA operation (planted)")
    assert "in planted_sync" in detail and ("in backward" in detail) == (where == "backward")


def test_sync_check_reports_a_sync_in_the_prefetch_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import megapack.bench.gpu.syncs as gpu_checks

    real_iter = iter
    monkeypatch.setattr(gpu_checks, "iter", lambda x: PlantedIterator(list(x)) if isinstance(x, list) else real_iter(x), raising=False)  # fmt: skip
    checks = sync_checks(TinyLM("nowhere"), batches(), device=CPU, guard=stand_in_guard)
    assert statuses(checks) == ["passed", "failed", "failed", "passed"], checks
    assert "in __next__" in checks[2].detail and "planted" in checks[2].detail


def test_sync_checks_are_skipped_without_cuda_but_their_steps_run() -> None:
    checks = sync_checks(TinyLM("forward"), batches(), device=CPU)  # the real guard: CUDA only
    assert statuses(checks) == ["skipped"] * 4
    assert all(c.detail.startswith("needs CUDA") for c in checks)
    broken = sync_checks(TinyLM("nowhere"), batches(), device=CPU)
    broken_model = TinyLM("nowhere")
    broken_model.forward = None  # type: ignore[assignment,method-assign]  # crashes on CPU too
    crashed = sync_checks(broken_model, batches(), device=CPU)
    assert statuses(broken) == ["skipped"] * 4 and crashed[3].status == "failed"
    assert crashed[3].detail.startswith("warm-up failed: TypeError")
    with pytest.raises(ValueError, match="at least 8 micro-batches"):
        sync_checks(TinyLM("nowhere"), batches(7), device=CPU)


def test_flex_target_compares_flex_with_varlen_and_skips_without_them() -> None:
    row = "one row"
    ok = flex_target({"torch_varlen": 2.0e-3, "flex": 3.0e-3, "sdpa": 9.0e-3}, row, where="cuda")
    assert (ok.status, ok.detail) == ("passed", "1.50x")
    assert ok.name == "target: flex fwd+bwd <= 1.5x torch_varlen (one row)"
    slow = flex_target({"torch_varlen": 2.0e-3, "flex": 3.1e-3}, row, where="cuda")
    assert (slow.status, slow.detail) == ("failed", "1.55x")
    none = flex_target({"sdpa": 1e-3}, row, where="cpu float32")
    assert (none.status, none.detail) == (
        "skipped",
        "flex and torch_varlen cannot train on cpu float32 here",
    )
    one = flex_target({"flex": 1e-3}, row, where="cpu float32")
    assert one.detail == "torch_varlen cannot train on cpu float32 here"


def test_attention_timing_times_every_backend_that_trains_here() -> None:
    checks = attention_timing(torch.device("cpu"), torch.float32, lengths=(5, 1, 9), heads=4,
                              groups=2, head_dim=8, repeats=2, warmup=1)  # fmt: skip
    timed, flex, cudnn = checks
    assert timed.status == "info"
    assert timed.name == (
        "attention time: fwd+bwd, one row of 3 documents (15 tokens), 4 heads / 2 groups x 8, float32"
    )
    assert re.fullmatch(
        r"median of 2 after 1 untimed: bucketed [\d.]+ ms, sdpa [\d.]+ ms", timed.detail
    )
    assert flex.status == "skipped" and cudnn.status == "skipped"
    assert cudnn.detail == "cudnn (or te) and torch_varlen cannot train on cpu float32 here"


def test_cudnn_target_takes_cudnn_else_te_against_varlen() -> None:
    row = "one row"
    ok = cudnn_target({"torch_varlen": 2.0e-3, "cudnn": 1.0e-3, "te": 3e-3}, row, where="cuda")
    assert (ok.status, ok.detail) == ("passed", "cudnn: 0.50x")
    assert ok.name == "target: cuDNN THD fwd+bwd <= 0.55x torch_varlen (one row)"
    slow = cudnn_target({"torch_varlen": 2.0e-3, "te": 1.2e-3}, row, where="cuda")
    assert (slow.status, slow.detail) == ("failed", "te: 0.60x")
    none = cudnn_target({"cudnn": 1e-3}, row, where="cuda bfloat16")
    assert (none.status, none.detail) == (
        "skipped",
        "torch_varlen cannot train on cuda bfloat16 here",
    )
