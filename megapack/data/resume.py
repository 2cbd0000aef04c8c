"""`DatasetIterator`: one DP rank's micro-batches of a `PackedDataset`, resumable exactly.

Its own state counts what was read from it. When something reads ahead of the trainer, save
that reader's state, which counts what the trainer took: `megapack.lockstep_steps`' (it reads a
whole step ahead; its ``state_dict()`` is the position of the first micro-batch the schedule has
not taken), else `megapack.prefetch`'s (it reports this iterator's position after the last batch
``next()`` returned). `DatasetIterator.load_state_dict` takes any of the three (`position_of`).
See the class docstring for what a resume on another DP size guarantees.

Two ways to a state, both exact:

* ``DatasetIterator.state_dict()``, saved beside the trainer's checkpoint: it records the
  dataset's identity (`identity`: its fingerprint, rows, seed, dealing), the position and the
  plan of the epoch in progress, so it resumes on any DP size with the global batch kept;
* `state_after` (``PackedDataset.state_for``) from what Megatron-LM counts
  (``consumed_train_samples`` at a stated ``micro_batch_size``, or ``iteration``); with
  ``balance="compute"`` the epoch's plan is an argument, as counters do not record it.

`check_state` refuses a malformed state whole, on load: a missing key, a wrong type, a negative
value or an index past its epoch, naming the key and the value. With ``balance="compute"`` the
epoch's order depends on the `CostModel`, which the identity records: another one is refused,
naming both.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from megapack.core.checks import check_int

if TYPE_CHECKING:
    from megapack.core.batch import PackedBatch
    from megapack.packing.options import LoadOptions, PackOptions

log = logging.getLogger(__name__)  # library code logs; the CLI prints


class PlannedDataset(Protocol):
    """What resuming needs of a dataset (`megapack.data.PackedDataset` is one): its rows
    (``meta``), its options (the seed of its `PackOptions`, the dealing of its `LoadOptions`),
    its epoch and the (dp_size, micro_batches) the epoch's order is planned for."""

    meta: dict[str, Any]
    packing: PackOptions
    loading: LoadOptions
    epoch: int
    padded_micro_batches: int

    @property
    def plan(self) -> tuple[int, int]: ...

    def set_epoch(self, epoch: int, *, plan: tuple[int, int] | None = None) -> None: ...

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> PackedBatch: ...


STATE_VERSION = 3
"""Version of `DatasetIterator.state_dict` (3: with the cost model; 2: with the dataset's
fingerprint; both earlier versions are read too)."""
LOCKSTEP_KIND = "megapack.lockstep_steps"
"""``"kind"`` of a `megapack.lockstep_steps` state (`megapack.delivery.steps.STATE_KIND`)."""


