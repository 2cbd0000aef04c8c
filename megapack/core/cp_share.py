"""Context parallelism (CP): which positions of a packed row each CP rank keeps, in plain torch.

With CP, every rank of a CP group holds 1/cp of a micro-batch's tokens. Causal attention makes
late tokens costlier than early ones, so each split is *zigzag*: a span is cut into ``2 * cp``
equal chunks and CP rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r`` (one cheap, one costly).

Two layouts (``CP_LAYOUTS``) decide what a "span" is:

    "document"  each buffer segment of the row (``cu_seqlens_padded`` when given, else
                ``cu_seqlens``) is a span; every span must be a multiple of 2 * cp. These are
                the indices of Transformer Engine's ``thd_get_partitioned_indices`` and what its
                fused THD CP attention expects (Megatron-LM's per-document balancing).
    "row"       the whole row [0, T) is one span; only T must be a multiple of 2 * cp
                (Megatron-LM's per-sequence balancing, also its plain [b, s] pretraining split).

Legend: T positions in the row, n documents, cp ranks; a rank keeps T / cp positions.

Worked example, spans ``cu = [0, 8, 16]`` (two documents of 8 tokens), cp = 2 (chunks of 2 per
document, of 4 for the row):

    document  rank 0 -> [0, 1, 6, 7, 8, 9, 14, 15]     rank 1 -> [2, 3, 4, 5, 10, 11, 12, 13]
    row       rank 0 -> [0, 1, 2, 3, 12, 13, 14, 15]   rank 1 -> [4, 5, 6, 7, 8, 9, 10, 11]

The boundaries (``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen``) stay those of the whole row on
every CP rank; only per-token fields are sliced. Given ``total=T``, `cp_indices` runs on the
boundaries' device without a host sync, so attention can rebuild the global positions of its local
queries from the boundaries alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from megapack.core.checks import check_int
from megapack.core.cp_pad import cp_pad_multiple as cp_pad_multiple  # torch-free home, re-exported
from megapack.core.fields import BatchField

CpLayout = Literal["document", "row"]
CP_LAYOUTS: tuple[CpLayout, ...] = ("document", "row")
"""The CP layouts, in the order the docs list them; "document" is the default everywhere."""


def cp_indices(
    cu_buffer: torch.Tensor | Sequence[int],
    cp_size: int,
    cp_rank: int,
    *,
    layout: CpLayout = "document",
    total: int | None = None,
) -> torch.Tensor:
    """Row positions that CP rank ``cp_rank`` keeps, in its local order (int64, 1-D, T / cp long).

    Args:
        cu_buffer: the row's buffer boundaries, ``[0, ..., T]`` (``cu_seqlens_padded`` when the batch
            has it, else ``cu_seqlens``). Only its last entry matters for ``layout="row"``.
        cp_size: number of CP ranks (1 gives ``arange(T)``).
        cp_rank: this rank's index in the CP group.
        layout: "document" (zigzag within every span) or "row" (zigzag over the whole row).
        total: T, when the caller knows it (e.g. cp x its local query count): then no entry of a
            GPU ``cu_buffer`` is read on the host, so the call never synchronizes the device.

    Returns:
        int64 positions on ``cu_buffer``'s device (CPU for a sequence).

    Raises:
        ValueError: ``cp_size``/``cp_rank``/``layout`` out of range, or a span not divisible by
            ``2 * cp_size`` (see `check_cp_spans`; not re-checked here when ``cu_buffer`` is on a GPU,
            to avoid a host sync).

    Example:
        >>> cp_indices([0, 8, 16], 2, 1).tolist()
        [2, 3, 4, 5, 10, 11, 12, 13]
        >>> cp_indices([0, 8, 16], 2, 1, layout="row").tolist()
        [4, 5, 6, 7, 8, 9, 10, 11]
    """
    _check_cp_args(cp_size, cp_rank, layout)
    cu = _as_cu_tensor(cu_buffer)
    if cu.device.type == "cpu":
        check_cp_spans(cu, cp_size, layout=layout)
    return zigzag_positions(
        cu, cp_size, cp_rank, layout=layout, total=int(cu[-1]) if total is None else total
    )


def zigzag_positions(
    cu_buffer: torch.Tensor, cp_size: int, cp_rank: int, *, layout: CpLayout, total: int
) -> torch.Tensor:
    """`cp_indices` without its checks: the positions, computed on ``cu_buffer``'s device with no
    read of its values on the host (the caller knows ``total`` and that the spans divide)."""
    cu = cu_buffer
    if layout == "row":
        cu = cu[[0, -1]]
    cu = cu.to(torch.int64)
    chunk = (cu[1:] - cu[:-1]) // (2 * cp_size)  # [n] chunk length of every span
    total_local = total // cp_size
    span = torch.repeat_interleave(2 * chunk, output_size=total_local)  # [T / cp] span of each
    local_start = torch.cumsum(2 * chunk, 0) - 2 * chunk  # where each span starts locally
    # index within the span's share
    j = torch.arange(total_local, device=cu.device) - local_start[span]
    c = chunk[span]
    early = cp_rank * c + j  # chunk r
    late = (2 * cp_size - 2 - cp_rank) * c + j  # chunk 2cp-1-r, shifted by the c of chunk r
    return cu[span] + torch.where(j < c, early, late)


def local_documents(
    cu_buffer: torch.Tensor, cp_size: int, cp_rank: int, *, layout: CpLayout, local_total: int
) -> torch.Tensor:
    """[Tl] int64 index of the buffer segment each of this CP rank's ``local_total`` tokens is in.

    On ``cu_buffer``'s device, with no read of a value on the host and no check (the batch was
    checked where its share was taken): cp = 1 gives the segment of every row position. A
    document split over CP ranks has the same index on every rank.

    Example:
        >>> local_documents(torch.tensor([0, 4, 8]), 2, 1, layout="document", local_total=4).tolist()
        [0, 0, 1, 1]
    """
    cu = cu_buffer.to(torch.int64)
    if cp_size == 1:
        positions = torch.arange(local_total, device=cu.device)
    else:
        positions = zigzag_positions(
            cu, cp_size, cp_rank, layout=layout, total=cp_size * local_total
        )
    return position_documents(cu, positions)


def position_documents(cu_buffer: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The buffer segment of every row position in ``positions`` (int64, on device, no host read)."""
    cu = cu_buffer.to(torch.int64)
    return torch.searchsorted(cu[1:], positions, right=True).clamp(max=len(cu) - 2)


