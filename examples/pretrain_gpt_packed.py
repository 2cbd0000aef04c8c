"""pretrain_gpt-style training of a small megatron-core GPT on packed documents, or on the same documents padded.

    torchrun --nproc-per-node 4 examples/pretrain_gpt_packed.py --tp 2 --pp 2            # packed (THD)
    torchrun --nproc-per-node 4 examples/pretrain_gpt_packed.py --tp 2 --pp 2 --padded   # one document per row
    torchrun --nproc-per-node 4 examples/pretrain_gpt_packed.py --tp 2 --cp 2            # context parallel

gloo on CPU (megatron-core's CUDA calls redirected by megapack.harness.megatron_cpu.megatron_on_cpu), NCCL on CUDA.
The structure follows Megatron-LM's pretrain_gpt.py: ``model_provider``, ``get_batch`` (here
megapack.get_batch_on_this_tp_rank), ``loss_func``, ``forward_step``, and megatron-core's schedules.
Every step trains on the same generated documents (lognormal lengths, like SFT data); packed
mode packs them into rows of ``--seq-len`` tokens with megapack.packing.plan (best-fit decreasing),
padded mode puts one per row. It prints the loss and real (non-padding) tokens per second.

With ``--cp N`` every CP rank holds 1/N of each row (``--cp-layout document`` pads every document
to a multiple of 2*N; ``row`` needs only the row length to divide by 2*N). The loss is each
micro-batch's mean over its trained tokens (megapack.megatron.normalized_loss, mode
"micro_batch_mean"); a CP rank's is its share of that mean. Without megatron-core's DDP here,
gradients are averaged over the CP group by hand, as DDP does over dp x cp.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import megapack
from megapack.core.quiet import quiet_megatron
from megapack.harness.gpt import packed_micro_batch, padded_micro_batch
from megapack.megatron import packed_gpt_layer_spec
from megapack.megatron.loss import normalized_loss
from megapack.packing import plan


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--cp-layout", default="document", choices=["document", "row"])
    p.add_argument(
        "--padded", action="store_true", help="one document per row, padded to --seq-len"
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row")
    p.add_argument("--mbs", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--docs", type=int, default=32, help="documents per global batch (every step)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--attention", default="auto", help="PackedAttention backend (auto, sdpa, flex, ...)"
    )
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def model_provider(args: argparse.Namespace, pre_process: bool, post_process: bool) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        context_parallel_size=args.cp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=packed_gpt_layer_spec(args.attention, cp_layout=args.cp_layout),
        vocab_size=args.vocab,
        max_sequence_length=args.seq_len,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )


def documents(args: argparse.Namespace) -> list[list[int]]:
    """The global batch: lognormal document lengths (median ~seq_len/6), random tokens."""
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(
        rng.lognormal(np.log(args.seq_len / 6), 0.8, args.docs).astype(int), 8, args.seq_len
    )
    return [rng.integers(1, args.vocab, n).tolist() for n in lengths]


def micro_batches(args: argparse.Namespace, docs: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    if args.padded:
        return [
            padded_micro_batch(docs[i : i + args.mbs], args.seq_len)
            for i in range(0, len(docs), args.mbs)
        ]
    pad = 2 * args.cp if args.cp > 1 and args.cp_layout == "document" else 1
    padded = [-(-len(d) // pad) * pad for d in docs]  # plan rows on the CP-padded lengths
    packing = plan(padded, args.seq_len, algorithm="bfd")  # best-fit decreasing
    rows = [[docs[i][a : min(b, len(docs[i]))] for i, a, b in row] for row in packing.bins]
    filler: list[list[int]] = [
        [0]
    ]  # a 1-token row that trains nothing, to fill the last micro-batch
    rows += [filler] * (-len(rows) % args.mbs)
    return [
        packed_micro_batch(rows[i : i + args.mbs], args.seq_len, pad_to_multiple_of=pad)
        for i in range(0, len(rows), args.mbs)
    ]


def forward_step(
    topology: megapack.Topology, data_iterator: Any, model: Any
) -> tuple[torch.Tensor, Any]:
    batch = megapack.get_batch_on_this_tp_rank(data_iterator, topology=topology)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"],
        labels=batch["labels"], packed_seq_params=batch["packed_seq_params"],
    )  # fmt: skip
    cp_group = topology.cp_group if topology.cp_size > 1 else None
    return output, functools.partial(
        normalized_loss,
        batch,
        mode="micro_batch_mean",
        calculate_per_token_loss=False,
        cp_group=cp_group,
    )


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not cuda:
        from megapack.harness.megatron_cpu import megatron_on_cpu

        megatron_on_cpu()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        context_parallel_size=args.cp,
    )
    model_parallel_cuda_manual_seed(args.seed)
    model = model_provider(args, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    if cuda:
        model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    topology = megapack.Topology.from_parallel_state(cp_layout=args.cp_layout)
    docs = documents(args)
    micro = micro_batches(args, docs)
    real_tokens = int(sum(m["loss_mask"].sum().item() for m in micro))
    slots = sum(m["tokens"].numel() for m in micro)
    seq_length, mbs = (args.mbs * args.seq_len, 1) if not args.padded else (args.seq_len, args.mbs)
    schedule = get_forward_backward_func()
    rank0 = dist.get_rank() == 0
    if rank0:
        mode = "padded" if args.padded else "packed"
        print(f"{mode}: tp={args.tp} pp={args.pp} cp={args.cp} {len(docs)} docs, "
              f"{len(micro)} micro-batches, {slots} token slots, {real_tokens} trained tokens "
              f"({real_tokens / slots:.1%} of slots), {sum(map(len, docs))} document tokens")  # fmt: skip
    for step in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        reduced = schedule(
            forward_step_func=functools.partial(forward_step, topology),
            data_iterator=iter(micro) if topology.is_source else None,
            model=[model],
            num_microbatches=len(micro),
            seq_length=seq_length,
            micro_batch_size=mbs,
            forward_only=False,
        )
        if topology.cp_size > 1:  # what megatron-core's DDP does over the dp x cp group
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=topology.cp_group)
                    p.grad /= topology.cp_size
        optimizer.step()
        # each report is [sum, count]: summed over micro-batches and CP, as Megatron-LM's train_step
        report = torch.zeros(2, dtype=torch.float64, device="cuda" if cuda else "cpu")
        for r in reduced:
            report += r["lm loss"].double()
        if topology.cp_size > 1 and reduced:
            dist.all_reduce(report, group=topology.cp_group)
        loss = (report[0] / report[1].clamp(min=1.0)).reshape(1)
        dist.all_reduce(loss, op=dist.ReduceOp.MAX)  # only the last stage has a loss; others send 0
        elapsed = time.perf_counter() - start
        if rank0:
            print(
                f"step {step}: loss {loss.item():.4f}  {real_tokens / elapsed:,.0f} real tokens/s  ({elapsed * 1e3:.0f} ms)"
            )
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    with quiet_megatron():  # megatron-core's known-harmless warnings (no apex/TE, CPU-only hints)
        main()
