"""Trainers' own fields across ranks (issue 26): every stage and CP share, every transport, errors.

Each TP source reads the same stream of Megatron SFT dicts carrying RL fields (per-token
advantages and bf16 old log-probs for the last stage, a per-sample reward for all) and image
fields (ragged pixel_values and image_grid_thw for the first stage). Every rank checks what it got
against an expectation computed here from the stream alone: a CP rank's token fields hold exactly
the positions its labels hold, per-sample and ragged fields arrive whole, bit-exact.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from megapack import BatchField, get_batch_on_this_tp_rank, prefetch
from megapack.core.cp_share import cp_indices
from megapack.delivery.transport import use_transport
from megapack.harness.grid import grid_topology
from megapack.testing.grids import Grid

pytestmark = pytest.mark.distributed

FIELDS = (
    BatchField("advantages", "token", torch.float32, "last", at="label"),
    BatchField("old_logprobs", "token", torch.bfloat16, "last", at="label"),
    BatchField("reward", "sample", torch.float32, "all"),
    BatchField("pixel_values", "ragged", torch.float16, "first"),
    BatchField("image_grid_thw", "ragged", torch.int64, "first"),
)
S = 16


def stream(n: int = 3) -> list[dict[str, Any]]:
    """Megatron SFT micro-batches of 2 rows of s=16 of two 8-token documents (every span divides
    by 2*cp for cp 2 and 4; -1 and repeat-of-s sentinels), with every declared field."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        tokens = torch.randint(1, 1000, (2, S), generator=gen)
        images = [torch.randn(2 * i + 1, 6, generator=gen).half(), torch.empty(0, 6).half()]
        out.append({
            "tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(2, S),
            "position_ids": torch.tensor([[*range(8), *range(8)], [*range(8), *range(8)]]),
            "cu_seqlens": torch.tensor([[0, 8, 16, -1], [0, 8, 16, 16]], dtype=torch.int32),
            "advantages": torch.randn(2, S, generator=gen),
            "old_logprobs": torch.randn(2, S, generator=gen).bfloat16(),
            "reward": torch.randn(2, generator=gen),
            "pixel_values": images, "image_grid_thw": [torch.tensor([[1, 1, 2 * i + 1]]), torch.empty(0, 3, dtype=torch.int64)],
        })  # fmt: skip
    return out


def run_fields(tp: int, pp: int, cp: int, mode: str, layout: str, ahead: bool) -> dict[str, Any]:
    with use_transport(mode):
        topo = grid_topology(tp, pp, cp, cp_layout=layout)  # type: ignore[arg-type]
        data = iter(stream()) if topo.is_source else None
        got = []
        if ahead:
            with prefetch(data, topology=topo, depth=2, fields=FIELDS) as batches:
                got = [
                    {f.name: b[f.name] for f in FIELDS} | {"labels": b["labels"]} for b in batches
                ]
        else:
            for _ in range(3):
                b = get_batch_on_this_tp_rank(data, topology=topo, fields=FIELDS)
                got.append({f.name: b[f.name] for f in FIELDS} | {"labels": b["labels"]})
        dist.barrier()
    return {"stage": topo.stage.value, "cp_rank": topo.cp_rank, "cp": topo.cp_size, "got": got}


def _same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    if a is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a, b.view(torch.uint8) if b.dtype == torch.bfloat16 else b))  # fmt: skip


def check(r: dict[str, Any], layout: str) -> None:
    last, first = r["stage"] in ("only", "last"), r["stage"] in ("only", "first")
    for item, got in zip(stream(), r["got"], strict=True):
        merged = torch.tensor([0, 8, 16, 24, 32], dtype=torch.int32)  # rows merged
        keep = cp_indices(merged, r["cp"], r["cp_rank"], layout=layout)
        for name in ("advantages", "old_logprobs", "labels"):
            want = item[name].reshape(1, -1)[:, keep]
            assert _same(got[name], want) if last else got[name] is None, (r["stage"], name)
        assert torch.equal(got["reward"], item["reward"])
        for name in ("pixel_values", "image_grid_thw"):
            want = torch.cat(item[name])
            assert torch.equal(got[name], want) if first else got[name] is None, (r["stage"], name)


