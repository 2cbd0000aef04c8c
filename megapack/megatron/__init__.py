"""megatron-core integration: the GPT layer spec whose attention trains THD packed batches (`spec.py`)."""

from megapack.megatron.spec import packed_gpt_layer_spec

__all__ = ["packed_gpt_layer_spec"]
