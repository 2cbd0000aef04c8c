"""The GPU kit's sync checks: no synchronizing CUDA call in delivery, prefetch, a forward and
backward, whole training steps and every attention backend, a positive control first.

After a warm-up, each step runs under ``torch.cuda.set_sync_debug_mode("error")`` (`sync_debug_errors`):
any synchronizing CUDA call raises where it is made, and its stack becomes the failed check's
detail. A planted ``.item()`` on a device tensor must raise first (`positive_control`), or the
detector is not on and the check fails. Without CUDA the steps run (their code is exercised) and
the checks are skipped, saying so.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from megapack.bench.gpu.checks import PAD_MULTIPLE, dtype_name
from megapack.bench.gpu.compile_failure import compile_failure
from megapack.bench.gpu.model import forward
from megapack.bench.gpu.report import Check


@contextlib.contextmanager
def sync_debug_errors(device: torch.device) -> Iterator[bool]:
    """``torch.cuda.set_sync_debug_mode("error")`` inside; yields whether syncs are detected (CUDA only)."""
    if device.type != "cuda":
        yield False
        return
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield True
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize(device)


def sync_checks(
    model: Any,
    batches: list[Any],
    *,
    device: torch.device,
    guard: Callable[[torch.device], contextlib.AbstractContextManager[bool]] = sync_debug_errors,
) -> list[Check]:
    """Each step warmed up once, then run inside ``guard``; a raised error is a failed check with its stack.

    ``batches``: at least 8 packed micro-batches (`megapack.PackedBatch`). Without CUDA the steps
    still run (so their code is exercised) and the checks are skipped: nothing detects syncs there.
    The positive control comes first: a guard that does not raise on a planted ``.item()`` fails
    it, and the report says so (`step_sync_checks` and `backend_sync_checks` add whole steps and
    every attention backend).
    """
    from megapack import Topology, get_batch_on_this_tp_rank, prefetch
    from megapack.megatron.loss import normalized_loss

    if len(batches) < 8:
        raise ValueError(f"sync_checks needs at least 8 micro-batches, got {len(batches)}")
    topology = Topology.single(device)
    data = iter(batches)
    fetch = lambda: get_batch_on_this_tp_rank(data, topology=topology)  # noqa: E731

    def train_step(batch: dict[str, Any]) -> None:
        out = forward(model, batch)
        loss, _ = normalized_loss(
            batch, out, mode="micro_batch_mean", calculate_per_token_loss=False
        )
        loss.backward()

    checks = [positive_control(device, guard)]
    first, second = (get_batch_on_this_tp_rank(iter([b]), topology=topology) for b in batches[:2])
    checks.append(
        _guarded(
            "sync: get_batch_on_this_tp_rank (tp=1), 3 calls",
            fetch,
            lambda: [fetch() for _ in range(3)],
            device,
            guard,
        )
    )
    with prefetch(iter(batches), topology=topology, depth=2) as ahead:
        take = lambda: next(ahead)  # noqa: E731
        takes = lambda: [next(ahead) for _ in range(4)]  # noqa: E731  (the thread fetches under the guard)
        checks.append(_guarded("sync: prefetch(depth=2), 4 batches", take, takes, device, guard))
    checks.append(
        _guarded(
            "sync: packed GPT forward + backward",
            lambda: train_step(first),
            lambda: train_step(second),
            device,
            guard,
        )
    )
    model.zero_grad(set_to_none=True)
    return checks


def step_sync_checks(
    model: Any,
    batches: list[Any],
    documents: Sequence[np.ndarray],
    seq_len: int,
    *,
    device: torch.device,
    guard: Callable[[torch.device], contextlib.AbstractContextManager[bool]] = sync_debug_errors,
) -> list[Check]:
    """Whole training steps under ``guard``: megatron-core's schedule over 3 micro-batches of
    ``batches`` fed by ``prefetch``, then the optimizer; and the same over ``documents`` packed
    into ``seq_len`` rows with every document padded to a multiple of `PAD_MULTIPLE`."""
    from megapack import PackedBatch, Topology

    if len(batches) < 6:
        raise ValueError(f"step_sync_checks needs at least 6 micro-batches, got {len(batches)}")
    whole = functools.partial(_whole_step, model, Topology.single(device))
    aligned = [
        PackedBatch.from_documents(row, seq_len=seq_len, pad_to_multiple_of=PAD_MULTIPLE)
        for row in _aligned_rows(documents, seq_len, count=4)
    ]
    checks = [
        _guarded(
            "sync: whole step: megatron-core schedule over 3 micro-batches fed by "
            "prefetch(depth=2), then SGD",
            lambda: whole(batches[:3]),
            lambda: whole(batches[3:6]),
            device,
            guard,
        ),
        _guarded(
            f"sync: whole step, documents padded to multiples of {PAD_MULTIPLE} "
            "(cu_seqlens_padded)",
            lambda: whole(aligned[:2]),
            lambda: whole(aligned[2:]),
            device,
            guard,
        ),
    ]
    model.zero_grad(set_to_none=True)
    return checks


def _aligned_rows(
    documents: Sequence[np.ndarray], seq_len: int, *, count: int
) -> list[list[np.ndarray]]:
    """``count`` rows of documents, in order, each fitting ``seq_len`` once every document is
    padded to a multiple of `PAD_MULTIPLE` (longer documents are left out)."""
    rows: list[list[np.ndarray]] = [[]]
    used = 0
    for doc in documents:
        size = -(-len(doc) // PAD_MULTIPLE) * PAD_MULTIPLE
        if size > seq_len:
            continue
        if used + size > seq_len:
            if len(rows) == count:
                break
            rows.append([])
            used = 0
        rows[-1].append(doc)
        used += size
    if len(rows) < count or not rows[-1]:
        raise ValueError(
            f"the documents fill only {len(rows)} aligned rows of {seq_len}; {count} needed"
        )
    return rows


def positive_control(
    device: torch.device,
    guard: Callable[[torch.device], contextlib.AbstractContextManager[bool]] = sync_debug_errors,
) -> Check:
    """The detector's own check: a planted ``.item()`` on a device tensor must raise inside ``guard``."""
    label = "sync: positive control (a planted .item() must trip the detector)"
    planted = torch.ones(2, device=device)
    detecting = raised = False
    try:
        with guard(device) as detecting:
            (planted * 2).sum().item()
    except RuntimeError:
        raised = True
    if not detecting:
        return Check(
            name=label, status="skipped", detail=f"needs CUDA; {device.type} cannot detect syncs"
        )
    if raised:
        return Check(name=label, status="passed", detail="the planted .item() raised")
    return Check(
        name=label,
        status="failed",
        detail="the planted .item() did not raise: the sync checks detect nothing",
    )


