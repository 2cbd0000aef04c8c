"""Control groups: the CPU (gloo) group on which megapack's small host-side messages for a group travel.

megapack keeps control (headers, stop and error flags, `megapack.lockstep`'s per-step flag) on the
host and data on the device. For a group that can carry CPU tensors (gloo, or a mixed
``"cpu:gloo,cuda:nccl"`` group) the control group is the group itself. For an NCCL-only group it
is a gloo group with the same ranks, created once and cached for as long as the group lives:

* **On first use** (default): created with ``new_group(ranks, backend="gloo",
  use_local_synchronization=True)``, so only the group's own ranks take part, at the call where
  all of them first need it (e.g. their first `get_batch_on_this_tp_rank`). Other groups' ranks
  are not involved and need not be at the same step.
* **Up front** (explicit): `set_control_group(group, control)` with a gloo group you created
  yourself, e.g. right after ``initialize_model_parallel`` in world lockstep.

A gloo group registered for a gloo ``group`` is also accepted: then headers travel on it and
payloads on ``group``, as on NCCL (how the tests exercise the NCCL path on CPU).

Example:
    >>> from megapack.distributed.groups import control_group, set_control_group  # doctest: +SKIP
    >>> tp = parallel_state.get_tensor_model_parallel_group()             # NCCL
    >>> set_control_group(tp, dist.new_group(dist.get_process_group_ranks(tp), backend="gloo"))
    >>> control_group(tp) is control_group(tp)                            # cached: one per group
    True
"""

from __future__ import annotations

import weakref

import torch.distributed as dist

from megapack.distributed import comm

# Keyed weakly by the data group: a control group lives exactly as long as its data group.
_controls: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = (
    weakref.WeakKeyDictionary()
)


def carries_cpu(group: dist.ProcessGroup | None) -> bool:
    """True when ``group`` (the default group when None) can run collectives on CPU tensors."""
    return comm.tensor_device(group).type == "cpu"


def control_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group that carries host-side messages for ``group``: registered, itself, or a cached gloo twin.

    Every rank of ``group`` must call it at the same point the first time (the gloo twin is
    created then, by exactly these ranks); later calls return the cached group without talking.

    Args:
        group: a process group, or None for the default group.

    Returns:
        The group registered with `set_control_group`; else ``group`` itself when it carries CPU
        tensors; else a gloo group with the same ranks (created on the first call, then cached).
    """
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    if (found := _controls.get(pg)) is not None:
        return found
    if carries_cpu(group):
        return group
    twin = dist.new_group(comm.group_ranks(group), backend="gloo", use_local_synchronization=True)
    _controls[pg] = twin
    return twin


def set_control_group(group: dist.ProcessGroup | None, control: dist.ProcessGroup) -> None:
    """Use ``control`` for ``group``'s host-side messages from now on (explicit one-time setup).

    Args:
        group: the data group (e.g. the NCCL TP group), or None for the default group.
        control: a group with exactly ``group``'s ranks, in the same order, that carries CPU
            tensors (gloo).

    Raises:
        ValueError: ``control`` has other ranks, or cannot carry CPU tensors, or is ``group``.
    """
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    ranks, control_ranks = comm.group_ranks(group), comm.group_ranks(control)
    if control is pg:
        raise ValueError(
            "set_control_group: control is the group itself; pass a separate gloo group"
        )
    if control_ranks != ranks:
        raise ValueError(
            f"set_control_group: control has ranks {control_ranks} but the group has {ranks}; "
            "create it with dist.new_group(dist.get_process_group_ranks(group), backend='gloo')"
        )
    if not carries_cpu(control):
        raise ValueError(
            f"set_control_group: control's backend {dist.get_backend(control)!r} cannot carry CPU "
            "tensors; create it with backend='gloo'"
        )
    _controls[pg] = control
