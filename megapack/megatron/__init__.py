"""megatron-core integration: the GPT layer spec whose attention trains THD packed batches
(`spec.py`), the losses a forward_step returns, the same however the step was packed (`loss.py`:
`normalized_loss`, `policy_loss`), a whole training step captured in one CUDA graph
(`graph_step.py`: `GraphStep`; what it owns and refuses: `graph_parts.py`), and the whole
replacements of Megatron-LM's and Megatron-Bridge's ``get_batch`` (`pretrain_gpt_get_batch`,
`bridge_get_batch`, defined with the other callers' conventions in `megapack.delivery.callers`).

May import `megapack.attention`, `megapack.core` and megatron-core (lazily); of the delivery only
`megapack.delivery.callers`, whose two replacements this package's namespace gives trainers.
"""

from megapack.core.loss_fields import LOSS_MODES
from megapack.delivery.callers import bridge_get_batch, pretrain_gpt_get_batch
from megapack.megatron.graph_step import GraphStep
from megapack.megatron.loss import normalized_loss, policy_loss
from megapack.megatron.spec import packed_gpt_layer_spec

__all__ = [
    "LOSS_MODES",
    "GraphStep",
    "bridge_get_batch",
    "normalized_loss",
    "packed_gpt_layer_spec",
    "policy_loss",
    "pretrain_gpt_get_batch",
]
