"""What a captured training step (`megapack.megatron.graph_step.GraphStep`) owns and refuses.

* `grad_views`: one flat gradient buffer per (dtype, device), each ``param.grad`` a view of it, so
  the graph zeroes, scales, all-reduces and clips a few buffers whose pointers never change;
  autograd accumulates into an existing ``.grad`` in place.
  Example: parameters of 6 and 4 fp32 elements -> one buffer of 10; ``p0.grad`` is ``flat[0:6]``.
* `check_optimizer`: every param group's learning rate is a one-element tensor on the parameters'
  device (what ``set_lr`` fills), ``capturable=True`` where the step is captured, and only the
  model's parameters.
* `check_parallel_sizes`: tp = pp = cp = 1 in megatron-core's ``parallel_state``.
* `rng_generators`: megatron-core's graph-safe RNG generators, registered with each graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def check_parallel_sizes() -> None:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise ValueError(
            "GraphStep runs megatron-core's schedule: initialize its parallel_state first "
            "(initialize_model_parallel)"
        )
    sizes = {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
    }
    if bad := {k: v for k, v in sizes.items() if v != 1}:
        raise ValueError(
            f"GraphStep captures tp = pp = cp = 1 only, got {bad}: their collectives, P2P and "
            "megapack's CP plan would run inside the graph (see docs/attention.md); train those "
            "steps eagerly"
        )


def data_parallel_group() -> Any:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group() if dist.is_initialized() else None


def check_optimizer(
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    device: torch.device,
    *,
    graph: bool,
) -> list[torch.Tensor]:
    """The param groups' lr tensors; errors for what the step cannot replay."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    owned = {id(p) for p in params}
    lrs = []
    for i, group in enumerate(optimizer.param_groups):
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor) or lr.numel() != 1 or lr.device != device:
            raise TypeError(
                f"optimizer.param_groups[{i}]['lr'] is {lr!r}: GraphStep needs a one-element "
                f"tensor on {device} (lr=torch.tensor(1e-4, device={str(device)!r})), which "
                "set_lr fills between steps"
            )
        if graph and not group.get("capturable", False):
            raise ValueError(
                f"optimizer.param_groups[{i}] has capturable={group.get('capturable')!r}: a "
                "captured optimizer step needs capturable=True"
            )
        if any(id(p) not in owned for p in group["params"]):
            raise ValueError(
                f"optimizer.param_groups[{i}] holds a parameter that is not one of the model's "
                "trainable parameters"
            )
        lrs.append(lr)
    return lrs


def grad_views(
    params: list[torch.nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One flat zero buffer per (dtype, device); each ``param.grad`` becomes a view of it, which
    autograd accumulates into in place."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    flats = []
    views: dict[int, torch.Tensor] = {}
    for (dtype, device), members in groups.items():
        flat = torch.zeros(sum(p.numel() for p in members), dtype=dtype, device=device)
        offset = 0
        for p in members:
            views[id(p)] = p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        flats.append(flat)
    return flats, [views[id(p)] for p in params]


def rng_generators() -> list[torch.Generator]:
    """megatron-core's graph-safe RNG tracker's generators, registered with each graph (as its
    ``FullCudaGraphWrapper`` does); the plain tracker (byte-tensor states) has none to register."""
    from megatron.core.tensor_parallel import random as mrandom

    if not getattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        return []
    states = mrandom.get_all_rng_states()
    return [s for s in states.values() if isinstance(s, torch.Generator)]
