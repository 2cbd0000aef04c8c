"""megatron-core integration: the GPT layer spec whose attention trains THD packed batches
(`spec.py`) and the losses a forward_step returns, the same however the step was packed
(`loss.py`).

May import `megapack.attention`, `megapack.core` and megatron-core (lazily); never the delivery.
"""

from megapack.megatron.loss import (
    clipped_policy_loss,
    masked_mean_loss,
    normalized_loss,
    policy_loss,
)
from megapack.megatron.spec import packed_gpt_layer_spec

__all__ = [
    "clipped_policy_loss",
    "masked_mean_loss",
    "normalized_loss",
    "packed_gpt_layer_spec",
    "policy_loss",
]
