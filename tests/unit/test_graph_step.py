"""`GraphStep` in this process (``mode="eager"`` on CPU): the step's own arithmetic against torch
written out, its slots and eager fallback, its DP all-reduce, and what it refuses.

The schedule is a stand-in for megatron-core's ``forward_backward_no_pipelining`` (the one
schedule GraphStep runs, tp = pp = 1) with its contract: each micro-batch's forward step, its loss
function's ``(sum, count, report)``, ``sum.backward()``, the counts summed and handed to
``config.finalize_model_grads_func(model, total)``. So this file tests what GraphStep does around
it (zeroing, the division by the step's tokens, clipping, the learning rate, the slots) where
mutation testing sees it; `tests/functional/test_graph_step.py` runs the real schedule, DDP and
optimizer on a megatron-core GPT over gloo ranks, and on CUDA the capture and its replays.
"""

from __future__ import annotations

import functools
import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megapack import GraphInputs, PackedBatch, StaticShape, Topology, get_batch_on_this_tp_rank
from megapack.core.static import segments_for
from megapack.megatron import normalized_loss
from megapack.megatron.graph_step import GraphStep

S = 32  # row length
CAP = 3  # documents a row in the static shape
M = 2  # micro-batches a step
VOCAB = 64
SHAPE = StaticShape(max_segments=segments_for(CAP), max_seqlen=S)
CPU = Topology.single(torch.device("cpu"))
LRS = (0.5, 0.2, 0.3, 0.4)
CLIP = 0.05  # below every step's gradient norm here: the clip always clips


class TinyLM(torch.nn.Module):
    """Embedding and linear head, float64, returning megatron-core's per-token loss."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, 8, generator=gen, dtype=torch.float64))
        self.head = torch.nn.Parameter(torch.randn(8, VOCAB, generator=gen, dtype=torch.float64))
        self.config = SimpleNamespace(
            calculate_per_token_loss=True, finalize_model_grads_func=None, timers=None
        )

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.embed[tokens] @ self.head
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(
            labels
        )


def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["labels"])
    return output, functools.partial(normalized_loss, batch, calculate_per_token_loss=True)


def no_pipelining(
    *,
    forward_step_func: Any,
    data_iterator: Any,
    model: list[Any],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
) -> list[Any]:
    """megatron-core's ``forward_backward_no_pipelining`` with ``calculate_per_token_loss``."""
    assert not forward_only
    config = model[0].config
    reports, total = [], torch.zeros((), dtype=torch.int32)
    for _ in range(num_microbatches):
        output, loss_func = forward_step_func(data_iterator, model[0])
        loss_sum, count, report = loss_func(output)
        loss_sum.backward()
        total += count
        reports.append(report)
    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(model, total)
    return reports


@pytest.fixture(autouse=True)
def schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core's parallel_state at tp = pp = cp = 1, and the schedule above."""
    import megatron.core.pipeline_parallel as pipeline
    from megatron.core import parallel_state as ps

    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
    for name in ("tensor_model", "pipeline_model", "context"):
        monkeypatch.setattr(ps, f"get_{name}_parallel_world_size", lambda: 1)
    monkeypatch.setattr(pipeline, "get_forward_backward_func", lambda: no_pipelining)


def packs() -> dict[str, list[PackedBatch]]:
    """M rows per name: A and B within CAP documents a row, C over it (an eager step)."""
    rng = np.random.default_rng(11)

    def row(lengths: list[int]) -> PackedBatch:
        return PackedBatch.from_documents([rng.integers(1, VOCAB, n) for n in lengths], seq_len=S)

    return {
        "A": [row([10, 7, 12]), row([30])],
        "B": [row([1, 20]), row([5, 5, 5])],
        "C": [row([4, 4, 4, 4, 4, 4]), row([12, 12])],
    }


def delivered(
    batches: list[PackedBatch], static: StaticShape | None = None
) -> list[dict[str, Any]]:
    return [get_batch_on_this_tp_rank(iter([b]), topology=CPU, static=static) for b in batches]


def sgd(model: torch.nn.Module, lr: Any = None) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=torch.tensor(0.0) if lr is None else lr)


def make(model: TinyLM | None = None, **kw: Any) -> GraphStep:
    model = model or TinyLM()
    opt = kw.pop("optimizer", None) or sgd(model)
    args = {"micro_batches": M, "static": SHAPE, "inputs": GraphInputs, "mode": "eager", **kw}
    return GraphStep(model, opt, forward_step, **args)


