"""Tests of megapack.attention.cp_attention: PackedAttention with context parallelism on gloo CPU ranks.

Every CP run is compared with the cp=1 result on the whole row (`PackedAttention` without CP, itself
checked against a dense reference in test_packed.py): each rank's outputs and its q/k/v gradients
must equal the whole row's at the positions it holds (`megapack.core.cp_share.cp_indices`).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from megapack.attention import PackedAttention
from megapack.attention.cp_plan import CpPlan, plan_for, row_positions
from megapack.core.batch import make_packed_seq_params
from megapack.core.cp_share import cp_indices

HEADS, GROUPS, DIM = 4, 2, 8


def config() -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=DIM,
                           attention_dropout=0.0, context_parallel_size=1, window_size=None,
                           softmax_type="vanilla", rotary_interleaved=False,
                           multi_latent_attention=False, apply_rope_fusion=False)  # fmt: skip


def attention(backend: str, layout: str, cp_group: Any) -> PackedAttention:
    pgs = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1), cp=cp_group)
    return PackedAttention(config(), 1, None, "self", pg_collection=pgs, backend=backend,
                           cp_layout=layout)  # type: ignore[arg-type]  # fmt: skip


def allowed_pairs(plan: CpPlan) -> set[tuple[int, int]]:
    """(query row position, key row position) pairs the plan lets attend."""
    pairs = set()
    cq, ck = plan.cu_q.tolist(), plan.cu_k.tolist()
    q_pos = plan.positions[plan.q_index].tolist()
    keys = plan.k_index.tolist()
    for s in range(len(cq) - 1):
        nq, nk = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        for i in range(nq):
            for j in range(nk):
                if j <= i + nk - nq:  # bottom-right causal
                    pairs.add((q_pos[cq[s] + i], keys[ck[s] + j]))
    return pairs


def brute_pairs(real: list[int], buffer: list[int], mine: list[int]) -> set[tuple[int, int]]:
    doc = {}
    for d in range(len(buffer) - 1):
        for p in range(buffer[d], buffer[d] + real[d + 1] - real[d]):
            doc[p] = d
    return {(p, k) for p in mine if p in doc for k in doc if doc[k] == doc[p] and k <= p}


def documents(seed: int, cp: int, layout: str) -> tuple[list[int], list[int]]:
    """(cu_real, cu_buffer) of random documents with 1-token, odd and < 2*cp lengths."""
    rng = np.random.default_rng(seed)
    lengths = [1, int(rng.integers(2, 2 * cp + 1)), *rng.integers(1, 20, 4).tolist(), 2 * cp + 1]
    rng.shuffle(lengths)
    two_cp = 2 * cp
    if layout == "document" or seed % 2:  # every document padded to a multiple of 2*cp
        spans = [-(-n // two_cp) * two_cp for n in lengths]
    else:  # row layout without per-document padding: only the row is padded at its end
        spans = list(lengths)
        spans[-1] += -sum(lengths) % two_cp
    return [0, *np.cumsum(lengths).tolist()], [0, *np.cumsum(spans).tolist()]


@pytest.mark.parametrize("layout", ["document", "row"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(4))
def test_plan_attends_exactly_the_document_causal_pairs(cp: int, layout: str, seed: int) -> None:
    real, buffer = documents(seed, cp, layout)
    for rank in range(cp):
        plan = CpPlan.build(torch.tensor(buffer), torch.tensor(real), cp_size=cp, cp_rank=rank,
                            layout=layout, local_total=buffer[-1] // cp)  # type: ignore[arg-type]  # fmt: skip
        mine = cp_indices(buffer, cp, rank, layout=layout).tolist()  # type: ignore[arg-type]
        assert plan.positions.tolist() == mine
        assert allowed_pairs(plan) == brute_pairs(real, buffer, mine)
        assert plan.max_k <= max(np.diff(real))


def test_plan_worked_example() -> None:
    plan = CpPlan.build(torch.tensor([0, 3, 8]), torch.tensor([0, 3, 8]), cp_size=2, cp_rank=0,
                        layout="row", local_total=4)  # fmt: skip
    assert plan.positions.tolist() == [0, 1, 6, 7]
    assert plan.offsets.tolist() == [0, 1, 3, 4]
    assert plan.k_index.tolist() == [0, 1, 3, 4, 5, 6, 7]
    assert (plan.cu_q.tolist(), plan.cu_k.tolist()) == ([0, 2, 4], [0, 2, 7])
    pos, doc = row_positions(torch.tensor([0, 8]), 2, 1, layout="document", local_total=4)
    assert (pos.tolist(), doc.tolist()) == ([2, 3, 4, 5], [0, 0, 0, 0])


def test_plan_rejects_boundaries_of_another_row() -> None:
    with pytest.raises(
        ValueError, match=r"cu_seqlens ends at 8 but cp_size=2 ranks hold 2 x 3 = 6"
    ):
        CpPlan.build(torch.tensor([0, 8]), torch.tensor([0, 8]), cp_size=2, cp_rank=0,
                     layout="row", local_total=3)  # fmt: skip


# ---- on the worker pool ---------------------------------------------------------------------


def thd_case(layout: str, seed: int, backend: str, docs: Any = None) -> dict[str, Any]:
    """On every rank: CP attention of this rank's share vs the whole-row cp=1 result, fwd and bwd."""
    import torch.distributed as dist

    cp, rank = dist.get_world_size(), dist.get_rank()
    real, buffer = docs or documents(seed, cp, layout)
    total = buffer[-1]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(total, h, DIM, generator=g) for h in (HEADS, GROUPS, GROUPS))
    weight = torch.randn(total, HEADS * DIM, generator=g)
    params = make_packed_seq_params(torch.tensor(real, dtype=torch.int32),
                                    torch.tensor(buffer, dtype=torch.int32), max(np.diff(real)))  # fmt: skip
    training = backend != "flex"  # flex has no CPU backward
    full = [x.clone().requires_grad_(training) for x in (q, k, v)]
    ref = attention("sdpa", layout, None)(*full, None, packed_seq_params=params)
    mine = cp_indices(buffer, cp, rank, layout=layout)  # type: ignore[arg-type]
    local = [x[mine].clone().requires_grad_(training) for x in (q, k, v)]
    module = attention(backend, layout, dist.group.WORLD)
    out = module(*local, None, packed_seq_params=params)
    result: dict[str, Any] = {"out": (out.detach(), ref.detach()[mine])}
    if training:
        (ref * weight).sum().backward()
        (out * weight[mine]).sum().backward()
        for name, x, y in zip("qkv", local, full, strict=True):
            result["d" + name] = (x.grad, y.grad[mine])  # type: ignore[index]
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", ["document", "row"])
def test_cp_attention_matches_the_whole_row(dist_pool: Any, cp: int, layout: str) -> None:
    for seed in (0, 1):
        for rank, got in enumerate(dist_pool.run(functools.partial(thd_case, layout, seed, "sdpa"), cp, timeout=120)):  # fmt: skip
            assert set(got) == {"out", "dq", "dk", "dv"}
            for name, (a, b) in got.items():
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")