GRIDS = [Grid(2, 2), Grid(2, 1, 2), Grid(1, 2, 2), Grid(1, 1, 4)]


@pytest.mark.parametrize("ahead", [False, True], ids=["call", "prefetch"])
@pytest.mark.parametrize("mode", ["auto", "split"])
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: g.id)
def test_fields_reach_their_stages_and_cp_shares(
    dist_pool: Any, grid: Grid, mode: str, ahead: bool
) -> None:
    for layout in ("document", "row") if grid.cp > 1 else ("document",):
        results = dist_pool.run(
            run_fields, grid.world_size, grid.tp, grid.pp, grid.cp, mode, layout, ahead, timeout=90
        )
        for r in results:
            check(r, layout)


def run_mismatch() -> str:
    topo = grid_topology(dist.get_world_size(), 1)
    fields = FIELDS if dist.get_rank() != 1 else FIELDS[:2]  # rank 1 forgot three declarations
    try:
        get_batch_on_this_tp_rank(
            iter(stream()) if topo.is_source else None, topology=topo, fields=fields
        )
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_declare_different_fields_all_fail_naming_the_ranks(dist_pool: Any) -> None:
    for message in dist_pool.run(run_mismatch, 3, timeout=60):
        assert message.startswith("TP ranks passed different fields= to get_batch_on_this_tp_rank")
        assert "rank 1: [('advantages'" in message and "rank 2: [('advantages'" in message
        assert "'pixel_values'" in message.split("rank 1:")[1].split("rank 2:")[1]


def run_align_mismatch() -> str:
    topo = grid_topology(dist.get_world_size(), 1)
    old = BatchField("old_logprobs", "token", torch.bfloat16, "last", at="token")
    fields = FIELDS if dist.get_rank() != 1 else (FIELDS[0], old, *FIELDS[2:])  # rank 1: at="token"
    try:
        get_batch_on_this_tp_rank(
            iter(stream()) if topo.is_source else None, topology=topo, fields=fields
        )
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_align_ranks_that_declare_another_alignment_all_fail_naming_it(dist_pool: Any) -> None:
    """A field's ``at`` is part of what TP ranks compare: a rank declaring old_logprobs at its
    tokens while the others declare it at the labels fails on every rank, naming both."""
    for message in dist_pool.run(run_align_mismatch, 2, timeout=60):
        assert message.startswith("TP ranks passed different fields= to get_batch_on_this_tp_rank")
        rank0, rank1 = message.split("rank 1:")
        assert "('old_logprobs', 'token', 'torch.bfloat16', 'last', 'at=label')" in rank0
        assert "('old_logprobs', 'token', 'torch.bfloat16', 'last', 'at=token')" in rank1


def run_bad_then_good() -> list[str]:
    topo = grid_topology(dist.get_world_size(), 1)
    good = stream(1)[0]
    bad = [good | {"advantages": good["advantages"][:, :3]}, {k: v for k, v in good.items() if k != "reward"},
           good | {"pixel_values": good["pixel_values"][:1]}, good | {"extra": 1}]  # fmt: skip
    data = iter([x for b in bad for x in (b, good)]) if topo.is_source else None
    outcomes = []
    for _ in range(2 * len(bad)):
        try:
            out = get_batch_on_this_tp_rank(data, topology=topo, fields=FIELDS)
            outcomes.append("ok" if torch.equal(out["reward"], good["reward"]) else "wrong")
        except Exception as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}"[:90])
    dist.barrier()
    return outcomes


def test_a_bad_field_fails_the_source_reaches_peers_and_the_stream_goes_on(dist_pool: Any) -> None:
    source, peer = dist_pool.run(run_bad_then_good, 2, timeout=60)
    assert source[1::2] == peer[1::2] == ["ok"] * 4  # the next batch is delivered intact
    assert source[0].startswith("ValueError: batch['advantages'] has shape (2, 3)")
    assert source[2].startswith("ValueError: batch is missing 'reward', declared in fields=")
    assert source[4].startswith("ValueError: batch['pixel_values'] is a list of 1 tensors")
    assert source[6].startswith("ValueError: batch has undeclared keys ['extra']")
    for s, p in zip(source[::2], peer[::2], strict=True):
        assert p.startswith("RemoteDataError: TP source rank 0 failed: ") and s[:40] in p