def check_cp_spans(
    cu_buffer: torch.Tensor | Sequence[int],
    cp_size: int,
    *,
    layout: CpLayout = "document",
    name: str = "cu_seqlens",
) -> None:
    """Raise ValueError unless every span of ``layout`` divides by ``2 * cp_size``.

    The message names the document, its length and the fix: pack with
    ``pad_to_multiple_of=2*cp`` (``--pad-multiple``), or use the "row" layout.

    Example:
        >>> check_cp_spans([0, 8, 13], 2)
        Traceback (most recent call last):
        ...
        ValueError: cu_seqlens document 1 spans 5 positions, not a multiple of 2*cp=4 ...
    """
    _check_cp_args(cp_size, 0, layout)
    if cp_size == 1:
        return
    cu = np.asarray(_as_cu_tensor(cu_buffer).cpu(), dtype=np.int64)
    two_cp = 2 * cp_size
    if layout == "row":
        if cu[-1] % two_cp:
            raise ValueError(
                f"the row holds {int(cu[-1])} positions, not a multiple of 2*cp={two_cp} "
                f"(cp_size={cp_size}, layout='row'): pad rows to a multiple of {two_cp} "
                f"(seq_len or pad_to_multiple_of)"
            )
        return
    lengths = np.diff(cu)
    bad = np.flatnonzero(lengths % two_cp)
    if len(bad):
        i = int(bad[0])
        more = f" ({len(bad)} documents in all)" if len(bad) > 1 else ""
        raise ValueError(
            f"{name} document {i} spans {int(lengths[i])} positions, not a multiple of 2*cp={two_cp}"
            f"{more} (cp_size={cp_size}, layout='document'): pack with pad_to_multiple_of={two_cp} "
            f"(--pad-multiple {two_cp}) so every document is padded, or use cp_layout='row'"
        )


