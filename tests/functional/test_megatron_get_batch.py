"""megapack counterparts of Megatron-LM's tests/unit_tests/data/test_get_batch.py, on CPU gloo.

Megatron's spec runs its ``get_batch`` (pretrain_gpt / pretrain_hybrid) on tp x pp x cp grids for:
SFT batches, inter-document-masking batches (micro-batch size > 1), plain pretraining batches with
and without a dataloader attention mask, and hybrid-CP batches carrying ``local_cp_size`` and
``cu_seqlens_padded``. Every case runnable with at most 8 ranks runs here against
``megapack.get_batch_on_this_tp_rank``, one pool task per grid, with Megatron's assertions
(shapes per CP rank, dtypes, which stage gets what) plus exact values from a reference share.
Deliberate differences: megapack returns ``cu_seqlens`` 1-D (Megatron (1, n)) and ``max_seqlen``
as a Python int (Megatron a [1] tensor), and middle stages of plain pretraining get an all-None
dict rather than a tuple of Nones. The row-merging (``flatten_batch_for_packed_sequences``) and
per-sequence balancing cases are in tests/unit/test_megatron_batches.py. Megatron-LM's own call
(a batch dict and its keywords, returning its (1, n) ``cu_seqlens`` and [1] ``max_seqlen``), its
older one and Megatron-Bridge's, in re-created callers: tests/functional/test_megatron_callers.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from megapack import get_batch_on_this_tp_rank
from megapack.core.cp_share import cp_indices
from megapack.distributed.topology import Stage
from megapack.harness.grid import grid_topology
from megapack.testing.grids import Grid
from tests.functional.test_cp_grid import _record_collectives

pytestmark = pytest.mark.distributed

S = 64
# Megatron's tp in {1, 2, 4} x pp in {1, 2, 4} x cp in {1, 2, 4}, those with at most 8 ranks that
# add something: every stage kind, every cp, tp > 1 with cp > 1.
GRIDS = (Grid(1, 1, 1), Grid(2, 4, 1), Grid(2, 1, 2), Grid(1, 2, 2), Grid(2, 2, 2), Grid(1, 4, 2),
         Grid(4, 1, 2), Grid(1, 1, 4), Grid(2, 1, 4), Grid(1, 2, 4))  # fmt: skip


def _share(
    t: torch.Tensor, cp: int, cp_rank: int, dim: int = 1, cu: list[int] | None = None
) -> torch.Tensor:
    layout = "row" if cu is None else "document"
    index = cp_indices(cu or [0, t.shape[dim]], cp, cp_rank, layout=layout)  # type: ignore[arg-type]
    return t.index_select(dim, index)


def sft_item(gen: torch.Generator, cp: int) -> dict[str, Any]:
    """Megatron's old SFTDataset sample after collation: documents of 10-40% of s, the last absorbing
    the row padding, cu_seqlens [1, n + 1] ending at s, max_seqlen [1] int32. Lengths are multiples
    of 2 * cp so that the per-document ("document") CP split applies."""
    step = 2 * cp
    lengths: list[int] = []
    while True:
        n = step * int(
            torch.randint(max(1, S // 10 // step), S * 4 // 10 // step + 1, (1,), generator=gen)
        )
        if sum(lengths) + n >= S:
            break
        lengths.append(n)
    lengths[-1] += S - sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens = torch.randint(0, 10_000, (1, S + 1), generator=gen)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, S),
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None], "cu_seqlens": cu[None],
            "max_seqlen": torch.tensor([max(lengths)], dtype=torch.int32)}  # fmt: skip


def inter_document_item(gen: torch.Generator, mbs: int) -> dict[str, Any]:
    """GPTDataset with inter-document masking: any boundaries, rows [mbs, s + 1] padded with s."""
    cu = torch.full((mbs, S + 1), S, dtype=torch.int32)
    for i in range(mbs):
        cuts = sorted(set(torch.randint(1, S, (4,), generator=gen).tolist()))
        cu[i, : len(cuts) + 2] = torch.tensor([0, *cuts, S])
    tokens = torch.randint(0, 10_000, (mbs, S), generator=gen)
    return {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(mbs, S),
            "position_ids": torch.arange(S).repeat(mbs, 1), "cu_seqlens": cu,
            "max_seqlen": torch.full((mbs,), S, dtype=torch.int32)}  # fmt: skip


def pretrain_item(gen: torch.Generator, mbs: int, mask: bool) -> dict[str, Any]:
    text = torch.randint(0, 10_000, (mbs, S + 1), generator=gen)
    item = {"tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": torch.ones(mbs, S),
            "position_ids": torch.arange(S).repeat(mbs, 1)}  # fmt: skip
    if mask:
        item["attention_mask"] = torch.tril(torch.ones(mbs, 1, S, S)).bool()
    return item


def hybrid_item(gen: torch.Generator, cp: int) -> dict[str, Any]:
    """pretrain_hybrid's HybridCP batch: 2*cp equal sequences, local_cp_size, cu_seqlens_padded."""
    n = max(2, 2 * cp)
    each = S // n // (2 * cp) * (2 * cp)
    cu = torch.arange(0, n * each + 1, each, dtype=torch.int32)[None]
    text = torch.randint(0, 10_000, (1, n * each + 1), generator=gen)
    return {"tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": torch.ones(1, n * each),
            "position_ids": torch.arange(each).repeat(n)[None], "cu_seqlens": cu, "cu_seqlens_padded": cu.clone(),
            "max_seqlen": torch.tensor([each], dtype=torch.int32),
            "local_cp_size": torch.tensor([cp], dtype=torch.int32)}  # fmt: skip


