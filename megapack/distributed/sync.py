"""Keep ranks in step: `lockstep` iteration and `check_in_sync` desync detection.

Hangs come from ranks that disagree about what happens next: one rank's data ends while the others
enter the next collective (prime-rl: 327 vs 338 validation batches), or ranks run different
collectives (Megatron-LM #4910). Both are cheap to turn into the same outcome on every rank:

* `lockstep` reduces one int32 flag per step with MIN (1 = I have an item, 0 = I am out,
  -1 = fetching failed), so every rank stops at the first step where any rank is out, and a
  failure on one rank becomes an exception on all of them. A further collective runs only on the
  failure path, to carry the message.
* `check_in_sync` all-gathers a 64-bit hash of a tag with a step and a status; any difference
  raises `DesyncError` on every rank, naming what each rank had.

Set ``MEGAPACK_DEBUG_SYNC=1`` to run `check_in_sync` inside every `lockstep` step and every
`megapack.get_batch_on_this_tp_rank` call (one extra small collective each). TORCH_DISTRIBUTED_DEBUG=DETAIL
cost ~6x on a small all_reduce here and misses ranks running the same collective at different steps.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist

from megapack.core.errors import DesyncError, RemoteRankError
from megapack.distributed import comm
from megapack.distributed.groups import control_group

T = TypeVar("T")
DEBUG_ENV = "MEGAPACK_DEBUG_SYNC"
HAVE, OUT, FAILED = 1, 0, -1


def debug_sync_enabled() -> bool:
    """True when $MEGAPACK_DEBUG_SYNC is set to a true value (1, true, yes, on)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def lockstep(
    iterable: Iterable[T],
    *,
    group: dist.ProcessGroup | None = None,
    cpu_group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
) -> Iterator[T]:
    """Yield items while every rank of ``group`` has one; all ranks stop at the same step.

    Args:
        iterable: this rank's items (e.g. its shard of validation batches).
        group: the ranks that must stay in step; the default group when None.
        cpu_group: a gloo group with the same ranks for the per-step flag. By default
            ``group``'s control group (`megapack.distributed.groups.control_group`): ``group`` itself
            when it can reduce CPU tensors, else a gloo group with the same ranks made once per
            group and cached (NCCL groups), so no step costs a device sync.
        timeout: seconds to wait for the slowest rank's item (default: $MEGAPACK_TIMEOUT_S or 300).

    Yields:
        This rank's items, while all ranks still have one. Items fetched at the step where another
        rank ran out are not yielded (a warning says how many ranks still had data).

    Raises:
        RemoteRankError: on every other rank when fetching failed on one rank (naming the rank and
            step); the failing rank re-raises its own exception.
        CollectiveError: when a peer is stuck past the timeout or crashed.

    Example:
        ranks with 3 and 5 items both run 3 steps: ``for batch in lockstep(my_batches): evaluate(batch)``
    """
    iterator = iter(iterable)
    if not dist.is_initialized():
        yield from iterator
        return
    flag_group = cpu_group if cpu_group is not None else control_group(group)
    debug = debug_sync_enabled()
    step = 0
    while True:
        item: T | None = None
        error: BaseException | None = None
        try:
            item = next(iterator)
            status = HAVE
        except StopIteration:
            status = OUT
        except Exception as exc:
            status, error = FAILED, exc
        if debug:
            check_in_sync("megapack.lockstep", step, group=flag_group, timeout=timeout)
        flag = torch.tensor([status], dtype=torch.int32)
        comm.all_reduce_min(flag, group=flag_group, what=f"lockstep step {step}", timeout=timeout)
        everyone = int(flag.item())
        if everyone == HAVE:
            yield item  # type: ignore[misc]
            step += 1
            continue
        if everyone == FAILED:
            _raise_failure(error, step, flag_group, timeout)
        if status == HAVE:
            warnings.warn(
                f"lockstep: rank {dist.get_rank()} still had data at step {step} but another rank ran out; "
                "all ranks stop here (balance the shards, e.g. with PackedDataset sharding)",
                stacklevel=2,
            )
        return


def check_in_sync(
    tag: str,
    step: int,
    *,
    group: dist.ProcessGroup | None = None,
    status: int = 0,
    timeout: float | None = None,
) -> None:
    """Raise `DesyncError` on every rank unless all ranks of ``group`` pass the same tag, step and status.

    One all_gather of 3 int64 per rank; a second one, on mismatch only, brings the tags for the message.

    Args:
        tag: what this rank is about to do, e.g. ``"save-optimizer/exp_avg"``.
        step: the step it is at.
        group: the ranks to compare; the default group when None.
        status: any small int the ranks must agree on (e.g. a count of keys or a phase).
        timeout: seconds to wait (default: $MEGAPACK_TIMEOUT_S or 300).
    """
    if not dist.is_initialized():
        return
    device = comm.tensor_device(group)
    mine = torch.tensor([tag_hash(tag), step, status], dtype=torch.int64, device=device)
    rows = comm.all_gather(
        mine, group=group, what=f"check_in_sync({tag!r}, step {step})", timeout=timeout
    )
    values = [tuple(int(v) for v in row.tolist()) for row in rows]
    if all(v == values[0] for v in values):
        return
    tags = comm.all_gather_strings(
        tag, group=group, what=f"check_in_sync({tag!r}) mismatch report", timeout=timeout
    )
    ranks = comm.group_ranks(group)
    states = {rank: (t, v[1], v[2]) for rank, t, v in zip(ranks, tags, values, strict=True)}
    lines = "; ".join(
        f"rank {r}: tag {t!r} step {s} status {st}" for r, (t, s, st) in states.items()
    )
    raise DesyncError(f"ranks are out of sync at check_in_sync: {lines}", states)


def tag_hash(tag: str) -> int:
    """A stable 63-bit hash of ``tag`` (same on every rank and run, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=8).digest(), "little") >> 1


def _raise_failure(
    error: BaseException | None, step: int, group: dist.ProcessGroup | None, timeout: float | None
) -> None:
    message = "" if error is None else f"{type(error).__name__}: {error}"
    messages = comm.all_gather_strings(
        message, group=group, what=f"lockstep step {step} failure report", timeout=timeout
    )
    if error is not None:
        error.add_note(
            f"megapack.lockstep: raised on rank {dist.get_rank()} at step {step}; every other rank raises RemoteRankError"
        )
        raise error
    ranks = comm.group_ranks(group)
    failed = [(r, m) for r, m in zip(ranks, messages, strict=True) if m]
    rank, text = failed[0]
    if len(failed) > 1:
        text += f" (ranks {[r for r, _ in failed]} failed at this step)"
    raise RemoteRankError(rank, step, text)
