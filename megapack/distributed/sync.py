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

`step_status` is that per-step flag on its own, for loops that decide more than "next item or
not": `megapack.lockstep_steps` (`megapack.delivery.steps`) reads a whole pipeline step ahead on
every TP source and agrees with it, on the world's control group, before a schedule starts. Ranks
that read nothing pass HAVE and never stop anyone. `gather_settings` and `disagreement` check once
that ranks which must agree (e.g. DP ranks reading one dataset) do, naming both ranks and values.

Set ``MEGAPACK_DEBUG_SYNC=1`` to run `check_in_sync` inside every `lockstep` step and every
`megapack.get_batch_on_this_tp_rank` call (one extra small collective each). TORCH_DISTRIBUTED_DEBUG=DETAIL
cost ~6x on a small all_reduce here and misses ranks running the same collective at different steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megapack.core.errors import DesyncError, RemoteDataError, RemoteRankError
from megapack.distributed import comm
from megapack.distributed.groups import control_group

log = logging.getLogger("megapack.distributed")

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
        rank ran out are not yielded (each rank that still had one logs a warning, on the
        ``megapack.distributed`` logger).

    Raises:
        RemoteRankError: on every other rank when fetching failed on one rank (naming the rank and
            step); the failing rank re-raises its own exception.
        CollectiveError: when a peer is stuck past the timeout or crashed.

    Example:
        ranks with 3 and 5 items both run 3 steps: ``for batch in lockstep(my_batches): evaluate(batch)``

    Inside a pipeline schedule the ranks of later stages never reach the data call in step with
    the source: wrap the loop around the schedule with `megapack.lockstep_steps` instead.
    """
    iterator = iter(iterable)
    if not dist.is_initialized():
        yield from iterator
        return
    flag_group = cpu_group if cpu_group is not None else control_group(group)
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
        if step_status(status, error, step, group=flag_group, timeout=timeout) == HAVE:
            yield item  # type: ignore[misc]
            step += 1
            continue
        if status == HAVE:
            log.warning(
                "megapack: lockstep: rank %d still had data at step %d but another rank ran out; "
                "all ranks stop here (balance the shards, e.g. with PackedDataset sharding)",
                dist.get_rank(),
                step,
                stacklevel=2,
            )
        return


def step_status(
    status: int,
    error: BaseException | None,
    step: int,
    *,
    group: dist.ProcessGroup | None,
    timeout: float | None = None,
    what: str = "lockstep",
    remote: type[RemoteRankError] = RemoteRankError,
) -> int:
    """Every rank's verdict on ``step``: one MIN all_reduce of an int32 flag on ``group`` (a CPU group).

    Args:
        status: this rank's HAVE (1: it has the step, or reads nothing), OUT (0: its data ended)
            or FAILED (-1: fetching failed with ``error``).
        error: the exception behind FAILED, re-raised on this rank; None otherwise.
        step: the step number, for messages.
        group: a group that reduces CPU tensors (a control group: `control_group`).
        timeout: seconds to wait for the slowest rank (default: $MEGAPACK_TIMEOUT_S or 300).
        what: the caller's name in messages (``"lockstep"``, ``"lockstep_steps"``).
        remote: the error other ranks raise for a failed rank: `RemoteRankError`, or
            `RemoteDataError` when the failed ranks read data for their TP group.

    Returns:
        HAVE when every rank had the step, else OUT.

    Raises:
        the rank's own ``error`` when it failed; ``remote`` naming the first failed rank, its step
        and message on every other rank (a second collective, on this path only); CollectiveError
        when a rank is stuck past the timeout or gone.

    Example:
        ranks with statuses (1, 1, 0, 1) all get 0 and stop; with (1, -1, 1, 1) rank 1 re-raises its
        OSError and ranks 0, 2 and 3 raise ``RemoteRankError("rank 1 failed at step 4: OSError: ...")``.
    """
    if status not in (HAVE, OUT, FAILED):
        raise ValueError(
            f"step_status: status must be HAVE (1), OUT (0) or FAILED (-1), got {status!r}"
        )
    if (status == FAILED) != (error is not None):
        raise ValueError("step_status: pass error= exactly when status is FAILED")
    if debug_sync_enabled():
        check_in_sync(f"megapack.{what}", step, group=group, timeout=timeout)
    flag = torch.tensor([status], dtype=torch.int32)
    comm.all_reduce_min(flag, group=group, what=f"{what} step {step}", timeout=timeout)
    everyone = int(flag.item())
    if everyone == FAILED:
        _raise_failure(error, step, group, timeout, what, remote)
    return everyone


def gather_settings(
    settings: Any,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
    what: str = "gather_settings",
) -> list[tuple[int, Any]]:
    """(global rank, settings) of every rank of ``group``, in group order: one all-gather of JSON.

    For checks done once (e.g. at a loop's first step) that ranks agree on settings; two small
    collectives (lengths, then bytes: `comm.all_gather_strings`) on ``group``, a CPU group.

    Args:
        settings: this rank's settings, JSON-serializable (anything else is sent as its ``str``);
            None where the rank has none to compare.
        group: the ranks to gather from; the default group when None.
        timeout: seconds to wait (default: $MEGAPACK_TIMEOUT_S or 300).
        what: the caller's name in a timeout's message.

    Example:
        ``gather_settings({"seed": 1})`` on ranks 0 and 1 returns
        ``[(0, {"seed": 1}), (1, {"seed": 1})]`` on both.
    """
    text = json.dumps(settings, sort_keys=True, default=str)
    if not dist.is_initialized():
        return [(0, json.loads(text))]
    texts = comm.all_gather_strings(text, group=group, what=what, timeout=timeout)
    ranks = comm.group_ranks(group)
    return [(rank, json.loads(t)) for rank, t in zip(ranks, texts, strict=True)]


def disagreement(
    entries: Sequence[tuple[int, Mapping[str, Any]]], keys: Iterable[str]
) -> str | None:
    """The first of ``keys`` on which two entries differ, naming both ranks and values; else None.

    Args:
        entries: (rank, settings) pairs, e.g. from `gather_settings`; a missing key reads as None.
        keys: the settings that must be equal, checked in this order.

    Example:
        ``disagreement([(0, {"seed": 1, "rows": 8}), (2, {"seed": 1, "rows": 9})], ["seed", "rows"])``
        is ``"rows: rank 0 has 8, rank 2 has 9"``.
    """
    if not entries:
        return None
    first_rank, first = entries[0]
    for key in keys:
        for rank, settings in entries[1:]:
            if settings.get(key) != first.get(key):
                return (
                    f"{key}: rank {first_rank} has {first.get(key)!r}, rank {rank} has "
                    f"{settings.get(key)!r}"
                )
    return None


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
    error: BaseException | None,
    step: int,
    group: dist.ProcessGroup | None,
    timeout: float | None,
    what: str,
    remote: type[RemoteRankError],
) -> None:
    message = "" if error is None else f"{type(error).__name__}: {error}"
    messages = comm.all_gather_strings(
        message, group=group, what=f"{what} step {step} failure report", timeout=timeout
    )
    if error is not None:
        error.add_note(
            f"megapack.{what}: raised on rank {dist.get_rank()} at step {step}; every other rank "
            f"raises {remote.__name__}"
        )
        raise error
    ranks = comm.group_ranks(group)
    failed = [(r, m) for r, m in zip(ranks, messages, strict=True) if m]
    # A TP peer whose prefetcher relays its source's failure did not fail itself.
    failed = [(r, m) for r, m in failed if not m.startswith("RemoteDataError: ")] or failed
    rank, text = failed[0]
    if len(failed) > 1:
        text += f" (ranks {[r for r, _ in failed]} failed at this step)"
    if remote is RemoteDataError:
        raise RemoteDataError(rank, text, step)
    raise remote(rank, step, text)