class DatasetIterator:
    """One rank's micro-batches of a `PackedDataset` in order, resumable from a checkpoint.

    ``state_dict()`` says where the next micro-batch is: the epoch, this rank's next index, the
    DP size and the (dp_size, micro_batches) this epoch's order was planned for. A new
    iterator over the same dataset resumes exactly there with ``load_state_dict``: the next
    micro-batches are bit for bit those the interrupted run would have had. Behind `megapack.prefetch`,
    checkpoint the prefetcher's ``state_dict()``, which counts the batches *used*, not the ones
    fetched ahead; under `megapack.lockstep_steps` (over either), the lockstep's, which counts the
    micro-batches the schedule took, not the step read ahead. ``load_state_dict`` takes all three.

    A different DP size on resume, with the global batch kept (``dp_size x micro_batches`` the
    same; Megatron keeps it when fewer nodes take over): the checkpoint must be at a step
    boundary. Then every global step holds the same micro-batches, in the same global positions
    (global micro-batch ``j`` of the epoch goes to DP rank ``j % dp_size``), so the same documents
    in the same order within the step; which rank trains which micro-batch changes. The rest of
    the epoch keeps the checkpoint's plan (with ``balance="compute"`` it is balanced for the old
    DP size); the next epoch is planned for the new one.

    Args:
        dataset: the dataset; its epoch is driven by the iterator (``set_epoch`` at each new one).
        repeat: go on epoch after epoch (Megatron trains for a number of steps); else stop at the
            end of the dataset's current epoch.
    """

    def __init__(self, dataset: PlannedDataset, *, repeat: bool = False) -> None:
        self.dataset = dataset
        self.repeat = repeat
        self.index = 0
        """This rank's next micro-batch within the epoch."""

    def __iter__(self) -> DatasetIterator:
        return self

    def __next__(self) -> PackedBatch:
        ds = self.dataset
        if self.index >= len(ds):
            if not self.repeat:
                raise StopIteration
            ds.set_epoch(ds.epoch + 1)
            self.index = 0
        batch = ds[self.index]
        self.index += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Where the next micro-batch is (plain ints: JSON- and torch.save-friendly)."""
        ds = self.dataset
        return {
            **identity(ds),
            "epoch": ds.epoch,
            "index": self.index,
            "dp_size": ds.loading.dp_size,
            "micro_batches": ds.loading.micro_batches,
            "plan": list(ds.plan),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``, checked whole before anything changes: `state_dict`'s (from any
        DP rank of the checkpointed run), `PackedDataset.state_for`'s, a `megapack.prefetch`er's
        or a `megapack.lockstep_steps`' ``state_dict()`` (their data position: `position_of`).

        Raises:
            TypeError: ``state`` is not a dict, or a key holds a value of the wrong type, naming
                the key and the value.
            ValueError: a missing key or a value out of range (a negative index, an index past
                the end of its epoch, a plan of another global batch), naming the key and the
                value; a state of another dataset (contents, rows, seed, rows per micro-batch,
                balance, cost model, version), another global batch, or a change of DP size away
                from a step boundary, naming the setting and both values; a prefetcher's or
                lockstep's state without one position to load, saying which to load.
        """
        ds = self.dataset
        checked = check_state(position_of(state))
        if "fingerprint" not in checked:
            log.warning(
                "megapack: resuming from a state of an earlier megapack (version %s), which "
                "records no dataset fingerprint: only the rows, seed and layout are checked",
                checked["version"],
            )
        mine_all = identity(ds)
        for key, mine in mine_all.items():
            if key not in ("version", "cost") and key in checked and checked[key] != mine:
                raise ValueError(
                    f"cannot resume: the checkpoint's dataset has {key}={checked[key]!r}, this "
                    f"one has {key}={mine!r}"
                )
        if "cost" not in checked and ds.loading.balance == "compute":
            raise ValueError(
                f"cannot resume: the state (version {checked['version']}, written by an earlier "
                "megapack) records no cost model, and with balance='compute' the epoch's order "
                "depends on it; if the checkpoint's run used this one, add "
                f"state['cost'] = {mine_all['cost']!r} and load it again"
            )
        costs = (checked.get("cost"), mine_all["cost"])
        if "cost" in checked and (costs[0] is None) != (costs[1] is None):
            raise ValueError(
                f"cannot resume: the checkpoint's dataset has cost={checked['cost']!r}, this one "
                f"has cost={mine_all['cost']!r} (a cost model is recorded with balance='compute' "
                "only)"
            )
        if "cost" in checked and checked["cost"] != mine_all["cost"]:
            raise ValueError(
                f"cannot resume: the checkpoint's epoch was ordered with "
                f"{_cost_text(checked['cost'])}, this run's is {_cost_text(mine_all['cost'])}: "
                "with balance='compute' the epoch's order depends on the cost model, so rows "
                "would be trained twice or never; load the dataset with the checkpoint's "
                f"(LoadOptions(balance='compute', cost={_cost_text(checked['cost'])}))"
            )
        old_dp, old_m = checked["dp_size"], checked["micro_batches"]
        step = ds.loading.dp_size * ds.loading.micro_batches
        if old_dp * old_m != step:
            raise ValueError(
                f"cannot resume: the checkpoint's global batch is dp_size {old_dp} x micro_batches "
                f"{old_m} = {old_dp * old_m} micro-batches, this run's {ds.loading.dp_size} x "
                f"{ds.loading.micro_batches} = {step}; keep the global batch"
            )
        plan = checked["plan"]
        if plan[0] * plan[1] != step:
            raise ValueError(
                f"state['plan']={list(plan)} is a global batch of {plan[0] * plan[1]} "
                f"micro-batches, but the state's dp_size {old_dp} x micro_batches {old_m} is "
                f"{step}: the epoch's plan must keep the global batch"
            )
        index = checked["index"]
        per_rank = ds.padded_micro_batches // old_dp  # the checkpoint's epoch, on its DP size
        if index > per_rank:
            raise ValueError(
                f"state['index']={index} is past the end of its epoch: each of the checkpoint's "
                f"{old_dp} DP ranks has {per_rank} micro-batches an epoch"
            )
        if (old_dp, old_m) != (ds.loading.dp_size, ds.loading.micro_batches):
            if index % old_m:
                raise ValueError(
                    f"cannot resume on dp_size {ds.loading.dp_size}: the checkpoint (dp_size {old_dp}) was "
                    f"taken after {index % old_m} of a step's {old_m} micro-batches; change the DP "
                    "size only at a step boundary"
                )
            index = index // old_m * ds.loading.micro_batches
        ds.set_epoch(checked["epoch"], plan=plan)  # the epoch's order as planned
        self.index = index


