"""Helpers for megapack's own tests (grids, host-read recording); tests only.

Running megatron-core on CPU, the worker pool and the tiny GPT live in `megapack.harness`, their one
import path (`megapack.harness.megatron_cpu`, `megapack.harness.pool`, `megapack.harness.gpt`).
"""
