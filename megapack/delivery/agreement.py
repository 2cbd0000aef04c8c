"""The first step's agreement of `megapack.lockstep_steps`: what ranks reading data must share.

Every rank sends its settings once (`megapack.distributed.sync.gather_settings`), after it read
step 0: the schedule's ``micro_batches``, whether it reads data, problems it found alone (a TP
source of an end stage without an iterator), the middle stages it is the TP source of without an
iterator, whether what it read for step 0 is packed and whether it passed ``packed=True``, each
dataset it reads (``PackedDataset.settings()``) and its DP place from megatron-core's
``parallel_state`` where that is set up. `agreement_errors` turns every rank's settings into the
same errors and warnings on every rank, each naming both ranks and both values:

* the ranks state the same ``micro_batches``, and some rank reads data;
* packed batches reach every stage: a middle stage whose TP source has no iterator (Megatron-LM's
  ``is_dataset_built_on_rank`` builds none there for plain pretraining) gets no ``cu_seqlens``, so
  when any rank read packed batches (or passed ``packed=True``) it is an error naming that
  stage, its global rank and the fix; with unpacked data it trains as if it read (nothing to
  send it), and `get_batch_on_this_tp_rank` is told not to warn there (`middle_checked`);
* every dataset shares `STEP_KEYS` (the shape of a step and its loss);
* DP shards of one dataset (``dp_size > 1``) share its identity too (fingerprint, rows, seed, ...);
  per-rank datasets (``dp_size=1``, e.g. evaluation sets packed per rank) may differ;
* with ``parallel_state``: a shard's ``dp_rank``/``dp_size`` are the rank's DP rank and size, and
  the pipeline stages and CP ranks of one DP rank read the same data (`PER_RANK_KEYS` included);
* a dataset built for other micro-batches a step than the schedule's: an error with loss fields
  (they count the dataset's steps), else a warning; every DP rank reading one ``dp_size=1``
  dataset: a warning.

Example (two DP shards built with different seeds)::

    agreement_errors([(0, {..., "datasets": [{"seed": 0, "dp_size": 2, ...}]}),
                      (1, {..., "datasets": [{"seed": 7, "dp_size": 2, ...}]})])
    -> (["the DP shards read different datasets, seed: rank 0 has 0, rank 1 has 7 (...)"], [])
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from megapack.core.fields import Stage
from megapack.distributed import sync
from megapack.distributed.topology import Topology

__all__ = [
    "PER_RANK_KEYS",
    "STEP_KEYS",
    "agreement_errors",
    "batch_is_packed",
    "data_parallel_place",
    "middle_checked",
    "middle_without_data",
    "warn_middle_without_data",
]

log = logging.getLogger("megapack.delivery")

# Groups (a TP group, or the default group where tp = 1) of middle stages without an iterator:
# those a lockstep_steps agreement found unpacked (no warning needed), and those warned once.
_middle_checked: weakref.WeakSet[Any] = weakref.WeakSet()
_middle_warned: weakref.WeakSet[Any] = weakref.WeakSet()

STEP_KEYS = ("rows_per_micro_batch", "micro_batches", "dp_size", "loss_fields")
"""Dataset settings every rank's dataset must share: they shape a step and its loss."""
PER_RANK_KEYS = ("dp_rank",)
"""Dataset settings that differ between DP ranks (shared by the stages and CP ranks of one)."""