def identity(ds: PlannedDataset) -> dict[str, Any]:
    """What a checkpoint's dataset must share with ``ds`` to resume it, as plain values (also
    what ranks compare to check they read one dataset): the state's version, the contents'
    fingerprint (`megapack.data.fingerprint`), the rows, the seed (`PackOptions`) and the dealing
    (`LoadOptions`: rows per micro-batch, balance and, with ``balance="compute"``, the cost
    model's ``{"a": ..., "b": ...}``, which orders the epoch; None with token balance)."""
    cost = ds.loading.cost if ds.loading.balance == "compute" else None
    return {
        "version": STATE_VERSION,
        "fingerprint": ds.meta.get("fingerprint"),
        "rows": int(ds.meta["rows"]),
        "seed": ds.packing.seed,
        "rows_per_micro_batch": ds.loading.rows_per_micro_batch,
        "balance": ds.loading.balance,
        "cost": None if cost is None else {"a": cost.a, "b": cost.b},
    }


def position_of(state: Any) -> Any:
    """The `DatasetIterator` state inside ``state``: a `megapack.lockstep_steps` state's
    position (every model chunk's, when they agree), a `megapack.prefetch` state's
    ``["iterator"]``, else ``state`` itself.

    Raises:
        ValueError: a prefetcher's or lockstep's state that holds no position (taken on a rank
            that reads no data) or, with virtual pipelining, different positions per model chunk,
            saying what to load instead.

    Example: ``{"used": 4, "iterator": {..., "index": 4}}`` -> ``{..., "index": 4}``.
    """
    if isinstance(state, Mapping) and state.get("kind") == LOCKSTEP_KIND:
        positions = state.get("iterators")
        if not isinstance(positions, list):
            raise TypeError(
                f"state['iterators'] of a lockstep_steps state must be a list (one data position "
                f"per model chunk), got {_short(positions)}: save StepLockstep.state_dict() whole"
            )
        held = [p for p in positions if p is not None]
        if not held:
            raise ValueError(
                "this lockstep_steps state holds no data position (state['iterators'] is "
                f"{_short(positions)}): it was saved on a rank that reads no data (a TP peer, or "
                "a middle stage without data); save global rank 0's (the first stage's TP source)"
            )
        if any(p != held[0] for p in held[1:]):
            raise ValueError(
                "this lockstep_steps state's model chunks are at different positions "
                "(it was saved inside the schedule): load state['iterators'][k] into model chunk "
                "k's iterator, or save it between steps, where every chunk is at one position"
            )
        state = held[0]
    if isinstance(state, Mapping) and {"used", "iterator"} <= set(state):
        if state["iterator"] is None:
            raise ValueError(
                "this megapack.prefetch state holds no data position (state['iterator'] is "
                "None): it was taken on a TP rank other than the source, or over an iterator "
                "without state_dict(); save the TP source's"
            )
        state = state["iterator"]
    return state


def _cost_text(cost: Any) -> str:
    """``"CostModel(a=1.0, b=0.0)"`` of an identity's ``cost``."""
    return f"CostModel(a={cost['a']!r}, b={cost['b']!r})"


KEYS: dict[str, int | None] = {
    "version": 1,
    "rows": 1,
    "seed": None,
    "rows_per_micro_batch": 1,
    "epoch": 0,
    "index": 0,
    "dp_size": 1,
    "micro_batches": 1,
}
"""The integer keys of a `DatasetIterator` state and their least value (None: any int)."""
STATE_KEYS = (*KEYS, "balance", "fingerprint", "plan", "cost")
"""Every key of a state (version 1, before fingerprints, lacks "fingerprint"; versions 1 and 2,
before cost models, lack "cost")."""


