"""`GraphStep`: a whole packed training step in one CUDA graph, replayed every step with no host sync.

One step is megatron-core's schedule (``get_forward_backward_func``, tp = pp = 1) over the step's
M micro-batches (forward, the loss in `megapack.megatron.normalized_loss`'s per-token form,
backward, gradient accumulation), the division by the step's trained tokens, gradient clipping
and the optimizer's update. `GraphStep` captures all of it once and replays it for every
following step; what changes between steps travels through static buffers:

    micro-batch slot i      one static buffer set (`megapack.GraphInputs`, the ``inputs``
                            factory) per micro-batch of the step: the schedule calls forward_step
                            M times inside the capture and the i-th call reads slot i, so a step
                            of M micro-batches fills M buffer sets before its replay (a
                            factory argument: the megatron layer never imports the delivery)
    gradients               one flat buffer per dtype, every ``param.grad`` a view of it: zeroed
                            in the graph, accumulated in place by autograd, all-reduced over DP
    trained tokens          the schedule's count (its ``finalize_model_grads_func`` hook), a
                            device int32 the update divides by (no host read: ``clamp(min=1)``
                            instead of Megatron's ``if num_tokens > 0``)
    learning rate           a device tensor per param group (``lr=torch.tensor(...)``);
                            `GraphStep.set_lr` fills it outside the graph, as a scheduler would
    clipping                ``torch.nn.utils.clip_grad_norm_`` without ``error_if_nonfinite``: the
                            norm and the clip coefficient stay on the device

A step runs as: M micro-batches checked (all of them, before anything is copied), padded into the
`megapack.StaticShape` where they fit and loaded into their slots; then ``warmup`` (>= 1) eager
steps on a side stream (lazily built optimizer state, workspaces), the capture, and a replay per
step. During the capture the config's ``timers`` are None (their ``start()`` synchronizes the
device), restored after (`megapack.megatron.graph_parts.hooks_cleared`).
With a DP group of more than one rank the graph is split in two around the gradient all-reduce,
which runs eagerly between the replays (gloo cannot be captured; NCCL could, but then every rank
must capture and replay in lockstep): ``zero + schedule`` | all-reduce(grads, tokens) |
``scale + clip + optimizer``. A rank whose step falls back to eager (below) runs the same three
parts unrolled, so DP ranks may mix replays and eager steps.

A step with a micro-batch over the static shape (more document segments, or a longer document)
runs eagerly on the batches as delivered, the same code on other buffers, and is counted in
`GraphStep.eager_steps`; cap the documents per row where rows are packed so that every step
fits. ``mode="eager"`` runs every step that way, exactly what the graph holds without capturing
it (on CPU: what the tests compare with megatron-core's own schedule, DDP and optimizer loop).

Not covered (refused at construction, by name, with the reason): tensor or pipeline parallelism
(their collectives and P2P would be captured; megatron-core's pipelined schedules also
synchronize the host), context parallelism (megapack's CP attention plan reads the boundaries on
the host), megatron-core's ``DistributedDataParallel`` wrapper and its optimizers (they own
gradient buffers and read the host for grad norms and found-inf checks), and the config fields of
`megapack.megatron.graph_parts.REFUSED` (loss scaling, DDP hooks, megatron-core's own CUDA graphs,
MoE token routing, multi-token prediction, recompute, offloading). A captured step also needs
the tensor-parallel group on NCCL (the loss's cross-entropy all-reduces over it even at tp 1) and
an attention a capture can hold (`megapack.megatron.graph_parts.check_capture_attention`),
checked at every step before the capture, the first before anything runs. Legend: M
micro-batches per step, DP data-parallel ranks.

Example, a pretrain_gpt-style loop (every micro-batch delivered in the static shape)::

    step = GraphStep(model, torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-4,
                     device="cuda"), capturable=True), forward_step, micro_batches=4,
                     static=shape, inputs=megapack.GraphInputs, max_grad_norm=1.0)
    for _ in range(steps):
        step.set_lr(scheduler_lr())                        # a host float, copied to the device
        out = step([next(batches) for _ in range(4)])      # out.reports: the schedule's
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megapack.core.checks import check_int
from megapack.core.static import StaticShape, pad_static
from megapack.megatron.graph_parts import (
    check_capture_attention,
    check_config,
    check_optimizer,
    check_parallel_sizes,
    check_tp_backend,
    data_parallel_group,
    grad_views,
    hooks_cleared,
    rng_generators,
)

logger = logging.getLogger("megapack.megatron")

_FROM_PARALLEL_STATE: Any = object()
"""``dp_group``'s default: megatron-core's data-parallel group."""
MODES = ("graph", "eager")


class StaticInputs(Protocol):
    """One micro-batch slot's static buffers (`megapack.GraphInputs` is one): ``check`` raises
    ValueError for a batch that does not fit, ``load`` copies one in and returns the static dict."""

    def check(self, batch: Mapping[str, Any]) -> None: ...

    def load(self, batch: Mapping[str, Any]) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What a step returns. Replayed steps return the graph's own tensors: read (or clone) them
    before the next step, which overwrites them."""

    reports: list[Any]
    """The schedule's per-micro-batch reports (``{"lm loss": [sum, count]}`` each)."""
    tokens: torch.Tensor
    """The trained tokens the gradients were divided by (summed over DP), device int32."""
    grad_norm: torch.Tensor | None
    """The gradient norm before clipping (None without ``max_grad_norm``)."""
    replayed: bool
    """Whether the step was a graph replay (False: warm-up, ``mode="eager"`` or a fallback)."""