def agreement_errors(
    everyone: Sequence[tuple[int, Mapping[str, Any]]],
) -> tuple[list[str], list[tuple[set[int], str]]]:
    """(errors, warnings) of the first step's agreement, from every rank's gathered settings.

    Args:
        everyone: (global rank, settings) of each rank: ``micro_batches``, ``reads``,
            ``problems`` (messages), ``datasets`` (each dataset's ``settings()``), ``dp``
            ([DP rank, DP size] from megatron-core's parallel_state, or None) and, optional,
            ``middle`` (`middle_without_data`'s entries), ``packed`` (whether what it read for
            step 0 is packed, or None) and ``packed_option`` (the ``packed=`` it passed).

    Returns:
        Error messages (raise them on every rank), and warnings with the ranks that give them.

    Example:
        ranks 0 and 1 with datasets of ``rows_per_micro_batch`` 2 and 1 give the error
        ``"the datasets disagree on rows_per_micro_batch: rank 0 has 2, rank 1 has 1 (...)"``.
    """
    errors = [p for _, s in everyone for p in s["problems"]]
    if (text := sync.disagreement(everyone, ["micro_batches"])) is not None:
        errors.append(f"ranks disagree on the schedule's micro-batches a step, {text}")
    if not any(s["reads"] for _, s in everyone):
        errors.append(
            "no rank reads data: pass the data iterator on the TP source (TP rank 0) of each "
            "stage that has a dataset"
        )
    if (text := _middle_stages_error(everyone)) is not None:
        errors.append(text)
    held = [(rank, ds, s["dp"]) for rank, s in everyone for ds in s["datasets"]]
    if errors or not held:
        return _first(errors), []
    entries = [(rank, ds) for rank, ds, _ in held]
    if (text := sync.disagreement(entries, STEP_KEYS)) is not None:
        return [f"the datasets disagree on {text} (every rank must build its dataset alike)"], []
    shared = entries[0][1]
    keys = sorted({k for _, ds in entries for k in ds} - set(PER_RANK_KEYS))
    if shared.get("dp_size", 1) > 1 and (text := sync.disagreement(entries, keys)):
        errors.append(
            f"the DP shards read different datasets, {text} (every DP rank must load the same "
            "packed data, with its own dp_rank)"
        )
    by_dp: dict[int, list[tuple[int, Mapping[str, Any]]]] = {}
    for rank, ds, dp in held:
        if dp is None:
            continue
        by_dp.setdefault(dp[0], []).append((rank, ds))
        if ds.get("dp_size", 1) > 1 and [ds.get("dp_rank"), ds.get("dp_size")] != list(dp):
            errors.append(
                f"rank {rank}'s dataset is DP shard {ds.get('dp_rank')} of {ds.get('dp_size')} "
                f"but megatron-core's parallel_state puts rank {rank} at DP rank {dp[0]} of "
                f"{dp[1]}: build it with dp_rank=parallel_state.get_data_parallel_rank(), "
                "dp_size=parallel_state.get_data_parallel_world_size()"
            )
    for dp_rank, group in sorted(by_dp.items()):
        if (text := sync.disagreement(group, [*PER_RANK_KEYS, *keys])) is not None:
            errors.append(
                f"the pipeline stages and CP ranks of DP rank {dp_rank} read different data, "
                f"{text} (they must read the same micro-batches)"
            )
    schedule = everyone[0][1]["micro_batches"]
    if shared.get("micro_batches") != schedule:
        text = (
            f"rank {entries[0][0]}'s dataset is built for micro_batches="
            f"{shared.get('micro_batches')} a step but the schedule runs micro_batches={schedule}"
        )
        if shared.get("loss_fields"):
            errors.append(
                f"{text}, and its loss fields count the dataset's steps, so every loss "
                "denominator would be wrong: build it with micro_batches=num_microbatches"
            )
    return _first(errors), _cautions(held, keys, schedule)


def _cautions(
    held: list[tuple[int, Mapping[str, Any], list[int] | None]], keys: list[str], schedule: int
) -> list[tuple[set[int], str]]:
    """The agreement's warnings (see `agreement_errors`), each with the ranks that give it."""
    out = []
    rank0, shared = held[0][0], held[0][1]
    if shared.get("micro_batches") != schedule and not shared.get("loss_fields"):
        out.append(
            (
                {rank for rank, _, _ in held},
                f"rank {rank0}'s dataset is built for micro_batches={shared.get('micro_batches')} "
                f"a step but the schedule runs micro_batches={schedule}: its epoch is padded to "
                "whole steps of its own (build it with micro_batches=num_microbatches)",
            )
        )
    firsts: dict[int, tuple[int, Mapping[str, Any]]] = {}
    for rank, ds, dp in held:
        if dp is not None and dp[1] > 1 and ds.get("dp_size", 1) == 1:
            firsts.setdefault(dp[0], (rank, ds))
    same = [
        rank
        for rank, ds in firsts.values()
        if ds.get("fingerprint") is not None and all(ds.get(k) == shared.get(k) for k in keys)
    ]
    if len(same) > 1:
        out.append(
            (
                {rank for rank, _, _ in held},
                f"ranks {same} are on different DP ranks but read the same dataset with "
                "dp_size=1: every DP rank trains the same micro-batches; build it with dp_rank= "
                "and dp_size= (parallel_state's data-parallel rank and size)",
            )
        )
    return out


