"""The README's quickstart as one script: a ``megapack pack`` folder to training steps of a GPT
through megatron-core's schedule, pretrain_gpt-style.

    megapack pack sft.jsonl --seq-len 256 --out packed/
    torchrun --nproc-per-node 4 examples/quickstart.py packed/ --tp 2 --pp 2

Every value a pretrain_gpt script gets from Megatron's arguments is defined here: the ranks from
megatron-core's ``parallel_state``, ``num_microbatches`` (``--micro-batches``), and the schedule's
shape: a packed micro-batch is ONE row of ``rows x seq_len`` tokens (THD), so the schedule runs
with ``seq_length = rows x seq_len`` and ``micro_batch_size = 1`` (Megatron's usual
``--seq-length 256 --micro-batch-size 2`` fails inside the schedule; `megapack.lockstep_steps`
names the right values before the first step). On a CPU, megatron-core's CUDA calls are
redirected first (`megapack.harness.megatron_on_cpu`); on GPUs it runs as it is, over NCCL.

What it shows, in order: `PackedDataset.load` of this DP rank's micro-batches with the step's loss
fields; the data iterator on TP rank 0 of every pipeline stage (every stage needs the document
boundaries); `get_batch_on_this_tp_rank` in ``forward_step``; `normalized_loss` in Megatron's
per-token form (the same loss however the step was packed); megatron-core's
``DistributedDataParallel`` and ``finalize_model_grads`` (which divides by the step's trained
tokens); and `lockstep_steps` around the schedule, so that when the data ends every rank stops
at the same step. Prints each step's loss (mean over the step's trained tokens).
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

import torch
import torch.distributed as dist

import megapack
from megapack.data import PackedDataset
from megapack.megatron import normalized_loss, packed_gpt_layer_spec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("folder", help="a folder written by `megapack pack`")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--rows", type=int, default=2, help="packed rows a micro-batch (default 2)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches a step (default 2)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps at most (default 3)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def model_provider(args: argparse.Namespace, vocab_size: int, seq_length: int) -> Any:
    """This rank's GPT stage with THD attention, wrapped in megatron-core's DDP (as Megatron-LM)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=True,  # Megatron-LM's --calculate-per-token-loss
    )
    config.finalize_model_grads_func = finalize_model_grads  # as Megatron-LM's training loop
    model = GPTModel(
        config=config,
        transformer_layer_spec=packed_gpt_layer_spec(),  # THD attention, RoPE per document
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        position_embedding_type="rope",
    )
    if torch.cuda.is_available():
        model.cuda()
    return DistributedDataParallel(config, DistributedDataParallelConfig(), model)


def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    # Every rank of the TP group calls this once per micro-batch; only TP rank 0 reads the iterator.
    batch = megapack.get_batch_on_this_tp_rank(data_iterator, fields=megapack.LOSS_FIELDS)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], packed_seq_params=batch["packed_seq_params"])  # fmt: skip
    return output, functools.partial(normalized_loss, batch, calculate_per_token_loss=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp
    )
    model_parallel_cuda_manual_seed(args.seed)
    tp_rank = ps.get_tensor_model_parallel_rank()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    num_microbatches = args.micro_batches

    # This DP rank's micro-batches, each with its step's loss fields (normalized_loss's counts).
    train = PackedDataset.load(args.folder, rows_per_micro_batch=args.rows, dp_rank=dp_rank,
                               dp_size=dp_size, micro_batches=num_microbatches, loss_fields=True)  # fmt: skip
    seq_length = args.rows * train.packing.seq_len  # a micro-batch is one [1, rows x seq_len] row
    vocab = int(train.meta.get("vocab_size") or 256)  # what `megapack pack` recorded
    multiple = 128 * args.tp  # Megatron-LM pads it: --make-vocab-size-divisible-by 128, x tp
    vocab_size = -(-vocab // multiple) * multiple
    data_iterator = train.iterate() if tp_rank == 0 else None  # TP rank 0 of every stage reads

    model = model_provider(args, vocab_size, seq_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    schedule = get_forward_backward_func()
    # the TP sources read and check each step ahead (as get_batch will, so the same fields=)
    steps = megapack.lockstep_steps(data_iterator, micro_batches=num_microbatches,
                                    seq_length=seq_length, micro_batch_size=1,
                                    fields=megapack.LOSS_FIELDS)  # fmt: skip
    for iteration, step_iterator in zip(range(args.steps), steps, strict=False):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = schedule(forward_step_func=forward_step, data_iterator=step_iterator,
                           model=[model], num_microbatches=num_microbatches,
                           seq_length=seq_length, micro_batch_size=1, forward_only=False)  # fmt: skip
        for (
            p
        ) in model.parameters():  # DDP accumulated into main_grad (Megatron's optimizer reads it)
            p.grad = p.main_grad
        optimizer.step()
        # the last stage reports [loss sum, trained tokens] per micro-batch; every other stage none
        total = torch.zeros(2, dtype=torch.float64, device="cuda" if cuda else "cpu")
        for report in reports:
            total += report["lm loss"].double().to(total.device)
        dist.all_reduce(total)  # over every rank: the last stages' sums (DP ranks add up)
        if dist.get_rank() == 0:
            print(f"step {iteration}: loss {(total[0] / total[1]).item():.4f} over "
                  f"{int(total[1].item())} trained tokens", flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
