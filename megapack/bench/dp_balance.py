"""Balance benchmark: token plan vs compute plan across data-parallel ranks (`megapack.packing.balance`).

Two parts, both plans side by side in one run:

* ``run_balance``: imbalance (mean over full global batches of max rank cost / mean rank cost)
  and efficiency of both plans on the OpenChat V1 lengths and on a long-tail set, at dp 2 and 8,
  4 micro-batches of one 2,048-token row per rank per step, under two costs: a Llama-3-8B shape
  (`CostModel.from_shape`) and attention alone (``sum(len^2)``). Target (issue 13), on OpenChat
  at dp 8: compute-plan imbalance <= max(1.02, 1 + (token-plan imbalance - 1) / 2) and the
  same efficiency within 0.1 point.
* ``run_balance_timing``: the wall-clock side, on CPU with the tiny megatron-core GPT (2 layers,
  hidden 64). Every packed row (and a zero-loss filler row) is timed as one micro-batch (forward
  + backward through megatron-core's schedule, then the optimizer), the fastest of ``repeats`` runs
  interleaved over all rows, in one process: two ranks sharing a 2-core machine would time each
  other. Both plans deal these same rows to dp ranks, M micro-batches each; a rank's step time
  is the sum of its micro-batches' measured times and a step lasts as long as its slowest rank,
  so the figure is the sum over steps of the slowest rank's time ("ideal": of the mean rank's).
  The compute plan runs twice: with the tiny GPT's FLOPs (`CostModel.from_shape`) and with
  ``a``, ``b`` fitted to the measured row times (``t = c + a * tokens + b * sum(len^2)``; on a
  CPU, per-token work outside the matmuls weighs more than FLOPs say).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np

from megapack.bench.datasets import OPENCHAT_CAP
from megapack.packing.cost import CostModel

LLAMA3_8B = {"hidden": 4096, "ffn": 14336, "layers": 32, "heads": 32, "kv_heads": 8}
LLAMA3_8B_VOCAB = 128256
TARGET_IMBALANCE = 1.02
"""Compute-plan imbalance that always passes; otherwise half the token plan's excess must go."""
TARGET_EFFICIENCY_PT = 0.1
"""Largest efficiency loss of the compute plan against the token plan, in percentage points."""


def costs() -> dict[str, CostModel]:
    """The cost models the bench compares plans under."""
    llama = CostModel.from_shape(**LLAMA3_8B, vocab=LLAMA3_8B_VOCAB, gated=True)
    return {"llama3-8b": llama, "sum(len^2)": CostModel(a=0.0, b=1.0)}


def long_tail_lengths(n: int, seed: int = 0) -> np.ndarray:
    """``n`` lengths, lognormal(5.5, 1.4) clipped to [16, 16,384]: mostly short, some 8x a row."""
    values = np.random.default_rng(seed).lognormal(5.5, 1.4, n)
    return np.clip(values, 16, 16384).astype(np.int64)


