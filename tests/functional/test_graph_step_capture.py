"""`GraphStep` captured and replayed on a GPU in bf16, with each attention backend a user gets forced.

Needs CUDA: every test here is skipped at collection without it, and a backend that cannot run
on this GPU (not installed, an older GPU) is skipped naming why. The fp32 capture (where ``auto``
picks flex) is `tests/functional/test_graph_step.py`'s; this file's CPU halves (the refusals,
the hooks cleared, the plan kept) are tests/unit/test_graph_parts.py, tests/unit/test_graph.py and
tests/functional/test_graph_step_refusals.py.

Per backend (te, cudnn, flash_attn, torch_varlen), two twin toy GPTs (bf16 through megatron-core's
``Float16Module``) with the same weights, one stepped by a captured `GraphStep`, one by an eager
one, learning rate 0 (the update runs, the weights stay): packs A, B (the warm-up), A (the
capture), B, A (replays), a pack over the static shape (the eager fallback). Each step runs eager
twice (its own spread) and the graph once: the replay's per-token losses and every gradient must
be within eager's spread, or a bf16 floor (a replay reading the wrong pack is off by O(1)). The
model config's megatron-core ``Timers`` (log level 2: ``start()`` synchronizes the device) must
be cleared for the capture and be back after it. Then replays under
``torch.cuda.set_sync_debug_mode("error")`` (after the detector's positive control): 0 syncs.
Transformer Engine on padded boundaries (documents padded to multiples of 4): captured with 0
syncs where megatron-core's ``PackedSeqParams`` has ``pad_between_seqs``, else refused by name
at the first step. ``bucketed`` and ``sdpa`` forced: refused at the first step, nothing trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

SEQ = 256
ROWS = 2
CAP = 8
M = 2  # micro-batches a step
WARMUP = 2
FLOOR = {"loss": 2e-2, "grad": 5e-2}
"""bf16 floors: relative to the largest per-token loss, and to each gradient's largest value."""


def unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot train bf16 on this machine's GPU, or None."""
    if not torch.cuda.is_available():
        return "capture needs CUDA (torch.cuda.graph)"
    from megapack.attention.choice import installed_here, refusal

    why = refusal(backend, "cuda", torch.bfloat16, training=True, dropout=0.0,
                  installed=installed_here())  # fmt: skip
    return None if why is None else f"{backend}: {why}"


def on_gpu(*values: Any, backend: str = "sdpa") -> Any:
    """A parameter set skipped at collection where ``backend`` cannot train bf16 on this GPU
    (the default, sdpa, runs anywhere: only CUDA is needed)."""
    why = unavailable(backend)
    return pytest.param(*values, marks=pytest.mark.skipif(why is not None, reason=str(why)))


def packs(docs: Sequence[np.ndarray], count: int, align: int) -> list[Any]:
    """``count`` micro-batches of ``ROWS`` rows of at most ``CAP`` documents each (aligned to
    ``align``: ``cu_seqlens_padded`` is set when ``align`` > 1)."""
    from megapack import PackedBatch

    made, i = [], 0
    for _ in range(count):
        rows = []
        for _ in range(ROWS):
            row: list[np.ndarray] = []
            used = 0
            while len(row) < CAP and used + -(-len(docs[i]) // align) * align <= SEQ:
                row.append(docs[i])
                used += -(-len(docs[i]) // align) * align
                i += 1
            rows.append(PackedBatch.from_documents(row, seq_len=SEQ, pad_to_multiple_of=align))
        made.append(PackedBatch.concat(rows))
    return made


def twins(backend: str, device: torch.device, static: Any) -> tuple[Any, Any, list[Any]]:
    """(captured step, eager step, their models): the same weights, AdamW at learning rate 0."""
    from megatron.core.utils import get_model_config

    from megapack import GraphInputs
    from megapack.bench.gpu.graph import kit_forward_step
    from megapack.bench.gpu.model import TOY, build_gpt
    from megapack.megatron.graph_step import GraphStep

    models = [build_gpt(TOY, device=device, dtype=torch.bfloat16, max_sequence_length=SEQ,
                        backend=backend) for _ in range(2)]  # fmt: skip
    models[1].load_state_dict(models[0].state_dict())
    steps = []
    for model, mode in zip(models, ("graph", "eager"), strict=True):
        get_model_config(model).calculate_per_token_loss = True
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.0, device=device),
                                weight_decay=0.1, capturable=True, foreach=True)  # fmt: skip
        steps.append(GraphStep(model, opt, kit_forward_step, micro_batches=M, static=static,
                               inputs=GraphInputs, mode=mode, max_grad_norm=1.0, warmup=WARMUP))  # fmt: skip
    return steps[0], steps[1], models


