"""The GPU kit's correctness checks: attention backends, packed == padded losses, no host syncs.

Each function returns `megapack.bench.gpu.report.Check` lines; the kit (`megapack.bench.gpu.kit`)
turns any exception escaping one into a failed check, so a broken backend never stops the kit.

(a) `attention_checks`: every backend of `megapack.attention.BACKENDS` through
    `megapack.attention.packed_attention`, forward and backward, against a float64 reference (one
    dense causal softmax per document, grouped-query heads repeated) on fresh random inputs:
    1-token documents beside documents of ``max_len``, the same documents each padded to a
    multiple of 8 (``cu_seqlens_padded``), one document filling a whole row, and static shapes
    (zero-length documents after the real ones, boundaries repeating the final offset). Passes when the
    relative L2 errors ``|x - ref| / |ref|`` of the output and of dq, dk, dv are within
    `ATTENTION_TOLERANCE` for the dtype, nothing is NaN or infinite, and the output and all three
    gradients are exactly 0 at alignment padding. A backend that cannot run here is skipped with
    the reason; one that can only run forward here (flex on CPU) is checked forward only.
(b) `packed_vs_padded`: the same documents through one GPTModel twice, packed in one THD row and
    padded to the longest as ``[b, s]``, both delivered by `megapack.get_batch_on_this_tp_rank`;
    every trained token's loss must agree within `LOSS_TOLERANCE`.
(c) the sync checks live in `megapack.bench.gpu.syncs`: after a warm-up, each of these runs under ``torch.cuda.set_sync_debug_mode("error")``:
    ``get_batch_on_this_tp_rank``, `megapack.prefetch`, a packed GPT forward + backward, a whole
    training step (megatron-core's schedule over several micro-batches fed by ``prefetch``, then
    the optimizer step), the same with aligned padding (``cu_seqlens_padded``), and every attention
    backend that trains in the dtype, forward + backward; any synchronizing CUDA call raises where
    it is made, and its stack becomes the failed check's detail. A positive control (a planted
    ``.item()`` on a device tensor) must raise, or the detector is not on and the check fails.

Tolerances. fp32 runs the same arithmetic in a different order: attention lands near 1e-7 relative
(measured on CPU), losses within 1e-5 of each other; `ATTENTION_TOLERANCE` and `LOSS_TOLERANCE`
allow 100x and 10x that. bf16 keeps 8 significant bits (unit roundoff 2^-9 = 0.002): rounding a
correct output once already costs ~0.1% relative, and a flash kernel's backward rounds the
recomputed probabilities again, so 1e-2 (output) and 2e-2 (gradients) are a few units of bf16
rounding; a wrong mask moves whole rows of attention weights (errors of order 1). For the losses,
a packed and a padded bf16 run round different partial sums in every one of the preset's 16 layers;
per-token differences of 0.009-0.012 were measured at the preset on a GPU (a colleague's run), and
0.0136 here on CPU (the preset's width with 2 layers, 1,748 trained tokens; mean 9e-5). The bf16
bound, 0.05, is about 4x those and still under one bf16 step of the loss itself (values in [8, 16),
around ln(32,000) = 10.4 at initialization, are 0.0625 apart in bf16). The kit on an H100
(2026-11-26, 16 layers, 3,970 trained tokens) measured 0.040 at most and 0.0086 on average: the
largest differences are single tokens a rounding step apart, inside the bound but closer to it
than the earlier figures (a wrong mask moves every token of a document by far more).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from megapack.bench.gpu.model import forward
from megapack.bench.gpu.report import Check, Status

ATTENTION_TOLERANCE = {
    torch.float32: {"out": 1e-5, "grad": 1e-5},
    torch.bfloat16: {"out": 1e-2, "grad": 2e-2},
}
"""Relative L2 error allowed against the float64 reference, per dtype (see the module docstring)."""
LOSS_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.05}
"""Largest absolute per-token loss difference allowed between packed and padded, per dtype."""
PAD_MULTIPLE = 8


def attention_cases(max_len: int) -> list[tuple[str, list[int], int]]:
    """(label, document lengths, pad multiple): the documents every backend is checked on.

    Example:
        >>> [(label, lengths, pad) for label, lengths, pad in attention_cases(16)][1]
        ('1-token and 16-token documents, each padded to a multiple of 8', [1, 16, 5, 1, 13, 11], 8)
    """
    mixed = [1, max_len, 5, 1, 13, max_len // 2 + 3]
    return [
        (f"1-token and {max_len}-token documents", mixed, 1),
        (
            f"1-token and {max_len}-token documents, each padded to a multiple of {PAD_MULTIPLE}",
            mixed,
            PAD_MULTIPLE,
        ),
        (f"one {max_len}-token document filling the row", [max_len], 1),
        (
            f"a static shape: {len(mixed)} documents and 4 zero-length ones after them",
            [*mixed, 0, 0, 0, 0],
            1,
        ),
        (
            f"a static shape, padded to a multiple of {PAD_MULTIPLE}, 4 zero-length documents",
            [*mixed, 0, 0, 0, 0],
            PAD_MULTIPLE,
        ),
    ]


def boundaries(lengths: Sequence[int], pad: int) -> tuple[list[int], list[int]]:
    """(cu_seqlens of the real lengths, cu_seqlens_padded of the buffer): ``[1, 3], 4`` -> ``[0, 1, 4], [0, 4, 8]``."""
    real, buffer = [0], [0]
    for n in lengths:
        real.append(real[-1] + n)
        buffer.append(buffer[-1] + -(-n // pad) * pad)
    return real, buffer


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_real: list[int],
    cu_buffer: list[int],
    scale: float,
) -> torch.Tensor:
    """Dense causal softmax attention within each document, zeros at padding; any dtype, differentiable."""
    repeat = q.shape[1] // k.shape[1]
    pieces = []
    for i in range(len(cu_real) - 1):
        start, n, width = cu_buffer[i], cu_real[i + 1] - cu_real[i], cu_buffer[i + 1] - cu_buffer[i]
        qd = q[start : start + n]
        kd = k[start : start + n].repeat_interleave(repeat, dim=1)
        vd = v[start : start + n].repeat_interleave(repeat, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qd, kd) * scale
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        pieces.append(torch.einsum("hqk,khd->qhd", weights, vd))
        pieces.append(q.new_zeros(width - n, q.shape[1], v.shape[2]))
    return torch.cat(pieces)


def attention_checks(
    device: torch.device,
    dtype: torch.dtype,
    *,
    heads: int,
    groups: int,
    head_dim: int,
    max_len: int,
) -> list[Check]:
    """One check per backend of `megapack.attention.BACKENDS`, plus which one "auto" picks."""
    from megapack.attention import BACKENDS, backend_available, packed_attention, resolve_backend
    from megapack.attention.choice import Installed, refusal

    checks = []
    for name in BACKENDS:
        training = backend_available(name, device, training=True, dtype=dtype)
        what = "fwd+bwd" if training or device.type == "cuda" else "fwd"
        label = f"attention: {name}, {dtype_name(dtype)}, {what} vs float64 reference"
        if not training and not backend_available(name, device, training=False, dtype=dtype):
            why = refusal(
                name, device.type, dtype, training=True, dropout=0.0, installed=Installed.find()
            )
            checks.append(
                Check(
                    name=label,
                    status="skipped",
                    detail=f"cannot run on {device.type} {dtype_name(dtype)}: {why}",
                )
            )
            continue
        attend = functools.partial(packed_attention, backend=name)
        checks.append(
            check_backend(
                label,
                attend,
                device,
                dtype,
                heads=heads,
                groups=groups,
                head_dim=head_dim,
                max_len=max_len,
                backward=training,
            )
        )
    auto = resolve_backend("auto", device, training=True, dtype=dtype)
    checks.append(
        Check(
            name=f"attention: auto on {device.type}, {dtype_name(dtype)}",
            status="info",
            detail=f"resolve_backend('auto') picks {auto!r} for training",
        )
    )
    checks.append(capture_token_check(device))
    return checks


def capture_token_check(device: torch.device) -> Check:
    """Two CUDA-graph captures see two different `megapack.core.capture.capture_token`s (from the
    CUDA runtime's capture ids), and none outside them: what batch-derived caches key on."""
    from megapack.core import capture

    name = "capture: every CUDA-graph capture has its own token, eager none"
    if device.type != "cuda":
        return Check(name=name, status="skipped", detail="needs CUDA")
    tokens = []
    stream = torch.cuda.Stream(device)
    x = torch.zeros(4, device=device)
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            tokens.append(capture.capture_token())
            x.add_(1)
    outside = capture.capture_token()
    runtime = all(isinstance(t, tuple) and t[0] == "capture" for t in tokens)
    source = "the CUDA runtime" if runtime else "epochs (no runtime capture id)"
    ok = outside is None and None not in tokens and tokens[0] != tokens[1]
    return Check(name=name, status="passed" if ok else "failed",
                 detail=f"tokens {tokens}, outside {outside!r}, ids from {source}")  # fmt: skip


def check_backend(
    label: str,
    attend: Callable[..., torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    *,
    heads: int,
    groups: int,
    head_dim: int,
    max_len: int,
    backward: bool = True,
    seed: int = 0,
) -> Check:
    """``attend(q, k, v, cu_seqlens=..., cu_seqlens_padded=..., max_seqlen=...)`` against the reference."""
    tolerance = ATTENTION_TOLERANCE[dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    worst: dict[str, float] = {}
    problems = []
    for case, lengths, pad in attention_cases(max_len):
        cu_real, cu_buffer = boundaries(lengths, pad)
        total, scale = cu_buffer[-1], head_dim**-0.5
        q, k, v, dout = (
            torch.randn(total, h, head_dim, device=device, dtype=dtype, generator=gen)
            for h in (heads, groups, groups, heads)
        )
        q, k, v = (x.requires_grad_(backward) for x in (q, k, v))
        cu = torch.tensor(cu_real, dtype=torch.int32, device=device)
        cu_padded = torch.tensor(cu_buffer, dtype=torch.int32, device=device) if pad > 1 else None
        widths = np.diff(cu_buffer)
        out = attend(
            q, k, v, cu_seqlens=cu, cu_seqlens_padded=cu_padded, max_seqlen=int(widths.max())
        )
        exact = [x.detach().double().requires_grad_(backward) for x in (q, k, v)]
        ref = reference_attention(exact[0], exact[1], exact[2], cu_real, cu_buffer, scale)
        pairs: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {"out": (out, ref)}
        if backward:
            out.backward(dout)
            ref.backward(dout.double())
            for name, x, x_ref in zip("qkv", (q, k, v), exact, strict=True):
                pairs[f"d{name}"] = (x.grad, x_ref.grad)
        padding = _padding_mask(cu_real, cu_buffer, device)
        for key, (value, want) in pairs.items():
            bound = tolerance["out" if key == "out" else "grad"]
            problem, error = compare_to_reference(value, want, padding, bound)
            if error is not None:
                worst[key] = max(worst.get(key, 0.0), error)
            if problem:
                problems.append(f"{case}: {key} {problem}")
    errors = ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    limits = f"tolerance {tolerance['out']:g} out, {tolerance['grad']:g} gradients"
    scope = "" if backward else "forward only (this backend has no backward here); "
    sizes = f"{heads} heads / {groups} groups x {head_dim}, max_len {max_len}"
    if problems:
        return Check(
            name=label, status="failed", detail=f"{scope}{'; '.join(problems)} ({limits}; {sizes})"
        )
    return Check(
        name=label,
        status="passed",
        detail=f"{scope}worst relative error {errors} ({limits}; {sizes}; 3 cases)",
    )


def compare_to_reference(
    value: torch.Tensor | None, want: torch.Tensor | None, padding: torch.Tensor, bound: float
) -> tuple[str, float | None]:
    """(what is wrong or "", relative L2 error) of ``value`` against the float64 ``want``: wrong
    when its shape differs, it holds NaN or inf, its error exceeds ``bound``, or it is not exactly
    0 where ``padding`` is True."""
    if value is None or want is None or value.shape != want.shape:
        shapes = [None if x is None else tuple(x.shape) for x in (value, want)]
        return f"has shape {shapes[0]}, want {shapes[1]}", None
    if not torch.isfinite(value).all():
        return "has NaN or inf", None
    error = (value.double() - want).norm().item() / max(want.norm().item(), 1e-30)
    if error > bound:
        return f"relative error {error:.2e}", error
    if padding.any() and value[padding].abs().max().item() != 0:
        return "is not 0 where no token is (alignment padding, past the last boundary)", error
    return "", error


def _padding_mask(cu_real: list[int], cu_buffer: list[int], device: torch.device) -> torch.Tensor:
    mask = torch.zeros(cu_buffer[-1], dtype=torch.bool, device=device)
    for i in range(len(cu_real) - 1):
        mask[cu_buffer[i] + cu_real[i + 1] - cu_real[i] : cu_buffer[i + 1]] = True
    return mask


def packed_vs_padded(
    model: Any,
    *,
    device: torch.device,
    dtype: torch.dtype,
    lengths: Sequence[int],
    seq_len: int,
    vocab_size: int,
    label: str,
    seed: int = 0,
) -> Check:
    """Per-token losses of one packed THD row == those of the documents padded to their longest."""
    from megapack import PackedBatch, Topology, get_batch_on_this_tp_rank
    from megapack.bench.modes import micro_batches

    tolerance = LOSS_TOLERANCE[dtype]
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, vocab_size, n) for n in lengths]
    topology = Topology.single(device)
    packed = PackedBatch.from_documents(docs, seq_len=seq_len)
    (padded,) = micro_batches("padded_longest", docs, seq_len, len(docs))
    losses = []
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for item in (packed, padded):
                b = get_batch_on_this_tp_rank(iter([item]), topology=topology)
                out = forward(model, b)
                losses.append(out.float().cpu())
    finally:
        model.train(training)
    packed_loss, padded_loss = losses
    start, diffs, values = 0, [], []
    for i, n in enumerate(lengths):  # a document's last token has no label: n - 1 trained tokens
        diffs.append((packed_loss[0, start : start + n - 1] - padded_loss[i, : n - 1]).abs())
        values.append(padded_loss[i, : n - 1])
        start += n
    diff, value = torch.cat(diffs), torch.cat(values)
    what = (
        f"{len(lengths)} documents ({min(lengths)}-{max(lengths)} tokens) in one {seq_len}-token "
        f"row vs padded to {max(lengths)}; {diff.numel()} trained tokens, mean loss {value.mean():.3f}"
    )
    if not (torch.isfinite(diff).all() and torch.isfinite(value).all()):
        return Check(name=label, status="failed", detail=f"NaN or inf in the losses; {what}")
    worst = diff.max().item()
    status: Status = "passed" if worst <= tolerance else "failed"
    return Check(
        name=label,
        status=status,
        detail=(
            f"largest per-token difference {worst:.2e} (mean {diff.mean():.1e}), tolerance {tolerance:g}; {what}"
        ),
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