def reference(model: TinyLM, batches: list[dict[str, Any]], lr: float, clip: float | None) -> Any:
    """One step written out: the micro-batches' summed token losses over the step's trained
    tokens, clipped to ``clip``, then SGD at ``lr``; the per-micro-batch [sum, count], the norm."""
    params = [model.embed, model.head]
    for p in params:
        p.grad = None
    sums, counts = [], []
    for b in batches:
        mask = b["loss_mask"].to(torch.float64)
        sums.append((model(b["tokens"], b["labels"]) * mask).sum())
        counts.append(int(mask.count_nonzero()))
    (torch.stack(sums).sum() / max(sum(counts), 1)).backward()
    norm = torch.nn.utils.clip_grad_norm_(params, clip) if clip is not None else None
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad  # type: ignore[operator]
    return [(float(s.detach()), c) for s, c in zip(sums, counts, strict=True)], norm


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= 1e-6 * max(float(b.abs().max()), 1e-30)


@pytest.mark.parametrize("clip", [CLIP, None], ids=["clipped", "unclipped"])
def test_eager_steps_equal_the_step_written_out(clip: float | None) -> None:
    """A (static slots built), B (refilled in place), C (over the shape: eager on the batches as
    delivered, counted), A delivered plain (padded by GraphStep): after each step the losses,
    the trained tokens, the norm, every gradient and every parameter are the reference's."""
    mine, ref = TinyLM(), TinyLM()
    step = make(mine, max_grad_norm=clip)
    data = packs()
    steps = [
        ("A", delivered(data["A"], SHAPE)),
        ("B", delivered(data["B"], SHAPE)),
        ("C", delivered(data["C"])),
        ("A", delivered(data["A"])),
    ]
    slots = None
    for lr, (name, batches) in zip(LRS, steps, strict=True):
        step.set_lr(lr)
        out = step(batches)
        want, norm = reference(ref, batches, lr, clip)
        got = [(float(r["lm loss"][0]), int(r["lm loss"][1])) for r in out.reports]
        assert [c for _, c in got] == [c for _, c in want], name
        assert all(abs(g - w) <= 1e-5 * abs(w) for (g, _), (w, _) in zip(got, want, strict=True))
        assert int(out.tokens) == sum(c for _, c in want) and out.tokens.dtype == torch.int32
        assert out.replayed is False
        if clip is None:
            assert out.grad_norm is None
        else:
            assert out.grad_norm is not None and norm is not None and close(out.grad_norm, norm)
            assert float(norm) > clip, name  # the clip did clip
        for p, q in ((mine.embed, ref.embed), (mine.head, ref.head)):
            assert p.grad is not None and q.grad is not None
            assert close(p.grad, q.grad), name
            assert close(p.detach(), q.detach()), name
        assert step._slots is not None and len(step._slots) == M
        slots = slots or [id(s) for s in step._slots]
        assert [id(s) for s in step._slots] == slots  # the same buffers every fitting step
    assert step.eager_steps == 1  # C
    assert step.replays == 0 and step.warmup_steps == 0


def test_a_dp_group_sums_gradients_and_tokens_over_its_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DP 2, the other rank with the same micro-batches (the all-reduce doubles): the tokens are
    summed over both, and the gradients (a sum over twice the tokens) are the single rank's."""
    import megapack.megatron.graph_step as graph_step

    reduced: list[tuple[int, Any]] = []

    def all_reduce(tensor: torch.Tensor, group: Any = None) -> None:
        reduced.append((tensor.numel(), group))
        tensor.mul_(2)

    group = object()
    monkeypatch.setattr(graph_step.dist, "get_world_size", lambda g=None: 2 if g is group else 1)
    monkeypatch.setattr(graph_step.dist, "all_reduce", all_reduce)
    mine, ref = TinyLM(), TinyLM()
    step = make(mine, dp_group=group, max_grad_norm=CLIP)
    assert step.dp_size == 2
    batches = delivered(packs()["A"], SHAPE)
    step.set_lr(LRS[0])
    out = step(batches)
    want, _ = reference(ref, batches, LRS[0], CLIP)
    assert int(out.tokens) == 2 * sum(c for _, c in want)
    assert close(mine.embed.grad, ref.embed.grad) and close(mine.head.grad, ref.head.grad)  # type: ignore[arg-type]
    assert close(mine.head.detach(), ref.head.detach())
    # one flat buffer (one dtype), then the tokens, each over the DP group
    assert reduced == [(VOCAB * 8 * 2, group), (1, group)]