class GraphStep:
    """A whole training step, captured once and replayed (module docstring).

    Args:
        model: the megatron-core model (``GPTModel``, or wrapped in ``Float16Module``), not
            wrapped in DDP; its config must have ``calculate_per_token_loss=True``.
        optimizer: a torch optimizer over the model's parameters whose every param group has a
            tensor ``lr`` on the parameters' device; ``capturable=True`` in ``mode="graph"``
            (e.g. ``torch.optim.AdamW(..., lr=torch.tensor(1e-4, device=dev), capturable=True)``).
        forward_step_func: megatron-core's ``forward_step_func(data_iterator, model)``; its
            iterator yields the step's micro-batch dicts (``next(data_iterator)``, no delivery
            inside), and its loss function returns the 3-tuple (sum, count, report).
        micro_batches: M, micro-batches per step.
        static: the shape every captured micro-batch has (boundaries and ``max_seqlen``).
        inputs: the factory of a slot's static buffers, ``megapack.GraphInputs``.
        mode: "graph" (capture after ``warmup`` steps; CUDA) or "eager" (never capture).
        max_grad_norm: clip the gradients' global L2 norm to this (None: no clipping).
        warmup: eager steps, on a side stream, before the capture ("graph" only), at least 1:
            a torch optimizer builds its state (AdamW's step count and moments) on its first
            ``step()``, which must not be the captured one.
        dp_group: the data-parallel group the gradients are summed over; default
            megatron-core's; None: no data parallelism.

    Raises:
        ValueError: tp, pp or cp above 1, ``calculate_per_token_loss`` off, ``warmup`` 0, a
            model config field GraphStep refuses (`megapack.megatron.graph_parts.REFUSED`:
            loss scaling, DDP hooks, megatron-core's own CUDA graphs, MoE, multi-token
            prediction, recompute, offloading; checked again before every step), an optimizer
            over parameters outside the model or not capturable in "graph" mode, "graph" on CPU.
            At the steps before the capture in "graph" mode (the first before anything runs): a
            tensor-parallel group whose CUDA backend is not NCCL, an attention whose backend a
            capture cannot hold, or Transformer Engine's on padded boundaries without
            ``pad_between_seqs`` (`megapack.megatron.graph_parts.check_capture_attention`).
        TypeError: a DDP-wrapped model, a param group whose ``lr`` is not a tensor.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        forward_step_func: Callable[..., Any],
        *,
        micro_batches: int,
        static: StaticShape,
        inputs: Callable[[Mapping[str, Any]], StaticInputs],
        mode: str = "graph",
        max_grad_norm: float | None = None,
        warmup: int = 2,
        dp_group: Any = _FROM_PARALLEL_STATE,
    ) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.utils import get_model_config

        self.micro_batches = check_int("micro_batches", micro_batches, minimum=1)
        self.warmup = check_int("warmup", warmup, minimum=0)
        if self.warmup == 0:
            raise ValueError(
                "warmup must be >= 1, got 0: a torch optimizer builds its state on its first "
                "step() (AdamW's step count and moments, zero-filled), so with no eager step "
                "before the capture that fill would be captured and every replay would restart "
                "Adam at step 1; use warmup=1 or more"
            )
        if not isinstance(static, StaticShape):
            raise TypeError(f"static must be a megapack.StaticShape, got {static!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if max_grad_norm is not None and not (
            isinstance(max_grad_norm, int | float) and math.isfinite(max_grad_norm)
        ):
            raise TypeError(f"max_grad_norm must be a finite number or None, got {max_grad_norm!r}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        if hasattr(model, "zero_grad_buffer"):
            raise TypeError(
                "GraphStep takes the model itself, not megatron-core's DistributedDataParallel: "
                "it owns the gradient buffers and the DP all-reduce (pass model.module)"
            )
        self.model, self.optimizer, self.static, self.mode = model, optimizer, static, mode
        self.forward_step_func, self.max_grad_norm, self._make_inputs = (
            forward_step_func,
            max_grad_norm,
            inputs,
        )
        self._config = get_model_config(model)
        if self._config.calculate_per_token_loss is not True:
            raise ValueError(
                "GraphStep needs the model config's calculate_per_token_loss=True (got "
                f"{self._config.calculate_per_token_loss!r}): the step divides by its trained "
                "tokens on the device (return normalized_loss(..., calculate_per_token_loss=True))"
            )
        check_config(self._config, graph=mode == "graph")
        check_parallel_sizes()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        if not self._params:
            raise ValueError("GraphStep: the model has no parameter that requires grad")
        self.device = self._params[0].device
        if mode == "graph" and self.device.type != "cuda":
            raise ValueError(
                f"mode='graph' captures with torch.cuda.graph, but the model is on "
                f"{self.device}: use mode='eager' off CUDA"
            )
        self._lrs = check_optimizer(optimizer, self._params, self.device, graph=mode == "graph")
        self.dp_group = data_parallel_group() if dp_group is _FROM_PARALLEL_STATE else dp_group
        self.dp_size = 1 if self.dp_group is None else dist.get_world_size(self.dp_group)
        self._flats, self._grads = grad_views(self._params)
        self._tokens = torch.zeros((), dtype=torch.int32, device=self.device)
        self._schedule = get_forward_backward_func()
        self._slots: list[StaticInputs] | None = None
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._output: StepOutput | None = None
        self.eager_steps = 0
        """Steps that did not fit the static shape and ran eagerly."""
        self.warmup_steps = 0
        """Eager steps run before the capture ("graph" mode)."""
        self.replays = 0
        """Steps replayed (the capture's own step included)."""
        autocast = getattr(self._config, "autocast_dtype", None)
        self._dtype = (
            autocast
            if getattr(self._config, "enable_autocast", False) and autocast is not None
            else self._params[0].dtype
        )
        """What the attention computes in: the config's autocast dtype, else the parameters'."""

    def set_lr(self, value: float | Sequence[float]) -> None:
        """Copy the learning rate (one float, or one per param group) into the device tensors the
        step reads: a stream-ordered fill, no host sync; call it between steps."""
        values = [value] * len(self._lrs) if isinstance(value, int | float) else list(value)
        if len(values) != len(self._lrs):
            raise ValueError(
                f"set_lr got {len(values)} values for {len(self._lrs)} param groups: pass one "
                "float, or one per group"
            )
        for i, v in enumerate(values):  # every value checked before any is filled
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise TypeError(f"set_lr: the learning rate must be a finite number, got {v!r}")
            if v < 0:
                raise ValueError(f"set_lr: the learning rate must be >= 0, got {v!r} (group {i})")
        for lr, v in zip(self._lrs, values, strict=True):
            lr.fill_(float(v))

    def __call__(self, batches: Sequence[Mapping[str, Any]]) -> StepOutput:
        """One training step over the step's M micro-batches (delivered dicts, in order)."""
        self._check_owned()
        batches = list(batches)
        if len(batches) != self.micro_batches:
            raise ValueError(
                f"GraphStep was made for micro_batches={self.micro_batches} a step, got "
                f"{len(batches)} micro-batches"
            )
        fitted = [self._fit(i, b) for i, b in enumerate(batches)]
        if any(f is None for f in fitted):
            self.eager_steps += 1
            logger.info(
                "GraphStep: a micro-batch exceeds %s; step run eagerly (%d so far)",
                self.static,
                self.eager_steps,
            )
            return self._eager(batches)
        ready = [f for f in fitted if f is not None]
        if self._slots is None:
            self._slots = [self._make_inputs(f) for f in ready]
        for i, (slot, f) in enumerate(zip(self._slots, ready, strict=True)):
            try:
                slot.check(f)
            except ValueError as exc:
                raise ValueError(f"micro-batch {i} of the step: {exc}") from None
        statics = [slot.load(f) for slot, f in zip(self._slots, ready, strict=True)]
        if self.mode == "eager":
            return self._eager(statics)
        if not self._graphs:  # before the warm-up's first step and again before the capture
            self._check_capture(statics[0])
        if self.warmup_steps < self.warmup:
            self.warmup_steps += 1
            return self._on_side_stream(statics)
        if not self._graphs:
            self._capture(statics)
        assert self._output is not None
        self._graphs[0].replay()
        if len(self._graphs) == 2:
            self._all_reduce()
            self._graphs[1].replay()
        self.replays += 1
        return self._output

    # ------------------------------------------------------------ the step's three parts

    def _forward_backward(self, batches: list[Mapping[str, Any]]) -> list[Any]:
        """Zero the gradients, run the schedule; the trained tokens land in ``self._tokens``."""
        for flat in self._flats:
            flat.zero_()
        config, saved = self._config, self._config.finalize_model_grads_func
        config.finalize_model_grads_func = self._keep_tokens
        try:
            return list(
                self._schedule(
                    forward_step_func=self.forward_step_func,
                    data_iterator=iter(batches),
                    model=[self.model],
                    num_microbatches=self.micro_batches,
                    seq_length=int(batches[0]["tokens"].shape[-1]),
                    micro_batch_size=int(batches[0]["tokens"].shape[0]),
                    forward_only=False,
                )
            )
        finally:
            config.finalize_model_grads_func = saved

    def _keep_tokens(self, model: Any, num_tokens: torch.Tensor | None, **_: Any) -> None:
        if num_tokens is not None:
            self._tokens.copy_(num_tokens)

    def _all_reduce(self) -> None:
        """Sum the gradients and the trained tokens over DP (never captured)."""
        if self.dp_size > 1:
            for flat in self._flats:
                dist.all_reduce(flat, group=self.dp_group)
            dist.all_reduce(self._tokens, group=self.dp_group)

    def _update(self) -> torch.Tensor | None:
        """Divide by the trained tokens, clip, step: megatron-core's finalize_model_grads and
        optimizer without their host reads."""
        scale = 1.0 / self._tokens.clamp(min=1)
        for flat in self._flats:
            flat.mul_(scale)
        norm = None
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(
                self._params, self.max_grad_norm, error_if_nonfinite=False
            )
        self.optimizer.step()
        return norm

    def _eager(self, batches: list[Any]) -> StepOutput:
        reports = self._forward_backward(batches)
        self._all_reduce()
        norm = self._update()
        return StepOutput(reports=reports, tokens=self._tokens, grad_norm=norm, replayed=False)

    # ------------------------------------------------------------ CUDA only

    def _on_side_stream(self, statics: list[Any]) -> StepOutput:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = self._eager(statics)
        current.wait_stream(side)
        return out

    def _capture(self, statics: list[Any]) -> None:
        """Record the step: one graph, or two around the DP all-reduce. Records, runs nothing."""
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()

        def record(part: Callable[[], Any]) -> Any:
            graph = torch.cuda.CUDAGraph()
            generators = rng_generators()
            register = getattr(graph, "register_generator_state", None)
            if generators and register is None:
                raise RuntimeError(
                    f"megatron-core's graph-safe RNG tracker holds {len(generators)} generators "
                    f"but torch {torch.__version__} cannot register them with a graph: every "
                    "replay would draw the same dropout masks"
                )
            for state in generators:
                register(state)  # type: ignore[misc]
            with (
                hooks_cleared(self._config),
                torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"),
            ):
                result = part()
            self._graphs.append(graph)
            return result

        if self.dp_size == 1:
            reports, norm = record(lambda: (self._forward_backward(statics), self._update()))
        else:
            reports = record(lambda: self._forward_backward(statics))
            norm = record(self._update)
        self._output = StepOutput(
            reports=reports, tokens=self._tokens, grad_norm=norm, replayed=True
        )
        logger.info("GraphStep: captured a step of %d micro-batches", self.micro_batches)

    # ------------------------------------------------------------ checks

    def _fit(self, index: int, batch: Mapping[str, Any]) -> dict[str, Any] | None:
        """``batch`` in the static shape, or None when it does not fit (an eager step)."""
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"micro-batch {index} of the step is a {type(batch).__name__}; GraphStep takes "
                "get_batch_on_this_tp_rank / prefetch dicts"
            )
        cu = batch.get("cu_seqlens")
        if not isinstance(cu, torch.Tensor) or not isinstance(batch.get("max_seqlen"), int):
            raise ValueError(
                f"micro-batch {index} of the step has cu_seqlens={type(cu).__name__} and "
                f"max_seqlen={batch.get('max_seqlen')!r}: GraphStep trains packed (THD) batches"
            )
        if getattr(batch.get("packed_seq_params"), "cp_group", None) is not None:
            raise ValueError(
                f"micro-batch {index} of the step has a CP group: GraphStep does not capture "
                "context parallelism (megapack's CP attention plan reads the host)"
            )
        if (
            cu.numel() - 1 > self.static.max_segments
            or batch["max_seqlen"] > self.static.max_seqlen
        ):
            return None
        return pad_static(batch, self.static)

    def _check_capture(self, batch: Mapping[str, Any]) -> None:
        """What the capture needs beyond the config (`megapack.megatron.graph_parts`): NCCL for
        the tensor-parallel group the loss all-reduces over, an attention a capture can hold."""
        check_tp_backend(self.model)
        check_capture_attention(self.model, batch, device=self.device, dtype=self._dtype)

    def _check_owned(self) -> None:
        """Nothing the graph reads was swapped for another tensor between steps, and no refused
        config field was set since (Megatron-LM's training loop sets hooks after building)."""
        check_config(self._config, graph=self.mode == "graph")
        if len(self.optimizer.param_groups) != len(self._lrs):
            raise ValueError(
                f"the optimizer has {len(self.optimizer.param_groups)} param groups but GraphStep "
                f"was made with {len(self._lrs)}: make a new GraphStep after add_param_group"
            )
        for i, (group, lr) in enumerate(zip(self.optimizer.param_groups, self._lrs, strict=True)):
            if group["lr"] is not lr:
                raise ValueError(
                    f"optimizer.param_groups[{i}]['lr'] was replaced by {group['lr']!r}: the step "
                    "reads the tensor it was made with; change the learning rate with set_lr"
                )
        for name, p, view in zip(self._names, self._params, self._grads, strict=True):
            if p.grad is not view:
                raise ValueError(
                    f"{name}.grad was replaced (by {type(p.grad).__name__}; zero_grad(set_to_none"
                    "=True)?): GraphStep owns the gradients and zeroes them itself"
                )
