"""get_batch_on_this_tp_rank with context parallelism on tp x pp x cp grids, both CP layouts.

Every CP rank's TP source reads the same stream of full rows. The test process computes what
each rank must return: the full-row expectation of the tp x pp grid test, then the CP rank's share
taken with `megapack.core.cp_share.cp_indices` from the whole row's boundaries. Every collective's size is
recorded on every rank; TP peers must agree call by call (gloo accepts mismatched broadcasts).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megapack import PackedBatch, Topology, get_batch_on_this_tp_rank
from megapack.core.cp_share import CP_LAYOUTS, cp_indices
from megapack.delivery.transport import use_transport
from megapack.harness.grid import grid_topology
from megapack.testing.grids import CP_GRIDS, Grid
from tests.functional.test_tp_pp_grid import COLLECTIVES, TENSOR_KEYS, expected

pytestmark = pytest.mark.distributed

S = 32  # row length of a Megatron-style row; a multiple of 2 * cp for every cp tested
MBS = (1, 2)
GRID_TOKENS = ("tokens", "labels", "loss_mask", "position_ids")


# ---------------------------------------------------------------- the stream every CP source reads


def _lengths(gen: torch.Generator, total: int, step: int) -> list[int]:
    """Document lengths, multiples of ``step``, summing to at most ``total``."""
    out: list[int] = []
    while True:
        n = step * int(torch.randint(1, 4, (1,), generator=gen))
        if sum(out) + n > total:
            return out or [step]
        out.append(n)


def _tokens(gen: torch.Generator, lengths: list[int]) -> list[list[int]]:
    return [torch.randint(1, 30_000, (n,), generator=gen).tolist() for n in lengths]


def _sft(gen: torch.Generator, mbs: int, cp: int) -> dict[str, torch.Tensor]:
    """Megatron SFT rows whose documents (and row tails) are multiples of 2 * cp, -1 sentinels."""
    rows = [
        PackedBatch.from_documents(_tokens(gen, _lengths(gen, S - 2 * cp, 2 * cp)), seq_len=S)
        for _ in range(mbs)
    ]
    cu = torch.full((mbs, max(len(r.cu_seqlens) for r in rows) + 1), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        cu[i, : len(r.cu_seqlens)] = r.cu_seqlens
    grid = {k: torch.cat([getattr(r, k) for r in rows]) for k in GRID_TOKENS}
    return {**grid, "cu_seqlens": cu}


def stream(mbs: int, cp: int, seed: int = 0) -> list[Any]:
    """Micro-batches of every accepted form, every one splittable by both layouts except item 3.

    Item 3 has odd-length documents without per-document padding: the "row" layout splits it,
    the "document" layout must refuse it on every rank and stay in step for item 4.
    """
    gen = torch.Generator().manual_seed(seed)
    odd = [int(torch.randint(1, 5, (1,), generator=gen)) * 2 + 1 for _ in range(3)]
    plain_tokens = torch.randint(1, 30_000, (mbs, S), generator=gen)
    return [
        PackedBatch.from_documents(
            _tokens(gen, [7, 1, 2, 5][: 2 + mbs]), pad_to_multiple_of=2 * cp, seq_len=mbs * S
        ),
        _sft(gen, mbs, cp),
        {
            "tokens": plain_tokens,
            "labels": torch.roll(plain_tokens, -1, dims=1),
            "loss_mask": torch.rand(mbs, S, generator=gen).round(),
            "position_ids": torch.arange(S).repeat(mbs, 1),
            "attention_mask": ~torch.tril(torch.ones(S, S, dtype=torch.bool)).expand(mbs, 1, S, S),
        },
        PackedBatch.from_documents(_tokens(gen, odd), seq_len=mbs * S),
        PackedBatch.from_documents(
            _tokens(gen, [3, 1]), pad_to_multiple_of=2 * cp, seq_len=mbs * S
        ),
    ]


# ---------------------------------------------------------------- the reference, in the test process


def cp_expected(item: Any, stage: str, cp: int, cp_rank: int, layout: str) -> dict[str, Any] | str:
    """The full-row expectation cut to ``cp_rank``'s share, or the error text the source must raise."""
    want = expected(item, stage)
    if cp == 1:
        return want
    if want["cu_seqlens"] is None:  # plain [b, s]: every row split as one span, mask on dim 2
        index = cp_indices([0, S], cp, cp_rank, layout="row")
        dims = {k: 1 for k in GRID_TOKENS} | {"attention_mask": 2}
    else:
        buffer = want["cu_seqlens_padded"] or want["cu_seqlens"]
        lengths = [b - a for a, b in itertools.pairwise(buffer)]
        bad = [i for i, n in enumerate(lengths) if n % (2 * cp)]
        if layout == "document" and bad:
            return f"document {bad[0]} spans {lengths[bad[0]]} positions, not a multiple of 2*cp={2 * cp}"
        index = cp_indices(buffer, cp, cp_rank, layout=layout)  # type: ignore[arg-type]
        dims = dict.fromkeys(GRID_TOKENS, 1)
    for key, dim in dims.items():
        if want[key] is not None:
            want[key] = want[key].index_select(dim, index)
    return want