def check_state(state: Any) -> dict[str, Any]:
    """A `DatasetIterator` state's values, each checked; see `DatasetIterator.load_state_dict`.

    Returns:
        The keys of `STATE_KEYS` the state's version has, as plain values (``plan`` a tuple).
    """
    if not isinstance(state, Mapping):
        raise TypeError(
            f"a DatasetIterator state is a dict (DatasetIterator.state_dict()), got "
            f"{type(state).__name__} {_short(state)}"
        )
    if {"used", "iterator"} <= set(state) or state.get("kind") == LOCKSTEP_KIND:
        raise ValueError(
            "this is a megapack.prefetch or lockstep_steps state_dict, not a DatasetIterator's: "
            "pass it to DatasetIterator.load_state_dict, which takes its position "
            "(megapack.data.resume.position_of)"
        )
    if "version" not in state:
        raise ValueError(f"the state has no 'version' (keys {sorted(map(str, state))})")
    version = check_int("state['version']", state["version"], minimum=1)
    if version > STATE_VERSION:
        raise ValueError(
            f"state['version']={version}: written by a later megapack; this one reads versions "
            f"1 to {STATE_VERSION}"
        )
    wanted = [
        k
        for k in STATE_KEYS
        if (version > 1 or k != "fingerprint") and (version > 2 or k != "cost")
    ]
    missing = [k for k in wanted if k not in state]
    if missing:
        raise ValueError(
            f"the state has no {', '.join(map(repr, missing))} (keys {sorted(map(str, state))}): "
            "save DatasetIterator.state_dict() whole"
        )
    out: dict[str, Any] = {
        key: check_int(f"state[{key!r}]", state[key], minimum=least) for key, least in KEYS.items()
    }
    for key in ("balance", "fingerprint") if version > 1 else ("balance",):
        if not isinstance(state[key], str):
            raise TypeError(
                f"state[{key!r}] must be a str, got {type(state[key]).__name__} {_short(state[key])}"
            )
        out[key] = state[key]
    plan = state["plan"]
    if not isinstance(plan, list | tuple):
        raise TypeError(
            f"state['plan'] must be a list [dp_size, micro_batches], got {type(plan).__name__} "
            f"{_short(plan)}"
        )
    if len(plan) != 2:
        raise ValueError(f"state['plan'] must be [dp_size, micro_batches], got {_short(plan)}")
    out["plan"] = tuple(check_int(f"state['plan'][{i}]", v, minimum=1) for i, v in enumerate(plan))
    if version > 2 or "cost" in state:  # an earlier state's, added by hand (load_state_dict)
        out["cost"] = _check_cost(state["cost"])
    return out