def test_no_dp_group_reduces_nothing_and_the_default_is_parallel_states() -> None:
    """Without torch.distributed, megatron-core's DP group is none: a step of one rank."""
    step = make()
    assert step.dp_group is None and step.dp_size == 1
    step.set_lr(0.1)
    out = step(delivered(packs()["A"], SHAPE))  # all_reduce would fail uninitialised
    assert int(out.tokens) == sum(int(b.loss_mask.count_nonzero()) for b in packs()["A"])


def test_set_lr_fills_every_groups_tensor_in_place() -> None:
    model = TinyLM()
    first, second = torch.tensor(0.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    opt = torch.optim.SGD([{"params": [model.embed], "lr": first},
                           {"params": [model.head], "lr": second}])  # fmt: skip
    step = make(model, optimizer=opt)
    step.set_lr(0.25)
    assert (float(first), float(second)) == (0.25, 0.25)
    step.set_lr([1, 0.5])  # an int is a number too
    assert (float(first), float(second)) == (1.0, 0.5)
    assert opt.param_groups[0]["lr"] is first and opt.param_groups[1]["lr"] is second
    step.set_lr([0.0, 0.0])  # zero is a learning rate
    for bad, error in (
        ([0.1], r"^set_lr got 1 values for 2 param groups: pass one float, or one per group$"),
        ([0.1, -0.5], r"^set_lr: the learning rate must be >= 0, got -0.5 \(group 1\)$"),
        ([0.1, float("nan")], r"^set_lr: the learning rate must be a finite number, got nan$"),
        ([0.1, True], r"^set_lr: the learning rate must be a finite number, got True$"),
        ([0.1, "0.1"], r"^set_lr: the learning rate must be a finite number, got '0.1'$"),
    ):
        with pytest.raises((TypeError, ValueError), match=error):
            step.set_lr(bad)  # type: ignore[arg-type]
        # a refused call changes nothing: group 0's valid 0.1 was not filled either
        assert (float(first), float(second)) == (0.0, 0.0)


def refused(**kw: Any) -> str:
    with pytest.raises((TypeError, ValueError)) as info:
        make(**kw)
    return f"{info.type.__name__}: {info.value}"


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"warmup": 0}, r"ValueError: warmup must be >= 1, got 0: a torch optimizer builds its state on its first step\(\) \(AdamW's step count and moments, zero-filled\), so with no eager step before the capture that fill would be captured and every replay would restart Adam at step 1; use warmup=1 or more$"),
        ({"warmup": -1}, r"ValueError: warmup must be an int >= 0, got -1"),
        ({"micro_batches": 0}, r"ValueError: micro_batches must be an int >= 1, got 0"),
        ({"static": (4, 32)}, r"TypeError: static must be a megapack.StaticShape, got \(4, 32\)$"),
        ({"mode": "replay"}, r"ValueError: mode must be one of \('graph', 'eager'\), got 'replay'$"),
        ({"max_grad_norm": float("inf")}, r"TypeError: max_grad_norm must be a finite number or None, got inf$"),
        ({"max_grad_norm": "1"}, r"TypeError: max_grad_norm must be a finite number or None, got '1'$"),
        ({"max_grad_norm": 0}, r"ValueError: max_grad_norm must be > 0 or None, got 0$"),
        ({"max_grad_norm": -1.0}, r"ValueError: max_grad_norm must be > 0 or None, got -1.0$"),
        ({"mode": "graph"}, r"ValueError: mode='graph' captures with torch.cuda.graph, but the model is on cpu: use mode='eager' off CUDA$"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_naming_them(kw: dict[str, Any], error: str) -> None:
    assert re.match(error, refused(**kw))


def test_the_smallest_accepted_arguments() -> None:
    step = make(warmup=1, micro_batches=1, max_grad_norm=1e-3)
    assert (step.warmup, step.micro_batches, step.max_grad_norm) == (1, 1, 1e-3)


def test_a_ddp_wrapped_model_or_a_config_without_per_token_loss_is_refused() -> None:
    wrapped = TinyLM()
    wrapped.zero_grad_buffer = lambda: None  # type: ignore[attr-defined]  # as megatron's DDP
    assert refused(model=wrapped) == (
        "TypeError: GraphStep takes the model itself, not megatron-core's DistributedDataParallel: "
        "it owns the gradient buffers and the DP all-reduce (pass model.module)"
    )
    for value in (False, None, 1):  # only True itself
        model = TinyLM()
        model.config.calculate_per_token_loss = value
        assert refused(model=model) == (
            "ValueError: GraphStep needs the model config's calculate_per_token_loss=True (got "
            f"{value!r}): the step divides by its trained tokens on the device (return "
            "normalized_loss(..., calculate_per_token_loss=True))"
        )


def test_a_refused_config_field_is_named_at_construction_and_before_every_step() -> None:
    """An eager step refuses the fields refused in every mode (graph-only ones are allowed)."""
    model = TinyLM()
    model.config.gradient_accumulation_fusion = True  # type: ignore[attr-defined]
    assert refused(model=model).startswith(
        "ValueError: GraphStep cannot run a step with the model config's "
        "gradient_accumulation_fusion=True"
    )
    model.config.gradient_accumulation_fusion = False  # type: ignore[attr-defined]
    model.config.num_moe_experts = 8  # type: ignore[attr-defined]  # refused when captured only
    step = make(model)
    step.set_lr(0.1)
    step(delivered(packs()["A"], SHAPE))
    model.config.gradient_accumulation_fusion = True  # type: ignore[attr-defined]  # set later
    with pytest.raises(ValueError, match="GraphStep cannot run a step with the model config's "
                                         "gradient_accumulation_fusion=True"):  # fmt: skip
        step(delivered(packs()["A"], SHAPE))


def test_a_model_without_trainable_parameters_or_outside_parallel_state_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    frozen = TinyLM()
    frozen.requires_grad_(False)
    assert refused(model=frozen) == (
        "ValueError: GraphStep: the model has no parameter that requires grad"
    )
    from megatron.core import parallel_state as ps

    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 2)
    assert "GraphStep captures tp = pp = cp = 1 only, got {'pipeline_model_parallel_size': 2}" in (
        refused()
    )