@pytest.mark.distributed
def test_cp_rank_without_real_queries_still_joins_backward(dist_pool: Any) -> None:
    """One 1-token document padded to 4: rank 1 holds only padding (zero outputs), yet its K/V
    gradient reduce-scatter must run, or rank 0 would hang."""
    task = functools.partial(thd_case, "document", 0, "sdpa", ([0, 1], [0, 4]))
    for rank, got in enumerate(dist_pool.run(task, 2, timeout=60)):
        for name, (a, b) in got.items():
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")
    assert not got["out"][0].any()  # rank 1: padding only


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["document", "row"])
def test_cp_flex_forward_matches_the_whole_row(dist_pool: Any, layout: str) -> None:
    """flex under CP attends every local query to the whole gathered row (key-interval mask)."""
    for seed in (0, 1):  # seed 1: every document padded, so padding queries are met
        task = functools.partial(thd_case, layout, seed, "flex")
        for rank, got in enumerate(dist_pool.run(task, 2, timeout=300)):
            torch.testing.assert_close(*got["out"], rtol=1e-5, atol=1e-5, msg=f"rank {rank} seed {seed}")  # fmt: skip


def sbhd_case(with_mask: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Padded [s, b] batches split by row: outputs and q/k/v gradients vs the unsplit run."""
    import torch.distributed as dist

    cp, rank = dist.get_world_size(), dist.get_rank()
    s, b = 4 * cp, 3
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(s, b, h, DIM, generator=g) for h in (HEADS, GROUPS, GROUPS))
    weight = torch.randn(s, b, HEADS * DIM, generator=g)
    mask = torch.rand(b, 1, s, s, generator=g) < 0.3 if with_mask else None
    if mask is not None:
        mask &= ~torch.eye(s, dtype=torch.bool)  # every query keeps one key
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attention("sdpa", "row", None)(*full, mask)
    mine = cp_indices([0, s], cp, rank, layout="row")
    local = [x[mine].clone().requires_grad_() for x in (q, k, v)]
    out = attention("sdpa", "row", dist.group.WORLD)(
        *local, None if mask is None else mask[:, :, mine]
    )
    (ref * weight).sum().backward()
    (out * weight[mine]).sum().backward()
    pairs = [(out.detach(), ref.detach()[mine])]
    return pairs + [(x.grad, y.grad[mine]) for x, y in zip(local, full, strict=True)]  # type: ignore[index,misc]


@pytest.mark.distributed
@pytest.mark.parametrize("with_mask", [False, True], ids=["causal", "mask"])
def test_cp_padded_batches_match_the_whole_sequence(dist_pool: Any, with_mask: bool) -> None:
    for rank, pairs in enumerate(dist_pool.run(functools.partial(sbhd_case, with_mask), 2, timeout=120)):  # fmt: skip
        for i, (a, b) in enumerate(pairs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"rank {rank} tensor {i}")


def test_plan_rejects_a_document_the_document_layout_cannot_split() -> None:
    with pytest.raises(
        ValueError, match=r"document 0 spans 5 positions, not a multiple of 2\*cp=4"
    ):
        CpPlan.build(torch.tensor([0, 5, 8]), torch.tensor([0, 5, 8]), cp_size=2, cp_rank=1,
                     layout="document", local_total=4)  # fmt: skip
    plan = CpPlan.build(torch.tensor([0, 5, 8]), torch.tensor([0, 5, 8]), cp_size=2, cp_rank=1,
                        layout="row", local_total=4)  # fmt: skip
    assert plan.positions.tolist() == [2, 3, 4, 5]  # the row layout needs no per-document padding
    assert allowed_pairs(plan) == brute_pairs([0, 5, 8], [0, 5, 8], [2, 3, 4, 5])


def test_plan_is_built_once_per_micro_batch_and_again_after_a_refill() -> None:
    from megapack.attention.documents import Documents

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    params = make_packed_seq_params(cu, None, 5)
    kwargs: Any = {"cp_size": 2, "cp_rank": 0, "layout": "row", "local_total": 4}
    first = plan_for(Documents.from_params(params, total=4), **kwargs)
    assert plan_for(Documents.from_params(params, total=4), **kwargs) is first  # later layers
    rank1 = plan_for(Documents.from_params(params, total=4), **{**kwargs, "cp_rank": 1})
    assert rank1.positions.tolist() == [2, 3, 4, 5]
    other = make_packed_seq_params(torch.tensor([0, 4, 8], dtype=torch.int32), None, 4)
    assert plan_for(Documents.from_params(other, total=4), **kwargs).k_index.tolist() == [
        0, 1, 4, 5, 6, 7,
    ]  # fmt: skip
    # GraphInputs refills the same boundary tensor in place: the plan must follow the new values
    # (the old cache keyed on the tensor's identity alone returned the stale plan here)
    cu.copy_(torch.tensor([0, 4, 8], dtype=torch.int32))
    refilled = plan_for(Documents.from_params(params, total=4), **kwargs)
    assert refilled is not first
    assert refilled.k_index.tolist() == [0, 1, 4, 5, 6, 7]
