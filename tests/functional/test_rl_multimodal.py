"""RL and multimodal batches through megatron-core's GPTModel and schedules (issue 26), CPU gloo.

(a) An RL step: a GRPO-style clipped policy loss (ratio of new to old log-probs times advantages,
    clipped, masked by loss_mask), fed by get_batch_on_this_tp_rank with ``advantages`` and
    ``old_logprobs`` declared as last-stage per-token fields: 3 SGD steps on every tp x pp x cp grid
    of the CP tests give the tp1 pp1 cp1 losses (relative 1e-4), both CP layouts.
(b) A VLM-style step: ``pixel_values`` and ``image_grid_thw`` declared as first-stage ragged
    fields; a toy patch projector adds patch embeddings at the image-token positions of the first
    stage's embeddings: packed == padded (relative 1e-5), and tp2 pp2 == tp1 pp1 over 3 steps.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pytest
import torch

from megapack import BatchField, PackedBatch
from megapack.harness.gpt import (
    TinyGPT,
    forward_step,
    init_weights,
    micro_batch_losses,
    padded_micro_batch,
)
from megapack.megatron.loss import policy_loss

pytestmark = pytest.mark.distributed

RL = (
    BatchField("advantages", "token", torch.float32, "last", at="label"),
    BatchField("old_logprobs", "token", torch.float32, "last", at="label"),
)
VLM = (
    BatchField("pixel_values", "ragged", torch.float32, "first"),
    BatchField("image_grid_thw", "ragged", torch.int64, "first"),
)
S, PAD, IMAGE, PATCH = 48, 8, 127, 6  # row length, CP document padding, image token id, patch dim
GPT = TinyGPT(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
              vocab_size=128, max_sequence_length=S)  # fmt: skip
CP_GRIDS = [(1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 1, 4)]  # (tp, pp, cp), as test_gpt_cp


def rl_documents() -> list[list[list[dict[str, Any]]]]:
    """micro-batches -> rows -> documents: tokens, a per-document advantage on every token (GRPO's
    group-normalised reward) and old log-probs near the initial model's (ratios around 1, some
    past the clip)."""
    rng = np.random.default_rng(5)
    lengths = [[[1, 7, 3, 13], [5, 2, 17]], [[11, 1, 9, 6], [15, 3, 1, 10]]]
    return [[[{"tokens": rng.integers(1, 127, n).tolist(),
               "advantages": [float(rng.choice([-1.0, 0.5, 1.5]))] * n,
               "old_logprobs": (np.log(1 / 128) + rng.normal(0, 0.3, n)).tolist()}
              for n in row] for row in rows] for rows in lengths]  # fmt: skip


def rl_micro_batch(rows: list[list[dict[str, Any]]], layout: str) -> PackedBatch:
    pad = PAD if layout == "document" else 1
    return PackedBatch.concat(
        [PackedBatch.from_documents(d, seq_len=S, pad_to_multiple_of=pad, fields=RL) for d in rows],
        RL,
    )


def _policy_loss(batch: dict[str, Any], cp_group: Any) -> Any:
    return functools.partial(policy_loss, batch, mode="micro_batch_mean",
                             calculate_per_token_loss=False, cp_group=cp_group)  # fmt: skip


def _setup(tp: int, pp: int, cp: int = 1, layout: str = "document") -> tuple[Any, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack import Topology
    from megapack.harness.megatron_cpu import megatron_on_cpu

    megatron_on_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp)  # fmt: skip
    model_parallel_cuda_manual_seed(1234)
    model = dataclasses.replace(GPT, cp_layout=layout).build()  # type: ignore[arg-type]
    init_weights(model, seed=7)
    return model, Topology.from_parallel_state(cp_layout=layout)  # type: ignore[arg-type]


def _train(model: Any, topology: Any, micro: list[Any], step: Any, params: list[Any], *,
           steps: int, seq_length: int, micro_batch_size: int) -> list[list[float]]:  # fmt: skip
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    optimizer = torch.optim.SGD(params, lr=0.5)
    schedule = get_forward_backward_func()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        reduced = schedule(
            forward_step_func=step, data_iterator=iter(micro) if topology.is_source else None,
            model=[model], num_microbatches=len(micro), seq_length=seq_length,
            micro_batch_size=micro_batch_size, forward_only=steps == 1,
        )  # fmt: skip
        if steps > 1:
            for p in model.parameters():  # megatron-core's DDP averages over the dp x cp group
                if p.grad is not None and topology.cp_size > 1:
                    dist.all_reduce(p.grad, group=topology.cp_group)
                    p.grad /= topology.cp_size
            optimizer.step()
        losses.append(
            micro_batch_losses(reduced, topology.cp_group if topology.cp_size > 1 else None)
        )
    return losses


def run_rl(tp: int, pp: int, cp: int, layout: str) -> dict[str, Any]:
    model, topology = _setup(tp, pp, cp, layout)
    micro = [rl_micro_batch(rows, layout) for rows in rl_documents()]
    step = functools.partial(forward_step, topology, fields=RL, loss=_policy_loss)
    losses = _train(model, topology, micro, step, list(model.parameters()), steps=3,
                    seq_length=2 * S, micro_batch_size=1)  # fmt: skip
    return {"last": topology.is_last_stage, "losses": losses}


def last_losses(results: list[dict[str, Any]]) -> list[list[float]]:
    last = [r["losses"] for r in results if r["last"]]
    assert last and all(x == last[0] for x in last), "the last stage's TP and CP ranks disagree"
    return last[0]


@pytest.fixture(scope="module")
def rl_reference(dist_pool: Any) -> dict[str, list[list[float]]]:
    return {layout: last_losses(dist_pool.run(run_rl, 1, 1, 1, 1, layout, timeout=180))
            for layout in ("document", "row")}  # fmt: skip


@pytest.mark.parametrize("layout", ["document", "row"])
@pytest.mark.parametrize("grid", CP_GRIDS, ids=lambda g: f"tp{g[0]}-pp{g[1]}-cp{g[2]}")
def test_rl_policy_loss_on_every_grid_equals_one_rank(
    dist_pool: Any,
    rl_reference: dict[str, list[list[float]]],
    grid: tuple[int, int, int],
    layout: str,
) -> None:
    tp, pp, cp = grid
    got = last_losses(dist_pool.run(run_rl, tp * pp * cp, tp, pp, cp, layout, timeout=180))
    want = rl_reference[layout]
    assert np.allclose(got, want, rtol=1e-4, atol=0), (got, want)
    assert (
        len({round(x, 6) for step in want for x in step}) > 2
    )  # the loss moves: training happened


def test_rl_policy_loss_clips_and_is_minus_the_advantage_at_ratio_one() -> None:
    def mean(batch: dict[str, Any], per_token: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        loss, _ = policy_loss(batch, per_token, mode="micro_batch_mean",
                              calculate_per_token_loss=False, **kwargs)  # fmt: skip
        return loss  # type: ignore[no-any-return]

    adv = torch.tensor([[1.0, -1.0, 2.0, 2.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    batch = {"loss_mask": torch.ones(1, 4), "advantages": adv, "old_logprobs": logp}
    assert mean(batch, -logp).item() == pytest.approx(-adv.mean().item())  # ratio 1
    one = {k: v[:, :1] for k, v in batch.items()}
    high = mean(one, -logp[:, :1] - 1.0, clip=0.2)
    assert high.item() == pytest.approx(-1.2)  # ratio e > 1.2 with A > 0: clipped at 1.2
    with pytest.raises(ValueError, match="must have the per-token loss's shape"):
        mean(batch | {"advantages": adv[:, :2]}, -logp)


# ---------------------------------------------------------------- (b) VLM


def vlm_documents() -> list[list[dict[str, Any]]]:
    """micro-batches -> documents: text with a run of image tokens where an image's patches go
    (t * h * w of them, image_grid_thw [t, h, w]), or text alone."""
    rng = np.random.default_rng(9)
    micro = []
    for m in range(2):
        docs = []
        for d in range(4):
            text = rng.integers(1, 127, int(rng.integers(4, 20))).tolist()
            if (m + d) % 2:
                t, h, w = 1, 2, int(rng.integers(1, 4))
                cut = int(rng.integers(0, len(text)))
                docs.append({"tokens": text[:cut] + [IMAGE] * (t * h * w) + text[cut:],
                             "pixel_values": torch.from_numpy(rng.normal(0, 1, (t * h * w, PATCH)).astype(np.float32)),
                             "image_grid_thw": torch.tensor([[t, h, w]])})  # fmt: skip
            else:
                docs.append({"tokens": text})
        micro.append(docs)
    return micro


def vlm_micro_batch(docs: list[dict[str, Any]], mode: str) -> Any:
    if mode == "packed":  # two rows of two documents, merged into one THD row
        return PackedBatch.concat([PackedBatch.from_documents(docs[i : i + 2], seq_len=S, fields=VLM)
                                   for i in (0, 2)], VLM)  # fmt: skip
    batch = padded_micro_batch([d["tokens"] for d in docs], S)  # one document a row
    empty = {
        "pixel_values": torch.empty(0, PATCH),
        "image_grid_thw": torch.empty(0, 3, dtype=torch.int64),
    }
    for name in ("pixel_values", "image_grid_thw"):
        batch[name] = [d.get(name, empty[name]) for d in docs]  # type: ignore[assignment]
    return batch


def _projector() -> torch.nn.Linear:
    """The toy patch projector: the same seeded weights on every rank."""
    gen = torch.Generator().manual_seed(3)
    proj = torch.nn.Linear(PATCH, GPT.hidden_size)
    with torch.no_grad():
        proj.weight.copy_(0.1 * torch.randn(proj.weight.shape, generator=gen))
        proj.bias.zero_()
    return proj


def _embed(projector: torch.nn.Linear, model: Any, batch: dict[str, Any]) -> torch.Tensor | None:
    """First stage: token embeddings plus each image patch's projection at its image token."""
    if batch["tokens"] is None:
        return None
    tokens, pixels, thw = batch["tokens"], batch["pixel_values"], batch["image_grid_thw"]
    where = tokens == IMAGE  # [b, s] (THD: [1, T]): sample-major, as the patches come
    if int(thw.prod(-1).sum()) != pixels.shape[0] or int(where.sum()) != pixels.shape[0]:
        raise AssertionError("image_grid_thw, pixel_values and the image tokens disagree")
    emb = model.embedding(input_ids=tokens, position_ids=batch["position_ids"])  # [s, b, h]
    by_sample = emb.transpose(0, 1)  # [b, s, h], a view of emb
    patches = torch.zeros_like(by_sample).index_put((where,), projector(pixels))
    return (by_sample + patches).transpose(0, 1)


