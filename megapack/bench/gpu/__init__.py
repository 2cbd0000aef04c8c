"""The GPU kit (``bash scripts/gpu_check.sh``; ``python -m megapack.bench.gpu.kit``), one module a step:

    kit.py         the kit: every step in order, the report rewritten after each (``--dry-run``: CPU)
    checks.py      attention against a float64 reference, packed == padded losses, sync checks
    model.py       the 0.84B preset, its THD-aware FLOPs, the measured matmul
    throughput.py  packing against every baseline of `megapack.bench.layouts` at real size
    graph.py       a captured training step over static-shape packs
    devices.py     each device's bf16 dense peak, MFU's denominator
    profile.py     one step under torch.profiler: host vs GPU time, by owner
    report.py      gpu-report.json and .md (imports neither torch nor megatron)

Importing this package imports nothing else: ``report`` must work where torch is broken. The
names of ``throughput`` (``megapack.bench.gpu`` was that module) load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_THROUGHPUT = (
    "ThroughputSizes",
    "length_mixes",
    "run_gpu_throughput",
    "step_estimate",
    "time_steps",
    "MIXES",
)


def __getattr__(name: str) -> Any:
    if name in _THROUGHPUT:
        return getattr(importlib.import_module("megapack.bench.gpu.throughput"), name)
    raise AttributeError(f"module 'megapack.bench.gpu' has no attribute {name!r}")
