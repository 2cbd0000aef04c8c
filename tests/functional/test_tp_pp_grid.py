"""get_batch_on_this_tp_rank on every tp x pp grid: each rank checks its fields against a local expectation.

Every TP source reads the same stream, which mixes every accepted input form (PackedBatch with and
without per-document padding, Megatron SFT rows with -1 and with repeated-s sentinels, a plain
pretraining batch with an attention mask). The test process computes what each stage must
receive with a deliberately simple reference, independent of megapack's field table.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megapack import PackedBatch, Topology, get_batch_on_this_tp_rank
from megapack.delivery.transport import use_transport
from megapack.harness.grid import grid_topology
from megapack.testing.grids import GRIDS, Grid

pytestmark = pytest.mark.distributed

TENSOR_KEYS = (
    "tokens",
    "labels",
    "loss_mask",
    "attention_mask",
    "position_ids",
    "cu_seqlens",
    "cu_seqlens_padded",
)
COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_object", "broadcast_object_list", "barrier",
               "send", "recv", "gather", "scatter", "reduce")  # fmt: skip
S = 16  # sequence length of a Megatron-style row


# ---------------------------------------------------------------- the stream every source reads


def _docs(gen: torch.Generator, total: int) -> list[list[int]]:
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(1, 7, (1,), generator=gen)), total - sum(lengths)))
    return [torch.randint(1, 30_000, (n,), generator=gen).tolist() for n in lengths]


def _sft(gen: torch.Generator, mbs: int, sentinel: int | None) -> dict[str, torch.Tensor]:
    rows = [PackedBatch.from_documents(_docs(gen, S - int(torch.randint(0, 4, (1,), generator=gen))), seq_len=S)
            for _ in range(mbs)]  # fmt: skip
    width = max(len(r.cu_seqlens) for r in rows) + 2
    cu = torch.full((mbs, width), S if sentinel is None else sentinel, dtype=torch.int32)
    for i, r in enumerate(rows):
        cu[i, : len(r.cu_seqlens)] = r.cu_seqlens
    out = {
        k: torch.cat([getattr(r, k) for r in rows])
        for k in ("tokens", "labels", "loss_mask", "position_ids")
    }
    return {**out, "cu_seqlens": cu}


def stream(mbs: int, seed: int = 0) -> list[Any]:
    """Micro-batches of every accepted form; identical on every source (same seed)."""
    gen = torch.Generator().manual_seed(seed)
    plain_tokens = torch.randint(1, 30_000, (mbs, S), generator=gen)
    return [
        PackedBatch.from_documents(_docs(gen, mbs * S - 5)),
        _sft(gen, mbs, sentinel=-1),
        _sft(gen, mbs, sentinel=None),
        PackedBatch.from_documents(_docs(gen, mbs * S // 2), pad_to_multiple_of=4, seq_len=mbs * S),
        {
            "tokens": plain_tokens,
            "labels": torch.roll(plain_tokens, -1, dims=1),
            "loss_mask": torch.ones(mbs, S),
            "position_ids": torch.arange(S).repeat(mbs, 1),
            "attention_mask": ~torch.tril(torch.ones(S, S, dtype=torch.bool)).expand(mbs, 1, S, S),
        },
    ]


# ---------------------------------------------------------------- the reference, in the test process


def merged_cu(rows: torch.Tensor, s: int) -> list[int]:
    out = [0]
    for r, row in enumerate(rows.tolist()):
        cut = row.index(s)
        out += [v + r * s for v in row[1 : cut + 1]]
    return out


def expected(item: Any, stage: str) -> dict[str, Any]:
    """What ``stage`` must receive for ``item``: written out per case, not derived from megapack's table."""
    if isinstance(item, PackedBatch):
        full: dict[str, Any] = {
            k: getattr(item, k) for k in ("tokens", "labels", "loss_mask", "position_ids")
        }
        full |= {"cu_seqlens": item.cu_seqlens.tolist(), "max_seqlen": item.max_seqlen, "attention_mask": None,
                 "cu_seqlens_padded": None if item.cu_seqlens_padded is None else item.cu_seqlens_padded.tolist()}  # fmt: skip
    elif "cu_seqlens" in item:
        full = {k: item[k].reshape(1, -1) for k in ("tokens", "labels", "position_ids")}
        full["loss_mask"] = item["loss_mask"].reshape(1, -1).float()
        cu = merged_cu(item["cu_seqlens"], item["tokens"].shape[1])
        full |= {"cu_seqlens": cu, "cu_seqlens_padded": None, "attention_mask": None,
                 "max_seqlen": max(b - a for a, b in itertools.pairwise(cu))}  # fmt: skip
    else:
        full = {
            k: item[k] for k in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
        }
        full |= {"cu_seqlens": None, "cu_seqlens_padded": None, "max_seqlen": None}
    keep = {
        "only": set(full),
        "first": {
            "tokens",
            "position_ids",
            "attention_mask",
            "cu_seqlens",
            "cu_seqlens_padded",
            "max_seqlen",
        },
        "middle": {"attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen"},
        "last": {
            "labels",
            "loss_mask",
            "attention_mask",
            "cu_seqlens",
            "cu_seqlens_padded",
            "max_seqlen",
        },
    }[stage]
    return {k: (v if k in keep else None) for k, v in full.items()}