def run_vlm(tp: int, pp: int, mode: str, steps: int) -> dict[str, Any]:
    model, topology = _setup(tp, pp)
    projector = _projector()
    micro = [vlm_micro_batch(docs, mode) for docs in vlm_documents()]
    step = functools.partial(forward_step, topology, fields=VLM,
                             embed=functools.partial(_embed, projector))  # fmt: skip
    params = [*model.parameters(), *(projector.parameters() if topology.is_first_stage else [])]
    packed = mode == "packed"
    losses = _train(model, topology, micro, step, params, steps=steps,
                    seq_length=2 * S if packed else S, micro_batch_size=1 if packed else 4)  # fmt: skip
    return {"last": topology.is_last_stage, "losses": losses}


def test_vlm_packed_equals_padded(dist_pool: Any) -> None:
    packed = last_losses(dist_pool.run(run_vlm, 1, 1, 1, "packed", 1, timeout=120))
    padded = last_losses(dist_pool.run(run_vlm, 1, 1, 1, "padded", 1, timeout=120))
    assert np.allclose(packed, padded, rtol=1e-5, atol=0), (packed, padded)


def test_vlm_tp2_pp2_equals_tp1_pp1(dist_pool: Any) -> None:
    one = last_losses(dist_pool.run(run_vlm, 1, 1, 1, "packed", 3, timeout=120))
    grid = last_losses(dist_pool.run(run_vlm, 4, 2, 2, "packed", 3, timeout=180))
    assert np.allclose(grid, one, rtol=1e-4, atol=0), (grid, one)
    assert len({round(x, 6) for step in one for x in step}) > 2
