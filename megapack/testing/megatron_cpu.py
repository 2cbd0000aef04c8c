"""megatron-core on CPU ranks for tests; it lives in `megapack.harness.megatron_cpu` (the bench uses it too)."""

from megapack.harness.megatron_cpu import megatron_on_cpu

__all__ = ["megatron_on_cpu"]
