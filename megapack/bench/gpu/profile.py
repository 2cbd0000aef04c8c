"""Where a training step's time goes: one step under ``torch.profiler``, summed the kit's way.

For each profiled step (`profile_step`):

    host_ms       wall time of the step, the device synchronized at both ends
    device_ms     the GPU's busy time: the sum of every kernel's own time (None without CUDA)
    by_owner_ms   the step's thread's time, each profiled event's self time (Python functions,
                  recorded with ``with_stack``, and the operators they call) given to the innermost
                  Python frame of megapack's code or megatron-core's that holds it, else to "torch"
                  (torch's own Python and operators, the interpreter, the optimizer); the
                  profiler's own start and stop, outside the step, left out
    top           the 5 kernels (CUDA) or operators (CPU) with the most self time, in ms

A step whose ``host_ms`` is far above its ``device_ms`` is bound by the host; ``by_owner_ms`` then
says whose code holds it. Other threads (a prefetch thread) are left out of ``by_owner_ms``.

Across torch versions (`summarize_events` reads only what each has): torch 2.13 lists Python
function events among ``prof.events()`` and marks them ``is_python_function``; torch 2.11 lists no
Python events and its ``FunctionEvent`` has no ``is_python_function``, but each operator carries
its Python ``stack`` (innermost frame first), which `owner_of` reads instead.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

OWNERS = ("megapack", "megatron", "torch")
_PYTHON_FRAME = re.compile(r"\.py\(\d+\): ")
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
    return summarize_events(list(prof.events()), host_ms=host_ms, cuda=cuda)


def summarize_events(events: list[Any], *, host_ms: float, cuda: bool) -> dict[str, Any]:
    """The module docstring's figures from profiled events (torch's ``FunctionEvent``, or any
    object with ``name``, ``thread``, ``self_cpu_time_total``, ``cpu_parent``, ``device_type`` and,
    where torch has them, ``is_python_function``, ``stack`` and ``self_device_time_total``)."""
    host = [e for e in events if not _on_device(e)]
    main = Counter(e.thread for e in host).most_common(1)[0][0] if host else None
    owners = dict.fromkeys(OWNERS, 0.0)
    for e in host:
        if e.thread == main and not _profilers_own(e):
            owners[owner_of(e)] += e.self_cpu_time_total / 1e3
    ops: dict[str, float] = {}
    for e in events:
        if cuda == _on_device(e) and not is_python_function(e):
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


def is_python_function(event: Any) -> bool:
    """Whether a profiled event is a Python function's, not an operator's or a kernel's: torch's
    ``is_python_function`` where the event has it (torch >= 2.12), else its name, which for a
    Python function is ``"path.py(line): name"`` or ``"<built-in ...>"``.

    Example:
        >>> from types import SimpleNamespace as E
        >>> is_python_function(E(name="megapack/core/batch.py(216): from_documents"))
        True
        >>> is_python_function(E(name="aten::mm")), is_python_function(E(name="x", is_python_function=True))
        (False, True)
    """
    flag = getattr(event, "is_python_function", None)
    if flag is not None:
        return bool(flag)
    name = str(getattr(event, "name", ""))
    return bool(_PYTHON_FRAME.search(name)) or name.startswith("<built-in")


def owner_of(event: Any) -> str:
    """Whose code holds an event: the innermost megapack or megatron-core Python frame among the
    event itself and its parents, each one's name then its ``stack`` (torch 2.11 gives operators
    their Python stack, innermost first, and lists no Python events), megapack's bench and harness
    frames passed over; else torch.

    Example:
        >>> from types import SimpleNamespace as E
        >>> mcore = E(name="megatron/core/layer.py(9): forward", cpu_parent=None)
        >>> owner_of(E(name="aten::mm", cpu_parent=E(name="torch/nn/functional.py(2): linear", cpu_parent=mcore)))
        'megatron'
        >>> owner_of(E(name="aten::mm", cpu_parent=None,
        ...            stack=["torch/nn/functional.py(2): linear", "megapack/attention/kernels.py(7): sdpa"]))
        'megapack'
    """
    while event is not None:
        for frame in [event.name, *(getattr(event, "stack", None) or [])]:
            owner = _frame_owner(str(frame))
            if owner is not None:
                return owner
        event = getattr(event, "cpu_parent", None)
    return "torch"


def _frame_owner(frame: str) -> str | None:
    path = frame.replace("\\", "/")
    if ".py(" not in path:
        return None
    if "megapack/" in path and not any(f"megapack/{p}/" in path for p in _CALLERS):
        return "megapack"
    if "megatron/" in path:
        return "megatron"
    return None


def _profilers_own(event: Any) -> bool:
    """Whether an event is the profiler starting or stopping (outside the timed step): it or a
    parent is a frame of ``torch/profiler/`` or ``torch/autograd/profiler``, by name or stack."""
    while event is not None:
        for frame in [event.name, *(getattr(event, "stack", None) or [])]:
            path = str(frame).replace("\\", "/")
            if "torch/profiler/" in path or "torch/autograd/profiler" in path:
                return True
        event = getattr(event, "cpu_parent", None)
    return False


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