def _check_cost(cost: Any) -> dict[str, float] | None:
    """A state's ``cost``: None, or ``{"a": number, "b": number}`` (a `CostModel`'s)."""
    if cost is None:
        return None
    if not isinstance(cost, Mapping) or set(cost) != {"a", "b"}:
        raise TypeError(
            f"state['cost'] must be None or a CostModel's {{'a': ..., 'b': ...}}, got {_short(cost)}"
        )
    for key in ("a", "b"):
        value = cost[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(
                f"state['cost'][{key!r}] must be a number, got {type(value).__name__} {_short(value)}"
            )
    return {"a": float(cost["a"]), "b": float(cost["b"])}


def state_after(
    ds: PlannedDataset,
    *,
    consumed_samples: int | None = None,
    micro_batch_size: int | None = None,
    iterations: int | None = None,
    global_batch_size: int | None = None,
    plan: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """`PackedDataset.state_for`: the iterator state after Megatron-LM's counters.

    Megatron-LM adds ``dp_size x micro_batch_size x micro_batches`` to ``consumed_train_samples``
    and 1 to ``iteration`` each step, and calls ``forward_step`` (one micro-batch of ``ds``)
    ``micro_batches`` times on each DP rank. So ``consumed_samples / micro_batch_size`` (or
    ``iterations x dp_size x micro_batches``) micro-batches of ``ds`` were used, over every DP
    rank and epoch, filler micro-batches included. Worked example, ``rows_per_micro_batch=2``,
    dp_size 1, micro_batches 2, after one step: Megatron's ``--micro-batch-size 1`` (THD)
    counts 2 samples, ``--micro-batch-size 2`` counts 4: both are 2 micro-batches, the next
    one is micro-batch 2 of the epoch.

    Raises:
        TypeError: no counter, ``consumed_samples`` without ``micro_batch_size``, or
            ``balance="compute"`` without ``plan`` (each naming what to pass and why); a
            counter that is not an int.
        ValueError: a negative counter, counts of no whole step, counters that disagree with
            each other or with this run's dp_size x micro_batches, or a plan of another global
            batch, naming the values.
    """
    step = ds.loading.dp_size * ds.loading.micro_batches  # micro-batches a step, over every DP rank
    used = _micro_batches_used(ds, consumed_samples, micro_batch_size, iterations, step)
    if global_batch_size is not None:
        if micro_batch_size is None:
            raise TypeError(
                "global_batch_size= is checked against micro_batch_size x dp_size x "
                "micro_batches: pass micro_batch_size= (args.micro_batch_size) too"
            )
        check_int("global_batch_size", global_batch_size, minimum=1)
        if global_batch_size != micro_batch_size * step:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not micro_batch_size "
                f"{micro_batch_size} x dp_size {ds.loading.dp_size} x micro_batches {ds.loading.micro_batches} "
                f"= {micro_batch_size * step}: this dataset's dp_size and micro_batches must be "
                "the run's (micro_batches = global batch / (micro-batch size x dp_size))"
            )
    epoch, done = divmod(used, ds.padded_micro_batches)
    planned = _plan(ds, plan, step)
    return {
        **identity(ds),
        "epoch": epoch,
        "index": done // ds.loading.dp_size,
        "dp_size": ds.loading.dp_size,
        "micro_batches": ds.loading.micro_batches,
        # an epoch not yet begun is planned by the run that begins it: this one
        "plan": list(planned if done else (ds.loading.dp_size, ds.loading.micro_batches)),
    }


def _micro_batches_used(
    ds: PlannedDataset,
    consumed_samples: int | None,
    micro_batch_size: int | None,
    iterations: int | None,
    step: int,
) -> int:
    """Micro-batches of ``ds`` used over every DP rank, from either counter (both must agree)."""
    if consumed_samples is None and iterations is None:
        raise TypeError(
            "state_for needs Megatron-LM's counters: consumed_samples=args.consumed_train_samples "
            "with micro_batch_size=args.micro_batch_size, or iterations=args.iteration"
        )
    used = None
    if consumed_samples is not None:
        check_int("consumed_samples", consumed_samples, minimum=0)
        if micro_batch_size is None:
            raise TypeError(
                f"state_for(consumed_samples={consumed_samples}) needs micro_batch_size=, "
                "Megatron's --micro-batch-size (args.micro_batch_size): it counts that many "
                "samples per forward_step, each of which gets one micro-batch of "
                f"rows_per_micro_batch={ds.loading.rows_per_micro_batch} rows (THD: --micro-batch-size "
                "1, a sample is a packed micro-batch)"
            )
        check_int("micro_batch_size", micro_batch_size, minimum=1)
        if consumed_samples % (micro_batch_size * step):
            raise ValueError(
                f"consumed_samples={consumed_samples} is not a whole number of steps of "
                f"micro_batch_size {micro_batch_size} x dp_size {ds.loading.dp_size} x micro_batches "
                f"{ds.loading.micro_batches} = {micro_batch_size * step} samples: check "
                "micro_batch_size, and that dp_size and micro_batches are the run's"
            )
        used = consumed_samples // micro_batch_size
    if iterations is not None:
        check_int("iterations", iterations, minimum=0)
        if used is not None and used != iterations * step:
            raise ValueError(
                f"consumed_samples={consumed_samples} at micro_batch_size {micro_batch_size} is "
                f"{used} micro-batches, but iterations={iterations} x dp_size {ds.loading.dp_size} x "
                f"micro_batches {ds.loading.micro_batches} is {iterations * step}: the counters disagree"
            )
        used = iterations * step
    assert used is not None
    return used


def _plan(ds: PlannedDataset, plan: Any, step: int) -> tuple[int, int]:
    """The (dp_size, micro_batches) of the checkpoint's epoch: ``plan``, required by "compute"."""
    if plan is None:
        if ds.loading.balance == "compute":
            raise TypeError(
                "state_for with balance='compute' needs plan=(dp_size, micro_batches) of the "
                "run that began the checkpoint's epoch: its order is balanced for that DP size "
                f"and counters do not record it (this run's is ({ds.loading.dp_size}, "
                f"{ds.loading.micro_batches}), if the DP size did not change). Or resume from "
                "DatasetIterator.state_dict(), which records it"
            )
        return (ds.loading.dp_size, ds.loading.micro_batches)
    if not isinstance(plan, list | tuple) or len(plan) != 2:
        raise TypeError(f"plan must be a pair (dp_size, micro_batches), got {_short(plan)}")
    dp, m = (check_int(f"plan[{i}]", v, minimum=1) for i, v in enumerate(plan))
    if dp * m != step:
        raise ValueError(
            f"plan=({dp}, {m}) is a global batch of {dp * m} micro-batches, this run's "
            f"({ds.loading.dp_size}, {ds.loading.micro_batches}) of {step}: the counters cannot map a changed "
            "global batch"
        )
    return (dp, m)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
