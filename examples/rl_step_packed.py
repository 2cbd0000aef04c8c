"""A GRPO-style RL step on packed sequences through megatron-core's schedules, fed by megapack.

    torchrun --nproc-per-node 4 examples/rl_step_packed.py --tp 2 --pp 2
    torchrun --nproc-per-node 4 examples/rl_step_packed.py --tp 2 --cp 2

The rollout: ``--prompts`` prompts, ``--group`` sampled completions each (random tokens and lengths
here; a rollout engine's in a real trainer), a reward per completion and GRPO's group-normalised
advantage ``(r - mean_group) / std_group`` on every completion token; ``old_logprobs`` are the
rollout's log-probs of those tokens, one per token as a rollout engine reports them (here drawn
near the untrained model's). Each prompt + completion is one document: ``loss_mask`` 1 on the
completion. Documents are packed into rows of ``--seq-len`` with megapack.packing.plan;
``advantages`` and ``old_logprobs`` are declared as last-stage per-token fields at their tokens
(``at="token"``: `PackedBatch.from_documents` shifts them to the labels that predict those
tokens, as it shifts ``loss_mask``), so the loss's stage receives them with the labels (and each
CP rank exactly its share), and the first stages never move their bytes:

    RL_FIELDS = (megapack.BatchField("advantages", "token", torch.float32, "last", at="token"),
                 megapack.BatchField("old_logprobs", "token", torch.float32, "last", at="token"))
    batch = megapack.get_batch_on_this_tp_rank(it, topology=topology, fields=RL_FIELDS)

The loss is the clipped surrogate `megapack.megatron.policy_loss` in ``--mode`` (token_mean: every
completion token of the step weighs the same, however the step was packed), with the step's loss
fields from `megapack.with_loss_fields` (megatron-core's ``calculate_per_token_loss`` off, as
here: no ``finalize_model_grads``). gloo on CPU (megatron-core's CUDA calls redirected by
megapack.harness.megatron_cpu.megatron_on_cpu), NCCL on CUDA.
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import megapack
from megapack.core.quiet import quiet_megatron
from megapack.harness.gpt import TinyGPT, init_weights
from megapack.megatron.loss import policy_loss
from megapack.packing import plan

RL_FIELDS = (
    megapack.BatchField("advantages", "token", torch.float32, "last", at="token"),
    megapack.BatchField("old_logprobs", "token", torch.float32, "last", at="token"),
)
FIELDS = (*RL_FIELDS, *megapack.LOSS_FIELDS)  # the step's denominators, for policy_loss


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--cp-layout", default="document", choices=["document", "row"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO's group)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per packed row")
    p.add_argument("--mbs", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--clip", type=float, default=0.2, help="the ratio's clip epsilon")
    p.add_argument(
        "--mode",
        default="token_mean",
        choices=["token_mean", "sequence_mean"],
        help="policy_loss's weighing (docs/losses.md: which mode to pick)",
    )
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def rollout(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """One document per completion: prompt + completion tokens, loss_mask, advantages, old log-probs."""
    rng = np.random.default_rng(args.seed)
    docs = []
    for _ in range(args.prompts):
        prompt = rng.integers(1, vocab, int(rng.integers(4, 16))).tolist()
        rewards = rng.normal(0, 1, args.group)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # GRPO
        for adv in advantages:
            completion = rng.integers(1, vocab, int(rng.integers(4, 40))).tolist()
            n = len(prompt) + len(completion)
            docs.append({
                "tokens": prompt + completion,
                "loss_mask": [0.0] * len(prompt) + [1.0] * len(completion),
                "advantages": [float(adv)] * n,
                "old_logprobs": (np.log(1 / vocab) + rng.normal(0, 0.2, n)).tolist(),
            })  # fmt: skip
    return docs


def micro_batches(
    args: argparse.Namespace, docs: list[dict[str, Any]]
) -> list[megapack.PackedBatch]:
    pad = 2 * args.cp if args.cp > 1 and args.cp_layout == "document" else 1
    lengths = [-(-len(d["tokens"]) // pad) * pad for d in docs]
    rows = [[docs[i] for i, _, _ in row] for row in plan(lengths, args.seq_len).bins]
    rows += [[{**docs[0], "loss_mask": [0.0] * len(docs[0]["tokens"])}]] * (-len(rows) % args.mbs)
    packed = [megapack.PackedBatch.from_documents(row, seq_len=args.seq_len, pad_to_multiple_of=pad,
                                                  fields=RL_FIELDS) for row in rows]  # fmt: skip
    return [megapack.PackedBatch.concat(packed[i : i + args.mbs], RL_FIELDS)
            for i in range(0, len(packed), args.mbs)]  # fmt: skip


def forward_step(
    topology: megapack.Topology, args: argparse.Namespace, data_iterator: Any, model: Any
) -> tuple[torch.Tensor, Any]:
    batch = megapack.get_batch_on_this_tp_rank(data_iterator, topology=topology, fields=FIELDS)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"],
        labels=batch["labels"], packed_seq_params=batch["packed_seq_params"],
    )  # fmt: skip  # the last stage's output: per-token cross-entropy, -logp of every label
    return output, functools.partial(
        policy_loss, batch, mode=args.mode, clip=args.clip, calculate_per_token_loss=False,
        cp_layout=args.cp_layout,
    )  # fmt: skip


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
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                 pipeline_model_parallel_size=args.pp,
                                 context_parallel_size=args.cp)  # fmt: skip
    model_parallel_cuda_manual_seed(args.seed)
    gpt = TinyGPT(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  vocab_size=256, max_sequence_length=args.seq_len, cp_layout=args.cp_layout)  # fmt: skip
    model = gpt.build()
    init_weights(model, seed=args.seed)
    if cuda:
        model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    topology = megapack.Topology.from_parallel_state(cp_layout=args.cp_layout)
    docs = rollout(args, gpt.vocab_size)
    micro = micro_batches(args, docs)
    schedule = get_forward_backward_func()
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"grpo: tp={args.tp} pp={args.pp} cp={args.cp} {len(docs)} completions of "
              f"{args.prompts} prompts in {len(micro)} packed micro-batches")  # fmt: skip
    for step in range(args.steps):
        optimizer.zero_grad()
        data = (megapack.with_loss_fields(iter(micro), micro_batches=len(micro))  # the step's counts
                if topology.is_source else None)  # fmt: skip
        reduced = schedule(
            forward_step_func=functools.partial(forward_step, topology, args),
            data_iterator=data, model=[model],
            num_microbatches=len(micro), seq_length=args.mbs * args.seq_len, micro_batch_size=1,
            forward_only=False,
        )  # fmt: skip
        if topology.cp_size > 1:  # what megatron-core's DDP does over the dp x cp group
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=topology.cp_group)
                    p.grad /= topology.cp_size
        optimizer.step()
        # the report is [sum, count] a micro-batch (last stage only; TP ranks repeat it, CP ranks
        # hold shares): the step's value is the total sum over the total count
        report = sum((r["lm loss"].double() for r in reduced), torch.zeros(2, dtype=torch.float64))
        dist.all_reduce(report, op=dist.ReduceOp.SUM)
        if rank0:
            print(f"step {step}: policy loss {report[0].item() / report[1].item():+.4f}")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    with quiet_megatron():  # megatron-core's known-harmless warnings (no apex/TE, CPU-only hints)
        main()