def _middle_stages_error(everyone: Sequence[tuple[int, Mapping[str, Any]]]) -> str | None:
    """The error for middle stages without data when the batches are packed, else None.

    Example: tp 1 x pp 4, ranks 1 and 2 (the middle stages) pass None and rank 0 read packed
    micro-batches -> "ranks 1 (pp_rank 1 of 4: data_iterator=None) and 2 (pp_rank 2 of 4:
    data_iterator=None) are TP sources of middle pipeline stages without data, but the batches
    are packed (rank 0 read packed micro-batches at step 0): ..."
    """
    middles = [(rank, place) for rank, s in everyone for place in s.get("middle", [])]
    if not middles:
        return None
    packed = [rank for rank, s in everyone if s.get("packed") is True]
    declared = [rank for rank, s in everyone if s.get("packed_option") is True]
    if not packed and not declared:
        return None
    where = [f"{rank} ({_place(place)})" for rank, place in middles[:4]]
    if len(middles) > 4:
        where.append(f"{len(middles) - 4} more")
    names = where[0] if len(where) == 1 else ", ".join(where[:-1]) + " and " + where[-1]
    who = (
        f"rank {names} is the TP source of a middle pipeline stage"
        if len(middles) == 1
        else f"ranks {names} are TP sources of middle pipeline stages"
    )
    why = (
        f"rank {packed[0]} read packed micro-batches at step 0"
        if packed
        else f"rank {declared[0]} passed packed=True"
    )
    return (
        f"{who} without data, but the batches are packed ({why}): a middle stage without data "
        "gets no cu_seqlens, so its attention would run across documents. For packed data "
        "build the dataset on TP rank 0 of every pipeline stage (Megatron-LM: "
        "is_dataset_built_on_rank must return True on middle stages too, e.g. "
        "is_dataset_built_on_rank(vp_stage, is_packed_sequence=True)) and pass its iterator "
        "there, as on the first and last stages"
    )


def _place(place: Sequence[Any]) -> str:
    """``"pp_rank 1 of 4: data_iterator=None"`` of a `middle_without_data` entry (with virtual
    pipelining ``"pp_rank 0 of 2, virtual chunk 1: data_iterator[1]=None"``)."""
    pp_rank, pp_size, passed, chunk = place
    chunked = "" if chunk is None else f", virtual chunk {chunk}"
    return f"pp_rank {pp_rank} of {pp_size}{chunked}: {passed}"


def _first(errors: list[str], most: int = 3) -> list[str]:
    """At most ``most`` errors, then how many more (thousands of ranks may share one mistake)."""
    if len(errors) <= most:
        return errors
    return [*errors[:most], f"and {len(errors) - most} more"]


