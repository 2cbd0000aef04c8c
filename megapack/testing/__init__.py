"""Helpers for megapack's own tests only: the tp x pp (x cp) grids they run on (`grids`) and host-read
recording (`host_reads`). No production module imports this package.

Running megatron-core on CPU, the worker pool, the tiny GPT and `grid_topology` live in
`megapack.harness`, their one import path (`megapack.harness.megatron_cpu`, `megapack.harness.pool`,
`megapack.harness.gpt`, `megapack.harness.grid`).
"""
