"""The GPU kit's ``attention-rows`` section: the fused THD backends on two real rows, against a
float64 reference, and their time per FLOP.

The backends of `BACKENDS` (cudnn, torch_varlen, bucketed), each on every row of the kit's sizes
(`megapack.bench.gpu.sizes.KitSizes.attention_rows`, an `AttentionRow` each):

    the timed row   the 14,398 tokens of 8 documents the attention timing has always used
    the gap row     zero-length documents in the middle, a 1-token document, positions past the
                    last boundary (a tail), and T not a multiple of 64 (cuDNN's
                    ``max_total_seq_len`` is T rounded up to one)

Per row, fresh random q, k, v (16 heads / 4 KV groups x 128 on a GPU) and one float64 reference
(`megapack.bench.gpu.checks.reference_attention`, zeros on the tail) with its gradients; per
backend, fwd+bwd against it (relative L2 error within `megapack.bench.gpu.checks.ATTENTION_TOLERANCE`,
no NaN, exactly 0 past the last boundary), then its median fwd+bwd time over ``repeats`` calls
after ``warmup`` untimed ones, and that time per FLOP. FLOPs are the row's causal attention work,
document by document (`attention_flops`: 3 x the forward's 4 x heads x head dim x sum L(L + 1)/2,
the kit's model convention, `megapack.bench.gpu.model`), so the same on every backend: per FLOP,
a row's backends compare as their times do, and rows compare with each other. The target, on the
timed row: cuDNN <= `megapack.bench.gpu.targets.CUDNN_OVER_VARLEN` x torch_varlen
(`megapack.bench.gpu.attention_timing.cudnn_target`).

A backend that cannot train here is skipped with the reason (on a CPU: cudnn and torch_varlen,
"runs on CUDA only"); one that raises is a failed check, and the next backend runs.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megapack.bench.gpu.attention_timing import cudnn_target
from megapack.bench.gpu.checks import (
    ATTENTION_TOLERANCE,
    compare_to_reference,
    dtype_name,
    reference_attention,
)
from megapack.bench.gpu.report import Check, Status

BACKENDS = ("cudnn", "torch_varlen", "bucketed")
"""The backends timed and checked on every row."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionRow:
    """One packed row: its documents' lengths (zero-length ones allowed) and a tail of positions
    past the last boundary.

    Example:
        >>> row = AttentionRow(label="gap", lengths=(3, 0, 2), tail=1)
        >>> row.total, row.boundaries()
        (6, [0, 3, 3, 5])
    """

    label: str
    """How the report names the row."""
    lengths: tuple[int, ...]
    """Document lengths, in order; 0 is a zero-length document (an empty segment)."""
    tail: int = 0
    """Positions after the last document, in no segment (output and gradients must be 0)."""

    @property
    def total(self) -> int:
        """T: the row's positions."""
        return sum(self.lengths) + self.tail

    def boundaries(self) -> list[int]:
        """``cu_seqlens``: ``[0, L0, L0 + L1, ...]``."""
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out

    def describe(self) -> str:
        zeros = sum(n == 0 for n in self.lengths)
        extra = f", {zeros} of them zero-length" if zeros else ""
        tail = f", a tail of {self.tail} past the last boundary" if self.tail else ""
        return (f"{self.label}: {len(self.lengths)} documents{extra} ({sum(self.lengths):,} "
                f"tokens{tail}; T {self.total:,})")  # fmt: skip


def attention_flops(lengths: Sequence[int], heads: int, head_dim: int) -> int:
    """Causal attention FLOPs of one fwd+bwd over documents of these lengths: 3 x the forward's
    4 x heads x head dim x sum L(L + 1)/2 (QK^T and AV over each document's (query, key) pairs).

    Example:
        >>> attention_flops([3, 0, 2], heads=2, head_dim=4)  # pairs 6 + 0 + 3
        864
    """
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return 3 * 4 * heads * head_dim * pairs


def attention_rows(
    device: torch.device,
    dtype: torch.dtype,
    *,
    rows: Sequence[AttentionRow],
    heads: int,
    groups: int,
    head_dim: int,
    repeats: int,
    warmup: int = 3,
    backends: Sequence[str] = BACKENDS,
) -> list[Check]:
    """Every backend on every row (module docstring): a check each, a time line per row, and the
    cuDNN target on the first row."""
    from megapack.attention.choice import installed_here, refusal

    checks: list[Check] = []
    for index, row in enumerate(rows):
        where = (
            f"{row.describe()}; {heads} heads / {groups} groups x {head_dim}, {dtype_name(dtype)}"
        )
        inputs = _inputs(row, device, dtype, heads=heads, groups=groups, head_dim=head_dim)
        times: dict[str, float] = {}
        failed: list[str] = []
        for name in backends:
            label = f"attention-rows: {name} fwd+bwd vs float64 ({row.label})"
            why = refusal(
                name, device.type, dtype, training=True, dropout=0.0, installed=installed_here()
            )
            if why is not None:
                checks.append(Check(name=label, status="skipped",
                                    detail=f"cannot train {dtype_name(dtype)} on {device.type} here: {why}"))  # fmt: skip
                continue
            try:
                check, seconds = _backend(label, name, row, inputs, dtype, device, repeats, warmup)
            except Exception as exc:
                stack = "\n".join(traceback.format_exc().splitlines()[-20:])
                checks.append(Check(name=label, status="failed", detail=f"{type(exc).__name__}: {exc}\n{stack}"))  # fmt: skip
                failed.append(name)
                continue
            checks.append(check)
            if seconds is not None:
                times[name] = seconds
            else:
                failed.append(name)
        checks.append(_time_line(row, times, where, heads, head_dim, repeats, warmup))
        if index == 0:
            target = cudnn_target(times, where, where=f"{device.type} {dtype_name(dtype)}")
            broken = [n for n in ("cudnn", "torch_varlen") if n in failed]
            if target.status == "skipped" and broken:  # not "cannot train": it failed its check
                target = Check(name=target.name, status="failed",
                               detail=f"{' and '.join(broken)} failed against float64 on this row: "
                               "not timed")  # fmt: skip
            checks.append(target)
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return checks