def test_frozen_parameters_are_not_the_steps() -> None:
    model = TinyLM()
    model.embed.requires_grad_(False)
    step = make(model, optimizer=torch.optim.SGD([model.head], lr=torch.tensor(0.0)))
    assert step._names == ["head"]
    step.set_lr(0.1)
    before = model.embed.detach().clone()
    step(delivered(packs()["A"], SHAPE))
    assert torch.equal(model.embed, before) and model.embed.grad is None


def test_a_step_refuses_bad_micro_batches_before_anything_trains() -> None:
    """Every micro-batch is checked (the count, each one's form, the slots' shapes) before a
    slot is loaded or a parameter changes."""
    model = TinyLM()
    step = make(model)
    good = delivered(packs()["A"], SHAPE)
    step.set_lr(0.1)
    step(good)  # builds the slots
    before = [p.detach().clone() for p in model.parameters()]
    slots = [s.batch["tokens"].clone() for s in step._slots or []]  # type: ignore[attr-defined]
    longer = dict(good[0], tokens=torch.ones(1, 2 * S, dtype=torch.int64))
    cp = SimpleNamespace(cp_group=object())
    cases = {
        "count": (good[:1], "ValueError: GraphStep was made for micro_batches=2 a step, got 1 micro-batches"),
        "not a dict": ([good[0], packs()["A"][1]], "TypeError: micro-batch 1 of the step is a PackedBatch; GraphStep takes get_batch_on_this_tp_rank / prefetch dicts"),
        "not packed": ([dict(good[0], cu_seqlens=None), good[1]], "ValueError: micro-batch 0 of the step has cu_seqlens=NoneType and max_seqlen=32: GraphStep trains packed (THD) batches"),
        "max_seqlen": ([good[0], dict(good[1], max_seqlen=None)], "ValueError: micro-batch 1 of the step has cu_seqlens=Tensor and max_seqlen=None: GraphStep trains packed (THD) batches"),
        "cp": ([good[0], dict(good[1], packed_seq_params=cp)], "ValueError: micro-batch 1 of the step has a CP group: GraphStep does not capture context parallelism (megapack's CP attention plan reads the host)"),
        "shape": ([good[0], longer], r"ValueError: micro-batch 1 of the step: GraphInputs: batch['tokens'] is (1, 64) torch.int64 but the captured step reads (1, 32) torch.int64"),
    }  # fmt: skip
    for name, (batches, error) in cases.items():
        with pytest.raises((TypeError, ValueError)) as info:
            step(batches)
        assert f"{info.type.__name__}: {info.value}".startswith(error), (name, str(info.value))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    now = [s.batch["tokens"] for s in step._slots or []]  # type: ignore[attr-defined]
    assert all(torch.equal(a, b) for a, b in zip(now, slots, strict=True))