def cases(cp: int) -> list[tuple[str, dict[str, Any], str | None]]:
    """(name, item, cp_layout override) in the order every source reads them; same seed everywhere."""
    gen = torch.Generator().manual_seed(7)
    out: list[tuple[str, dict[str, Any], str | None]] = [("sft", sft_item(gen, cp), None)]
    out += [(f"inter_document-mbs{m}", inter_document_item(gen, m), "row") for m in (1, 2, 4)]
    out += [
        (f"pretrain-mbs{m}-mask{int(k)}", pretrain_item(gen, m, k), None)
        for m in (1, 4)
        for k in (False, True)
    ]
    out += [("hybrid_cp", hybrid_item(gen, cp), None)] if cp > 1 else []
    return out


def check(
    name: str, item: dict[str, Any], out: dict[str, Any], stage: Stage, cp: int, cp_rank: int
) -> None:
    first = stage in (Stage.ONLY, Stage.FIRST)
    last = stage in (Stage.ONLY, Stage.LAST)
    packed = "cu_seqlens" in item
    b, s = item["tokens"].shape
    rows, cols = (1, b * s // cp) if packed else (b, s // cp)
    cu_doc = item["cu_seqlens"][0].tolist() if name in ("sft", "hybrid_cp") else None
    for key, needed in (
        ("tokens", first),
        ("position_ids", first),
        ("labels", last),
        ("loss_mask", last),
    ):
        got = out[key]
        if not needed:
            assert got is None, f"{name} {stage}: {key} should be None"
            continue
        assert got is not None and got.shape == (rows, cols), (
            f"{name} {stage}: {key} {None if got is None else got.shape}"
        )
        assert got.dtype == (torch.float32 if key == "loss_mask" else torch.int64), (
            f"{name}: {key} dtype"
        )
        want = _share(item[key].reshape(rows, -1), cp, cp_rank, cu=cu_doc)
        assert torch.equal(got, want), f"{name} {stage} cp_rank {cp_rank}: {key} values"
    if last:
        assert ((out["loss_mask"] == 0) | (out["loss_mask"] == 1)).all() and out[
            "loss_mask"
        ].sum() == rows * cols
    if not packed:
        assert (
            out["cu_seqlens"] is None
            and out["max_seqlen"] is None
            and out["packed_seq_params"] is None
        )
        assert out["local_cp_size"] is None and out["cu_seqlens_padded"] is None
        if "attention_mask" in item:
            assert out["attention_mask"].shape == (b, 1, s // cp, s), (
                f"{name}: mask {out['attention_mask'].shape}"
            )
            assert torch.equal(
                out["attention_mask"], _share(item["attention_mask"], cp, cp_rank, dim=2)
            )
        else:
            assert out["attention_mask"] is None
        return
    cu = out["cu_seqlens"]  # every stage, middle ones included
    assert cu is not None and cu.dim() == 1 and cu.dtype == torch.int32, (
        f"{name} {stage}: cu_seqlens"
    )
    assert cu[0] == 0 and cu[-1] == b * s and len(cu) >= b + 1, f"{name}: cu_seqlens {cu.tolist()}"
    assert type(out["max_seqlen"]) is int and 0 < out["max_seqlen"] <= s, f"{name}: max_seqlen"
    assert out["attention_mask"] is None
    psp = out["packed_seq_params"]
    assert psp.cu_seqlens_q is cu and psp.max_seqlen_q == out["max_seqlen"]
    if name == "hybrid_cp":
        assert out["local_cp_size"] == cp and psp.local_cp_size == cp
        assert out["cu_seqlens_padded"].tolist() == item["cu_seqlens_padded"][0].tolist()
        assert out["max_seqlen"] == int(item["max_seqlen"])
        assert psp.cp_group is not None
    else:
        assert out["local_cp_size"] is None and out["cu_seqlens_padded"] is None


def run_megatron_spec(tp: int, pp: int, cp: int) -> dict[str, Any]:
    topo = grid_topology(tp, pp, cp)
    log = _record_collectives()
    items = cases(cp)
    data = iter([item for _, item, _ in items]) if topo.is_source else None
    for name, item, layout in items:
        out = get_batch_on_this_tp_rank(data, topology=topo, cp_layout=layout)  # type: ignore[arg-type]
        check(name, item, out, topo.stage, cp, topo.cp_rank)
    # Megatron builds no dataset on middle stages of plain pretraining: no iterator, all None.
    if topo.stage == Stage.MIDDLE:
        out = get_batch_on_this_tp_rank(None, topology=topo)
        assert all(v is None for v in out.values()), out
    sizes = list(log)
    dist.barrier()  # leave together: a rank tearing down early breaks a peer still connecting a group
    return {"tp_ranks": topo.tp_ranks, "sizes": sizes}


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: g.id)
def test_megatron_get_batch_spec_with_cp(dist_pool: Any, grid: Grid) -> None:
    results = dist_pool.run(
        run_megatron_spec, grid.world_size, grid.tp, grid.pp, grid.cp, timeout=120
    )
    by_group: dict[tuple[int, ...], list[Any]] = {}
    for r in results:
        by_group.setdefault(r["tp_ranks"], []).append(r["sizes"])
    for ranks, logs in by_group.items():
        assert all(log == logs[0] for log in logs), f"TP group {ranks}: collective sizes differ"
        assert (len(logs[0]) > 0) == (grid.tp > 1), ranks