@dataclass(frozen=True, slots=True)
class _Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    cu: torch.Tensor
    reference: dict[str, torch.Tensor]
    """out, dq, dk, dv in float64."""


def _inputs(
    row: AttentionRow,
    device: torch.device,
    dtype: torch.dtype,
    *,
    heads: int,
    groups: int,
    head_dim: int,
) -> _Inputs:
    """Fresh random inputs for ``row`` and their float64 reference, output and gradients."""
    gen = torch.Generator(device=device).manual_seed(len(row.lengths) * 1_000 + row.total)
    q, k, v, dout = (torch.randn(row.total, h, head_dim, device=device, dtype=dtype, generator=gen)
                     for h in (heads, groups, groups, heads))  # fmt: skip
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    cu = row.boundaries()
    body = reference_attention(exact[0], exact[1], exact[2], cu, cu, head_dim**-0.5)
    out = torch.cat([body, body.new_zeros(row.tail, heads, head_dim)])
    out.backward(dout.double())
    reference = {"out": out.detach()}
    reference |= {f"d{n}": x.grad for n, x in zip("qkv", exact, strict=True) if x.grad is not None}
    boundaries = torch.tensor(cu, dtype=torch.int32, device=device)
    return _Inputs(q=q, k=k, v=v, dout=dout, cu=boundaries, reference=reference)


def _backend(
    label: str,
    name: str,
    row: AttentionRow,
    inputs: _Inputs,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
    warmup: int,
) -> tuple[Check, float | None]:
    """(the backend's check against the reference, its median fwd+bwd seconds or None when it
    failed the check)."""
    from megapack.attention import packed_attention

    longest = max(max(row.lengths), 1)

    def call() -> dict[str, torch.Tensor | None]:
        q, k, v = (x.detach().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
        out = packed_attention(q, k, v, cu_seqlens=inputs.cu, max_seqlen=longest, backend=name)
        out.backward(inputs.dout)
        return {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}

    got = call()
    tolerance = ATTENTION_TOLERANCE[dtype]
    tail = torch.zeros(row.total, dtype=torch.bool, device=device)
    tail[row.total - row.tail :] = True
    problems, errors = [], []
    for key, want in inputs.reference.items():
        bound = tolerance["out" if key == "out" else "grad"]
        problem, error = compare_to_reference(got[key], want, tail, bound)
        if error is not None:
            errors.append(f"{key} {error:.1e}")
        if problem:
            problems.append(f"{key} {problem}")
    limits = f"tolerance {tolerance['out']:g} out, {tolerance['grad']:g} gradients"
    if problems:
        return Check(name=label, status="failed", detail=f"{'; '.join(problems)} ({limits})"), None
    seconds = []
    for i in range(warmup + repeats):
        _sync(device)
        begin = time.perf_counter()
        call()
        _sync(device)
        if i >= warmup:
            seconds.append(time.perf_counter() - begin)
    median = statistics.median(seconds)
    zeros = " and exactly 0 on the tail" if row.tail else ""
    check = Check(name=label, status="passed",
                  detail=f"relative error {', '.join(errors)}{zeros} ({limits}); median fwd+bwd "
                  f"{median * 1e3:.2f} ms")  # fmt: skip
    return check, median


def _time_line(
    row: AttentionRow,
    times: dict[str, float],
    where: str,
    heads: int,
    head_dim: int,
    repeats: int,
    warmup: int,
) -> Check:
    """The row's backends: median fwd+bwd time, TFLOP/s and picoseconds per FLOP, and each one
    against torch_varlen's time per FLOP."""
    flops = attention_flops(row.lengths, heads, head_dim)
    parts = []
    for name, seconds in times.items():
        part = f"{name} {seconds * 1e3:.2f} ms, {flops / seconds / 1e12:.3g} TFLOP/s, {seconds / flops * 1e12:.3g} ps/FLOP"
        if name != "torch_varlen" and "torch_varlen" in times:
            part += f" ({seconds / times['torch_varlen']:.2f}x torch_varlen per FLOP)"
        parts.append(part)
    measured = "; ".join(parts) or "no backend passed its check here"
    status: Status = "info"
    return Check(name=f"attention-rows: time per FLOP ({where})", status=status,
                 detail=f"{flops / 1e9:,.2f} GFLOP fwd+bwd (causal, per document); median of "
                 f"{repeats} after {warmup} untimed: {measured}")  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
