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
at the same step.

Prints, on global rank 0, each step's loss (mean over the step's trained tokens), its trained
tokens, its real tokens (every non-padding token of the step's documents, over every DP rank),
the step's wall time and real tokens/s:

    step 0: loss 6.2814 over 500 trained tokens; 943 real tokens in 1.27 s: 742 real tokens/s

Each figure is counted once: the trained tokens and the loss on TP rank 0 of the last stage (the
last stage's TP ranks all hold the same loss), the real tokens on TP rank 0 of the first stage as
the schedule takes each micro-batch; one all-reduce adds the DP ranks up. The script is the
application, so it configures logging: megapack's own lines (INFO and above of the ``megapack``
logger, e.g. rank 0's line when the data ends) show on stderr, and megatron-core's known-harmless
warnings (no Apex or Transformer Engine, ...) are quieted with `megapack.core.quiet.quiet_megatron`.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import megapack
from megapack.core.quiet import quiet_megatron
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


def real_tokens(batch: megapack.PackedBatch, pad_id: int) -> int:
    """The non-padding tokens of a micro-batch as the dataset yields it: its documents' tokens,
    not a row's trailing padding segment nor a filler row (segments holding only ``pad_id``).

    Example: rows of 8 with documents of 3 and 4 tokens, ``cu_seqlens`` [0, 3, 8, 12, 16] (each
    row's padding a segment of its own): 3 + 4 = 7 real tokens.
    """
    cu = batch.cu_seqlens.tolist()  # host tensors: the dataset's batch, before any transfer
    padded = batch.cu_seqlens_padded
    starts = (padded if padded is not None else batch.cu_seqlens).tolist()
    tokens = batch.tokens[0]
    return sum(
        cu[i + 1] - cu[i]
        for i in range(len(cu) - 1)
        if bool((tokens[starts[i] : starts[i] + cu[i + 1] - cu[i]] != pad_id).any())
    )


class Counted:
    """A step's data iterator as the schedule reads it, adding up the real tokens it hands out."""

    def __init__(self, items: Iterator[Any], pad_id: int) -> None:
        self.items, self.pad_id, self.tokens = items, pad_id, 0

    def __iter__(self) -> Counted:
        return self

    def __next__(self) -> Any:
        batch = next(self.items)
        self.tokens += real_tokens(batch, self.pad_id)
        return batch


def configure_logging() -> None:
    """The script is the application: megapack's INFO lines and every library's warnings show on
    stderr, each prefixed with the global rank (torchrun's ``RANK``)."""
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(message)s")
    logging.getLogger("megapack").setLevel(logging.INFO)


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
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
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
    device = "cuda" if cuda else "cpu"
    last_report = time.perf_counter()  # a step's time: from the last report, its reading included
    for iteration, step_iterator in zip(range(args.steps), steps, strict=False):
        counted = None  # the real tokens are counted once: on TP rank 0 of the first stage
        if first and step_iterator is not None:
            step_iterator = counted = Counted(step_iterator, train.pad_token_id)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = schedule(forward_step_func=forward_step, data_iterator=step_iterator,
                           model=[model], num_microbatches=num_microbatches,
                           seq_length=seq_length, micro_batch_size=1, forward_only=False)  # fmt: skip
        for p in model.parameters():  # DDP accumulated into main_grad (Megatron's optimizer's)
            p.grad = p.main_grad
        optimizer.step()
        # [loss sum, trained tokens, real tokens] of the step, each added once per DP rank: every
        # TP rank of the last stage reports the same [loss sum, trained tokens] per micro-batch,
        # so only TP rank 0 adds them (the TP ranks' sum would count each token tp times)
        figures = torch.zeros(3, dtype=torch.float64, device=device)
        if last and tp_rank == 0:
            for report in reports:
                figures[:2] += report["lm loss"].double().to(device)
        if counted is not None:
            figures[2] = counted.tokens
        dist.all_reduce(figures)  # over every rank: the DP ranks' shares add up
        if dist.get_rank() == 0:
            now = time.perf_counter()
            seconds, last_report = now - last_report, now
            loss_sum, trained, real = figures.tolist()
            print(f"step {iteration}: loss {loss_sum / trained:.4f} over {int(trained)} trained "
                  f"tokens; {int(real)} real tokens in {seconds:.2f} s: "
                  f"{real / seconds:,.0f} real tokens/s", flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    configure_logging()
    with quiet_megatron():  # megatron-core's known-harmless warnings (megapack.core.quiet.HARMLESS)
        main()
