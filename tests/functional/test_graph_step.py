"""`GraphStep` (a whole captured training step) against megatron-core's own loop, on CPU gloo.

CPU runs ``mode="eager"``: exactly what the graph holds (the static buffers of every micro-batch
slot, the flat gradient views, the device learning rate, the capturable AdamW, the clip on the
device) without capturing it. The reference is the loop Megatron-LM runs: megatron-core's
schedule over the same micro-batches, its ``DistributedDataParallel`` and
``finalize_model_grads`` (the DP all-reduce and the division by the step's trained tokens), then
``clip_grad_norm_`` and the same ``torch.optim.AdamW`` (capturable, its learning rate a tensor
the loop sets, as a scheduler would); after the first step a plain AdamW (float learning rate,
not capturable) given the same gradients must land on the same parameters too. Steps:

    A   packs A, delivered by prefetch(static=)                 (the first: slots built)
    B   packs B, prefetch(static=)                              (refilled in place)
    A   packs A again, delivered plain (GraphStep pads them)    (identity-keyed caches see it)
    C   a pack over the static shape (more documents a row)     (eager fallback, counted)

with another learning rate each step. After every step the losses, every parameter's gradient
and every parameter must agree within 1e-6 (relative to the tensor's largest value), on DP 1 and
DP 2, and on DP 1 with every batch bringing its bucket plan (``fields=megapack.BUCKET_FIELDS``):
the slots keep each batch's plan, whose shapes change from A to B. The kit's optimizer comparison, CUDA-only in the kit, runs with an eager stand-in for the
graph (it passes on the same update and fails on another). The CUDA test captures and replays the
step through the kit's `compare_replay` (skipped without CUDA).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from megapack import PackedBatch, StaticShape
from megapack.core.static import segments_for
from megapack.harness.gpt import TinyGPT, init_weights

pytestmark = pytest.mark.distributed

S = 32  # row length
CAP = 3  # documents a row in the static shape
M = 2  # micro-batches a step
GPT = TinyGPT(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
              vocab_size=128, max_sequence_length=S)  # fmt: skip
SHAPE = StaticShape(max_segments=segments_for(CAP), max_seqlen=S)
LRS = (1e-3, 3e-3, 5e-4, 2e-3)
CLIP = 0.5
RTOL = 1e-6


@contextlib.contextmanager
def capturable_on_cpu() -> Iterator[None]:
    """Let torch's capturable Adam run on CPU tensors (it refuses them only by a device list), so
    the eager step runs the very update the graph captures on a GPU."""
    import torch.optim.adam as adam

    original = adam._get_capturable_supported_devices
    adam._get_capturable_supported_devices = lambda supports_xla=True: [
        *original(supports_xla),
        "cpu",
    ]
    try:
        yield
    finally:
        adam._get_capturable_supported_devices = original


def packs(dp_rank: int) -> dict[str, list[PackedBatch]]:
    """M micro-batches (one row each) per name; A and B within CAP documents a row, C over it."""
    rng = np.random.default_rng(100 + dp_rank)

    def row(lengths: list[int]) -> PackedBatch:
        return PackedBatch.from_documents([rng.integers(1, 128, n) for n in lengths], seq_len=S)

    return {
        "A": [row([10, 7, 15]), row([30])],
        "B": [row([1, 20]), row([5, 5, 5])],
        "C": [row([4, 4, 4, 4, 4, 4]), row([12, 12])],
    }


def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    """The captured step's forward_step: the micro-batch is the next dict, no delivery inside."""
    from megapack.megatron import normalized_loss

    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], packed_seq_params=batch["packed_seq_params"])  # fmt: skip
    return output, functools.partial(normalized_loss, batch, calculate_per_token_loss=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


def compare_task(mode: str, planned: bool = False) -> dict[str, Any]:
    """Four steps through GraphStep and through megatron-core's loop; the worst differences.
    ``planned``: GraphStep's batches bring their bucket plan."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megapack
    from megapack import BUCKET_FIELDS, GraphInputs, Topology, get_batch_on_this_tp_rank
    from megapack.core.seq_params import BUCKETS_ATTR
    from megapack.harness.megatron_cpu import megatron_on_cpu
    from megapack.megatron.graph_step import GraphStep

    megatron_on_cpu()
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    topology = Topology.from_parallel_state()
    mine = packs(ps.get_data_parallel_rank())
    fields = BUCKET_FIELDS if planned else ()

    ref_model, model, plain_model = GPT.build(), GPT.build(), GPT.build()
    for m in (ref_model, model, plain_model):
        init_weights(m, seed=7)
        m.config.calculate_per_token_loss = True
    ref_model.config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(ref_model.config, DistributedDataParallelConfig(), ref_model)
    ref_params = [p for p in ref_model.parameters()]
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=LRS[0], weight_decay=0.1)

    with capturable_on_cpu():
        # the same optimizer as the step's, its lr tensor set as Megatron's scheduler would
        ref_lr = torch.tensor(LRS[0])
        ref_opt = torch.optim.AdamW(ref_params, lr=ref_lr, weight_decay=0.1, capturable=True,
                                    foreach=True)  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(LRS[0]), weight_decay=0.1,
                                capturable=True, foreach=True)  # fmt: skip
        step = GraphStep(model, opt, forward_step, micro_batches=M, static=SHAPE,
                         inputs=GraphInputs, mode=mode, max_grad_norm=CLIP)  # fmt: skip

        def plain(batches: list[PackedBatch], fields: Any = ()) -> list[dict[str, Any]]:
            return [get_batch_on_this_tp_rank(iter([b]), topology=topology, fields=fields)
                    for b in batches]  # fmt: skip

        with megapack.prefetch(iter(mine["A"] + mine["B"]), topology=topology, depth=2,
                               static=SHAPE, fields=fields) as ahead:  # fmt: skip
            static = [next(ahead) for _ in range(2 * M)]
        inputs = [static[:M], static[M:], plain(mine["A"], fields), plain(mine["C"], fields)]
        names = ["A", "B", "A", "C"]
        worst: dict[str, float] = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        reports, norms, slots, plans = [], [], [], []
        for lr, name, batches in zip(LRS, names, inputs, strict=True):
            step.set_lr(lr)
            out = step(batches)
            slots.append([id(s) for s in step._slots or []])
            statics = [s.batch for s in step._slots or []]  # type: ignore[attr-defined]
            kept = [getattr(b["packed_seq_params"], BUCKETS_ATTR, None) for b in statics]
            plans.append([None if k is None else [tuple(b.shape) for b in k] for k in kept])

            ddp.zero_grad_buffer()
            ref_reports = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(plain(mine[name])),
                model=[ddp], num_microbatches=M, seq_length=S, micro_batch_size=1,
                forward_only=False,
            )  # fmt: skip
            for p in ref_params:
                p.grad = p.main_grad  # as Megatron's optimizer hands its main_grad over
            ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, CLIP)
            ref_lr.fill_(lr)
            ref_opt.step()

            got = torch.stack([r["lm loss"] for r in out.reports])
            want = torch.stack([r["lm loss"] for r in ref_reports])
            worst["loss"] = max(worst["loss"], _rel(got, want))
            for p, q in zip(model.parameters(), ref_params, strict=True):
                assert p.grad is not None and q.grad is not None
                worst["grad"] = max(worst["grad"], _rel(p.grad, q.grad))
                worst["param"] = max(worst["param"], _rel(p.detach(), q.detach()))
            assert out.grad_norm is not None
            norms.append((float(out.grad_norm), float(ref_norm)))
            reports.append(got.tolist())
            if not plain_opt.state:  # the first step: the plain optimizer's update, same grads
                for a, q in zip(plain_model.parameters(), ref_params, strict=True):
                    a.grad = q.grad.clone()
                plain_opt.step()
                worst["plain_adamw"] = max(
                    _rel(a.detach(), p.detach())
                    for a, p in zip(plain_model.parameters(), model.parameters(), strict=True)
                )
            for q in ref_params:  # Megatron's optimizer zero_grad: main_grad is accumulated anew
                q.grad = None
    return {
        "worst": worst,
        "norms": norms,
        "reports": reports,
        "eager_steps": step.eager_steps,
        "slots_kept": all(s == slots[0] for s in slots) and len(slots[0]) == M,
        "tokens": int(out.tokens),
        "plans": plans[:3],  # the fitting steps' (C fell back: its slots were not loaded)
    }


@pytest.mark.parametrize(("dp", "planned"), [(1, False), (2, False), (1, True)],
                         ids=["dp1", "dp2", "dp1-bucket-plan"])  # fmt: skip
def test_graph_step_eager_equals_megatron_schedule_ddp_and_adamw(
    dist_pool: Any, dp: int, planned: bool
) -> None:
    results = dist_pool.run(compare_task, dp, "eager", planned, timeout=180)
    for rank, r in enumerate(results):
        a, b, again = r["plans"]  # each slot holds its batch's plan (A, B, A), or none
        assert (a == again != b and None not in a) if planned else a == b == again == [None] * M
        assert all(v <= RTOL for v in r["worst"].values()), (rank, r["worst"])
        assert r["eager_steps"] == 1 and r["slots_kept"], r  # C fell back; A, B, A one slot set
        assert any(mine > CLIP for mine, _ in r["norms"]), r["norms"]  # the clip did clip
        first, second, third = r["reports"][:3]  # A, B, A: each pack's own losses
        assert first != second and second != third and r["reports"][3] != third
    # the last step's divisor: C's trained tokens summed over DP
    trained = sum(int(b.loss_mask.sum()) for rank in range(dp) for b in packs(rank)["C"])
    assert {r["tokens"] for r in results} == {trained}


def errors_task() -> dict[str, str]:
    """Every refusal, as 'TypeName: message'; and nothing trained by a refused step."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack import GraphInputs, Topology, get_batch_on_this_tp_rank
    from megapack.harness.megatron_cpu import megatron_on_cpu
    from megapack.megatron.graph_step import GraphStep

    megatron_on_cpu()
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    topology = Topology.from_parallel_state()
    model = GPT.build()
    init_weights(model, seed=7)
    model.config.calculate_per_token_loss = True
    mine = packs(0)
    good = [get_batch_on_this_tp_rank(iter([b]), topology=topology, static=SHAPE)
            for b in mine["A"]]  # fmt: skip
    out: dict[str, str] = {}

    def record(key: str, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    def make(**kw: Any) -> GraphStep:
        opt = kw.pop("opt", None) or torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
        return GraphStep(model, opt, forward_step, micro_batches=M, static=SHAPE,
                         inputs=GraphInputs, **{"mode": "eager", **kw})  # fmt: skip

    record("float lr", lambda: make(opt=torch.optim.AdamW(model.parameters(), lr=1e-3)))
    record("graph on cpu", lambda: make(mode="graph"))
    record("mode", lambda: make(mode="replay"))
    record("micro_batches", lambda: GraphStep(model, torch.optim.AdamW(model.parameters(),
           lr=torch.tensor(1e-3)), forward_step, micro_batches=0, static=SHAPE,
           inputs=GraphInputs))  # fmt: skip
    model.config.calculate_per_token_loss = False
    record("per-token loss off", make)
    model.config.calculate_per_token_loss = True

    step = make()
    step(good)  # builds the slots
    before = [p.detach().clone() for p in model.parameters()]
    record("count", lambda: step(good[:1]))
    longer = dict(good[0], tokens=torch.ones(1, 2 * S, dtype=torch.int64))
    record("shape", lambda: step([good[0], longer]))
    record("dtype", lambda: step([dict(good[0], labels=good[0]["labels"].int()), good[1]]))
    record("not packed", lambda: step([dict(good[0], cu_seqlens=None), good[1]]))
    record("not a dict", lambda: step([good[0], mine["A"][1]]))  # type: ignore[list-item]
    record("set_lr count", lambda: step.set_lr([1e-3, 1e-3]))
    record("set_lr value", lambda: step.set_lr(-1.0))
    out["unchanged"] = str(
        all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    )
    step.optimizer.param_groups[0]["lr"] = 1e-3  # as a scheduler that writes floats would
    record("lr replaced", lambda: step(good))
    step.optimizer.param_groups[0]["lr"] = step._lrs[0]
    step.optimizer.zero_grad()  # set_to_none=True
    record("grad replaced", lambda: step(good))
    return out


def test_graph_step_refuses_bad_inputs_naming_them_and_trains_nothing(dist_pool: Any) -> None:
    out = dist_pool.run(errors_task, 1, timeout=120)[0]
    expected = {
        "float lr": r"TypeError: optimizer.param_groups\[0\]\['lr'\] is 0.001: GraphStep needs a one-element tensor on cpu",
        "graph on cpu": "ValueError: mode='graph' captures with torch.cuda.graph, but the model is on cpu",
        "mode": r"ValueError: mode must be one of \('graph', 'eager'\), got 'replay'",
        "micro_batches": "ValueError: micro_batches must be an int >= 1, got 0",
        "per-token loss off": "ValueError: GraphStep needs the model config's calculate_per_token_loss=True",
        "count": "ValueError: GraphStep was made for micro_batches=2 a step, got 1 micro-batches",
        "shape": r"ValueError: micro-batch 1 of the step: GraphInputs: batch\['tokens'\] is \(1, 64\) torch.int64 but the captured step reads \(1, 32\) torch.int64: deliver",
        "dtype": r"ValueError: micro-batch 0 of the step: GraphInputs: batch\['labels'\] is \(1, 32\) torch.int32 but the captured step reads \(1, 32\) torch.int64: deliver",
        "not packed": "ValueError: micro-batch 0 of the step has cu_seqlens=NoneType and max_seqlen=32: GraphStep trains packed",
        "not a dict": "TypeError: micro-batch 1 of the step is a PackedBatch; GraphStep takes",
        "set_lr count": "ValueError: set_lr got 2 values for 1 param groups",
        "set_lr value": "ValueError: set_lr: the learning rate must be >= 0, got -1.0",
        "unchanged": "True",
        "lr replaced": r"ValueError: optimizer.param_groups\[0\]\['lr'\] was replaced by 0.001: the step reads the tensor",
        "grad replaced": r"ValueError: embedding.word_embeddings.weight.grad was replaced \(by NoneType; zero_grad",
    }  # fmt: skip
    import re

    assert set(out) == set(expected), out
    for key, pattern in expected.items():
        assert re.match(pattern, out[key]), (key, out[key])


def kit_optimizer_task() -> list[tuple[str, str]]:
    """The kit's optimizer comparison (CUDA-only in the kit) with an eager stand-in for the graph:
    the same update, then one with another weight decay."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack import GraphInputs, Topology, get_batch_on_this_tp_rank
    from megapack.bench.gpu import graph as kit
    from megapack.bench.gpu.model import TOY
    from megapack.harness.megatron_cpu import megatron_on_cpu
    from megapack.megatron.graph_step import GraphStep

    megatron_on_cpu()
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    device, rows, seq, cap = torch.device("cpu"), 2, 64, 3
    static = StaticShape(max_segments=segments_for(cap, rows), max_seqlen=seq)
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, TOY.vocab_size, n) for n in rng.integers(1, 30, 60)]
    made = kit.static_packs(docs, seq, rows, cap, 2 * (kit.WARMUP + 2 + kit.OPTIMIZER_STEPS))
    topology = Topology.single(device)
    steps = [[get_batch_on_this_tp_rank(iter([b]), topology=topology, static=static)
              for b in made[i : i + 2]] for i in range(0, len(made), 2)]  # fmt: skip
    out: list[tuple[str, str]] = []
    for decay in (0.1, 0.2):  # make_step's AdamW has 0.1
        model_g, model_e = kit.twin_models(TOY, device, torch.float32, seq)
        eager = kit.make_step(model_e, device, static, 2, "eager")
        opt = torch.optim.AdamW(model_g.parameters(), lr=torch.tensor(0.0), weight_decay=decay)
        graph = GraphStep(model_g, opt, kit.kit_forward_step, micro_batches=2, static=static,
                          inputs=GraphInputs, mode="eager", max_grad_norm=1.0)  # fmt: skip
        for batches in steps[: kit.WARMUP]:
            eager(batches)
            graph(batches)
        check = kit._optimizer_check("x", graph, eager, model_g, model_e, steps, device)
        out.append((check.status, check.detail))
    return out


def test_kit_graph_optimizer_check_passes_on_the_same_update_and_fails_on_another(
    dist_pool: Any,
) -> None:
    (same, other) = dist_pool.run(kit_optimizer_task, 1, timeout=120)[0]
    assert same[0] == "passed" and "largest relative parameter difference 0.00e+00" in same[1], same
    assert other[0] == "failed", other


# ------------------------------------------------------------------ CUDA: capture and replay


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="capture needs CUDA (torch.cuda.graph)")
def test_graph_step_replays_what_eager_computes_with_no_sync_on_cuda() -> None:
    from megapack.bench.gpu.graph import compare_replay
    from megapack.bench.gpu.model import TOY
    from megapack.bench.gpu.steps import set_up, tear_down

    device = torch.device("cuda", torch.cuda.current_device())
    set_up(device, seed=0)
    try:
        rng = np.random.default_rng(0)
        docs = [rng.integers(1, TOY.vocab_size, n) for n in rng.integers(1, 120, 400)]
        checks = compare_replay(TOY, docs, device=device, dtype=torch.float32, seq_len=256,
                                rows=2, cap=8, label="toy", target=None, steps=6)  # fmt: skip
    finally:
        tear_down()
    failed = [c for c in checks if c.status == "failed"]
    assert not failed and any("0 syncs" in c.name for c in checks), checks
