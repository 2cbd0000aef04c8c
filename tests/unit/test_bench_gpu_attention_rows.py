"""The GPU kit's attention-rows section on CPU: its rows are the ones the first run needs, its
FLOPs are counted per document, and it catches a kernel that leaks across documents, writes past
the last boundary or raises (the next backend still runs). cudnn and torch_varlen cannot train on
a CPU: they are reported unavailable with the reason; on a GPU the kit runs them."""

from __future__ import annotations

import doctest
from typing import Any

import pytest
import torch

from megapack.attention import kernels
from megapack.attention.documents import Documents
from megapack.bench.gpu import attention_rows as rows_module
from megapack.bench.gpu.attention_rows import AttentionRow, attention_flops, attention_rows
from megapack.bench.gpu.sizes import DRY, FULL, TIMED_ROW

CPU = torch.device("cpu")
SHAPE = {"heads": 4, "groups": 2, "head_dim": 8}


def test_docstring_examples() -> None:
    result = doctest.testmod(rows_module)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize("sizes", [FULL, DRY], ids=["full", "dry"])
def test_the_rows_are_the_timed_row_and_a_gap_row(sizes: Any) -> None:
    timed, gap = sizes.attention_rows
    assert timed.lengths == sizes.timing_lengths and timed.tail == 0  # the cuDNN target's row
    inner = gap.lengths[1:-1]
    assert 0 in inner and 0 not in (gap.lengths[0], gap.lengths[-1])  # zero-length in the middle
    assert 1 in gap.lengths and gap.tail > 0 and gap.total % 64 != 0
    assert max(gap.lengths) <= sizes.attention["max_len"]


def test_the_timed_row_is_14398_tokens_of_8_documents() -> None:
    assert FULL.attention_rows[0].lengths == TIMED_ROW
    assert (len(TIMED_ROW), sum(TIMED_ROW)) == (8, 14_398)
    assert FULL.attention_rows[1].total == 5_712  # 89.25 x 64


def test_flops_are_counted_per_document() -> None:
    assert attention_flops([3, 0, 2], heads=2, head_dim=4) == 3 * 4 * 2 * 4 * (6 + 3)
    assert attention_flops([5, 5], 16, 128) == 2 * attention_flops([5], 16, 128)
    assert attention_flops([10], 16, 128) > attention_flops(
        [5, 5], 16, 128
    )  # one document attends more


def run(**kw: Any) -> dict[str, Any]:
    checks = attention_rows(
        CPU, torch.float32, rows=DRY.attention_rows, **SHAPE, repeats=1, warmup=0, **kw
    )
    return {c.name: c for c in checks}


def test_every_backend_on_every_row_on_cpu() -> None:
    checks = run()
    for row in ("the timed row", "the gap row"):
        for name in ("cudnn", "torch_varlen"):
            skipped = checks[f"attention-rows: {name} fwd+bwd vs float64 ({row})"]
            assert skipped.status == "skipped"
            assert skipped.detail == f"cannot train float32 on cpu here: {name} runs on CUDA only"
        bucketed = checks[f"attention-rows: bucketed fwd+bwd vs float64 ({row})"]
        assert bucketed.status == "passed", bucketed.detail
    assert (
        "exactly 0 on the tail"
        in checks["attention-rows: bucketed fwd+bwd vs float64 (the gap row)"].detail
    )
    times = [c for name, c in checks.items() if name.startswith("attention-rows: time per FLOP")]
    assert len(times) == 2 and all(c.status == "info" and "bucketed " in c.detail for c in times)
    assert "T 159" in times[1].name and "4 of them zero-length" in times[1].name
    target = [c for name, c in checks.items() if name.startswith("target: cuDNN")]
    assert len(target) == 1 and target[0].status == "skipped"  # on the timed row only
    assert "the timed row" in target[0].name


def leaks_across_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float, dropout: float) -> torch.Tensor:  # fmt: skip
    whole = Documents(
        torch.tensor([0, q.shape[0]]), torch.tensor([0, q.shape[0]]), q.shape[0], q.shape[0]
    )
    return kernels.sdpa_attention(q, k, v, whole, scale, dropout)


def writes_the_tail(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float, dropout: float) -> torch.Tensor:  # fmt: skip
    out = kernels.sdpa_attention(q, k, v, docs, scale, dropout)
    return out + (~docs.kept())[:, None, None] * 1e-7


def raises(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float, dropout: float) -> torch.Tensor:  # fmt: skip
    raise RuntimeError("cuDNN: graph execution failed")


@pytest.mark.parametrize(
    ("kernel", "expected"),
    [(leaks_across_documents, "out relative error"), (writes_the_tail, "not 0 where no token is")],
    ids=["leaks-across-documents", "writes-past-the-last-boundary"],
)
def test_a_broken_kernel_fails_its_row(
    monkeypatch: pytest.MonkeyPatch, kernel: Any, expected: str
) -> None:
    monkeypatch.setitem(kernels.KERNELS, "bucketed", kernel)
    check = run()["attention-rows: bucketed fwd+bwd vs float64 (the gap row)"]
    assert check.status == "failed" and expected in check.detail, check.detail


def test_a_backend_that_raises_is_a_failed_check_and_the_next_one_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(kernels.KERNELS, "bucketed", raises)
    checks = run(backends=("bucketed", "sdpa"))
    failed = checks["attention-rows: bucketed fwd+bwd vs float64 (the timed row)"]
    assert failed.status == "failed"
    assert failed.detail.startswith("RuntimeError: cuDNN: graph execution failed")
    assert checks["attention-rows: sdpa fwd+bwd vs float64 (the timed row)"].status == "passed"
    assert checks["attention-rows: sdpa fwd+bwd vs float64 (the gap row)"].status == "passed"


def test_a_row_describes_itself() -> None:
    row = AttentionRow(label="r", lengths=(4, 0, 1), tail=3)
    assert (
        row.describe()
        == "r: 3 documents, 1 of them zero-length (5 tokens, a tail of 3 past the last boundary; T 8)"
    )


def stand_ins(monkeypatch: pytest.MonkeyPatch, cudnn: Any) -> None:
    """cudnn and torch_varlen made to run on CPU: ``cudnn`` as their kernel, sdpa as varlen's."""
    from megapack.attention import choice

    real = choice.refusal

    def refusal(name: str, *args: Any, **kw: Any) -> str | None:
        return None if name in ("cudnn", "torch_varlen") else real(name, *args, **kw)

    monkeypatch.setattr(choice, "refusal", refusal)
    monkeypatch.setitem(kernels.KERNELS, "cudnn", cudnn)
    monkeypatch.setitem(kernels.KERNELS, "torch_varlen", kernels.sdpa_attention)


def test_the_cudnn_target_reads_the_timed_row(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_ins(monkeypatch, kernels.sdpa_attention)
    checks = run()
    (target,) = [c for name, c in checks.items() if name.startswith("target: cuDNN")]
    assert "the timed row" in target.name and target.status in ("passed", "failed")
    assert target.detail.startswith("cudnn: ") and target.detail.endswith("x")
    (line,) = [
        c
        for name, c in checks.items()
        if name.startswith("attention-rows: time per FLOP (the timed row")
    ]
    assert "x torch_varlen per FLOP" in line.detail and "cudnn " in line.detail


def test_a_cudnn_that_fails_its_check_fails_the_target_instead_of_skipping_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stand_ins(monkeypatch, raises)
    checks = run()
    (target,) = [c for name, c in checks.items() if name.startswith("target: cuDNN")]
    assert (target.status, target.detail) == (
        "failed",
        "cudnn failed against float64 on this row: not timed",
    )