def difference(out: Any, losses: list[torch.Tensor], model: Any, grads: list[torch.Tensor]) -> dict[str, float]:  # fmt: skip
    loss = max(float((r["per_token"] - w).abs().max()) for r, w in zip(out.reports, losses, strict=True))  # fmt: skip
    scale = max(float(w.abs().max()) for w in losses)
    grad = max(float((p.grad.float() - g).abs().max()) / max(float(g.abs().max()), 1e-30)
               for p, g in zip(model.parameters(), grads, strict=True))  # fmt: skip
    return {"loss": loss / max(scale, 1e-30), "grad": grad}


@pytest.fixture
def cuda() -> Any:
    from megapack.bench.gpu.steps import set_up, tear_down

    device = torch.device("cuda", torch.cuda.current_device())
    set_up(device, seed=0)
    try:
        yield device
    finally:
        tear_down()


def delivered(device: torch.device, align: int) -> tuple[Any, list[list[dict[str, Any]]]]:
    """(the static shape, the steps' micro-batches: A, B, A, B, A, over-shape, B)."""
    from megapack import StaticShape, Topology, get_batch_on_this_tp_rank
    from megapack.bench.gpu.graph import over_shape_pack
    from megapack.bench.gpu.model import TOY
    from megapack.core.static import segments_for

    static = StaticShape(max_segments=segments_for(CAP, ROWS), max_seqlen=SEQ)
    topology = Topology.single(device)
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, TOY.vocab_size, n) for n in rng.integers(1, 120, 400)]
    made = [get_batch_on_this_tp_rank(iter([b]), topology=topology, static=static)
            for b in packs(docs, 2 * M, align)]  # fmt: skip
    a, b = made[:M], made[M:]
    over = get_batch_on_this_tp_rank(iter([over_shape_pack(docs, SEQ, ROWS, CAP)]),
                                     topology=topology)  # fmt: skip
    return static, [a, b, a, b, a, [over, *b[1:]], b]


@pytest.mark.parametrize(
    ("backend", "align"),
    [*(on_gpu(b, 1, backend=b) for b in ("te", "cudnn", "flash_attn", "torch_varlen")),
     on_gpu("te", 4, backend="te")],
    ids=["te", "cudnn", "flash_attn", "torch_varlen", "te-padded"],
)  # fmt: skip
def test_a_bf16_step_replays_what_eager_computes_with_no_sync(
    cuda: torch.device, backend: str, align: int
) -> None:
    import dataclasses

    from megatron.core.timers import Timers
    from megatron.core.utils import get_model_config

    from megapack.bench.gpu.syncs import positive_control, sync_debug_errors

    static, steps = delivered(cuda, align)
    graph, eager, (model_g, model_e) = twins(backend, cuda, static)
    params = steps[0][0]["packed_seq_params"]
    if align > 1 and "pad_between_seqs" not in {f.name for f in dataclasses.fields(params)}:
        with pytest.raises(ValueError, match=r"Transformer Engine's attention .* no pad_between_seqs"):  # fmt: skip
            graph(steps[0])
        assert graph.warmup_steps == 0
        return
    config = get_model_config(model_g)
    timers = Timers(log_level=2, log_option="minmax")
    config.timers = timers  # start() synchronizes: cleared for the capture, back after it
    spread = {"loss": 0.0, "grad": 0.0}
    worst = {"loss": 0.0, "grad": 0.0}
    for batches in steps[:-1]:
        out = eager(batches)
        losses = [r["per_token"].clone() for r in out.reports]
        grads = [p.grad.float().clone() for p in model_e.parameters()]
        for k, v in difference(eager(batches), losses, model_e, grads).items():
            spread[k] = max(spread[k], v)
        for k, v in difference(graph(batches), losses, model_g, grads).items():
            worst[k] = max(worst[k], v)
    assert config.timers is timers and "forward-backward" in timers._timers  # it ran eagerly
    assert (graph.warmup_steps, graph.replays, graph.eager_steps) == (WARMUP, 3, 1)
    assert all(worst[k] <= max(spread[k], FLOOR[k]) for k in worst), (worst, spread)
    control = positive_control(cuda)
    assert control.status == "passed", control
    with sync_debug_errors(cuda):
        graph.set_lr(0.0)
        assert graph(steps[-1]).replayed


@pytest.mark.parametrize("backend", [on_gpu("bucketed"), on_gpu("sdpa")])
def test_a_capture_refuses_an_attention_that_reads_the_host_before_its_warm_up(
    cuda: torch.device, backend: str
) -> None:
    static, steps = delivered(cuda, 1)
    graph, _, (model, _) = twins(backend, cuda, static)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=f"it runs '{backend}' \\(forced\\)"):
        graph(steps[0])
    assert graph.warmup_steps == 0 and not graph.optimizer.state
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
