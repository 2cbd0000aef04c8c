"""The end of a `megapack.lockstep_steps` loop, said once: the step, the rank whose data ended or
failed and why, and the steps and trained tokens handed to the schedule across the job.

Trained tokens (``loss_mask`` non-zero) are counted by a `Tally` on the last stage's TP sources,
where every micro-batch carries its loss mask (delivered batches too), as the schedule takes each
micro-batch; `report_end` gathers every rank's count, status and partial step once, at the loop's
end (one small all-gather on the loop's control group, bounded by the timeout; none per step), and
the group's first rank (global rank 0 by default) logs one line on the ``megapack.delivery``
logger: INFO for a clean end at a step boundary, WARNING for a partial step, ERROR for a failure.

Example (rank 0's data ended after 1 of step 2's 2 micro-batches)::

    megapack: lockstep_steps stopped at step 2: the data on rank 0 ended after 1 of its 2
    micro-batches (the partial step is not run); trained 2 steps and 28 trained tokens (loss_mask
    non-zero) handed to the schedule across the job
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from megapack.core.capture import capturing
from megapack.core.errors import CollectiveError, RemoteRankError
from megapack.distributed import comm, sync
from megapack.distributed.topology import Topology

__all__ = ["Tally", "report_end", "tally_for"]

log = logging.getLogger("megapack.delivery")


class Tally:
    """Trained tokens (non-zero ``loss_mask``) of the micro-batches handed to the schedule.

    CPU masks are counted at once; a device mask adds to a device counter (no host sync) read
    once, at the loop's end (not while a CUDA graph is captured: its kernels would be recorded). A whole row read from a data iterator is counted on CP rank 0
    only (every CP rank's source reads it whole); a delivered batch (`megapack.prefetch`) holds
    this CP rank's share, counted on every CP rank.
    """

    def __init__(self, cp_rank: int) -> None:
        self._cp_rank = cp_rank
        self._host = 0
        self._device: dict[torch.device, torch.Tensor] = {}

    def add(self, item: Any) -> None:
        delivered = isinstance(item, Mapping) and "packed_seq_params" in item
        if not delivered and self._cp_rank != 0:
            return
        mask = (
            item.get("loss_mask") if isinstance(item, Mapping) else getattr(item, "loss_mask", None)
        )
        if not isinstance(mask, torch.Tensor):
            return
        if mask.device.type == "cpu":
            self._host += int(torch.count_nonzero(mask))
            return
        if capturing():  # no kernel of ours in a CUDA graph: a captured step goes uncounted
            return
        count = torch.count_nonzero(mask)
        held = self._device.get(mask.device)
        self._device[mask.device] = count if held is None else held + count

    def total(self) -> int:
        return self._host + sum(int(t.item()) for t in self._device.values())


def tally_for(
    iterator: Iterator[Any] | None, topo: Topology, index: int, chunked: bool
) -> Tally | None:
    """A `Tally` where this chunk counts the trained tokens (module docstring), else None: the
    TP source (TP rank 0, also over a prefetcher) of the last stage, where every micro-batch
    carries its loss_mask (delivered batches too)."""
    if iterator is None or not topo.is_source:
        return None
    if chunked and topo.vp_size is None:
        return None  # which chunk is the last stage is unknown
    place = dataclasses.replace(topo, vp_stage=index) if chunked else topo
    return Tally(topo.cp_rank) if place.is_last_stage else None


def report_end(
    *,
    step: int,
    micro_batches: int,
    status: int,
    partial: int,
    tokens: int,
    error: BaseException | None,
    group: dist.ProcessGroup | None,
    timeout: float | None,
) -> None:
    """Log one line on the group's first rank (global rank 0 by default) when the loop ends:
    the step, the rank whose data ended or failed and why, and the steps and trained tokens
    handed to the schedule across the job (one small all-gather, bounded by the timeout)."""
    mine = [status, partial, tokens]
    if dist.is_initialized():
        try:
            rows = comm.all_gather(
                torch.tensor(mine, dtype=torch.int64, device=comm.tensor_device(group)),
                group=group,
                what=f"lockstep_steps end report at step {step}",
                timeout=timeout,
            )
        except CollectiveError:
            return  # the group is broken: the error on its way out says why
        ranks = comm.group_ranks(group)
        everyone = [(r, [int(v) for v in row.tolist()]) for r, row in zip(ranks, rows, strict=True)]
    else:
        everyone = [(0, mine)]
    if _rank() != everyone[0][0]:
        return
    total = sum(row[2] for _, row in everyone)
    trained = (
        f"{step} step{'' if step == 1 else 's'} and {total:,} trained tokens "
        "(loss_mask non-zero) handed to the schedule across the job"
    )
    if error is not None:
        rank = error.rank if isinstance(error, RemoteRankError) else _rank()
        text = (
            error.remote_message
            if isinstance(error, RemoteRankError)
            else f"{type(error).__name__}: {error}"
        )
        log.error(
            "megapack: lockstep_steps stopped at step %d: rank %d failed: %s; trained %s",
            step,
            rank,
            text,
            trained,
        )
        return
    out = [(r, row) for r, row in everyone if row[0] == sync.OUT]
    rank, row = next(((r, row) for r, row in out if row[1]), out[0] if out else (_rank(), mine))
    if row[1]:
        log.warning(
            "megapack: lockstep_steps stopped at step %d: the data on rank %d ended after %d of "
            "its %d micro-batches (the partial step is not run); trained %s",
            step,
            rank,
            row[1],
            micro_batches,
            trained,
        )
    else:
        log.info(
            "megapack: lockstep_steps stopped at step %d: the data on rank %d ended at the "
            "step boundary; trained %s",
            step,
            rank,
            trained,
        )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
