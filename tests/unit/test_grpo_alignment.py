"""GRPO with log-probs straight from a token-level rollout pairs each one with its label (issue 41).

A rollout gives one log-prob per generated token: ``logp(t_k | t_<k)``, the value *of token k*.
The loss needs it where the model predicts token k, the label position ``k - 1`` (where
``labels[k - 1] == t_k``). Declared ``at="token"``, `PackedBatch.from_documents` shifts it there,
as it shifts ``loss_mask``. The policy here is a bigram table, so the expected log-prob at every
label position is computed by hand from the batch's own tokens and labels: ``log_softmax(W[token
j])[label j]``. With the same policy the PPO ratio is then 1 at every trained token, and the
surrogate is minus the advantage; as given (``at="label"``, what megapack did before `at`
existed) the values sit one position early and pair with the wrong labels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from megapack import BatchField, PackedBatch, Topology, get_batch_on_this_tp_rank
from megapack.megatron.loss import policy_loss

VOCAB, SEQ = 50, 64
W = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(41))
"""The policy: logits of the next token given the previous one."""


def fields(at: str) -> tuple[BatchField, ...]:
    return (BatchField("advantages", "token", torch.float32, "last", at=at),  # type: ignore[arg-type]
            BatchField("old_logprobs", "token", torch.float32, "last", at=at))  # type: ignore[arg-type]  # fmt: skip


def rollout(seed: int = 0) -> list[dict[str, Any]]:
    """Two prompts, a group of three completions each, sampled from the policy; each generated
    token's log-prob recorded as a rollout engine reports it (0 on prompt tokens)."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(2):
        prompt = rng.integers(0, VOCAB, int(rng.integers(2, 6))).tolist()
        rewards = rng.normal(0, 1, 3)
        for adv in (rewards - rewards.mean()) / (rewards.std() + 1e-6):
            tokens, logps = list(prompt), [0.0] * len(prompt)
            for _ in range(int(rng.integers(2, 8))):
                logits = torch.log_softmax(W[tokens[-1]], dim=-1)
                nxt = int(torch.multinomial(logits.exp(), 1, generator=gen))
                tokens.append(nxt)
                logps.append(float(logits[nxt]))  # one log-prob per generated token
            docs.append({"tokens": tokens, "loss_mask": [0.0] * len(prompt) + [1.0] * (len(tokens) - len(prompt)),
                         "advantages": [float(adv)] * len(tokens), "old_logprobs": logps})  # fmt: skip
    return docs


def delivered(docs: list[dict[str, Any]], at: str) -> dict[str, Any]:
    """The docs packed two rows a micro-batch and delivered as a trainer's loss stage gets them."""
    rows = [PackedBatch.from_documents(docs[i : i + 3], seq_len=SEQ, fields=fields(at))
            for i in range(0, len(docs), 3)]  # fmt: skip
    item = PackedBatch.concat(rows, fields(at))
    topo = Topology.single(torch.device("cpu"))
    return get_batch_on_this_tp_rank(iter([item]), topology=topo, fields=fields(at))


def current_logprobs(batch: dict[str, Any]) -> torch.Tensor:
    """The policy's log-prob of every label given its token: what a model computes per position."""
    logits = torch.log_softmax(W[batch["tokens"][0]], dim=-1)  # [T, vocab]
    return logits.gather(-1, batch["labels"][0, :, None])[:, 0][None]


def test_align_grpo_rollout_logprobs_pair_with_their_labels() -> None:
    docs = rollout()
    batch = delivered(docs, "token")
    trained = batch["loss_mask"][0] != 0
    generated = sum(int(sum(d["loss_mask"][1:])) for d in docs)
    assert int(trained.sum()) == generated  # one trained label per generated token
    by_hand = current_logprobs(batch)[0]
    for j in torch.nonzero(trained).flatten().tolist():  # each label position, by hand
        token, label = int(batch["tokens"][0, j]), int(batch["labels"][0, j])
        assert batch["old_logprobs"][0, j].item() == pytest.approx(
            torch.log_softmax(W[token], dim=-1)[label].item(), abs=1e-6
        ), j
    assert torch.allclose(batch["old_logprobs"][0][trained], by_hand[trained], atol=1e-6)
    # the same policy: ratio 1 at every trained token, the surrogate is minus the advantage
    total, count, _ = policy_loss(batch, -current_logprobs(batch), calculate_per_token_loss=True)
    want = -sum(d["advantages"][0] * sum(d["loss_mask"][1:]) for d in docs)
    assert int(count) == int(trained.sum()) and total.item() == pytest.approx(want, abs=1e-5)


def test_align_grpo_rollout_logprobs_as_given_pair_with_the_wrong_labels() -> None:
    """The failure the declaration prevents: placed as given (before `at`, silently), a rollout's
    log-probs sit one position early, and the ratios at trained tokens are not 1."""
    docs = rollout()
    batch = delivered(docs, "label")
    trained = batch["loss_mask"][0] != 0
    wrong = batch["old_logprobs"][0][trained] - current_logprobs(batch)[0][trained]
    assert (wrong.abs() > 1e-3).float().mean() > 0.5
