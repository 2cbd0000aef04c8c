"""A context-parallel rank's share of a normalized micro-batch, taken on the TP source before encoding.

With ``cp_size > 1`` every CP rank's TP source reads the same full row (as in Megatron), keeps its
zigzag share (`megapack.cp.cp_indices`) of every per-token field and encodes only that, so its TP
peers receive 1/cp of the token bytes. Which fields are per-token, and along which dimension, is
the ``cp_dim`` column of `megapack.wire.FIELDS`; the boundaries (``cu_seqlens``,
``cu_seqlens_padded``) and ``max_seqlen`` stay those of the whole row.

    packed THD [1, T]    spans from cu_seqlens_padded (else cu_seqlens), layout "document" or "row"
    plain [b, s]         every row split as one span ("row" layout on dim 1; attention_mask
                         [b, 1, s, s] on its query dim 2), as Megatron's get_batch_on_this_cp_rank

Worked example, two documents of 8 tokens, cp = 2, CP rank 1 (``cp_indices`` docstring):
tokens ``[0 .. 15]`` -> document layout ``[2, 3, 4, 5, 10, 11, 12, 13]``, row layout
``[4, 5, 6, 7, 8, 9, 10, 11]``; ``cu_seqlens`` stays ``[0, 8, 16]``.

Kept apart from the byte encoding in `megapack.wire`, which only ever sees the share.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megapack.cp import CpLayout, check_cp_spans, cp_indices
from megapack.inputs import Layout
from megapack.topology import Stage
from megapack.wire import FIELDS, travels


def take_cp_share(
    layout: Layout,
    tensors: Mapping[str, torch.Tensor | None],
    *,
    cp_size: int,
    cp_rank: int,
    cp_layout: CpLayout = "document",
    tp_size: int = 1,
    sequence_parallel: bool = False,
    stage: Stage | None = None,
) -> dict[str, torch.Tensor | None]:
    """Every per-token field of ``tensors`` cut to CP rank ``cp_rank``'s share; the rest unchanged.

    Args:
        layout: PACKED (THD [1, T] with boundaries) or PLAIN ([b, s]), from `megapack.inputs.normalize`.
        tensors: the normalized fields by name.
        cp_size, cp_rank: the CP group's size and this rank's index in it.
        cp_layout: "document" or "row" for packed batches; plain batches always split by row.
        tp_size, sequence_parallel: with sequence parallelism each CP rank's tokens are split
            over the TP ranks as well, so their count must also divide by ``tp_size``.
        stage: when given, per-token fields that do not travel to this pipeline stage
            (`megapack.wire.travels`) are dropped (None) instead of sliced.

    Returns:
        A new dict; with ``cp_size == 1`` the same tensors.

    Raises:
        ValueError: a span (document, or the row) not divisible by ``2 * cp_size``, naming the
            document, its length and the ``pad_to_multiple_of`` that fixes it; or, with sequence
            parallelism, a per-rank token count not divisible by ``tp_size``.
    """
    out = dict(tensors)
    if cp_size == 1:
        return out
    tokens = tensors["tokens"]
    assert tokens is not None  # normalize() always returns tokens
    total = int(tokens.shape[1])
    multiple = 2 * cp_size * (tp_size if sequence_parallel else 1)
    sp_hint = (
        f"; with sequence parallelism (tp={tp_size}) pad to a multiple of 2*cp*tp={multiple}"
        if sequence_parallel and tp_size > 1
        else ""
    )
    if layout == Layout.PLAIN:
        buffer: torch.Tensor = torch.tensor([0, total])
        split: CpLayout = "row"
    else:
        padded = tensors.get("cu_seqlens_padded")
        cu = tensors["cu_seqlens"]
        assert cu is not None  # packed batches always carry cu_seqlens
        buffer = (padded if padded is not None else cu).cpu()
        split = cp_layout
    name = "cu_seqlens_padded" if tensors.get("cu_seqlens_padded") is not None else "cu_seqlens"
    try:
        check_cp_spans(buffer, cp_size, layout=split, name=name)
    except ValueError as exc:
        where = "the plain [b, s] batch's rows" if layout == Layout.PLAIN else "the packed batch"
        raise ValueError(f"{exc} (in {where}){sp_hint}") from None
    local = total // cp_size
    if sequence_parallel and local % tp_size:
        raise ValueError(
            f"each CP rank keeps {local} of the row's {total} tokens, not a multiple of tp={tp_size} "
            f"as sequence parallelism needs (cp_size={cp_size}): pack with "
            f"pad_to_multiple_of={multiple} (--pad-multiple {multiple}) or pad rows to a multiple of {multiple}"
        )
    index = cp_indices(buffer, cp_size, cp_rank, layout=split, total=total)
    for field in FIELDS:
        t = out.get(field.name)
        if field.cp_dim is None or t is None:
            continue
        if stage is not None and not travels(field, stage):
            out[field.name] = None
        else:
            out[field.name] = t.index_select(field.cp_dim, index.to(t.device))
    return out
