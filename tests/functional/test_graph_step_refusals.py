"""`GraphStep` refuses what it cannot run or capture, by name, before it trains anything (CPU gloo).

A CPU cannot construct ``mode="graph"`` (the capture needs CUDA), but the config is checked
first, so every refusal of `megapack.megatron.graph_parts.REFUSED` shows there as it would on a
GPU; the ones GraphStep cannot honour in any mode show in ``mode="eager"`` too, the capture-only
ones do not. A hook set after construction (as Megatron-LM's training loop sets
``grad_scale_func`` and ``no_sync_func``) is refused at the next step, with nothing trained.
``warmup=0`` is refused with its reason. The checks of the steps before a capture are reached by
switching an eager step's mode (what a CUDA step runs up to its warm-up): the pool's
tensor-parallel group is gloo, whose backend is named; with its backend config reported as NCCL,
``auto`` runs ``bucketed`` on CPU, which a capture cannot hold. Each step is refused before its
warm-up, with nothing trained.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from tests.functional.test_graph_step import GPT, SHAPE, M, forward_step, packs
from tests.unit.test_graph_parts import REFUSED_VALUE

pytestmark = pytest.mark.distributed


def refusals_task() -> dict[str, str]:
    """Every refusal as 'TypeName: message' ('accepted' where none is due); what training saw."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack import GraphInputs, Topology, get_batch_on_this_tp_rank
    from megapack.harness.megatron_cpu import megatron_on_cpu
    from megapack.megatron import graph_parts
    from megapack.megatron.graph_parts import REFUSED
    from megapack.megatron.graph_step import GraphStep

    megatron_on_cpu()
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    topology = Topology.from_parallel_state()
    model = GPT.build()
    model.config.calculate_per_token_loss = True
    config = model.config
    good = [get_batch_on_this_tp_rank(iter([b]), topology=topology, static=SHAPE)
            for b in packs(0)["A"]]  # fmt: skip
    out: dict[str, str] = {}

    def record(key: str, fn: Any) -> None:
        try:
            fn()
            out[key] = "accepted"
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    def make(**kw: Any) -> GraphStep:
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
        return GraphStep(model, opt, forward_step, micro_batches=M, static=SHAPE,
                         inputs=GraphInputs, **{"mode": "eager", **kw})  # fmt: skip

    record("warmup 0", lambda: make(warmup=0))
    for refusal in REFUSED:
        absent = not hasattr(config, refusal.field)
        saved = getattr(config, refusal.field, None)
        setattr(config, refusal.field, REFUSED_VALUE[refusal.field])
        try:
            record(f"graph {refusal.field}", lambda: make(mode="graph"))
            record(f"eager {refusal.field}", make)
        finally:
            if absent:
                delattr(config, refusal.field)
            else:
                setattr(config, refusal.field, saved)
    record("graph on cpu", lambda: make(mode="graph"))  # nothing refused: the device is named

    step = make()
    step(good)
    before = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in step.optimizer.state.items()}
    config.grad_scale_func = REFUSED_VALUE["grad_scale_func"]  # as Megatron-LM's train() does
    record("grad_scale_func set later", lambda: step(good))
    config.grad_scale_func = None
    config.num_moe_experts = 8  # refused only where the step is captured
    step.mode = "graph"  # what a CUDA step runs up to the capture (see the module docstring)
    record("num_moe_experts set later, graph", lambda: step(good))
    config.num_moe_experts = None
    record("tp backend", lambda: step(good))
    reported = graph_parts.dist.get_backend_config
    graph_parts.dist.get_backend_config = lambda group: "cpu:gloo,cuda:nccl"  # as on a GPU
    try:
        record("bucketed at the first captured step", lambda: step(good))
    finally:
        graph_parts.dist.get_backend_config = reported
    out["warmup steps"] = str(step.warmup_steps)
    out["unchanged"] = str(
        all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        and all(
            torch.equal(v, state[id(p)][k])
            for p, s in step.optimizer.state.items()
            for k, v in s.items()
        )
    )
    return out


def test_graph_step_refuses_configs_hooks_and_attention_by_name_before_training(
    dist_pool: Any,
) -> None:
    from megapack.megatron.graph_parts import REFUSED

    out = dist_pool.run(refusals_task, 1, timeout=120)[0]
    expected = {
        "warmup 0": re.escape("ValueError: warmup must be >= 1, got 0: a torch optimizer builds its state on its first step() (AdamW's step count and moments, zero-filled), so with no eager step before the capture that fill would be captured and every replay would restart Adam at step 1"),
        "graph on cpu": re.escape("ValueError: mode='graph' captures with torch.cuda.graph, but the model is on cpu"),
        "grad_scale_func set later": r"ValueError: GraphStep cannot run a step with the model config's grad_scale_func=<lambda>: backward_step multiplies the loss by it",
        "num_moe_experts set later, graph": r"ValueError: GraphStep cannot capture a step with the model config's num_moe_experts=8: MoE token routing",
        "bucketed at the first captured step": r"ValueError: GraphStep cannot capture decoder.layers.0.self_attention.core_attention \(PackedAttention backend='auto'\): it runs 'bucketed' \(auto's choice\), and its bucket shapes change with every micro-batch",
        "warmup steps": "0$",
        "unchanged": "True$",
        "tp backend": r"ValueError: GraphStep captures the loss's vocab-parallel cross-entropy, which all-reduces over the tensor-parallel group even at tp 1, but that group runs CUDA tensors on 'gloo' \(backend config 'cpu:gloo,cuda:gloo'\); a CUDA graph holds NCCL collectives only",
    }  # fmt: skip
    for refusal in REFUSED:
        name = refusal.field
        graph = f"ValueError: GraphStep cannot {'capture' if refusal.graph_only else 'run'} a step with the model config's {name}="  # fmt: skip
        expected[f"graph {name}"] = re.escape(graph)
        expected[f"eager {name}"] = "accepted$" if refusal.graph_only else re.escape(graph)
    assert set(out) == set(expected), set(out) ^ set(expected)
    for key, pattern in expected.items():
        assert re.match(pattern, out[key]), (key, out[key])
