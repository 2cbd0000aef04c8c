"""What a captured training step (`megapack.megatron.graph_step.GraphStep`) owns and refuses.

What it owns:

* `grad_views`: one flat gradient buffer per (dtype, device), each ``param.grad`` a view of it, so
  the graph zeroes, scales, all-reduces and clips a few buffers whose pointers never change;
  autograd accumulates into an existing ``.grad`` in place.
  Example: parameters of 6 and 4 fp32 elements -> one buffer of 10; ``p0.grad`` is ``flat[0:6]``.
* `check_optimizer`: every param group's learning rate is a one-element tensor on the parameters'
  device (what ``set_lr`` fills), ``capturable=True`` where the step is captured, and only the
  model's parameters.
* `rng_generators`: megatron-core's graph-safe RNG generators, registered with each graph.

What it refuses, by name, with the reason and the fix (ValueError), before anything runs:

* `check_parallel_sizes`: tp = pp = cp = 1 in megatron-core's ``parallel_state``.
* `check_config`: the model config's fields in `REFUSED` (read from megatron-core's schedules,
  ``forward_backward_no_pipelining``, ``forward_step`` and ``backward_step`` of 0.16.1 and 0.19.2,
  and from the layers they reach): hooks whose work GraphStep does itself or cannot replay
  (``grad_scale_func``, ``no_sync_func``), megatron-core's own CUDA graphs, MoE token routing,
  multi-token prediction, activation recompute and offloading. A field a release lacks is never
  refused there (read with ``getattr``).
* `check_tp_backend`: the tensor-parallel group's CUDA backend is NCCL when the step is captured:
  megatron-core's vocab-parallel cross-entropy all-reduces over it at every tp, 1 included.
* `check_capture_attention`: every attention of the model runs a capturable backend
  (`UNCAPTURABLE`), and Transformer Engine's on padded boundaries is told so
  (``PackedSeqParams.pad_between_seqs``) instead of comparing them on the host.

What it clears instead: `hooks_cleared` sets the config's `CLEARED_FOR_CAPTURE` hooks to None
while the step is captured and restores them after. ``timers``: megatron-core's ``Timer.start``
calls ``torch.cuda.synchronize()`` (the schedule starts "forward-backward" at log level 1,
"forward-compute" and "backward-compute" at 2), which a capture cannot hold; a timer there would
time the recording, not a step, and a replay never runs the host code that calls it, so clearing
it loses nothing: warm-up and eager steps keep their timers, and a replayed step is timed around
``step(...)``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# ------------------------------------------------------------------ what the step refuses


@dataclass(frozen=True, kw_only=True, slots=True)
class Refusal:
    """A megatron-core config field GraphStep refuses when set (not None, False, 0 or "none")."""

    field: str
    """The config attribute (a release without it: never refused there)."""
    because: str
    """Why the step cannot run with it set."""
    fix: str
    """What to do instead."""
    graph_only: bool = True
    """Refused only where the step is captured (``mode="graph"``); False: in both modes."""


_WITHOUT = "train such steps without GraphStep (megatron-core's own schedule and optimizer)"

REFUSED: tuple[Refusal, ...] = (
    Refusal(
        field="grad_scale_func",
        because="backward_step multiplies the loss by it (megatron-core's optimizer's loss "
        "scale) and GraphStep's update never divides it out",
        fix="set config.grad_scale_func = None (bf16 and fp32 train without loss scaling)",
        graph_only=False,
    ),
    Refusal(
        field="no_sync_func",
        because="it is megatron-core DistributedDataParallel's no_sync, and GraphStep owns the "
        "gradients and their data-parallel all-reduce: no DDP hook may run in its step",
        fix="set config.no_sync_func = None and give GraphStep the model without DDP",
        graph_only=False,
    ),
    Refusal(
        field="gradient_accumulation_fusion",
        because="megatron-core's linear layers then add weight gradients into param.main_grad "
        "(DistributedDataParallel's buffers) instead of param.grad, which GraphStep owns",
        fix="set config.gradient_accumulation_fusion = False",
        graph_only=False,
    ),
    Refusal(
        field="hybrid_context_parallel",
        because="the schedule then runs hybrid context parallelism, which regroups each step's "
        "samples on the host",
        fix=_WITHOUT,
        graph_only=False,
    ),
    Refusal(
        field="cuda_graph_impl",
        because="megatron-core would record its own CUDA graphs (per layer, or around the "
        "iteration) inside GraphStep's capture, and the schedule calls create_cudagraphs() "
        "after each step",
        fix="set config.cuda_graph_impl = 'none': GraphStep's one graph holds the whole step",
    ),
    Refusal(
        field="enable_cuda_graph",
        because="it is cuda_graph_impl='local' under its older name: megatron-core's per-layer "
        "CUDA graphs would be recorded inside GraphStep's capture",
        fix="set it False (and cuda_graph_impl = 'none')",
    ),
    Refusal(
        field="external_cuda_graph",
        because="it is cuda_graph_impl='transformer_engine' under its older name: Transformer "
        "Engine's graphed layers would be replayed inside GraphStep's capture",
        fix="set it False (and cuda_graph_impl = 'none')",
    ),
    Refusal(
        field="num_moe_experts",
        because="MoE token routing copies each expert's token count to the host (the token "
        "dispatcher's tokens_per_expert .cpu() / .tolist()) to size its GEMMs",
        fix=_WITHOUT,
    ),
    Refusal(
        field="overlap_moe_expert_parallel_comm",
        because="the schedule then runs its combined 1F1B MoE path, with expert-parallel "
        "all-to-alls sized on the host",
        fix=_WITHOUT,
    ),
    Refusal(
        field="moe_paged_stash",
        because="the schedule resets MoE's paged stash on the host before each step",
        fix=_WITHOUT,
    ),
    Refusal(
        field="mtp_num_layers",
        because="multi-token prediction rolls packed labels document by document, slicing at "
        "each cu_seqlens entry read on the host (roll_tensor)",
        fix=_WITHOUT,
    ),
    Refusal(
        field="recompute_granularity",
        because="activation recompute (tensor_parallel.checkpoint) saves the CUDA RNG state "
        "through megatron-core's RNG tracker in the forward and sets it back in the backward: "
        "the plain tracker reads and writes the generator's state on the host (torch refuses "
        "that during a capture), and the graph-safe one hands back the live generator state, "
        "not a copy (not covered)",
        fix="set config.recompute_granularity = None",
    ),
    Refusal(
        field="cpu_offloading",
        because="activation offloading moves activations to the host and back through host-side "
        "hooks and their bookkeeping, which a replay does not run",
        fix="set config.cpu_offloading = False",
    ),
    Refusal(
        field="fine_grained_activation_offloading",
        because="the schedule resets megatron-core's offload manager on the host after each "
        "step (off_interface.reset()), which a replay does not run",
        fix="set config.fine_grained_activation_offloading = False",
    ),
)
"""Every refused config field, in the order they are checked (module docstring)."""

CLEARED_FOR_CAPTURE = ("timers",)
"""Config hooks set to None while the step is captured, restored after (module docstring)."""

UNCAPTURABLE = {
    "bucketed": "its bucket shapes change with every micro-batch",
    "sdpa": "it loops over the documents with their boundaries read on the host",
}
"""Attention backends a capture cannot hold, and why."""


def check_config(config: Any, *, graph: bool) -> None:
    """ValueError naming the first field of `REFUSED` set in ``config`` (those with
    ``graph_only`` only when ``graph``), why, and the fix.

    Example:
        >>> from types import SimpleNamespace
        >>> check_config(SimpleNamespace(num_moe_experts=None, cuda_graph_impl="none"), graph=True)
        >>> check_config(SimpleNamespace(num_moe_experts=8), graph=False)  # eager: allowed
    """
    for refusal in REFUSED:
        if refusal.graph_only and not graph:
            continue
        value = getattr(config, refusal.field, None)  # a field this release lacks: not refused
        if _is_set(value):
            doing = "capture a step" if refusal.graph_only else "run a step"
            raise ValueError(
                f"GraphStep cannot {doing} with the model config's {refusal.field}="
                f"{_describe(value)}: {refusal.because}; {refusal.fix}"
            )


@contextlib.contextmanager
def hooks_cleared(config: Any) -> Iterator[None]:
    """`CLEARED_FOR_CAPTURE`'s hooks of ``config`` set to None inside, restored after (an error
    included)."""
    saved = {name: getattr(config, name, None) for name in CLEARED_FOR_CAPTURE}
    saved = {name: value for name, value in saved.items() if value is not None}
    for name in saved:
        setattr(config, name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


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


def check_tp_backend(model: torch.nn.Module) -> None:
    """ValueError unless the model's tensor-parallel group runs CUDA tensors on NCCL.

    megatron-core's ``vocab_parallel_cross_entropy`` (the GPT loss) all-reduces the logits' max,
    the predicted logits and the sum of exponentials over the TP group even at tp 1, so the
    capture holds those collectives; only NCCL's can be captured.
    """
    group = _tensor_parallel_group(model)
    backend, config = cuda_backend(group)
    if backend != "nccl":
        raise ValueError(
            "GraphStep captures the loss's vocab-parallel cross-entropy, which all-reduces over "
            "the tensor-parallel group even at tp 1, but that group runs CUDA tensors on "
            f"{backend!r} (backend config {config!r}); a CUDA graph holds NCCL collectives "
            "only: initialize torch.distributed with backend='nccl' (or 'cpu:gloo,cuda:nccl')"
        )


def cuda_backend(group: Any) -> tuple[str | None, str]:
    """(the backend ``group`` runs CUDA tensors on, None if none; its whole backend config).

    Example: a group made with ``"cpu:gloo,cuda:nccl"`` -> ``("nccl", "cpu:gloo,cuda:nccl")``.
    """
    config = str(dist.get_backend_config(group))
    for part in config.split(","):
        device, _, name = part.strip().rpartition(":")
        if device in ("", "cuda"):
            return name, config
    return None, config


def check_capture_attention(
    model: torch.nn.Module, batch: Mapping[str, Any], *, device: torch.device, dtype: torch.dtype
) -> None:
    """ValueError naming the first attention of ``model`` that a capture of ``batch`` cannot
    hold: a megapack `PackedAttention` whose backend resolves (as its forward would, for
    ``dtype`` tensors on ``device``, training) to one of `UNCAPTURABLE`; or Transformer Engine's
    attention (megapack's ``te`` backend, or megatron-core's own TE attention) on padded
    boundaries without ``pad_between_seqs`` set (`check_te_padding`).
    """
    from megapack.attention.choice import resolve_backend
    from megapack.attention.packed import PackedAttention
    from megapack.core.seq_params import BUCKETS_ATTR

    params = batch.get("packed_seq_params")
    planned = getattr(params, BUCKETS_ATTR, None) is not None
    te_class = _te_attention_class()
    te_at = None
    for name, module in model.named_modules():
        if isinstance(module, PackedAttention):
            dropout = module.dropout if module.training else 0.0
            ran = resolve_backend(
                module.backend, device, training=True, dropout=dropout, dtype=dtype, planned=planned
            )
            if ran in UNCAPTURABLE:
                chosen = (
                    f"auto's choice{' (the batches bring their bucket plan)' if planned else ''}"
                    if module.backend == "auto"
                    else "forced"
                )
                raise ValueError(
                    f"GraphStep cannot capture {name or 'the model'} (PackedAttention backend="
                    f"{module.backend!r}): it runs {ran!r} ({chosen}), and {UNCAPTURABLE[ran]}; "
                    "give the layer spec a capturable backend (cudnn, te, flash_attn, "
                    "torch_varlen, flex)"
                    + (" or deliver without fields=megapack.BUCKET_FIELDS" if planned else "")
                )
            if ran == "te" and te_at is None:
                te_at = name
        elif te_class is not None and isinstance(module, te_class) and te_at is None:
            te_at = name
    if te_at is not None and isinstance(batch.get("cu_seqlens_padded"), torch.Tensor):
        check_te_padding(te_at or "the model", params)


def check_te_padding(where: str, params: Any, *, fields: frozenset[str] | None = None) -> None:
    """ValueError unless Transformer Engine is told the boundaries are padded
    (``params.pad_between_seqs`` True): without it TE's THD attention decides with
    ``torch.equal(cu_seqlens_padded, cu_seqlens)``, a host read a capture cannot hold.

    ``fields``: the ``PackedSeqParams`` fields of the installed release (default: from
    `megapack.core.megatron_release`; megatron-core 0.19 has ``pad_between_seqs``, 0.16.1 not).
    """
    if fields is None:
        from megapack.core.megatron_release import megatron_release

        fields = megatron_release().packed_seq_fields
    if "pad_between_seqs" not in fields:
        raise ValueError(
            f"GraphStep cannot capture Transformer Engine's attention ({where}) on padded "
            "boundaries (the batches carry cu_seqlens_padded) with this megatron-core: its "
            "PackedSeqParams has no pad_between_seqs (megatron-core 0.19 has it), so TE compares "
            "cu_seqlens_padded with cu_seqlens on the host (torch.equal) in every layer; deliver "
            "unpadded boundaries, give the layer spec another backend (cudnn, torch_varlen), or "
            "upgrade megatron-core"
        )
    if params.pad_between_seqs is not True:
        raise ValueError(
            f"GraphStep cannot capture Transformer Engine's attention ({where}) on padded "
            f"boundaries with packed_seq_params.pad_between_seqs={params.pad_between_seqs!r}: "
            "TE then compares cu_seqlens_padded with cu_seqlens on the host (torch.equal) in "
            "every layer (or, with False, reads padded boundaries as unpadded); set it True "
            "(megapack.GraphInputs does for padded batches)"
        )


def _te_attention_class() -> type | None:
    """Transformer Engine's ``DotProductAttention`` when TE is imported (a model using it has
    imported it), else None; megatron-core's ``TEDotProductAttention`` derives from it."""
    te = sys.modules.get("transformer_engine.pytorch")
    cls = getattr(te, "DotProductAttention", None)
    return cls if isinstance(cls, type) else None


def _tensor_parallel_group(model: torch.nn.Module) -> Any:
    """The group the model's loss reduces over: its ``tp_group`` (megatron-core's language
    models), else megatron-core's parallel state's."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model

    try:
        group = get_attr_wrapped_model(model, "tp_group")
    except RuntimeError:  # not found on the model or any wrapper
        group = None
    return ps.get_tensor_model_parallel_group() if group is None else group


def _is_set(value: Any) -> bool:
    return (
        value is not None
        and value is not False
        and not (isinstance(value, int | str) and value in (0, "none"))
    )


def _describe(value: Any) -> str:
    """A config value for a message: a function by its qualified name, anything else by repr."""
    if callable(value):
        return str(getattr(value, "__qualname__", type(value).__name__))
    return repr(value)


# ------------------------------------------------------------------ what the step owns


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
