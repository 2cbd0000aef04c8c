"""The GPU kit's attention timing: every backend that trains here, fwd+bwd on one packed row, and
the targets: flex within `FLEX_OVER_VARLEN` x torch_varlen; cuDNN's THD path (``cudnn``, else
``te``: the kernels padded SDPA gets on Hopper) at most `CUDNN_OVER_VARLEN` x torch_varlen; the
``bucketed`` fallback (dense SDPA per length bucket) reported against both.

Timing is not correctness: `megapack.bench.gpu.checks` checks each backend's values; this module
only reports the medians (an "info" line) and the one target.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from megapack.bench.gpu.checks import dtype_name
from megapack.bench.gpu.report import Check, Status
from megapack.bench.gpu.targets import CUDNN_OVER_VARLEN, FLEX_OVER_VARLEN

__all__ = [
    "CUDNN_OVER_VARLEN",
    "FLEX_OVER_VARLEN",
    "attention_timing",
    "cudnn_target",
    "flex_target",
]


def attention_timing(
    device: torch.device,
    dtype: torch.dtype,
    *,
    lengths: Sequence[int],
    heads: int,
    groups: int,
    head_dim: int,
    repeats: int,
    warmup: int = 3,
) -> list[Check]:
    """Median fwd+bwd seconds of every backend that trains here, on one row of ``lengths``, and
    the target flex <= `FLEX_OVER_VARLEN` x torch_varlen (where both train, i.e. on a GPU).

    Every call gets the same boundary tensor, as every layer of a micro-batch does, so flex's
    block mask is built once (in the untimed calls) and reused, as in training.
    """
    from megapack.attention import BACKENDS, backend_available, packed_attention

    total, longest = int(sum(lengths)), int(max(lengths))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (
        torch.randn(total, h, head_dim, device=device, dtype=dtype, generator=gen)
        for h in (heads, groups, groups, heads)
    )
    times: dict[str, float] = {}
    for name in BACKENDS:
        if not backend_available(name, device, training=True, dtype=dtype):
            continue
        samples = []
        for i in range(warmup + repeats):
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            out = packed_attention(qq, kk, vv, cu_seqlens=cu, max_seqlen=longest, backend=name)
            out.backward(dout)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
    row = (
        f"one row of {len(lengths)} documents ({total:,} tokens), {heads} heads / {groups} "
        f"groups x {head_dim}, {dtype_name(dtype)}"
    )
    measured = (
        ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in times.items()) or "no backend trains here"
    )
    checks = [
        Check(
            name=f"attention time: fwd+bwd, {row}",
            status="info",
            detail=f"median of {repeats} after {warmup} untimed: {measured}",
        )
    ]
    where = f"{device.type} {dtype_name(dtype)}"
    checks.append(flex_target(times, row, where=where))
    checks.append(cudnn_target(times, row, where=where))
    if "bucketed" in times and "torch_varlen" in times:
        ratios = [f"{times['bucketed'] / times['torch_varlen']:.2f}x torch_varlen"]
        if "cudnn" in times:
            ratios.append(f"{times['bucketed'] / times['cudnn']:.2f}x cudnn")
        checks.append(Check(name=f"attention time: bucketed ({row})", status="info",
                            detail=", ".join(ratios)))  # fmt: skip
    return checks


def cudnn_target(times: dict[str, float], row: str, *, where: str) -> Check:
    """The target cuDNN's THD attention <= `CUDNN_OVER_VARLEN` x torch_varlen (``cudnn``, else ``te``)."""
    name = f"target: cuDNN THD fwd+bwd <= {CUDNN_OVER_VARLEN:g}x torch_varlen ({row})"
    fused = next((n for n in ("cudnn", "te") if n in times), None)
    if fused is not None and "torch_varlen" in times:
        ratio = times[fused] / times["torch_varlen"]
        status: Status = "passed" if ratio <= CUDNN_OVER_VARLEN else "failed"
        return Check(name=name, status=status, detail=f"{fused}: {ratio:.2f}x")
    missing = " and ".join(
        n
        for n, ok in (("cudnn (or te)", fused), ("torch_varlen", "torch_varlen" in times))
        if not ok
    )
    return Check(name=name, status="skipped", detail=f"{missing} cannot train on {where} here")


def flex_target(times: dict[str, float], row: str, *, where: str) -> Check:
    """The target flex <= `FLEX_OVER_VARLEN` x torch_varlen from the backends' median ``times``."""
    name = f"target: flex fwd+bwd <= {FLEX_OVER_VARLEN:g}x torch_varlen ({row})"
    if "flex" in times and "torch_varlen" in times:
        ratio = times["flex"] / times["torch_varlen"]
        status: Status = "passed" if ratio <= FLEX_OVER_VARLEN else "failed"
        return Check(name=name, status=status, detail=f"{ratio:.2f}x")
    missing = " and ".join(n for n in ("flex", "torch_varlen") if n not in times)
    return Check(name=name, status="skipped", detail=f"{missing} cannot train on {where} here")
