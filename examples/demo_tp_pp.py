"""Show what every rank of a tp x pp grid receives from megapack.get_batch_on_this_tp_rank.

Run on CPU (gloo) over tp=2 x pp=2:

    torchrun --nproc-per-node 4 examples/demo_tp_pp.py --tp 2 --pp 2

Each TP source rank packs the same small documents (with micro-batch size 2, Megatron SFT-style
rows merged into one THD row) and every rank prints its stage and the fields it received.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import megapack
from megapack.core.quiet import quiet_megatron


def sft_batches(mbs: int, seq_len: int, steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Megatron SFT-style micro-batches: rows of documents, cu_seqlens padded with -1."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        rows = []
        for _ in range(mbs):
            lengths = []
            while sum(lengths) < seq_len:
                lengths.append(
                    min(
                        int(torch.randint(2, seq_len // 2, (1,), generator=gen)),
                        seq_len - sum(lengths),
                    )
                )
            docs = [torch.randint(1, 1000, (n,), generator=gen) for n in lengths]
            rows.append(megapack.PackedBatch.from_documents(docs, seq_len=seq_len))
        k = max(len(r.cu_seqlens) for r in rows)
        cu = torch.full((mbs, k), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            cu[i, : len(r.cu_seqlens)] = r.cu_seqlens
        out.append(
            {
                "tokens": torch.cat([r.tokens for r in rows]),
                "labels": torch.cat([r.labels for r in rows]),
                "loss_mask": torch.cat([r.loss_mask for r in rows]),
                "position_ids": torch.cat([r.position_ids for r in rows]),
                "cu_seqlens": cu,
            }
        )
    return out


def describe(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, int):
        return f"int {value}"
    return type(value).__name__


def launch_problem(tp: int, pp: int, env: Any) -> str | None:
    """Why this launch cannot run the demo (not under torchrun, or a grid that does not fit), or None."""
    how = (
        f"run it with torchrun --nproc-per-node {max(tp, 1) * max(pp, 1)} examples/demo_tp_pp.py "
        f"--tp {tp} --pp {pp} (or bash scripts/demo.sh)"
    )
    if tp < 1 or pp < 1:
        return f"--tp and --pp must be >= 1, got --tp {tp} --pp {pp}"
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return f"not launched by torchrun (no RANK/WORLD_SIZE in the environment); {how}"
    world = int(env["WORLD_SIZE"])
    if world % (tp * pp):
        return f"--tp {tp} x --pp {pp} = {tp * pp} does not divide the {world} ranks torchrun started; {how}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument(
        "--mbs", type=int, default=2, help="micro-batch size (rows per micro-batch)"
    )
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    problem = launch_problem(args.tp, args.pp, os.environ)
    if problem:
        if int(os.environ.get("RANK", 0)) == 0:  # one line, not one per rank
            print(f"demo_tp_pp.py: error: {problem}", file=sys.stderr, flush=True)
        else:
            time.sleep(1)  # let rank 0 print before torchrun stops the others
        sys.exit(2)

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    with quiet_megatron():  # megatron-core warns once per process that TE/apex are absent
        from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp
    )
    topo = megapack.Topology.from_parallel_state()
    data = (
        iter(sft_batches(args.mbs, args.seq_len, args.steps, seed=1234)) if topo.is_source else None
    )
    lines = []
    step = 0
    while True:
        try:
            batch = megapack.get_batch_on_this_tp_rank(data, topology=topo)
        except StopIteration:
            lines.append(
                f"  step {step}: StopIteration (data ended on the TP source) -- clean stop"
            )
            break
        fields = ", ".join(f"{k}={describe(v)}" for k, v in batch.items())
        lines.append(f"  step {step}: {fields}")
        if step == 0 and batch["cu_seqlens"] is not None:
            lines.append(f"    cu_seqlens={batch['cu_seqlens'].tolist()}")
        step += 1
    role = "source" if topo.is_source else "receiver"
    report = f"rank {dist.get_rank()} | stage {topo.stage.value} (pp_rank {topo.pp_rank}) | tp_rank {topo.tp_rank} ({role})\n"
    reports: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report + "\n".join(lines))
    if dist.get_rank() == 0:
        print(
            f"megapack {megapack.__version__}: tp={args.tp} x pp={args.pp}, backend={backend}, mbs={args.mbs}"
        )
        for r in reports:
            print(r)
        sys.stdout.flush()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