def run_balance(lengths: list[int], long_tail_n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Both plans for every (dataset, dp, cost); the target verdict on OpenChat at dp 8."""
    from megapack.packing import LoadOptions, PackOptions
    from megapack.packing.compare import compare_plans

    datasets = {"openchat": np.asarray(lengths), "long-tail": long_tail_lengths(long_tail_n, seed)}
    rows = []
    for name, values in datasets.items():
        for dp in (2, 8):
            for cost_name, cost in costs().items():
                packing = PackOptions(seq_len=OPENCHAT_CAP, seed=seed)
                r = compare_plans(
                    values, packing, LoadOptions(dp_size=dp, micro_batches=4, cost=cost)
                )
                token, compute = r["imbalance_token_plan"], r["imbalance_compute_plan"]
                target = max(TARGET_IMBALANCE, 1 + (token - 1) / 2)
                loss_pt = 100 * (r["efficiency_token_plan"] - r["efficiency_compute_plan"])
                checked = name == "openchat" and dp == 8
                ok = compute <= target and loss_pt <= TARGET_EFFICIENCY_PT
                rows.append(
                    {
                        **r,
                        "dataset": name,
                        "cost": cost_name,
                        "seq_len": OPENCHAT_CAP,
                        "target_imbalance": target,
                        "efficiency_loss_pt": loss_pt,
                        "verdict": ("pass" if ok else "FAIL") if checked else "",
                    }
                )
    return rows


def _model_kit() -> tuple[Any, Any, Any, Any]:
    """The tiny GPT and its helpers (megapack.harness.gpt, not megapack.testing)."""
    from megapack.harness.gpt import TinyGPT, forward_step, init_weights
    from megapack.harness.megatron_cpu import megatron_on_cpu

    return TinyGPT, forward_step, init_weights, megatron_on_cpu


def run_balance_timing(
    lengths: list[int],
    seq_len: int,
    n_docs: int,
    dp: int,
    micro_batches: int,
    repeats: int,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """On one rank (world size 1): slowest-rank step time of both plans (module docstring)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack.core.batch import PackedBatch
    from megapack.distributed.topology import Topology
    from megapack.packing import LoadOptions, plan
    from megapack.packing.balance import order_rows, rank_costs

    tiny_gpt, forward_step, init_weights, megatron_on_cpu = _model_kit()
    megatron_on_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)
    gpt = tiny_gpt(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=256,
        max_sequence_length=seq_len,
    )
    model = gpt.build()
    init_weights(model, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    topology = Topology.from_parallel_state()
    schedule = get_forward_backward_func()
    flops = CostModel.from_shape(hidden=64, ffn=4 * 64, layers=2, heads=4, kv_heads=2, vocab=256)

    rng = np.random.default_rng(seed)
    sample = rng.choice(np.asarray(lengths), size=n_docs, replace=len(lengths) < n_docs)
    doc_lengths = np.maximum(1, np.minimum(sample, OPENCHAT_CAP) * seq_len // OPENCHAT_CAP)
    docs = [rng.integers(1, 256, int(n)) for n in doc_lengths]
    packed = plan(doc_lengths, seq_len)
    rows = [
        PackedBatch.from_documents(
            [{"tokens": docs[d][a:b], "loss_mask": np.ones(b - a)} for d, a, b in packed.bin(i)],
            seq_len=seq_len,
        )
        for i in range(packed.num_bins)
    ]
    filler = PackedBatch.from_documents([{"tokens": [0] * seq_len, "loss_mask": np.zeros(seq_len)}])

    def run(batch: Any) -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        schedule(
            forward_step_func=functools.partial(forward_step, topology),
            data_iterator=iter([batch]),
            model=[model],
            num_microbatches=1,
            seq_length=seq_len,
            micro_batch_size=1,
            forward_only=False,
        )
        optimizer.step()
        return time.perf_counter() - start

    run(rows[0])  # warm-up
    samples: list[list[float]] = [[] for _ in range(len(rows) + 1)]  # the last one: a filler row
    for _ in range(repeats):  # rows interleaved, so a slow spell of the machine hits all of them
        for i, batch in enumerate([*rows, filler]):
            samples[i].append(run(batch))
    measured = np.array([min(t) for t in samples])  # contention only ever adds time
    sizes = (packed.slices[:, 2] - packed.slices[:, 1]).astype(np.float64)
    starts = packed.bin_offsets[:-1]
    tokens, squares = np.add.reduceat(sizes, starts), np.add.reduceat(sizes**2, starts)
    design = np.stack([np.ones(len(tokens)), tokens, squares], axis=1)  # t = c + a tokens + b sq
    fit = np.linalg.lstsq(design, measured[:-1], rcond=None)[0][1:]  # c: the same on every rank
    fit = np.maximum(fit, 0.0)  # nearly full rows: a is hard to tell from c; a < 0 -> 0
    costs_by_name = {"tiny-gpt FLOPs": flops}
    if fit[1] > 0:
        costs_by_name["fitted to these timings"] = CostModel(a=float(fit[0]), b=float(fit[1]))
    deal = LoadOptions(dp_size=dp, micro_batches=micro_batches)
    per_batch = deal.rows_per_step
    out: list[dict[str, Any]] = []
    for name, cost in [("", flops), *costs_by_name.items()]:
        mode = "token" if not name else "compute"
        if name.startswith("fitted"):
            name += f" (a={cost.a:.2e} s, b={cost.b:.2e} s)"
        row_costs = cost.bin_costs(packed.slices, packed.bin_offsets)
        mode_deal = LoadOptions(dp_size=dp, micro_batches=micro_batches, balance=mode, cost=cost)
        order = order_rows(row_costs, mode_deal, seed=seed)
        step_time = np.where(order >= 0, measured[order], measured[-1])
        per_rank = step_time.reshape(-1, micro_batches, dp).sum(axis=1)  # [steps, dp]
        full = len(packed.bin_offsets[:-1]) // per_batch
        model = rank_costs(order, flops.bin_costs(packed.slices, packed.bin_offsets), deal)
        out.append(
            {
                "mode": mode,
                "cost": name or "-",
                "dp_size": dp,
                "micro_batches": micro_batches,
                "seq_len": seq_len,
                "steps": len(per_rank),
                "rows": packed.num_bins,
                "repeats": repeats,
                "slowest_rank_s": float(per_rank.max(axis=1).sum()),
                "ideal_s": float(per_rank.mean(axis=1).sum()),
                "measured_imbalance": float(
                    np.mean(per_rank[:full].max(axis=1) / per_rank[:full].mean(axis=1))
                ),
                "flops_imbalance": float(
                    np.mean(model[:full].max(axis=1) / model[:full].mean(axis=1))
                ),
            }
        )
    token_s = float(out[0]["slowest_rank_s"])
    for r in out:
        r["speedup_vs_token"] = token_s / r["slowest_rank_s"]
    return out


def markdown(rows: list[dict[str, Any]], timing: list[dict[str, Any]]) -> str:
    """The balance section of the report."""
    parts = []
    if rows:
        head = (
            "## Balance: token plan vs compute plan across DP ranks (M=4 micro-batches of one "
            f"{OPENCHAT_CAP:,}-token row per rank)\n\nimbalance = mean over full global batches of max "
            f"rank cost / mean rank cost. Target on OpenChat at dp 8: compute <= max({TARGET_IMBALANCE}, "
            f"1 + half the token plan's excess), efficiency within {TARGET_EFFICIENCY_PT} pt.\n\n"
            "| dataset | dp | cost | rows | token plan | compute plan | target | efficiency token / compute | plan s | verdict |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
        )
        lines = [
            f"| {r['dataset']} | {r['dp_size']} | {r['cost']} | {r['rows']:,} | "
            f"{r['imbalance_token_plan']:.4f} | {r['imbalance_compute_plan']:.4f} | "
            f"{r['target_imbalance']:.4f} | {r['efficiency_token_plan']:.2%} / "
            f"{r['efficiency_compute_plan']:.2%} | {r['compute_plan_seconds']:.2f} | {r['verdict']} |"
            for r in rows
        ]
        parts.append("\n".join([head, *lines]))
    if timing:
        t0 = timing[0]
        head = (
            f"## Balance on CPU: tiny GPT, dp {t0['dp_size']}, {t0['micro_batches']} micro-batches, "
            f"rows of {t0['seq_len']:,}, {t0['steps']} steps ({t0['rows']} rows, fastest of "
            f"{t0['repeats']} timings each)\n\n"
            "| plan | cost model | slowest rank, s (sum over steps) | ideal (mean rank), s | measured "
            "imbalance | FLOPs imbalance | speedup vs token plan |\n| --- | --- | --- | --- | --- | --- | --- |"
        )
        lines = [
            f"| {r['mode']} | {r['cost']} | {r['slowest_rank_s']:.3f} | {r['ideal_s']:.3f} | "
            f"{r['measured_imbalance']:.3f} | {r['flops_imbalance']:.3f} | {r['speedup_vs_token']:.3f} |"
            for r in timing
        ]
        parts.append("\n".join([head, *lines]))
    return "\n\n".join(parts)
