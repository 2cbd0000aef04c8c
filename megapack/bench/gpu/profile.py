"""Where a training step's time goes: one step under ``torch.profiler``, summed the kit's way.

For each profiled step (`profile_step`):

    host_ms       wall time of the step, the device synchronized at both ends
    device_ms     the GPU's busy time: the sum of every kernel's own time (None without CUDA)
    by_owner_ms   the step's thread's time, each profiled event's self time (Python functions,
                  recorded with ``with_stack``, and the operators they call) given to the innermost
                  Python frame of megapack's code or megatron-core's that holds it, else to "torch"
                  (torch's own Python and operators, the interpreter, the optimizer)
    top           the 5 kernels (CUDA) or operators (CPU) with the most self time, in ms

A step whose ``host_ms`` is far above its ``device_ms`` is bound by the host; ``by_owner_ms`` then
says whose code holds it. Other threads (a prefetch thread) are left out of ``by_owner_ms``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

OWNERS = ("megapack", "megatron", "torch")
_CALLERS = ("bench", "harness", "testing")
"""megapack's packages that play the trainer (the kit's loop, the pretrain_gpt-style step): their
frames are passed over, so what they call counts for its own owner."""
TOP = 5


def profile_step(run: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """Profile one call of ``run`` (a whole training step); see the module docstring."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with profile(activities=activities, with_stack=True) as prof:
        start = time.perf_counter()
        run()
        _sync(device)
        host_ms = (time.perf_counter() - start) * 1e3
    events = prof.events()
    host = [e for e in events if not _on_device(e)]
    main = Counter(e.thread for e in host).most_common(1)[0][0] if host else None
    owners = dict.fromkeys(OWNERS, 0.0)
    for e in host:
        if e.thread == main:
            owners[owner_of(e)] += e.self_cpu_time_total / 1e3
    ops: dict[str, float] = {}
    for e in events:
        if cuda == _on_device(e) and not e.is_python_function:
            ops[e.name] = ops.get(e.name, 0.0) + (
                _self_device_us(e) if cuda else e.self_cpu_time_total
            )
    top = sorted(ops.items(), key=lambda kv: kv[1], reverse=True)[:TOP]
    return {
        "host_ms": host_ms,
        "device_ms": sum(_self_device_us(e) for e in events if _on_device(e)) / 1e3
        if cuda
        else None,
        "by_owner_ms": owners,
        "top": [(name[:60], us / 1e3) for name, us in top],
    }


def owner_of(event: Any) -> str:
    """Whose code holds an event: the innermost megapack or megatron-core Python frame among the
    event itself and its parents (megapack's bench and harness frames passed over), else torch.

    Example:
        >>> from types import SimpleNamespace as E
        >>> mcore = E(name="megatron/core/layer.py(9): forward", cpu_parent=None)
        >>> owner_of(E(name="aten::mm", cpu_parent=E(name="torch/nn/functional.py(2): linear", cpu_parent=mcore)))
        'megatron'
    """
    while event is not None:
        path = event.name.replace("\\", "/")
        if (
            "megapack/" in path
            and ".py(" in path
            and not any(f"megapack/{p}/" in path for p in _CALLERS)
        ):
            return "megapack"
        if "megatron/" in path and ".py(" in path:
            return "megatron"
        event = event.cpu_parent
    return "torch"


def _on_device(event: Any) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def _self_device_us(event: Any) -> float:
    """An event's own device time, in µs (``self_device_time_total`` since torch 2.4)."""
    value: Any = getattr(event, "self_device_time_total", None)
    if value is None:
        value = getattr(event, "self_cuda_time_total", 0.0)
    return float(value)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
