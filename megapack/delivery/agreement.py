"""The first step's agreement of `megapack.lockstep_steps`: what ranks reading data must share.

Every rank sends its settings once (`megapack.distributed.sync.gather_settings`): the schedule's
``micro_batches``, whether it reads data, problems it found alone (a TP source of an end stage
without an iterator), each dataset it reads (``PackedDataset.settings()``) and its DP place from
megatron-core's ``parallel_state`` where that is set up. `agreement_errors` turns every rank's
settings into the same errors and warnings on every rank, each naming both ranks and both values:

* the ranks state the same ``micro_batches``, and some rank reads data;
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
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from megapack.core.fields import Stage
from megapack.distributed import sync
from megapack.distributed.topology import Topology

__all__ = ["PER_RANK_KEYS", "STEP_KEYS", "agreement_errors", "data_parallel_place"]

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
            ``problems`` (messages), ``datasets`` (each dataset's ``settings()``) and ``dp``
            ([DP rank, DP size] from megatron-core's parallel_state, or None).

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


def first_step_agreement(
    *,
    micro_batches: int,
    reads: bool,
    problems: list[str],
    datasets: Sequence[Any],
    group: Any,
    timeout: float | None,
) -> None:
    """`lockstep_steps`' first-step checks: one all-gather of every rank's settings on ``group``,
    then the same ValueError (naming both ranks and values) or warnings on every rank."""
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
    }
    everyone = sync.gather_settings(
        mine, group=group, timeout=timeout, what="lockstep_steps agreement"
    )
    errors, cautions = agreement_errors(everyone)
    if errors:
        raise ValueError("lockstep_steps: " + "; ".join(errors))
    for ranks, text in cautions:
        if _rank() in ranks:
            warnings.warn(f"lockstep_steps: {text}", stacklevel=4)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
