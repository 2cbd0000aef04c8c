"""`CpPlan`: which local queries of a context-parallel rank attend to which row keys (`megapack.attention.cp_attention`).

Built once per micro-batch from the whole row's boundaries (`plan_for` keeps it in the
micro-batch's `megapack.attention.documents.Documents`, the one owner of batch-derived state),
shared by `megapack.attention.cp_attention`'s gather and the cross kernels
(`megapack.attention.cp_kernels`). Building it reads a few sizes on the host, so it is refused
inside a CUDA-graph capture (`megapack.core.capture`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from megapack.core.capture import refuse_under_capture
from megapack.core.cp_share import CpLayout, cp_indices, position_documents

if TYPE_CHECKING:
    from megapack.attention.documents import Documents


@dataclass(frozen=True, slots=True)
class CpPlan:
    """Which local queries attend to which row keys, for one CP rank (see the module docstring)."""

    positions: torch.Tensor
    """[Tl] int64 global row position of every local query, in local order."""
    offsets: torch.Tensor
    """[Tl] int64 position of every local query within its document (RoPE's position)."""
    q_index: torch.Tensor
    """[Nq] int64 local indices of the real queries, segment after segment."""
    k_index: torch.Tensor
    """[Nk] int64 row positions of the keys of every segment, segment after segment."""
    cu_q: torch.Tensor
    """[S + 1] int32 offsets of the segments in the selected queries."""
    cu_k: torch.Tensor
    """[S + 1] int32 offsets of the segments in the selected keys."""
    max_q: int
    """Longest query segment."""
    max_k: int
    """Longest key segment."""
    order: torch.Tensor
    """[cp, Tl] int64 row positions held by every CP rank (where gathered K/V rows go)."""
    starts: torch.Tensor
    """[Tl] int64 row position where the document of every local query starts."""
    ends: torch.Tensor
    """[Tl] int64 row position just past the real tokens of that document."""
    memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """Values kernels derive from the plan once per micro-batch (host boundaries, flex mask)."""

    @classmethod
    def build(
        cls,
        cu_buffer: torch.Tensor,
        cu_real: torch.Tensor,
        *,
        cp_size: int,
        cp_rank: int,
        layout: CpLayout,
        local_total: int,
    ) -> CpPlan:
        """The plan of rank ``cp_rank`` for a row with buffer spans ``cu_buffer`` and real lengths ``cu_real``.

        Example:
            >>> p = CpPlan.build(torch.tensor([0, 3, 8]), torch.tensor([0, 3, 8]), cp_size=2,
            ...                  cp_rank=0, layout="row", local_total=4)
            >>> p.positions.tolist(), p.k_index.tolist(), p.cu_q.tolist(), p.cu_k.tolist()
            ([0, 1, 6, 7], [0, 1, 3, 4, 5, 6, 7], [0, 2, 4], [0, 2, 7])
        """
        refuse_under_capture(
            "context-parallel attention's plan",
            "it reads its segment sizes on the host",
            "capture with context_parallel_size=1, or run context parallelism eagerly",
        )
        total = cp_size * local_total
        if cu_buffer.device.type == "cpu" and int(cu_buffer[-1]) != total:
            raise ValueError(
                f"cu_seqlens ends at {int(cu_buffer[-1])} but cp_size={cp_size} ranks hold "
                f"{cp_size} x {local_total} = {total} positions: pass the whole row's boundaries "
                f"and this rank's share of the tokens (megapack.get_batch_on_this_tp_rank does)"
            )
        cu = cu_buffer.to(torch.int64)
        positions, doc = row_positions(cu, cp_size, cp_rank, layout=layout, local_total=local_total)
        offsets = positions - cu[doc]
        lengths = (cu_real[1:] - cu_real[:-1]).to(torch.int64)
        q_index = torch.nonzero(offsets < lengths[doc]).flatten()
        doc_start = cu[doc]
        q_pos, q_doc = positions[q_index], doc[q_index]
        new = torch.ones_like(q_pos, dtype=torch.bool)
        new[1:] = (q_doc[1:] != q_doc[:-1]) | (q_pos[1:] != q_pos[:-1] + 1)
        starts = torch.nonzero(new).flatten()
        ends = torch.cat([starts[1:], starts.new_tensor([len(q_pos)])])
        len_q = ends - starts
        first_key = cu[q_doc[starts]]
        len_k = q_pos[ends - 1] + 1 - first_key if len(starts) else len_q
        cu_k = F.pad(torch.cumsum(len_k, 0), (1, 0))
        nk = int(cu_k[-1])
        within = torch.arange(nk, device=cu.device) - torch.repeat_interleave(
            cu_k[:-1], len_k, output_size=nk
        )
        k_index = torch.repeat_interleave(first_key, len_k, output_size=nk) + within
        order = torch.stack(
            [cp_indices(cu, cp_size, r, layout=layout, total=total) for r in range(cp_size)]
        )
        return cls(
            order=order,
            starts=doc_start,
            ends=doc_start + lengths[doc],
            positions=positions,
            offsets=offsets,
            q_index=q_index,
            k_index=k_index,
            cu_q=F.pad(torch.cumsum(len_q, 0), (1, 0)).to(torch.int32),
            cu_k=cu_k.to(torch.int32),
            max_q=int(len_q.max()) if len(starts) else 0,
            max_k=int(len_k.max()) if len(starts) else 0,
        )


def plan_for(
    docs: Documents,
    *,
    cp_size: int,
    cp_rank: int,
    layout: CpLayout,
    local_total: int,
) -> CpPlan:
    """`CpPlan.build` for the micro-batch of ``docs``, once: kept in ``docs.memo``.

    megatron-core hands every layer the same ``packed_seq_params``, whose `Documents` is built by
    the first layer; the plan (a few host syncs on a GPU) is built by the first layer too and
    reused by the others. It is rebuilt with its `Documents`: for new or refilled boundaries, and
    for a CUDA-graph capture (where building it is refused).
    """
    key = ("cp_plan", cp_size, cp_rank, layout, local_total)
    plan = docs.memo.get(key)
    if plan is None:
        plan = docs.memo[key] = CpPlan.build(
            docs.cu_buffer,
            docs.cu_real,
            cp_size=cp_size,
            cp_rank=cp_rank,
            layout=layout,
            local_total=local_total,
        )
    return plan


def row_positions(
    cu_buffer: torch.Tensor, cp_size: int, cp_rank: int, *, layout: CpLayout, local_total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([Tl] row position, [Tl] document index) of every local token; no host sync.

    Example:
        >>> pos, doc = row_positions(torch.tensor([0, 3, 8]), 2, 0, layout="row", local_total=4)
        >>> pos.tolist(), doc.tolist()
        ([0, 1, 6, 7], [0, 0, 1, 1])
    """
    cu = cu_buffer.to(torch.int64)
    positions = cp_indices(cu, cp_size, cp_rank, layout=layout, total=cp_size * local_total)
    return positions, position_documents(cu, positions)
