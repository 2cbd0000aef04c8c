"""Losses a pretrain_gpt-style ``forward_step`` returns for packed micro-batches, CP-aware.

Both take megatron-core's per-token loss (``GPTModel(..., labels=...)`` returns the cross-entropy of
every position, [1, T] for THD, on the last stage) and the delivered per-token fields, and return
``(loss, {"lm loss": reported, ...})`` for megatron-core's schedules.

With context parallelism each CP rank holds a share of the tokens: the loss is this share's sum
over the whole micro-batch's trained-token count (one all-reduce of the count over ``cp_group``),
so the CP ranks' losses add up to the micro-batch mean. megatron-core's schedule multiplies a
returned loss by cp and its DDP averages gradients over the dp x cp group: together, the gradient
of that mean. The reported value is the mean itself, on every CP rank.

`clipped_policy_loss` is the PPO / GRPO surrogate an RL trainer computes from the per-token
``advantages`` and ``old_logprobs`` it declares as last-stage fields (`megapack.BatchField`)::

    ratio = exp(logp - old_logprobs)          logp = -per-token cross-entropy of the labels
    loss  = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), masked by loss_mask, mean
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def masked_mean_loss(
    loss_mask: torch.Tensor, per_token: torch.Tensor, cp_group: Any = None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Mean loss over trained positions of one micro-batch; also reports the masked per-token losses."""
    return _masked_mean(loss_mask, per_token, cp_group)


def clipped_policy_loss(
    loss_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor,
    per_token: torch.Tensor,
    *,
    clip: float = 0.2,
    cp_group: Any = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The clipped policy-gradient surrogate (PPO, GRPO) over trained positions of one micro-batch.

    Args:
        loss_mask: [1, T] (or [b, s]), 1 where a token is trained.
        advantages, old_logprobs: the same shape, as the trainer computed them at rollout time.
        per_token: megatron-core's per-token cross-entropy (``-logp`` of every label).
        clip: epsilon of the ratio's clip range [1 - clip, 1 + clip].
        cp_group: the context-parallel group, None without CP.

    Example: logp = old logp (ratio 1) gives ``-A`` per token, whatever ``clip`` is.
    """
    if advantages.shape != per_token.shape or old_logprobs.shape != per_token.shape:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} and old_logprobs {tuple(old_logprobs.shape)} "
            f"must have the per-token loss's shape {tuple(per_token.shape)}: declare them per "
            "token for the last stage (megapack.BatchField(name, 'token', dtype, 'last'))"
        )
    ratio = torch.exp(-per_token.float() - old_logprobs.float())  # logp = -per_token
    adv = advantages.float()
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(1.0 - clip, 1.0 + clip) * adv)
    return _masked_mean(loss_mask, surrogate, cp_group)


def _masked_mean(
    loss_mask: torch.Tensor, per_token: torch.Tensor, cp_group: Any
) -> tuple[torch.Tensor, dict[str, Any]]:
    mask = loss_mask.float()
    count = mask.sum()
    if cp_group is not None:
        count = count.detach().clone()
        dist.all_reduce(count, group=cp_group)
    loss = (per_token.float() * mask).sum() / count.clamp(min=1.0)
    reported = loss.detach().clone()  # clone(): the schedule divides the loss in place
    if cp_group is not None:
        dist.all_reduce(reported, group=cp_group)
    return loss, {"lm loss": reported, "per_token": (per_token.detach() * mask).clone()}