# ---------------------------------------------------------------- what runs on each rank


def _record_collectives() -> list[tuple[str, int]]:
    """Patch torch.distributed so every collective appends (name, bytes of its tensors)."""
    log: list[tuple[str, int]] = []
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def recording(
            *args: Any, _original: Any = original, _name: str = name, **kwargs: Any
        ) -> Any:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [
                t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)
            ]
            log.append((_name, sum(t.numel() * t.element_size() for t in tensors)))
            return _original(*args, **kwargs)

        setattr(dist, name, recording)
    return log


def _summary(out: dict[str, Any]) -> dict[str, Any]:
    psp = out["packed_seq_params"]
    rec: dict[str, Any] = {k: out[k] for k in TENSOR_KEYS}
    rec["max_seqlen"] = out["max_seqlen"]
    rec["psp"] = None if psp is None else {
        "cu_q": psp.cu_seqlens_q is out["cu_seqlens"],
        "cu_kv_padded": psp.cu_seqlens_kv_padded is out["cu_seqlens_padded"],
        "max_seqlen_kv": psp.max_seqlen_kv,
        "cp_ranks": None if psp.cp_group is None else tuple(dist.get_process_group_ranks(psp.cp_group)),
    }  # fmt: skip
    return rec


def run_cp_grid(
    tp: int, pp: int, cp: int, use_megatron: bool = False, links: bool = True
) -> dict[str, Any]:
    """Both layouts x micro-batch sizes 1 and 2 on one process group: every call's output and sizes.

    With ``use_megatron`` the Topology comes from megatron-core's parallel_state instead, and
    must equal the hand-built one of the same grid. ``links``: TP peers on local links (the
    default on one host) or gloo frames, whose every collective size is recorded.
    """
    with use_transport("auto" if links else "collectives"):
        return _run_cp_grid(tp, pp, cp, use_megatron)


def _run_cp_grid(tp: int, pp: int, cp: int, use_megatron: bool) -> dict[str, Any]:
    topo = grid_topology(tp, pp, cp)  # cp_layout "document" on the Topology, "row" per call
    if use_megatron:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
        )
        mine = Topology.from_parallel_state()
        fields = ("tp_ranks", "tp_rank", "pp_rank", "pp_size", "cp_ranks", "cp_rank", "cp_layout")
        got, want = ([getattr(t, f) for f in fields] for t in (mine, topo))
        if got != want:
            raise AssertionError(f"rank {dist.get_rank()}: from_parallel_state {got} != {want}")
        topo = mine
    log = _record_collectives()
    runs: dict[str, Any] = {}
    for layout in CP_LAYOUTS:
        for mbs in MBS:
            data = iter(stream(mbs, cp)) if topo.is_source else None
            steps: list[Any] = []
            start = len(log)
            while True:
                try:
                    out = get_batch_on_this_tp_rank(
                        data, topology=topo, cp_layout=None if layout == "document" else "row"
                    )
                    steps.append(_summary(out))
                except StopIteration:
                    break
                except Exception as exc:
                    steps.append(f"{type(exc).__name__}: {exc}")
            runs[f"{layout}-mbs{mbs}"] = {"steps": steps, "sizes": log[start:]}
    dist.barrier()  # leave together: a rank tearing down early breaks a peer still connecting a group
    return {
        "stage": topo.stage.value,
        "tp_ranks": topo.tp_ranks,
        "tp_rank": topo.tp_rank,
        "cp_rank": topo.cp_rank,
        "cp_ranks": topo.cp_ranks,
        "runs": runs,
    }


