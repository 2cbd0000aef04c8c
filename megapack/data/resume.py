"""`DatasetIterator`: one DP rank's micro-batches of a `PackedDataset`, resumable exactly.

Its state counts what the trainer used: checkpoint `megapack.prefetch`'s ``state_dict()`` when
batches are fetched ahead (it reports this iterator's position after the last batch used). See the
class docstring for what a resume on another DP size guarantees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from megapack.core.checks import check_int

if TYPE_CHECKING:
    from megapack.core.batch import PackedBatch


class PlannedDataset(Protocol):
    """What resuming needs of a dataset (`megapack.data.PackedDataset` is one): its rows and
    seed (``meta``), its DP layout, its epoch and the (dp_size, micro_batches) the epoch's order
    is planned for."""

    meta: dict[str, Any]
    rows_per_micro_batch: int
    dp_size: int
    micro_batches: int
    balance: str
    epoch: int
    padded_micro_batches: int

    @property
    def plan(self) -> tuple[int, int]: ...

    def set_epoch(self, epoch: int, *, plan: tuple[int, int] | None = None) -> None: ...

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> PackedBatch: ...


STATE_VERSION = 1
"""Version of `DatasetIterator.state_dict`."""


class DatasetIterator:
    """One rank's micro-batches of a `PackedDataset` in order, resumable from a checkpoint.

    ``state_dict()`` says where the next micro-batch is: the epoch, this rank's next index, the
    DP layout and the (dp_size, micro_batches) this epoch's order was planned for. A new
    iterator over the same dataset resumes exactly there with ``load_state_dict``: the next
    micro-batches are bit for bit those the interrupted run would have had. Behind `megapack.prefetch`,
    checkpoint the prefetcher's ``state_dict()``, which counts the batches *used*, not the ones
    fetched ahead.

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
            "dp_size": ds.dp_size,
            "micro_batches": ds.micro_batches,
            "plan": list(ds.plan),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (`state_dict`'s, from any DP rank of the checkpointed run).

        Raises:
            ValueError: a state of another dataset (rows, seed, rows per micro-batch, balance,
                version), another global batch, or a change of DP size away from a step boundary,
                naming the setting and both values.
        """
        ds = self.dataset
        for key, mine in identity(ds).items():
            if state.get(key) != mine:
                raise ValueError(
                    f"cannot resume: the checkpoint's dataset has {key}={state.get(key)!r}, this "
                    f"one has {key}={mine!r}"
                )
        old_dp, old_m = int(state["dp_size"]), int(state["micro_batches"])
        if old_dp * old_m != ds.dp_size * ds.micro_batches:
            raise ValueError(
                f"cannot resume: the checkpoint's global batch is dp_size {old_dp} x micro_batches "
                f"{old_m} = {old_dp * old_m} micro-batches, this run's {ds.dp_size} x "
                f"{ds.micro_batches} = {ds.dp_size * ds.micro_batches}; keep the global batch"
            )
        index = int(state["index"])
        if (old_dp, old_m) != (ds.dp_size, ds.micro_batches):
            if index % old_m:
                raise ValueError(
                    f"cannot resume on dp_size {ds.dp_size}: the checkpoint (dp_size {old_dp}) was "
                    f"taken after {index % old_m} of a step's {old_m} micro-batches; change the DP "
                    "size only at a step boundary"
                )
            index = index // old_m * ds.micro_batches
        plan = (int(state["plan"][0]), int(state["plan"][1]))  # the epoch's order as planned
        ds.set_epoch(int(state["epoch"]), plan=plan)
        self.index = index


def identity(ds: PlannedDataset) -> dict[str, Any]:
    """What a checkpoint's dataset must share with ``ds`` to resume it."""
    return {
        "version": STATE_VERSION,
        "rows": int(ds.meta["rows"]),
        "seed": int(ds.meta["seed"]),
        "rows_per_micro_batch": ds.rows_per_micro_batch,
        "balance": ds.balance,
    }


def state_after(ds: PlannedDataset, consumed_samples: int) -> dict[str, Any]:
    """`PackedDataset.state_for`: the iterator state after ``consumed_samples`` rows."""
    check_int("consumed_samples", consumed_samples, minimum=0)
    rows = ds.rows_per_micro_batch
    if consumed_samples % (rows * ds.dp_size * ds.micro_batches):
        raise ValueError(
            f"consumed_samples={consumed_samples} is not a whole number of global batches of "
            f"{rows * ds.dp_size * ds.micro_batches} rows (dp_size {ds.dp_size} x "
            f"micro_batches {ds.micro_batches} x rows_per_micro_batch {rows})"
        )
    epoch, done = divmod(consumed_samples // rows, ds.padded_micro_batches)
    return {
        **identity(ds),
        "epoch": epoch,
        "index": done // ds.dp_size,
        "dp_size": ds.dp_size,
        "micro_batches": ds.micro_batches,
        "plan": [ds.dp_size, ds.micro_batches],
    }