def _whole_step(model: Any, topology: Any, batches: list[Any]) -> None:
    """One training step as Megatron runs it: the schedule over ``batches``, each delivered ahead by
    ``prefetch`` (the README's loop: ``forward_step`` takes the next delivered batch), then SGD."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megapack import prefetch
    from megapack.megatron.loss import normalized_loss

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)
        out = forward(model, batch)
        return out, functools.partial(
            normalized_loss, batch, mode="micro_batch_mean", calculate_per_token_loss=False
        )

    # lr 0: runs the update's kernels, moves nothing
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    width = int(batches[0].tokens.shape[1])
    with prefetch(iter(batches), topology=topology, depth=2) as ahead:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=ahead,
            model=[model],
            num_microbatches=len(batches),
            seq_length=width,
            micro_batch_size=1,
            forward_only=False,
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def backend_sync_checks(
    device: torch.device,
    dtype: torch.dtype,
    guard: Callable[[torch.device], contextlib.AbstractContextManager[bool]] = sync_debug_errors,
) -> list[Check]:
    """Every attention backend that trains in ``dtype`` here: fwd+bwd of one packed row, guarded."""
    from megapack.attention import BACKENDS, backend_available, packed_attention

    lengths = [1, 37, 64, 5, 19]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(sum(lengths), h, 64, device=device, dtype=dtype, generator=gen)
        for h in (4, 2, 2)
    )
    checks = []
    for name in BACKENDS:
        if not backend_available(name, device, training=True, dtype=dtype):
            continue

        def run(name: str = name) -> None:
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            packed_attention(
                qq, kk, vv, cu_seqlens=cu, max_seqlen=max(lengths), backend=name
            ).sum().backward()

        checks.append(
            _guarded(
                f"sync: attention {name}, {dtype_name(dtype)}, fwd+bwd", run, run, device, guard
            )
        )
    return checks


def _guarded(
    label: str,
    warm: Callable[[], Any],
    run: Callable[[], Any],
    device: torch.device,
    guard: Callable[[torch.device], contextlib.AbstractContextManager[bool]],
) -> Check:
    """A check of ``run`` under ``guard`` after ``warm``; a kernel that cannot compile here (e.g.
    flex in bf16 at head dim 64) is skipped with the reason, not failed: no sync was found."""
    try:
        warm()
    except Exception as exc:
        return _failed(label, exc, "warm-up failed: ")
    try:
        with guard(device) as detecting:
            run()
    except Exception as exc:
        return _failed(label, exc)
    if not detecting:
        return Check(
            name=label,
            status="skipped",
            detail=(
                f"needs CUDA (torch.cuda.set_sync_debug_mode); the same steps ran on {device.type} without it"
            ),
        )
    return Check(name=label, status="passed", detail="0 synchronizing CUDA calls after warm-up")


def _failed(label: str, exc: BaseException, prefix: str = "") -> Check:
    """A failed check whose detail is the exception and the last 40 lines of its stack; a skipped
    one saying "cannot compile here: <reason>" when the exception is a compile failure."""
    why = compile_failure(exc)
    if why is not None:
        return Check(name=label, status="skipped", detail=why)
    stack = "".join(traceback.format_exception(exc)).splitlines()
    return Check(
        name=label,
        status="failed",
        detail=f"{prefix}{type(exc).__name__}: {exc}\n" + "\n".join(stack[-40:]),
    )


SYNC_TARGET = "target: 0 synchronizing CUDA calls over a whole step, the positive control tripping"


def sync_target(checks: Sequence[Check]) -> Check:
    """The sync target from the sync checks: passed when the positive control passed and no check
    failed; a skipped check (a kernel that cannot compile here) is named, not counted against it.
    Without CUDA (the control skipped) the target is skipped."""
    control = [c for c in checks if c.name.startswith("sync: positive control")]
    if not control or control[0].status == "skipped":
        why = control[0].detail if control else "the sync checks did not run"
        return Check(name=SYNC_TARGET, status="skipped", detail=why)
    failed = [c.name for c in checks if c.status == "failed"]
    skipped = [f"{c.name} ({c.detail})" for c in checks if c.status == "skipped"]
    detail = f"{sum(c.status == 'passed' for c in checks)} sync checks passed"
    detail += f"; skipped: {'; '.join(skipped)}" if skipped else ""
    if failed:
        return Check(name=SYNC_TARGET, status="failed", detail=f"failed: {failed}; {detail}")
    return Check(name=SYNC_TARGET, status="passed", detail=detail)
