"""`align_by_kind`: deal micro-batches to ranks so that at every micro-step all ranks hold the same kind.

If rank 0 gets an image micro-batch while rank 1 gets text, only rank 0 enters the vision encoder's
FSDP all-gather and the job hangs (prime-rl PR #1918). Dealing each kind in whole rounds of
``num_ranks`` micro-batches, padded per kind with zero-loss micro-batches, removes the mismatch.

``kind`` may name a ragged field instead of computing the kind: ``kind="pixel_values"`` makes
"this micro-batch has a non-empty pixel_values" the kind (a `PackedBatch`'s extras or a dict's
key: a tensor with rows, or a list holding any), so every rank enters the vision encoder at the
same micro-step; `zero_loss` makes the padding micro-batches (loss_mask all 0, inputs kept).

Example, 2 ranks, kinds ``[t0, t1, i0, t2]`` (t = text, i = image), padding ``P(i)``:
    text rounds: (t0, t1), (t2, P(t)); image round: (i0, P(i))
    rounds ordered by their first original item: (t0, t1), (i0, P(i)), (t2, P(t))
    rank 0: [t0, i0, t2]    rank 1: [t1, P(i), P(t)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from megapack.core.checks import check_int

T = TypeVar("T")


def align_by_kind(
    micro_batches: Sequence[T],
    num_ranks: int,
    *,
    kind: Callable[[T], Hashable] | str,
    make_padding: Callable[[T], T],
) -> list[list[T]]:
    """Per-rank lists of micro-batches with the same kind at every micro-step.

    Args:
        micro_batches: all micro-batches of the step, in order.
        num_ranks: ranks to deal to.
        kind: the kind of a micro-batch (e.g. ``lambda mb: "image" if "pixel_values" in mb else "text"``),
            or the name of a ragged field: then the kind is whether the micro-batch holds rows
            of it (`has_rows`).
        make_padding: builds a padding micro-batch of the same kind from an example of it; it must
            carry zero loss weight (e.g. ``loss_mask`` all 0) and keep the kind's inputs (e.g.
            ``pixel_values``) so the same modules run.

    Returns:
        ``num_ranks`` lists of equal length. Each original micro-batch appears exactly once; each
        kind gets fewer than ``num_ranks`` padding micro-batches; a single-kind input keeps its
        order (read round by round, rank by rank).
    """
    check_int("num_ranks", num_ranks, minimum=1)
    if isinstance(kind, str):
        name = kind
        kind = lambda mb: has_rows(mb, name)  # noqa: E731
    by_kind: dict[Hashable, list[tuple[int, T]]] = {}
    for index, mb in enumerate(micro_batches):
        by_kind.setdefault(kind(mb), []).append((index, mb))
    rounds: list[tuple[int, list[T]]] = []
    for members in by_kind.values():
        items = [mb for _, mb in members]
        items += [make_padding(items[0]) for _ in range(-len(items) % num_ranks)]
        for start in range(0, len(items), num_ranks):
            first = members[start][0]
            rounds.append((first, items[start : start + num_ranks]))
    rounds.sort(key=lambda r: r[0])
    return [[chunk[rank] for _, chunk in rounds] for rank in range(num_ranks)]


def has_rows(micro_batch: Any, name: str) -> bool:
    """Whether ``micro_batch`` (a PackedBatch or a dict) holds rows of ragged field ``name``.

    Example: ``has_rows({"pixel_values": [torch.empty(0, 4), torch.ones(2, 4)]}, "pixel_values")``
    is True; with two empty images, or no such key, False.
    """
    values = micro_batch.extras if hasattr(micro_batch, "extras") else micro_batch
    if not isinstance(values, Mapping):
        raise TypeError(
            f"a micro-batch is a PackedBatch or a dict, got {type(micro_batch).__name__}"
        )
    value = values.get(name)
    if isinstance(value, torch.Tensor):
        return value.dim() > 0 and value.shape[0] > 0
    if isinstance(value, list | tuple):
        return any(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] > 0 for v in value)
    return False


def zero_loss(micro_batch: T) -> T:
    """A copy of ``micro_batch`` (a PackedBatch or a dict with ``loss_mask``) that trains nothing:
    ``loss_mask`` all 0, every input kept, so the same modules run (`align_by_kind` padding)."""
    batch: Any = micro_batch
    if dataclasses.is_dataclass(batch) and hasattr(batch, "loss_mask"):
        out: Any = dataclasses.replace(batch, loss_mask=torch.zeros_like(batch.loss_mask))  # type: ignore[type-var]
        return out
    if isinstance(batch, Mapping) and "loss_mask" in batch:
        copy: Any = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}
        return copy
    raise TypeError(
        f"zero_loss needs a PackedBatch or a dict with loss_mask, got {type(micro_batch).__name__}"
    )