def check_rank(r: dict[str, Any], cp: int) -> None:
    for key, run in r["runs"].items():
        layout, mbs = key.split("-mbs")
        items = stream(int(mbs), cp)
        where = f"stage {r['stage']} tp_rank {r['tp_rank']} cp_rank {r['cp_rank']} {key}"
        assert len(run["steps"]) == len(items), f"{where}: {len(run['steps'])} outputs"
        for i, (got, item) in enumerate(zip(run["steps"], items, strict=True)):
            want = cp_expected(item, r["stage"], cp, r["cp_rank"], layout)
            at = f"{where} step {i}"
            if isinstance(want, str):
                kind = "ValueError" if r["tp_rank"] == 0 else "RemoteDataError"
                assert isinstance(got, str) and got.startswith(kind) and want in got, f"{at}: {got}"
                assert "pad_to_multiple_of" in got, at
                continue
            assert isinstance(got, dict), f"{at}: {got}"
            for k in TENSOR_KEYS:
                w, g = want[k], got[k]
                if w is None:
                    assert g is None, f"{at}: {k} should be None"
                elif isinstance(w, list):
                    assert g is not None and g.dtype == torch.int32 and g.tolist() == w, (
                        f"{at}: {k}"
                    )
                else:
                    assert g is not None and g.shape == w.shape and g.dtype == w.dtype, f"{at}: {k}"
                    assert torch.equal(g, w), f"{at}: {k} values differ"
            assert got["max_seqlen"] == want["max_seqlen"], at
            if want["cu_seqlens"] is None:
                assert got["psp"] is None, at
            else:
                cp_ranks = r["cp_ranks"] if cp > 1 else None
                assert got["psp"] == {"cu_q": True, "cu_kv_padded": True,
                                      "max_seqlen_kv": want["max_seqlen"], "cp_ranks": cp_ranks}, at  # fmt: skip


@pytest.mark.parametrize("grid", CP_GRIDS, ids=lambda g: g.id)
def test_cp_grid_every_rank_gets_its_share(dist_pool: Any, grid: Grid) -> None:
    results = dist_pool.run(
        run_cp_grid, grid.world_size, grid.tp, grid.pp, grid.cp, False, False, timeout=120
    )
    for r in results:
        check_rank(r, grid.cp)
    # Every collective of every call has the same size on every rank of a TP group.
    groups: dict[tuple[int, ...], list[Any]] = {}
    for r in results:
        groups.setdefault(r["tp_ranks"], []).append({k: v["sizes"] for k, v in r["runs"].items()})
    for ranks, logs in groups.items():
        assert all(log == logs[0] for log in logs), (
            f"TP group {ranks} disagrees on collective sizes"
        )
        if grid.tp > 1:
            assert all(len(v) >= len(stream(1, grid.cp)) for v in logs[0].values()), ranks


@pytest.mark.parametrize("grid", [Grid(2, 1, 2), Grid(2, 2, 2)], ids=lambda g: g.id)
def test_cp_grid_over_local_links(dist_pool: Any, grid: Grid) -> None:
    # The same calls with TP peers on local links: the same outputs, and no collective after the
    # set-up on the first call (the fields check, and the link's all-gather and two all-reduces).
    results = dist_pool.run(
        run_cp_grid, grid.world_size, grid.tp, grid.pp, grid.cp, False, True, timeout=120
    )
    for r in results:
        check_rank(r, grid.cp)
        sizes = [v["sizes"] for v in r["runs"].values()]
        assert len(sizes[0]) == 4 and not any(sizes[1:]), (r["tp_ranks"], sizes)


def test_cp_topology_from_megatron_parallel_state(dist_pool: Any) -> None:
    grid = Grid(2, 2, 2)
    results = dist_pool.run(run_cp_grid, 8, grid.tp, grid.pp, grid.cp, True, timeout=120)
    for r in results:
        check_rank(r, grid.cp)


def run_bytes(tp: int, cp: int, n_rows: int) -> int:
    """Bytes this rank's collectives moved for ``n_rows`` rows of 4096 tokens (16 documents each),
    on gloo frames (links off: a local link moves the same frames without collectives)."""
    with use_transport("collectives"):
        return _run_bytes(tp, cp, n_rows)


def _run_bytes(tp: int, cp: int, n_rows: int) -> int:
    topo = grid_topology(tp, 1, cp)
    log = _record_collectives()
    rows = [
        PackedBatch.from_documents([[7] * 256] * 16, pad_to_multiple_of=8) for _ in range(n_rows)
    ]
    data = iter(rows) if topo.is_source else None
    for _ in rows:
        get_batch_on_this_tp_rank(data, topology=topo)
    moved = sum(n for _, n in log)
    dist.barrier()
    return moved


def test_cp_halves_the_bytes_each_tp_peer_receives(dist_pool: Any) -> None:
    without = dist_pool.run(run_bytes, 2, 2, 1, 6, timeout=60)
    with_cp = dist_pool.run(run_bytes, 4, 2, 2, 6, timeout=60)
    # TP peers move the same bytes; the two CP ranks' shares differ slightly in lean label
    # exceptions (their zigzag chunks end at different positions, megapack.codec)
    assert len(set(without)) == 1 and with_cp[0] == with_cp[1] and with_cp[2] == with_cp[3], (
        without,
        with_cp,
    )
    ratio = sum(with_cp) / 4 / without[0]
    assert 0.45 < ratio < 0.6, f"cp=2 moves {with_cp[0]} bytes per TP rank, cp=1 {without[0]}"