def data_parallel_place() -> list[int] | None:
    """[DP rank, DP size] from megatron-core's parallel_state where it is imported and set up."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        return None
    return [ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()]


def schedule_shape(item: Any, *, cp_size: int = 1) -> tuple[int, int, bool] | None:
    """(seq_length, micro_batch_size, packed) a megatron-core schedule needs for ``item``, or None
    where the item does not say (a middle stage's delivered batch has no tokens).

    ``item`` is what a TP source reads (a `megapack.PackedBatch`, a Megatron SFT dict with
    ``cu_seqlens``, a plain pretraining dict) or what `megapack.prefetch` delivers (this CP
    rank's share: the schedule counts the whole row, so x ``cp_size``).

    Example:
        >>> import torch
        >>> schedule_shape({"tokens": torch.zeros(2, 512, dtype=torch.long),
        ...                 "cu_seqlens": torch.tensor([[0, 512], [0, 512]])})
        (1024, 1, True)
        >>> schedule_shape({"tokens": torch.zeros(4, 256, dtype=torch.long)})
        (256, 4, False)
    """
    tokens = getattr(item, "tokens", None)
    if tokens is not None:  # a PackedBatch: [1, T]
        return int(tokens.shape[-1]) * int(tokens.shape[0]), 1, True
    if not isinstance(item, Mapping) or item.get("tokens") is None:
        return None
    rows, width = (int(n) for n in item["tokens"].shape)
    delivered = "packed_seq_params" in item
    packed = item.get("packed_seq_params") is not None if delivered else "cu_seqlens" in item
    share = cp_size if delivered else 1  # a delivered batch holds this CP rank's share
    if packed:
        return rows * width * share, 1, True
    return width * share, rows, False


def schedule_mismatch(
    item: Any, seq_length: int, micro_batch_size: int, *, cp_size: int
) -> str | None:
    """Why ``item`` does not fit a schedule run with ``seq_length`` and ``micro_batch_size``
    (naming the values to pass), or None when it fits or does not say (`schedule_shape`)."""
    shape = schedule_shape(item, cp_size=cp_size)
    if shape is None or shape[:2] == (seq_length, micro_batch_size):
        return None
    want_s, want_b, packed = shape
    kind = (
        f"a packed micro-batch is one [1, {want_s}] row (rows x seq_len tokens)"
        if packed
        else f"a plain micro-batch is {want_b} rows of {want_s} tokens"
    )
    return (
        f"the schedule's seq_length={seq_length}, micro_batch_size={micro_batch_size} do not fit "
        f"it: {kind}; pass seq_length={want_s}, micro_batch_size={want_b} to the schedule "
        f"(get_forward_backward_func()(..., seq_length={want_s}, micro_batch_size={want_b})) "
        "and to lockstep_steps"
    )


def local_problems(
    topo: Topology, iterators: Sequence[Iterator[Any] | None], *, chunked: bool
) -> list[str]:
    """What is wrong on this rank alone (reported on every rank at the first step): a TP source
    of a first, last or only stage (of each model chunk) without its iterator."""
    problems: list[str] = []
    if not topo.is_source:
        return problems
    for index, iterator in enumerate(iterators):
        place = topo
        if chunked:
            if topo.vp_size is None:
                break  # which chunk is which stage is unknown: get_batch will tell
            place = dataclasses.replace(topo, vp_stage=index)
        if iterator is None and place.stage != Stage.MIDDLE:
            where = f"data_iterator[{index}]" if chunked else "data_iterator"
            problems.append(
                f"rank {_rank()} is the TP source of a {place.stage.value!r} pipeline stage but "
                f"passed {where}=None: get_batch_on_this_tp_rank needs its data there"
            )
    return problems


def middle_without_data(
    topo: Topology,
    iterators: Sequence[Iterator[Any] | None],
    sources: Sequence[Iterator[Any] | None],
    *,
    chunked: bool,
) -> list[tuple[int, int, str, int | None]]:
    """The middle stages (model chunks) this rank is the TP source of without data to send:
    ``(pp_rank, pp_size, what was passed, virtual chunk or None)`` each.

    ``iterators`` holds what was passed for each chunk, ``sources`` what the TP source reads
    there: the iterator passed, or the one a `megapack.prefetch`er was built over (None there:
    it delivers the all-None batch).

    Example: tp 1 x pp 4, rank 2 passes None -> ``[(2, 4, "data_iterator=None", None)]``.
    """
    found: list[tuple[int, int, str, int | None]] = []
    if not topo.is_source:
        return found
    for index, (iterator, source) in enumerate(zip(iterators, sources, strict=True)):
        place = topo
        if chunked:
            if topo.vp_size is None:
                break  # which chunk is which stage is unknown
            place = dataclasses.replace(topo, vp_stage=index)
        if source is None and place.stage == Stage.MIDDLE:
            where = f"data_iterator[{index}]" if chunked else "data_iterator"
            what = "None" if iterator is None else "megapack.prefetch(None, ...)"
            found.append(
                (topo.pp_rank, topo.pp_size, f"{where}={what}", index if chunked else None)
            )
    return found


def batch_is_packed(item: Any) -> bool | None:
    """Whether a data-iterator item (or a batch `megapack.prefetch` delivered) is packed: True
    for a `megapack.PackedBatch`, a Megatron SFT dict with ``cu_seqlens`` or a delivered batch
    with ``packed_seq_params``; False for a plain pretraining dict (or a delivered plain or
    all-None batch); None where the item does not say (not a batch megapack knows).

    Example:
        >>> import torch
        >>> batch_is_packed({"tokens": torch.zeros(2, 8, dtype=torch.long)})
        False
        >>> batch_is_packed({"tokens": torch.zeros(1, 8, dtype=torch.long),
        ...                  "cu_seqlens": torch.tensor([[0, 8]])})
        True
        >>> batch_is_packed(3) is None
        True
    """
    if getattr(item, "cu_seqlens", None) is not None:  # a PackedBatch
        return True
    if not isinstance(item, Mapping):
        return None
    if "packed_seq_params" in item:  # delivered by get_batch_on_this_tp_rank (prefetch)
        return item["packed_seq_params"] is not None
    if item.get("cu_seqlens") is not None:
        return True
    return False if "tokens" in item else None


def middle_checked(topo: Topology) -> None:
    """Record that `lockstep_steps`' agreement found this middle stage's data unpacked, so
    `get_batch_on_this_tp_rank` does not warn that its TP source has no iterator."""
    if (key := _group_key(topo)) is not None:
        _middle_checked.add(key)


def warn_middle_without_data(topo: Topology) -> None:
    """Warn, once per TP group, that this middle stage's TP source has no iterator and so sends
    the all-None batch: right for plain pretraining, wrong (attention across documents) when the
    other stages' batches are packed, which cannot be seen from here (`lockstep_steps` can).
    Called by `get_batch_on_this_tp_rank` with ``packed=None``; not after `lockstep_steps`'
    agreement found the data unpacked (`middle_checked`)."""
    key = _group_key(topo)
    if key is not None and (key in _middle_checked or key in _middle_warned):
        return
    if key is not None:
        _middle_warned.add(key)
    chunk = "" if topo.vp_stage is None else f", virtual chunk {topo.vp_stage}"
    log.warning(
        "megapack: get_batch_on_this_tp_rank: data_iterator is None on TP source rank %d of a "
        "middle pipeline stage (pp_rank %d of %d%s), so this stage gets no cu_seqlens. Right "
        "for plain pretraining data; but if the other stages' batches are packed, this stage's "
        "attention runs across documents, and that cannot be seen from here. Packed data: build "
        "the dataset on TP rank 0 of every pipeline stage (Megatron-LM: "
        "is_dataset_built_on_rank(vp_stage, is_packed_sequence=True)) and pass its iterator. "
        "Unpacked data: pass packed=False to say so (this warning goes); megapack.lockstep_steps "
        "checks it across the stages",
        topo.src_rank,
        topo.pp_rank,
        topo.pp_size,
        chunk,
        stacklevel=5,  # the caller of get_batch_on_this_tp_rank
    )


def first_step_agreement(
    *,
    micro_batches: int,
    reads: bool,
    problems: list[str],
    datasets: Sequence[Any],
    group: Any,
    timeout: float | None,
    middle: Sequence[tuple[int, int, str, int | None]] = (),
    packed: bool | None = None,
    packed_option: bool | None = None,
) -> bool:
    """`lockstep_steps`' first-step checks: one all-gather of every rank's settings on ``group``,
    then the same ValueError (naming both ranks and values) or warnings on every rank.

    Args:
        micro_batches, reads, problems, datasets: this rank's (see `agreement_errors`).
        group, timeout: the gather's.
        middle: the middle stages this rank is the TP source of without data
            (`middle_without_data`).
        packed: whether what this rank read for step 0 is packed (`batch_is_packed`; None:
            nothing read, or items that do not say).
        packed_option: the ``packed=`` this rank passed.

    Returns:
        Whether the data is known to be unpacked (some rank read or declared unpacked batches,
        none packed), so that a middle stage without data is right.
    """
    settings, problems = [], list(problems)
    for ds in datasets:
        try:  # a failure here must reach every rank, not leave them in the gather
            settings.append(ds.settings())
        except Exception as exc:
            problems.append(f"rank {_rank()}: dataset.settings() failed: {exc!r}")
    mine = {
        "micro_batches": micro_batches,
        "reads": reads,
        "problems": problems,
        "datasets": settings,
        "dp": data_parallel_place(),
        "middle": [list(place) for place in middle],
        "packed": packed,
        "packed_option": packed_option,
    }
    everyone = sync.gather_settings(
        mine, group=group, timeout=timeout, what="lockstep_steps agreement"
    )
    errors, cautions = agreement_errors(everyone)
    if errors:
        raise ValueError("lockstep_steps: " + "; ".join(errors))
    for ranks, text in cautions:
        if _rank() in ranks:
            log.warning("megapack: lockstep_steps: %s", text, stacklevel=4)
    said = [s.get("packed") for _, s in everyone] + [s.get("packed_option") for _, s in everyone]
    return True not in said and False in said


def _group_key(topo: Topology) -> Any:
    """What "once per TP group" keys on: the TP group, or the default group where tp = 1."""
    if topo.tp_group is not None:
        return topo.tp_group
    return dist.group.WORLD if dist.is_initialized() else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
