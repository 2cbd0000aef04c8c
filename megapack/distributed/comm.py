"""megapack's collectives: each one ends within a short timeout, or raises an error that says where.

A plain ``dist.broadcast`` waits for the process group's timeout (30 min on gloo, 10 min on NCCL)
when a peer is stuck or gone, and then fails with no word of which step was waiting. megapack's
own collectives instead run asynchronously and wait with a timeout of their own:

    explicit ``timeout=`` argument  >  `long_operation` in effect  >  $MEGAPACK_TIMEOUT_S  >  300 s

and turn any failure (timeout, a peer that crashed: gloo reports "Connection closed by peer" within
milliseconds) into `megapack.CollectiveError` naming the operation, the group's global ranks and
the timeout. After such an error the group is unusable, as after an NCCL timeout: end the job.

`long_operation(group, timeout)` is for rank-0-serialized work such as a checkpoint export, where
the other ranks legitimately wait for minutes: it lengthens the group's own timeout (and megapack's)
for the duration and restores both afterwards.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megapack.core.checks import check_seconds
from megapack.core.errors import CollectiveError

DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "MEGAPACK_TIMEOUT_S"
_long_timeout: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "megapack_long_timeout", default=None
)


def collective_timeout(timeout: float | None = None) -> float:
    """Seconds megapack's collectives wait: ``timeout``, else `long_operation`'s, else $MEGAPACK_TIMEOUT_S, else 300."""
    if timeout is not None:
        return _positive(timeout, "timeout")
    if (extended := _long_timeout.get()) is not None:
        return extended
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    return _positive(value, f"${TIMEOUT_ENV}")


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` (the default group when None)."""
    return (
        list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    )


def wait(
    start: Callable[[], Any], *, what: str, group: dist.ProcessGroup | None, timeout: float | None
) -> None:
    """Run ``start()`` (an ``async_op=True`` collective) and wait for it, or raise `CollectiveError`."""
    seconds = collective_timeout(timeout)
    try:
        work = start()
        if work is not None:
            work.wait(timeout=timedelta(seconds=seconds))
    except RuntimeError as exc:
        reason = "timed out" if "timed out" in str(exc).lower() else "failed"
        raise CollectiveError(
            f"{what} {reason} on rank {dist.get_rank()} over ranks {group_ranks(group)} "
            f"(timeout {seconds:g} s, set by timeout= or ${TIMEOUT_ENV}): {str(exc).strip()[:300]}. "
            "A peer is stuck, has crashed, or is running a different collective; the group is now unusable"
        ) from exc


def broadcast(
    tensor: torch.Tensor,
    src: int,
    *,
    group: dist.ProcessGroup | None,
    what: str,
    timeout: float | None = None,
) -> None:
    wait(
        lambda: dist.broadcast(tensor, src=src, group=group, async_op=True),
        what=what,
        group=group,
        timeout=timeout,
    )


def broadcast_on_stream(
    tensor: torch.Tensor,
    src: int,
    *,
    group: dist.ProcessGroup | None,
    what: str,
    timeout: float | None = None,
) -> None:
    """`broadcast`, except that a CUDA tensor's broadcast is only ordered on the current stream.

    For a CUDA tensor (NCCL) the host does not wait: later kernels on the stream wait for the
    data, and a stuck peer is reported by the NCCL group's own timeout and watchdog (``timeout=``
    of ``init_process_group``/``new_group``), not by megapack's. CPU tensors wait as `broadcast`.
    """
    if tensor.device.type != "cuda":
        broadcast(tensor, src, group=group, what=what, timeout=timeout)
        return
    try:
        dist.broadcast(tensor, src=src, group=group)  # NCCL: stream-ordered, returns at once
    except RuntimeError as exc:
        raise CollectiveError(
            f"{what} failed on rank {dist.get_rank()} over ranks {group_ranks(group)}: "
            f"{str(exc).strip()[:300]}. The group is now unusable"
        ) from exc


def all_reduce_min(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    what: str,
    timeout: float | None = None,
) -> None:
    op = dist.ReduceOp.MIN
    wait(
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
        what=what,
        group=group,
        timeout=timeout,
    )


def all_gather(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    what: str,
    timeout: float | None = None,
) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    wait(
        lambda: dist.all_gather(out, tensor, group=group, async_op=True),
        what=what,
        group=group,
        timeout=timeout,
    )
    return out


def all_gather_strings(
    text: str, *, group: dist.ProcessGroup | None, what: str, timeout: float | None = None
) -> list[str]:
    """Every rank's ``text``, in group-rank order: two fixed-shape gathers (lengths, then padded bytes)."""
    device = tensor_device(group)
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    lengths = all_gather(
        torch.tensor([data.numel()], device=device), group=group, what=what, timeout=timeout
    )
    width = max(int(n.item()) for n in lengths)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    rows = all_gather(padded.to(device), group=group, what=what, timeout=timeout)
    return [
        bytes(row[: int(n.item())].cpu().tolist()).decode(errors="replace")
        for row, n in zip(rows, lengths, strict=True)
    ]


def tensor_device(group: dist.ProcessGroup | None) -> torch.device:
    """CPU when ``group`` can reduce CPU tensors (gloo, or a mixed cpu:gloo backend), else CUDA."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@contextlib.contextmanager
def long_operation(group: dist.ProcessGroup | None, timeout: float | timedelta) -> Iterator[None]:
    """Lengthen ``group``'s timeout (and megapack's) for rank-0-serialized work; restore both after.

    Example:
        >>> with megapack.long_operation(dp_group, timeout=3600):   # doctest: +SKIP
        ...     export_checkpoint_on_rank_0_then_barrier()
    """
    seconds = _positive(
        timeout.total_seconds() if isinstance(timeout, timedelta) else timeout, "timeout"
    )
    pg = group if group is not None else dist.group.WORLD
    backends = _backends(pg)
    previous = [b.options._timeout for b in backends]
    token = _long_timeout.set(seconds)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), pg)
    try:
        yield
    finally:
        for backend, old in zip(backends, previous, strict=True):
            backend._set_default_timeout(old)
        _long_timeout.reset(token)


def group_timeout(group: dist.ProcessGroup | None) -> timedelta:
    """The group's own default timeout (its first backend's), e.g. to check `long_operation`."""
    pg = group if group is not None else dist.group.WORLD
    return _backends(pg)[0].options._timeout


def _backends(pg: Any) -> list[Any]:
    found = []
    for device in pg._device_types:
        backend = pg._get_backend(device)
        if (
            hasattr(backend, "options")
            and hasattr(backend, "_set_default_timeout")
            and backend not in found
        ):
            found.append(backend)
    if not found:
        raise RuntimeError(
            f"cannot read or change the timeout of process group {pg!r} (backend {dist.get_backend(pg)})"
        )
    return found


def _positive(value: float, name: str) -> float:
    return check_seconds(name, value)
