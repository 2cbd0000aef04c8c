"""The GPU kit's smoke section on CPU, on the worker pool (megatron-core's GPT in a gloo world of 1):
the section as the dry run runs it (bucketed, and sdpa, refused before any warm-up as expected,
their eager steps timed; cudnn and torch_varlen unavailable, saying why), and its comparison of
replays with eager catching a replay that read the wrong pack. A capture needs CUDA: a stand-in
for the captured step (an eager GraphStep that calls its steps after the warm-up replays) runs
the same comparison here; the real capture is the kit's on a GPU."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

SEQ, ROWS = 128, 2


def world() -> tuple[torch.device, Any, dict[str, list[Any]], list[np.ndarray]]:
    """megatron-core on CPU, tp = pp = 1; (device, static shape, packs A and B delivered, docs)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack import BUCKET_FIELDS, StaticShape, Topology, get_batch_on_this_tp_rank
    from megapack.bench.gpu.model import TOY
    from megapack.bench.gpu.smoke import CAP, MICRO_BATCHES, two_packs
    from megapack.core.static import segments_for
    from megapack.harness.megatron_cpu import megatron_on_cpu

    megatron_on_cpu()
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    device = torch.device("cpu")
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, TOY.vocab_size, n) for n in rng.integers(1, 60, 64)]
    static = StaticShape(max_segments=segments_for(CAP, ROWS), max_seqlen=SEQ)
    made = two_packs(docs, SEQ, ROWS, MICRO_BATCHES)
    topology = Topology.single(device)
    packs = {key: [get_batch_on_this_tp_rank(iter([b]), topology=topology, static=static,
                                             fields=BUCKET_FIELDS) for b in pack]
             for key, pack in zip("AB", made, strict=True)}  # fmt: skip
    return device, static, packs, docs


def section_task() -> list[tuple[str, str, str]]:
    from megapack.bench.gpu.model import TOY
    from megapack.bench.gpu.smoke import BACKENDS, smoke_checks

    device, _, _, docs = world()
    checks = smoke_checks(TOY, docs, device=device, dtype=torch.float32, seq_len=SEQ, rows=ROWS,
                          backends=(*BACKENDS, "sdpa"))  # fmt: skip
    return [(c.name, c.status, c.detail) for c in checks]


@pytest.mark.distributed
def test_the_smoke_section_on_cpu(dist_pool: Any) -> None:
    (checks,) = dist_pool.run(section_task, 1, timeout=120)
    by_name = {name: (status, detail) for name, status, detail in checks}
    assert [s for _, s, _ in checks].count("failed") == 0, checks
    for name in ("cudnn", "torch_varlen"):
        assert by_name[f"smoke: {name}"] == ("skipped", f"cannot train float32 on cpu here: {name} runs on CUDA only")  # fmt: skip
    for name, why in (("bucketed", "its bucket shapes change with every micro-batch"),
                      ("sdpa", "it loops over the documents with their boundaries read on the host")):  # fmt: skip
        status, detail = by_name[f"smoke: {name}: refused by GraphStep before its warm-up (expected: a capture cannot hold it)"]  # fmt: skip
        assert status == "passed", detail
        assert f"it runs '{name}' (forced), and {why}" in detail
        assert "warm-up steps run 0, optimizer state none, weights unchanged" in detail
        assert by_name[f"smoke: {name}: eager step time"][0] == "info"
    skipped = [name for name, status, _ in checks if status == "skipped"]
    assert any(n.startswith("sync: positive control") for n in skipped)
    assert any(n.startswith("host-wait probe: positive control") for n in skipped)


class StandIn:
    """The captured step's stand-in: an eager GraphStep whose steps after the warm-up count as
    replays; ``swap`` makes its fourth step (a replay of pack B) run pack A instead."""

    def __init__(self, step: Any, packs: dict[str, list[Any]], swap: bool) -> None:
        self.step, self.packs, self.swap, self.calls = step, packs, swap, 0
        self.eager_steps = 0

    @property
    def warmup_steps(self) -> int:
        from megapack.bench.gpu.smoke import WARMUP

        return min(self.calls, WARMUP)

    @property
    def replays(self) -> int:
        from megapack.bench.gpu.smoke import WARMUP

        return max(0, self.calls - WARMUP)

    def __call__(self, batches: list[Any]) -> Any:
        from megapack.bench.gpu.smoke import WARMUP

        self.calls += 1
        if self.swap and self.calls == 4:
            batches = self.packs["A"] if batches is self.packs["B"] else self.packs["B"]
        return dataclasses.replace(self.step(batches), replayed=self.calls > WARMUP)


def compare_task(swap: bool) -> list[tuple[str, str, str]]:
    from megapack.bench.gpu.graph import twin_models
    from megapack.bench.gpu.model import TOY
    from megapack.bench.gpu.smoke import MICRO_BATCHES, make_step, replay_checks

    device, static, packs, _ = world()
    model_g, model_e = twin_models(TOY, device, torch.float32, SEQ, "bucketed")
    eager = make_step(model_e, device, static, MICRO_BATCHES, "eager")
    graph = StandIn(make_step(model_g, device, static, MICRO_BATCHES, "eager"), packs, swap)
    checks = replay_checks("bucketed", graph, eager, model_g, model_e, packs, device, torch.float32)
    return [(c.name, c.status, c.detail) for c in checks]


@pytest.mark.distributed
@pytest.mark.parametrize("swap", [False, True], ids=["same-packs", "a-replay-reads-the-wrong-pack"])
def test_the_replay_comparison_catches_a_replay_of_the_wrong_pack(
    dist_pool: Any, swap: bool
) -> None:
    (checks,) = dist_pool.run(compare_task, 1, swap, timeout=120)
    (name, status, detail), (timing, info, _) = checks
    assert name == "smoke: bucketed: replays of packs A, B, A == eager (within eager's spread)"
    assert (timing, info) == ("smoke: bucketed: step time, eager and replayed", "info")
    assert "warm-up steps 2, replays 3, eager fallback steps 0" in detail
    if not swap:
        assert status == "passed", detail
        assert "largest per-token loss difference 0.00e+00 relative" in detail
    else:
        assert status == "failed", detail
        worst = float(detail.split("largest per-token loss difference ")[1].split(" ")[0])
        assert worst > 1e-2, detail  # O(1): another pack's losses, far above the floor


def accepted_task() -> tuple[str, str]:
    """The refusal check with GraphStep's list of uncapturable backends emptied of bucketed (as if
    a change let a capture hold it)."""
    from megapack.bench.gpu.graph import twin_models
    from megapack.bench.gpu.model import TOY
    from megapack.bench.gpu.smoke import refusal_check
    from megapack.megatron import graph_parts

    device, static, packs, _ = world()
    model, _ = twin_models(TOY, device, torch.float32, SEQ, "bucketed")
    why = graph_parts.UNCAPTURABLE.pop("bucketed")
    try:
        check = refusal_check("bucketed", model, packs, static, device=device, dtype=torch.float32)
    finally:  # the worker runs other tests' tasks next
        graph_parts.UNCAPTURABLE["bucketed"] = why
    return check.status, check.detail


@pytest.mark.distributed
def test_an_uncapturable_backend_accepted_fails_the_smoke(dist_pool: Any) -> None:
    (result,) = dist_pool.run(accepted_task, 1, timeout=120)
    assert result[0] == "failed" and "accepted backend 'bucketed'" in result[1], result