# ---------------------------------------------------------------- what runs on each rank


def _count_collectives() -> dict[str, int]:
    counts = {"n": 0}
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counting(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            counts["n"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
    return counts


def _summary(out: dict[str, Any]) -> dict[str, Any]:
    """A picklable record of one output (PackedSeqParams stays in the worker)."""
    psp = out["packed_seq_params"]
    rec: dict[str, Any] = {k: out[k] for k in TENSOR_KEYS}
    rec["keys"] = sorted(out)
    rec["max_seqlen"] = out["max_seqlen"]
    rec["max_seqlen_type"] = type(out["max_seqlen"]).__name__
    rec["psp"] = None if psp is None else (
        psp.qkv_format, psp.cu_seqlens_q is out["cu_seqlens"], psp.cu_seqlens_kv is out["cu_seqlens"],
        psp.cu_seqlens_q_padded is out["cu_seqlens_padded"], psp.max_seqlen_q, type(psp.max_seqlen_kv).__name__,
    )  # fmt: skip
    return rec


def run_stream(tp: int, pp: int, mbs: int, use_megatron: bool) -> dict[str, Any]:
    if use_megatron:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
        topo: Topology | None = None  # get_batch reads megatron-core's parallel_state itself
        mine = Topology.from_parallel_state()
        rank, pp_rank = dist.get_rank(), dist.get_rank() // tp
        want_ranks = tuple(range(pp_rank * tp, (pp_rank + 1) * tp))
        got = (mine.tp_ranks, mine.tp_rank, mine.pp_rank, mine.pp_size)
        if got != (want_ranks, rank % tp, pp_rank, pp):
            raise AssertionError(f"rank {rank}: Topology.from_parallel_state gave {got}")
    else:
        topo = mine = grid_topology(tp, pp)
    counts = _count_collectives()
    data = iter(stream(mbs)) if mine.is_source else None
    steps, per_call = [], []
    while True:
        before = counts["n"]
        try:
            steps.append(_summary(get_batch_on_this_tp_rank(data, topology=topo)))
        except StopIteration:
            per_call.append(counts["n"] - before)
            break
        per_call.append(counts["n"] - before)
    dist.barrier()  # leave together: a rank tearing down early breaks a peer still connecting
    return {
        "stage": mine.stage.value,
        "tp_rank": mine.tp_rank,
        "steps": steps,
        "collectives": per_call,
    }


def check_rank(result: dict[str, Any], mbs: int, tp: int) -> None:
    items = stream(mbs)
    where = f"stage {result['stage']} tp_rank {result['tp_rank']}"
    assert len(result["steps"]) == len(items), f"{where}: got {len(result['steps'])} batches"
    for i, (got, item) in enumerate(zip(result["steps"], items, strict=True)):
        want = expected(item, result["stage"])
        at = f"{where} step {i}"
        extra = ["dataset_id", "local_cp_size", "max_seqlen", "packed_seq_params"]
        assert got["keys"] == sorted([*TENSOR_KEYS, *extra]), at
        for key in TENSOR_KEYS:
            w, g = want[key], got[key]
            if w is None:
                assert g is None, f"{at}: {key} should be None"
            elif isinstance(w, list):
                assert (
                    g is not None and g.dim() == 1 and g.dtype == torch.int32 and g.tolist() == w
                ), f"{at}: {key}"
            else:
                assert g is not None and g.shape == w.shape and g.dtype == w.dtype, (
                    f"{at}: {key} {g} vs {w}"
                )
                assert torch.equal(g, w), f"{at}: {key} values differ"
        assert got["max_seqlen"] == want["max_seqlen"], at
        if want["cu_seqlens"] is None:
            assert got["psp"] is None, at
        else:
            assert got["max_seqlen_type"] == "int", at
            assert got["psp"] == ("thd", True, True, True, want["max_seqlen"], "int"), at
    # The group's first call sets up (fields check, local link: 4 collectives); then at most 2
    # collectives per batch, 1 for the clean stop, none at all without TP peers.
    limit = 2 if tp > 1 else 0
    assert result["collectives"][0] <= limit + (4 if tp > 1 else 0), result["collectives"]
    assert max(result["collectives"][1:-1]) <= limit, (
        f"{where}: collectives per call {result['collectives']}"
    )
    assert result["collectives"][-1] <= (1 if tp > 1 else 0), (
        f"{where}: stop used {result['collectives'][-1]}"
    )


@pytest.mark.parametrize("mbs", [1, 3], ids=lambda m: f"mbs{m}")
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: g.id)
def test_every_rank_gets_its_stage_fields(dist_pool: Any, grid: Grid, mbs: int) -> None:
    results = dist_pool.run(run_stream, grid.world_size, grid.tp, grid.pp, mbs, False, timeout=60)
    stages = [r["stage"] for r in results]
    assert stages.count("middle") == grid.tp * max(grid.pp - 2, 0)
    for r in results:
        check_rank(r, mbs, grid.tp)


@pytest.mark.parametrize(
    "grid", [Grid(2, 2), Grid(4, 2), Grid(2, 3), Grid(1, 4)], ids=lambda g: g.id
)
def test_topology_from_megatron_parallel_state(dist_pool: Any, grid: Grid) -> None:
    results = dist_pool.run(run_stream, grid.world_size, grid.tp, grid.pp, 2, True, timeout=90)
    for r in results:
        check_rank(r, 2, grid.tp)


# ---------------------------------------------------------------- failures reach every rank


class FailingIterator:
    """Yields ``good`` batches, then raises (``mode="raise"``) or yields a bad batch (``mode="bad"``)."""

    def __init__(self, good: int, mode: str) -> None:
        self.items = stream(1)[:good]
        self.mode = mode

    def __iter__(self) -> FailingIterator:
        return self

    def __next__(self) -> Any:
        if self.items:
            return self.items.pop(0)
        if self.mode == "raise":
            self.mode = "done"
            raise OSError("shard /data/part-7.jsonl vanished")
        if self.mode == "bad":
            self.mode = "done"
            bad = _sft(torch.Generator().manual_seed(3), 2, sentinel=-1)
            bad["cu_seqlens"][1, 2] = bad["cu_seqlens"][1, 1]  # row 1 repeats a boundary
            return bad
        return stream(1)[0]  # recovered: the next batch is good again


def run_failure(tp: int, pp: int, mode: str) -> dict[str, Any]:
    topo = grid_topology(tp, pp)
    data = FailingIterator(2, mode) if topo.is_source else None
    events: list[tuple[str, str, float]] = []
    for _ in range(4):
        t0 = time.perf_counter()
        try:
            out = get_batch_on_this_tp_rank(data, topology=topo)
            events.append(("ok", str(out["cu_seqlens"].tolist()), time.perf_counter() - t0))
        except StopIteration:
            events.append(("StopIteration", "", time.perf_counter() - t0))
        except Exception as exc:
            events.append((type(exc).__name__, str(exc), time.perf_counter() - t0))
    return {"tp_rank": topo.tp_rank, "src": topo.src_rank, "events": events}


@pytest.mark.parametrize("mode", ["raise", "bad"])
@pytest.mark.parametrize("grid", [Grid(2, 2), Grid(4, 2)], ids=lambda g: g.id)
def test_source_failure_reaches_every_tp_rank(dist_pool: Any, grid: Grid, mode: str) -> None:
    results = dist_pool.run(run_failure, grid.world_size, grid.tp, grid.pp, mode, timeout=30)
    good = stream(1)
    for r in results:
        kinds = [e[0] for e in r["events"]]
        assert kinds == ["ok", "ok", "ValueError" if mode == "bad" else "OSError", "ok"] if r["tp_rank"] == 0 else \
            kinds == ["ok", "ok", "RemoteDataError", "ok"], r  # fmt: skip
        name, message, seconds = r["events"][2]
        assert seconds < 5, f"failure took {seconds:.1f}s to reach tp_rank {r['tp_rank']}"
        if mode == "bad":
            assert "cu_seqlens row 1 is not strictly increasing" in message
        else:
            assert "shard /data/part-7.jsonl vanished" in message
        if name == "RemoteDataError":
            assert f"TP source rank {r['src']} failed" in message
        # The step after the failure is delivered intact: the protocol stayed in step.
        assert r["events"][3][1] == str(good[0].cu_seqlens.tolist())


def run_plain_without_mask(tp: int, pp: int) -> list[dict[str, Any]]:
    topo = grid_topology(tp, pp)
    plain = {k: v for k, v in stream(2)[-1].items() if k != "attention_mask"}
    data = iter([plain, stream(2)[0]]) if topo.is_source else None
    return [_summary(get_batch_on_this_tp_rank(data, topology=topo)) for _ in range(2)]


def test_stage_that_needs_no_bytes_stays_in_step(dist_pool: Any) -> None:
    # A middle stage gets nothing from a plain batch without attention_mask: an empty payload must
    # not be sent, or the next header is read from the wrong collective.
    results = dist_pool.run(run_plain_without_mask, 6, 2, 3, timeout=30)
    for rank, (plain, packed) in enumerate(results):
        if rank // 2 == 1:
            assert all(plain[k] is None for k in TENSOR_KEYS), rank
        assert packed["cu_seqlens"].tolist() == stream(2)[0].cu_seqlens.tolist(), rank


def run_exhausted_at_start(tp: int) -> list[str]:
    topo = grid_topology(tp, 1)
    data = iter([]) if topo.is_source else None
    outcomes = []
    for _ in range(2):
        try:
            get_batch_on_this_tp_rank(data, topology=topo)
            outcomes.append("ok")
        except StopIteration:
            outcomes.append("StopIteration")
    return outcomes


def test_empty_iterator_stops_every_rank_every_time(dist_pool: Any) -> None:
    assert dist_pool.run(run_exhausted_at_start, 4, 4, timeout=30) == [["StopIteration"] * 2] * 4


def run_mismatched_stages() -> str:
    # A hand-built Topology that puts TP peers on different pipeline stages: the receiver must refuse.
    group = dist.new_group([0, 1])
    topo = Topology.from_groups(group, pp_rank=dist.get_rank(), pp_size=2)
    data = iter(stream(1)) if topo.is_source else None
    try:
        get_batch_on_this_tp_rank(data, topology=topo)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def test_peers_on_different_stages_are_refused(dist_pool: Any) -> None:
    source, receiver = dist_pool.run(run_mismatched_stages, 2, timeout=30)
    assert source == "ok"
    assert receiver.startswith("ProtocolError: TP source rank 0 serves pipeline stage 'first'")
    assert "this rank is on stage 'last'" in receiver


def run_steady_state(tp: int, row_lengths: list[int], mode: str) -> list[int]:
    """Collectives per call (and the final stop) for rows of the given lengths, 8-token documents."""
    with use_transport(mode):
        return _steady_state(tp, row_lengths)


def _steady_state(tp: int, row_lengths: list[int]) -> list[int]:
    topo = grid_topology(tp, 1)
    counts = _count_collectives()
    rows = [PackedBatch.from_documents([[7] * 8] * (n // 8), seq_len=n) for n in row_lengths]
    data = iter(rows) if topo.is_source else None
    per_call = []
    for _ in range(len(rows) + 1):
        before = counts["n"]
        with contextlib.suppress(StopIteration):
            get_batch_on_this_tp_rank(data, topology=topo)
        per_call.append(counts["n"] - before)
    return per_call


def test_steady_state_on_collectives_is_header_and_payload(dist_pool: Any) -> None:
    # Links off: the first call checks that every rank declared the same fields (1 all-gather);
    # every batch is then a header broadcast and a payload broadcast, the stop a header alone.
    lengths = [64, 64, 64, 256, 256, 64, 64]
    results = dist_pool.run(run_steady_state, 4, 4, lengths, "collectives", timeout=30)
    assert all(r == [3, 2, 2, 2, 2, 2, 2, 1] for r in results), results


def test_steady_state_on_a_local_link_is_no_collective(dist_pool: Any) -> None:
    # The first call checks the fields (1 all-gather) and sets up the local link (an all-gather
    # of pids, address and secret, and two all-reduces: everyone reached it, everyone was
    # accepted); after that frames of any size use no collective.
    lengths = [64, 64, 64, 256, 256, 64, 64]
    results = dist_pool.run(run_steady_state, 4, 4, lengths, "auto", timeout=30)
    assert all(r == [4, 0, 0, 0, 0, 0, 0, 0] for r in results), results
