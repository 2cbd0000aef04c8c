"""megatron-core integration: the GPT layer spec whose attention trains THD packed batches
(`spec.py`), the losses a forward_step returns, the same however the step was packed (`loss.py`:
`normalized_loss`, `policy_loss`), and a whole training step captured in one CUDA graph
(`graph_step.py`: `GraphStep`; what it owns and refuses: `graph_parts.py`).

May import `megapack.attention`, `megapack.core` and megatron-core (lazily); never the delivery.
"""

from megapack.core.loss_fields import LOSS_MODES
from megapack.megatron.graph_step import GraphStep
from megapack.megatron.loss import normalized_loss, policy_loss
from megapack.megatron.spec import packed_gpt_layer_spec

__all__ = [
    "LOSS_MODES",
    "GraphStep",
    "normalized_loss",
    "packed_gpt_layer_spec",
    "policy_loss",
]