def _check_cp_args(cp_size: int, cp_rank: int, layout: str) -> None:
    cp_size = check_int("cp_size", cp_size, minimum=1)
    check_int("cp_rank", cp_rank, minimum=0, maximum=cp_size - 1)
    if layout not in CP_LAYOUTS:
        raise ValueError(f"cp layout must be one of {CP_LAYOUTS}, got {layout!r}")


def _as_cu_tensor(cu_buffer: torch.Tensor | Sequence[int]) -> torch.Tensor:
    cu = cu_buffer if isinstance(cu_buffer, torch.Tensor) else torch.as_tensor(cu_buffer)
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with >= 2 entries, got shape {tuple(cu.shape)}")
    if cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must hold integers, got dtype {cu.dtype}")
    return cu


def take_share(
    values: Mapping[str, Any],
    fields: Sequence[BatchField],
    *,
    packed: bool,
    cp_size: int,
    cp_rank: int,
    layout: CpLayout = "document",
    tp_size: int = 1,
    sequence_parallel: bool = False,
) -> dict[str, Any]:
    """The values of ``fields`` (one stage's) as CP rank ``cp_rank`` of ``cp_size`` keeps them.

    Each field's declaration says how (`BatchField.share`): per-token fields keep this rank's
    zigzag positions (dim 1), a plain batch's ``attention_mask`` its query rows (dim 2), every
    other field stays whole, so ``cu_seqlens``, ``cu_seqlens_padded`` and ``max_seqlen`` describe
    the whole row on every CP rank. Fields not in ``fields`` are dropped (their stage does not
    get them). Packed rows split by ``layout`` over the spans of ``cu_seqlens_padded`` (else
    ``cu_seqlens``); plain [b, s] rows always split by row, as Megatron's
    ``get_batch_on_this_cp_rank``.

    Worked example, two documents of 8 tokens, cp = 2, rank 1: tokens ``[0 .. 15]`` ->
    ``[2, 3, 4, 5, 10, 11, 12, 13]`` ("document"), ``[4, 5, 6, 7, 8, 9, 10, 11]`` ("row").

    Raises:
        ValueError: a span not divisible by ``2 * cp_size``, naming the document, its length and
            the ``pad_to_multiple_of`` that fixes it; with sequence parallelism, a per-rank token
            count not divisible by ``tp_size``.
    """
    out = {f.name: values.get(f.name) for f in fields}
    if cp_size == 1:
        return out
    tokens = values["tokens"]
    total = int(tokens.shape[1])
    multiple = 2 * cp_size * tp_size  # the padding sequence parallelism needs
    sp_hint = (
        f"; with sequence parallelism (tp={tp_size}) pad to a multiple of 2*cp*tp={multiple}"
        if sequence_parallel and tp_size > 1
        else ""
    )
    padded = values.get("cu_seqlens_padded")
    name = "cu_seqlens_padded" if padded is not None else "cu_seqlens"
    if packed:
        buffer = (padded if padded is not None else values["cu_seqlens"]).cpu()
        split: CpLayout = layout
    else:
        buffer, split = torch.tensor([0, total]), "row"
    try:
        check_cp_spans(buffer, cp_size, layout=split, name=name)
    except ValueError as exc:
        where = "the packed batch" if packed else "the plain [b, s] batch's rows"
        raise ValueError(f"{exc} (in {where}){sp_hint}") from None
    local = total // cp_size
    if sequence_parallel and local % tp_size:
        raise ValueError(
            f"each CP rank keeps {local} of the row's {total} tokens, not a multiple of "
            f"tp={tp_size} as sequence parallelism needs (cp_size={cp_size}): pack with "
            f"pad_to_multiple_of={multiple} (--pad-multiple {multiple}) or pad rows to a "
            f"multiple of {multiple}"
        )
    index = cp_indices(buffer, cp_size, cp_rank, layout=split, total=total)
    for f in fields:
        t = out[f.name]
        if t is not None and f.share != "whole":
            out[f.name] = t.index_select(1 if f.share == "positions" else 2, index.to(t.device))
    return out
