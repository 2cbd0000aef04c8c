"""`lockstep_steps`: every rank learns that a whole step of data exists before a pipeline schedule starts.

Why. megatron-core's schedules (1F1B, interleaved, forward-only) read data inside the schedule: each
stage's TP source calls the data iterator once per micro-batch, while a later stage waits in a p2p
receive for activations. When the data ends, or the source's iterator fails, at stage 0 mid-step,
stage 0 leaves the schedule and every later stage waits for activations that never come, until
the process group's own timeout (10-30 minutes). `megapack.lockstep` cannot help there: a later
stage never reaches its next data call. So the agreement moves out of the schedule, to the step:

    steps = megapack.lockstep_steps(it if topo.is_source else None, micro_batches=M, topology=topo)
    for step_iterator in steps:          # every rank of every stage and DP rank stops at one step
        schedule(forward_step_func=forward_step, data_iterator=step_iterator, num_microbatches=M, ...)

Before each step each TP source reads the step's ``M`` items from its iterator (host memory, no
device work; a `megapack.prefetch`er is read on every TP rank, since it delivers there), then every
rank of ``group`` (default: all ranks) joins one MIN all_reduce of an int32 on the CPU control
group: `megapack.lockstep`'s flag (`megapack.distributed.sync.step_status`). No device sync. Then,
before any p2p of the step:

    a whole step read everywhere        -> the step's iterator (the M items, in order; None where
                                           nothing is read), on every rank
    data ended on some source           -> StopIteration on every rank, the same step; a source
      (after k < M items: a warning)       that still had a whole step warns that it stops early
    a source's iterator raised, or an   -> that rank re-raises its error; every other rank raises
      item it read fails the checks        RemoteDataError naming it, the step and the message
      get_batch_on_this_tp_rank's source
      will make (``check=True``)

Ranks that read nothing (TP peers, a middle stage without a dataset) always say "have it", so
they never stop anyone. With virtual pipelining, pass the list of per-chunk iterators Megatron's
interleaved schedule takes: a step is read from each.

Checks, once, after step 0 is read and before it starts (one all-gather of each rank's settings
on the same group, `megapack.delivery.agreement`): the ranks state the same ``micro_batches``; a
TP source of a first, last or only stage has an iterator; a middle stage whose TP source has no
data (Megatron-LM's ``is_dataset_built_on_rank`` for plain pretraining) is refused when any rank
read packed batches (or passed ``packed=True``), since it would get no ``cu_seqlens``: its
attention would run across documents (with unpacked data it is right, and not warned about);
the datasets read (a `megapack.data.PackedDataset` behind a `DatasetIterator` or a prefetcher,
or ``dataset=``) agree across DP ranks and stages, and with the schedule's ``micro_batches`` when
they carry loss fields. Each failure is a ValueError on every rank naming both ranks and both
values. A read error or a data end at step 0 still ends every rank as at any step.

The schedule must take exactly ``micro_batches`` items a step: more raises ValueError inside the
schedule (naming the step), fewer is found at the next step and raised on every rank (the rest
would be lost silently).

Resume: `StepLockstep.state_dict` is the data position of the first micro-batch the schedule has
not taken (a snapshot of the iterator's ``state_dict()``, or a prefetcher's ``["iterator"]``,
after each item read), so a checkpoint saved anywhere in the loop resumes bit-exactly; the
iterator's own state counts the step read ahead. Load it into a fresh ``dataset.iterate()``
before building the prefetcher and lockstep_steps again (docs/delivery.md, "Exact resume").

When the loop ends on a data end or a data failure, the group's first rank (global rank 0) logs
one line: the step, the rank whose data ended or failed and why, and the steps and trained tokens
handed to the schedule across the job (`megapack.delivery.step_report`).

Measured on the 2-core dev machine (CPU gloo, 2026-11-27): tp 2 x pp 2 and tp 1 x pp 4 under 1F1B,
and tp 1 x pp 2 with 2 virtual chunks under the interleaved schedule, end every rank the same way
for data end, a source error mid-step and uneven DP sources, training and evaluation
(tests/functional/test_schedule_lockstep.py); without the wrapper the same runs hang.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from megapack.core.checks import check_int
from megapack.core.errors import RemoteDataError, RemoteRankError
from megapack.core.fields import Schema
from megapack.delivery.agreement import (
    batch_is_packed,
    first_step_agreement,
    local_problems,
    middle_checked,
    middle_without_data,
    schedule_mismatch,
)
from megapack.delivery.deliver import (
    SourceOptions,
    source_batch,
    source_options,
    warn_ignored_iterator,
)
from megapack.delivery.prefetch import Prefetcher
from megapack.delivery.step_report import Tally, report_end, tally_for
from megapack.distributed import sync
from megapack.distributed.groups import control_group
from megapack.distributed.topology import Topology, resolve_topology

__all__ = ["STATE_KIND", "StepIterator", "StepLockstep", "lockstep_steps"]

log = logging.getLogger("megapack.delivery")

STATE_KIND = "megapack.lockstep_steps"
"""``state_dict()["kind"]`` of a `StepLockstep`: what `DatasetIterator.load_state_dict` knows it by."""
STATE_VERSION = 1
"""Version of `StepLockstep.state_dict`."""


def lockstep_steps(
    data_iterator: Iterator[Any] | list[Iterator[Any] | None] | None,
    *,
    micro_batches: int,
    topology: Topology | None = None,
    pg_collection: Any = None,
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
    dataset: Any = None,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    check: bool = True,
    **options: Any,
) -> StepLockstep:
    """Steps of ``micro_batches`` items that every rank of ``group`` starts or stops together.

    Create it on every rank at the same point (every stage, TP, CP and DP rank) and loop over it
    around the schedule call; see the module docstring.

    Args:
        data_iterator: this rank's data iterator: on a TP source the iterator
            `get_batch_on_this_tp_rank` reads (e.g. ``dataset.iterate()``), None elsewhere; a
            `megapack.prefetch`er on every TP rank; with virtual pipelining a list of them, one
            per model chunk (Megatron's interleaved schedule takes that list).
        micro_batches: the schedule's ``num_microbatches``: items read a step from each iterator.
        topology: this rank's place in the grid; default: from megatron-core's ``parallel_state``.
        pg_collection: megatron-core's ``ProcessGroupCollection`` (Megatron-Bridge, megatron-core's
            explicit groups) instead of ``topology`` (`Topology.from_pg_collection`; with a list
            of iterators, one per virtual chunk, chunk 0's).
        group: the ranks that stop together; default: the default group (every rank: anything
            less lets the others enter the step's p2p or DP collectives alone).
        timeout: seconds a rank waits for the slowest rank to reach the next step (default:
            $MEGAPACK_TIMEOUT_S or 300); a step's reading counts, a whole step's compute too
            when ranks finish it far apart (`megapack.long_operation` for a checkpoint save).
        dataset: the dataset this rank reads, for the agreement checks (a `PackedDataset` or any
            object with ``settings()``); default: found behind a `DatasetIterator` or a prefetcher.
        seq_length, micro_batch_size: the schedule's own (both or neither): every micro-batch
            read is checked against them before the step starts, since a mismatch fails only
            inside the schedule, as a shape error on the last stage and a closed connection on
            the others. A packed micro-batch is one [1, T] row, so the schedule needs
            ``seq_length=T`` (rows x seq_len) and ``micro_batch_size=1``; a plain [b, s] batch
            ``seq_length=s``, ``micro_batch_size=b``. A mismatch is a ValueError on the reading
            rank naming both and the values to pass (`RemoteDataError` on the others).
        check: check each micro-batch a TP source reads as `get_batch_on_this_tp_rank`'s source
            will (its fields, rows and values; the static cap; the CP share), before the step,
            so that a bad batch stops every rank there instead of failing inside the schedule
            while later stages wait for activations. False: the items are not megapack batches
            (a forward step of your own reads them). A prefetcher's batches are already checked.
        **options: the keyword arguments the forward step passes to
            `get_batch_on_this_tp_rank` (``fields``, ``packed``, ``static``, ``cp_layout``,
            ``sequence_parallel``), for the check: pass the same (a declared field not passed
            here is an undeclared key to the check).

    Returns:
        A `StepLockstep`: iterate it to get each step's data iterator (a `StepIterator` where
        this rank reads, None elsewhere; a list with virtual pipelining).

    Example:
        ranks whose sources hold 6 and 5 micro-batches, ``micro_batches=2``: every rank runs 2
        steps; the second source warns that 1 micro-batch of its third step was left unused.
    """
    return StepLockstep(
        data_iterator,
        micro_batches=micro_batches,
        topology=topology,
        pg_collection=pg_collection,
        group=group,
        timeout=timeout,
        dataset=dataset,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        check=check,
        **options,
    )


class StepIterator:
    """One step's items, read ahead, for the schedule to take one by one, each exactly once.

    Raises ValueError when the schedule asks for more than the step holds (``num_microbatches``
    larger than ``micro_batches``); `StepLockstep` checks at the next step that all were taken.
    """

    def __init__(
        self,
        items: list[Any],
        step: int,
        *,
        positions: list[Any] | None = None,
        taken: Callable[[Any], None] | None = None,
    ) -> None:
        self._items: list[Any] = items
        self.step = step
        """The step these items belong to (0-based)."""
        self.used = 0
        """How many items the schedule has taken."""
        self._positions = positions
        self._taken = taken

    def __iter__(self) -> StepIterator:
        return self

    def __next__(self) -> Any:
        if self.used >= len(self._items):
            raise ValueError(
                f"lockstep_steps(micro_batches={len(self._items)}): the schedule asked for "
                f"micro-batch {self.used + 1} of step {self.step}, which holds "
                f"{len(self._items)}: pass the schedule's num_microbatches as micro_batches="
            )
        item, self._items[self.used] = self._items[self.used], None  # the schedule keeps it
        self.used += 1
        if self._taken is not None:
            self._taken(item)
        return item

    def __len__(self) -> int:
        """Items not yet taken."""
        return len(self._items) - self.used

    def position(self) -> Any:
        """The data position after the last item the schedule took (before the step's first
        when it took none), or None where the iterator has no ``state_dict``."""
        return None if self._positions is None else self._positions[self.used]


@dataclasses.dataclass(slots=True)
class _Chunk:
    """One data iterator of this rank (one model chunk's with virtual pipelining)."""

    iterator: Iterator[Any] | None
    reads: bool
    """Whether this rank reads it: a prefetcher on any TP rank, else an iterator on the source."""
    position: Callable[[], Any] | None
    """The data position now: the iterator's ``state_dict``, a prefetcher's ``["iterator"]``."""
    tally: Tally | None
    """Counts the trained tokens handed to the schedule (one rank per micro-batch: the TP
    source of the last stage, CP rank 0 for whole rows), else None."""
    last: StepIterator | None = None
    """The step iterator it gave the schedule last."""
    before: Any = None
    """The data position before this lockstep's first read (None until then)."""
    read: bool = False
    """Whether this lockstep read from it yet."""


class StepLockstep:
    """The iterator `lockstep_steps` returns; ``step`` counts the steps it gave out.

    Its `state_dict` is the data position of the first micro-batch the schedule has not taken
    (module docstring, "Resume")."""

    def __init__(
        self,
        data_iterator: Iterator[Any] | list[Iterator[Any] | None] | None,
        *,
        micro_batches: int,
        topology: Topology | None = None,
        pg_collection: Any = None,
        group: dist.ProcessGroup | None = None,
        timeout: float | None = None,
        dataset: Any = None,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        check: bool = True,
        **options: Any,
    ) -> None:
        self.micro_batches = check_int("micro_batches", micro_batches, minimum=1)
        if (seq_length is None) != (micro_batch_size is None):
            raise ValueError(
                f"lockstep_steps: give the schedule's seq_length and micro_batch_size together "
                f"(got seq_length={seq_length!r}, micro_batch_size={micro_batch_size!r})"
            )
        self._schedule: tuple[int, int] | None = None
        if seq_length is not None and micro_batch_size is not None:
            self._schedule = (
                check_int("seq_length", seq_length, minimum=1),
                check_int("micro_batch_size", micro_batch_size, minimum=1),
            )
        if dataset is not None and not callable(getattr(dataset, "settings", None)):
            raise TypeError(
                f"lockstep_steps: dataset must have a settings() method (a megapack.data."
                f"PackedDataset), got {type(dataset).__name__}"
            )
        chunked = isinstance(data_iterator, list)
        entries: list[Iterator[Any] | None] = (
            list(data_iterator) if isinstance(data_iterator, list) else [data_iterator]
        )
        for i, it in enumerate(entries):
            if it is not None and not isinstance(it, Iterator):
                where = f"data_iterator[{i}]" if chunked else "data_iterator"
                raise TypeError(
                    f"lockstep_steps: {where} must be an iterator (e.g. iter(batches) or "
                    f"dataset.iterate()), a megapack.prefetch(...), or None; got "
                    f"{type(it).__name__}"
                )
        if chunked and not entries:
            raise ValueError("lockstep_steps: data_iterator is an empty list; give one per chunk")
        # a ProcessGroupCollection does not know the virtual chunks: one iterator per chunk does
        vp = len(entries) if chunked and len(entries) > 1 and pg_collection is not None else None
        topo = (
            resolve_topology(
                topology, pg_collection, vp_stage=None if vp is None else 0, vp_size=vp
            )
            or _topology_from_parallel_state()
        )
        if topo.vp_size is not None and not chunked:
            raise ValueError(
                f"lockstep_steps: virtual pipelining is on (vp_size={topo.vp_size}): pass a list "
                f"of {topo.vp_size} data iterators, one per model chunk, as megatron-core's "
                "interleaved schedule takes"
            )
        if chunked and topo.vp_size is not None and len(entries) != topo.vp_size:
            raise ValueError(
                f"lockstep_steps: data_iterator lists {len(entries)} iterators but virtual "
                f"pipelining has vp_size={topo.vp_size} model chunks: give one per chunk"
            )
        self._topo, self._chunked, self._group, self._timeout = topo, chunked, group, timeout
        if not isinstance(check, bool):
            raise TypeError(f"lockstep_steps: check must be True or False, got {check!r}")
        try:  # checked on every rank, so a wrong option stops every rank here
            _, schema, source = source_options(topo, **options)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"lockstep_steps: {exc}") from None
        self._packed_option = source.packed
        self._source: tuple[Schema, SourceOptions] | None = (schema, source) if check else None
        self._chunks = [
            _Chunk(it, _reads(it, topo), _position_of(it), tally_for(it, topo, index, chunked))
            for index, it in enumerate(entries)
        ]
        if any(it is not None and not c.reads for it, c in zip(entries, self._chunks, strict=True)):
            warn_ignored_iterator(topo, "lockstep_steps")
        self._datasets = [dataset] if dataset is not None else _datasets_of(entries)
        self._problems = local_problems(self._topo, entries, chunked=chunked)
        sources = [_source_of(it) for it in entries]
        self._middle = middle_without_data(self._topo, entries, sources, chunked=chunked)
        self._flag_group: dist.ProcessGroup | None = None
        self._ended: BaseException | None = None
        self._partial = 0  # items of the step at which this rank's data ended
        self.step = 0
        """Steps given out so far."""

    def __iter__(self) -> StepLockstep:
        return self

    def __next__(self) -> StepIterator | list[StepIterator | None] | None:
        if self._ended is not None:
            raise self._ended
        distributed = dist.is_initialized()
        status, error = sync.HAVE, None
        read: list[list[Any]] = []
        positions: list[list[Any] | None] = []
        try:
            if self.step == 0 and distributed:
                self._flag_group = control_group(self._group)
            try:
                self._check_taken()
                status, read, positions = self._read()
            except Exception as exc:
                status, error = sync.FAILED, exc
            if self.step == 0:
                self._agree(read, error)
            if distributed:
                everyone = sync.step_status(
                    status,
                    error,
                    self.step,
                    group=self._flag_group,
                    timeout=self._timeout,
                    what="lockstep_steps",
                    remote=RemoteDataError,
                )
            elif error is not None:
                error.add_note(f"megapack.lockstep_steps: raised on rank 0 at step {self.step}")
                raise error
            else:
                everyone = status
        except BaseException as exc:
            self._ended = RuntimeError(
                f"this lockstep_steps ended with an error at step {self.step}; create a new one"
            )
            if isinstance(exc, RemoteRankError) or exc is error:  # a data failure, not a hang
                self._report(sync.FAILED, exc)
            raise
        if everyone == sync.HAVE:
            steps = [
                StepIterator(
                    items,
                    self.step,
                    positions=where,
                    taken=None if c.tally is None else c.tally.add,
                )
                if c.reads
                else None
                for c, items, where in zip(self._chunks, read, positions, strict=True)
            ]
            for chunk, it in zip(self._chunks, steps, strict=True):
                chunk.last = it
            self.step += 1
            return steps if self._chunked else steps[0]
        if status == sync.HAVE and any(c.reads for c in self._chunks):
            log.warning(
                "megapack: lockstep_steps: rank %d still had step %d's data but another rank's "
                "data ended; every rank stops before it (balance the DP shards, e.g. with "
                "PackedDataset's dp_rank/dp_size)",
                _rank(),
                self.step,
                stacklevel=2,
            )
        self._ended = StopIteration()
        self._report(status, None)
        raise StopIteration

    # ---- resume

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: the data position of the first micro-batch the schedule has not taken.

        Taken anywhere in the loop (before or after the schedule inside ``for step_iterator in
        steps``, between steps, after the loop), it counts the micro-batches handed to the
        schedule, not those read ahead: the position after the last item the schedule took
        from the last step given out (the step's start when it took none; where this lockstep
        started before its first step). Over a `megapack.prefetch`er it is the prefetcher's
        ``["iterator"]`` as of that item, so nothing fetched ahead counts either.

        Returns:
            ``{"kind": STATE_KIND, "version": 1, "steps": steps given out, "taken": [items the
            schedule took of the last step, per chunk], "iterators": [data position per chunk]}``;
            a position is the iterator's own ``state_dict()`` (a `DatasetIterator`'s), None on
            a chunk this rank does not read (a TP peer without prefetch, a middle stage without
            data) or whose iterator has no ``state_dict``. Plain values: JSON-friendly.

        Resume by loading it into a fresh ``dataset.iterate()`` (``load_state_dict`` accepts
        this state) before building the prefetcher and lockstep_steps again; save it from
        global rank 0 (the first stage's TP source, which reads).

        Example: ``micro_batches=2``, taken after the schedule of step 1 with ``zip(steps,
        range(2))``: 4 micro-batches trained, the iterator itself at 4 (or at 6 once zip's last
        ``next`` read step 2 ahead); this state's position is 4 either way.
        """
        return {
            "kind": STATE_KIND,
            "version": STATE_VERSION,
            "steps": self.step,
            "taken": [0 if c.last is None else c.last.used for c in self._chunks],
            "iterators": [self._position(c) for c in self._chunks],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load `state_dict`'s positions into each chunk's iterator, before the first step.

        The same as ``data_iterator.load_state_dict(state)`` on each chunk's fresh
        `DatasetIterator` before building this lockstep; with `megapack.prefetch` that is the
        only way (a prefetcher reads ahead as soon as it is built). Chunks this rank does not
        read are left alone, so the state saved on global rank 0 loads on every rank.

        Raises:
            TypeError: ``state`` is not a `state_dict` of a lockstep_steps, or an iterator to
                load has no ``load_state_dict``.
            ValueError: a step was already read, a prefetcher is read, the number of chunks
                differs, or the state holds no position for a chunk read here, naming what to
                load instead.
        """
        if not isinstance(state, Mapping) or state.get("kind") != STATE_KIND:
            raise TypeError(
                f"StepLockstep.load_state_dict takes a lockstep_steps state_dict() (kind "
                f"{STATE_KIND!r}), got {_short(state)}; load a DatasetIterator's or a "
                "prefetcher's state into the dataset's iterator (DatasetIterator.load_state_dict)"
            )
        version = check_int("state['version']", state.get("version"), minimum=1)
        if version > STATE_VERSION:
            raise ValueError(
                f"state['version']={version}: written by a later megapack; this one reads "
                f"lockstep_steps states of version {STATE_VERSION}"
            )
        positions = state.get("iterators")
        if not isinstance(positions, list) or len(positions) != len(self._chunks):
            raise ValueError(
                f"state['iterators'] holds {_short(positions)}, but this lockstep_steps reads "
                f"{len(self._chunks)} data iterator(s): save and load the state of a lockstep_steps "
                "built alike (one position per model chunk)"
            )
        if self.step or any(c.read for c in self._chunks):
            raise ValueError(
                "StepLockstep.load_state_dict: this lockstep_steps already read a step; load the "
                "state before its first step (or into a fresh dataset.iterate() before building it)"
            )
        for index, (chunk, position) in enumerate(zip(self._chunks, positions, strict=True)):
            if not chunk.reads:
                continue
            where = f"data_iterator[{index}]" if self._chunked else "data_iterator"
            if isinstance(chunk.iterator, Prefetcher):
                raise ValueError(
                    f"StepLockstep.load_state_dict: {where} is a megapack.prefetch, which read "
                    "ahead when it was built: load the state into the dataset's iterator "
                    "(it.load_state_dict(state)) before building the prefetcher over it"
                )
            if position is None:
                raise ValueError(
                    f"state['iterators'][{index}] is None: the state was saved on a rank that "
                    "reads no data there (a TP peer, or a middle stage without data); save "
                    "global rank 0's (the first stage's TP source)"
                )
            load = getattr(chunk.iterator, "load_state_dict", None)
            if not callable(load):
                raise TypeError(
                    f"StepLockstep.load_state_dict: {where} ({type(chunk.iterator).__name__}) "
                    "has no load_state_dict(); resume it your own way"
                )
            load(position)

    def _position(self, chunk: _Chunk) -> Any:
        if not chunk.reads or chunk.position is None:
            return None
        if chunk.last is not None:
            return chunk.last.position()
        if chunk.read:  # read, but no step was given out: the data ended or failed at step 0
            return chunk.before
        return chunk.position()

    # ---- reading a step

    def _read(self) -> tuple[int, list[list[Any]], list[list[Any] | None]]:
        """(HAVE or OUT, each chunk's items, each chunk's data positions before the step and
        after each item): every read chunk's whole step, or where it ended."""
        read: list[list[Any]] = []
        positions: list[list[Any] | None] = []
        for index, chunk in enumerate(self._chunks):
            items: list[Any] = []
            read.append(items)
            where = None if chunk.position is None or not chunk.reads else [chunk.position()]
            positions.append(where)
            if not chunk.reads:
                continue
            if not chunk.read:
                chunk.read, chunk.before = True, None if where is None else where[0]
            assert chunk.iterator is not None
            try:
                checks = self._source is not None and not isinstance(chunk.iterator, Prefetcher)
                while len(items) < self.micro_batches:
                    items.append(next(chunk.iterator))
                    if where is not None:
                        assert chunk.position is not None
                        where.append(chunk.position())
                    if self._schedule is not None:
                        self._check_shape(items[-1], len(items) - 1)
                    if checks:
                        self._check_batch(items[-1], len(items) - 1)
            except StopIteration:
                if items:
                    self._partial = len(items)
                    place = f" (model chunk {index})" if self._chunked else ""
                    log.warning(
                        "megapack: lockstep_steps: the data on rank %d%s ended after %d of step "
                        "%d's %d micro-batches: the partial step is not run (%d micro-batch(es) "
                        "left unused); every rank stops before it",
                        _rank(),
                        place,
                        len(items),
                        self.step,
                        self.micro_batches,
                        len(items),
                        stacklevel=3,
                    )
                return sync.OUT, read, positions
        return sync.HAVE, read, positions

    def _check_shape(self, item: Any, index: int) -> None:
        """ValueError when ``item`` does not fit the schedule's seq_length x micro_batch_size."""
        assert self._schedule is not None
        problem = schedule_mismatch(item, *self._schedule, cp_size=self._topo.cp_size)
        if problem is not None:
            raise ValueError(f"lockstep_steps: micro-batch {index} of step {self.step}: {problem}")

    def _check_batch(self, item: Any, index: int) -> None:
        """The error `get_batch_on_this_tp_rank`'s source would raise on ``item``, raised now,
        its message naming lockstep_steps (other ranks get only the message).

        With virtual pipelining every chunk is checked with chunk 0's topology: the chunks differ
        only in their stage, which picks the fields sent, not what makes a batch bad."""
        assert self._source is not None
        try:
            source_batch(item, self._topo, *self._source)
        except (TypeError, ValueError) as exc:
            text = (
                f"lockstep_steps: micro-batch {index} of step {self.step}, checked before the "
                f"step as get_batch_on_this_tp_rank's source will: {exc}"
            )
            if "fields=megapack." not in str(exc):  # the intake names megapack's own fields
                text += (
                    " (pass get_batch's fields=/packed=/static= to lockstep_steps too; "
                    "check=False: not a megapack batch)"
                )
            raise type(exc)(text).with_traceback(exc.__traceback__) from None
        except Exception as exc:
            exc.add_note(
                f"megapack.lockstep_steps: micro-batch {index} of step {self.step}, checked before "
                "the step as get_batch_on_this_tp_rank's source will (check=False: not a "
                "megapack batch; pass get_batch's fields=/packed=/static= here too)"
            )
            raise

    def _check_taken(self) -> None:
        """ValueError when the schedule took fewer items of the last step than it held."""
        for index, chunk in enumerate(self._chunks):
            if chunk.last is not None and len(chunk.last):
                where = f" of model chunk {index}" if self._chunked else ""
                raise ValueError(
                    f"lockstep_steps(micro_batches={self.micro_batches}): the schedule took "
                    f"{chunk.last.used} of step {chunk.last.step}'s {self.micro_batches} "
                    f"micro-batches{where} on rank {_rank()}; the rest would be lost: pass the "
                    "schedule's num_microbatches as micro_batches="
                )

    # ---- the one-time agreement, and the loop's end

    def _agree(self, read: list[list[Any]], error: BaseException | None) -> None:
        """The first step's checks (module docstring), after step 0 was read (its items say
        whether the batches are packed): one all-gather, the same verdict everywhere."""
        said = [batch_is_packed(item) for items in read for item in items]
        packed = True if True in said else (False if False in said else None)
        try:
            unpacked = first_step_agreement(
                micro_batches=self.micro_batches,
                reads=any(c.reads for c in self._chunks),
                problems=self._problems,
                datasets=self._datasets,
                group=self._flag_group,
                timeout=self._timeout,
                middle=self._middle,
                packed=packed,
                packed_option=self._packed_option,
            )
        except ValueError as exc:
            if error is not None:
                exc.add_note(
                    f"megapack.lockstep_steps: this rank's read of step 0 failed too: {error!r}"
                )
            raise
        if unpacked:  # a middle stage without data is right: get_batch need not warn there
            for _, _, _, chunk in self._middle:
                middle_checked(
                    self._topo if chunk is None else dataclasses.replace(self._topo, vp_stage=chunk)
                )

    def _report(self, status: int, error: BaseException | None) -> None:
        """Log the loop's end on the group's first rank (`megapack.delivery.step_report`)."""
        report_end(
            step=self.step,
            micro_batches=self.micro_batches,
            status=status,
            partial=self._partial,
            tokens=sum(c.tally.total() for c in self._chunks if c.tally is not None),
            error=error,
            group=self._flag_group,
            timeout=self._timeout,
        )


def _reads(iterator: Iterator[Any] | None, topo: Topology) -> bool:
    if isinstance(iterator, Prefetcher):
        return True  # it delivers on every TP rank
    return iterator is not None and topo.is_source


def _source_of(iterator: Iterator[Any] | None) -> Iterator[Any] | None:
    """What the TP source reads: the iterator, or the one a prefetcher was built over."""
    # a prefetcher keeps its source's iterator as _iterator (this package's own class)
    return getattr(iterator, "_iterator", None) if isinstance(iterator, Prefetcher) else iterator


def _position_of(iterator: Iterator[Any] | None) -> Callable[[], Any] | None:
    """How to read the data position of ``iterator`` now: a prefetcher's ``state_dict()
    ["iterator"]`` (as of the last batch next() returned), else its own ``state_dict``."""
    if isinstance(iterator, Prefetcher):
        prefetcher = iterator
        return lambda: prefetcher.state_dict()["iterator"]
    state = getattr(iterator, "state_dict", None)
    return state if callable(state) else None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _datasets_of(entries: Sequence[Iterator[Any] | None]) -> list[Any]:
    """The datasets behind a `DatasetIterator` or a prefetcher of one, each once."""
    found: list[Any] = []
    for it in entries:
        # a prefetcher keeps its source's iterator as _iterator (this package's own class)
        inner = getattr(it, "_iterator", it) if isinstance(it, Prefetcher) else it
        ds = getattr(inner, "dataset", None)
        if callable(getattr(ds, "settings", None)) and all(ds is not f for f in found):
            found.append(ds)
    return found


def _topology_from_parallel_state() -> Topology:
    """This rank's topology from megatron-core; chunk 0's with virtual pipelining (same TP group)."""
    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():  # lazy: importing megatron takes ~5 s
        from megatron.core import parallel_state as ps

    vp = (
        ps.get_virtual_pipeline_model_parallel_world_size()
        if ps.model_parallel_is_initialized()
        else None
    )
    return Topology.from_parallel_state(vp_stage=None if vp is None else 0)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
