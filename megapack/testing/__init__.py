"""Helpers for tests of megapack and of users' own training code (worker pool, grids, megatron on CPU)."""

from megapack.harness.megatron_cpu import megatron_on_cpu

__all__ = ["megatron_on_cpu"]