def test_a_batch_at_the_static_caps_fits_and_one_past_either_runs_eagerly() -> None:
    rng = np.random.default_rng(2)

    def row(lengths: list[int]) -> PackedBatch:
        return PackedBatch.from_documents([rng.integers(1, VOCAB, n) for n in lengths], seq_len=S)

    tight = StaticShape(max_segments=3, max_seqlen=16)
    step = make(static=tight, micro_batches=1)
    step.set_lr(0.1)
    for lengths, eager in (([16, 10, 6], 0), ([16, 8, 4, 4], 1), ([17, 15], 2), ([8, 8], 2)):
        batch = delivered([row(lengths)])
        assert batch[0]["cu_seqlens"].numel() - 1 <= 4
        step(batch)
        assert step.eager_steps == eager, lengths


def test_what_the_graph_reads_may_not_be_swapped_between_steps() -> None:
    model = TinyLM()
    opt = sgd(model)
    step = make(model, optimizer=opt)
    good = delivered(packs()["A"], SHAPE)
    step.set_lr(0.1)
    step(good)
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = 0.1  # as a scheduler that writes floats would
    with pytest.raises(ValueError, match=r"^optimizer.param_groups\[0\]\['lr'\] was replaced by "
                                         r"0.1: the step reads the tensor it was made with; "
                                         "change the learning rate with set_lr$"):  # fmt: skip
        step(good)
    opt.param_groups[0]["lr"] = lr
    opt.zero_grad()  # set_to_none=True
    with pytest.raises(ValueError, match=r"^embed.grad was replaced \(by NoneType; zero_grad"
                                         r"\(set_to_none=True\)\?\): GraphStep owns the gradients"):  # fmt: skip
        step(good)
    model.embed.grad = step._grads[0]
    model.head.grad = torch.zeros_like(model.head)  # another tensor, not the flat buffer's view
    with pytest.raises(ValueError, match=r"^head.grad was replaced \(by Tensor;"):
        step(good)
    model.head.grad = step._grads[1]
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": torch.tensor(0.1)})
    with pytest.raises(ValueError, match=r"^the optimizer has 2 param groups but GraphStep was "
                                         "made with 1: make a new GraphStep after add_param_group$"):  # fmt: skip
        step(good)
    opt.param_groups.pop()
    step(good)  # restored: runs again


def test_graph_mode_is_the_default_and_refuses_graph_only_fields_before_the_device() -> None:
    """The default mode captures: on CPU it is refused, naming the device; a field refused
    for captured steps only (MoE token routing) is named first, as the config is checked
    before the model's device."""
    model = TinyLM()
    with pytest.raises(ValueError, match=r"^mode='graph' captures with torch.cuda.graph"):
        GraphStep(model, sgd(model), forward_step, micro_batches=M, static=SHAPE,
                  inputs=GraphInputs)  # fmt: skip
    model.config.num_moe_experts = 8  # type: ignore[attr-defined]
    assert refused(model=model, mode="graph").startswith(
        "ValueError: GraphStep cannot capture a step with the model config's num_moe_experts=8: "
    )


def test_the_configs_own_finalize_hook_is_restored_after_every_step() -> None:
    model = TinyLM()

    def finalize(*args: Any, **kwargs: Any) -> None:  # Megatron-LM's finalize_model_grads
        raise AssertionError("GraphStep runs its own; the schedule must not call this one")

    model.config.finalize_model_grads_func = finalize
    step = make(model)
    step.set_lr(0.1)
    step(delivered(packs()["A"], SHAPE))
    assert model.config.finalize_model_grads_func is finalize


def test_a_step_of_one_trained_token_divides_by_one() -> None:
    mine, ref = TinyLM(), TinyLM()
    step = make(mine, micro_batches=1)
    rng = np.random.default_rng(4)
    batch = delivered([PackedBatch.from_documents([rng.integers(1, VOCAB, 2)], seq_len=S)], SHAPE)
    assert int(batch[0]["loss_mask"].count_nonzero()) == 1
    step.set_lr(0.5)
    out = step(batch)
    reference(ref, batch, 0.5, None)
    assert int(out.tokens) == 1
    assert close(mine.head.grad, ref.head.grad)  # type: ignore[arg-type]


def test_a_non_finite_gradient_is_clipped_on_the_device_without_an_error() -> None:
    """The norm stays a device value (a captured step cannot raise on it): a NaN loss gives a
    NaN norm, reported, not an exception."""
    model = TinyLM()
    with torch.no_grad():
        model.head[0, 0] = float("nan")
    step = make(model, max_grad_norm=1.0)
    step.set_lr(0.1)
    out = step(delivered(packs()["A"], SHAPE))
    assert out.grad_norm is not None and bool(torch.isnan(out.grad_norm))
