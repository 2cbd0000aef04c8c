"""Tests of megapack.harness.gpt: the tiny GPT, its topology-independent weights and its forward step."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from megapack.harness.gpt import TinyGPT, init_weights, micro_batch_losses
from megapack.megatron import normalized_loss


def test_micro_batch_losses_are_each_micro_batch_mean_over_trained_tokens() -> None:
    masks = [
        torch.tensor([[1, 0, 1, 1]]),
        torch.tensor([[0, 0, 0, 0]]),
        torch.tensor([[0, 1, 0, 0]]),
    ]
    per_token = torch.tensor([[2.0, 100.0, 4.0, 6.0]])
    reports = [
        normalized_loss(
            {"loss_mask": m}, per_token, mode="micro_batch_mean", calculate_per_token_loss=False
        )[-1]
        for m in masks
    ]
    assert micro_batch_losses(reports) == pytest.approx([4.0, 0.0, 100.0])  # all masked: 0, not NaN
    assert micro_batch_losses([]) == []


def full_weights(tp: int, pp: int) -> dict[str, Any]:
    """On every rank: build the TinyGPT, load seed-7 weights, return this rank's named parameters."""
    from megatron.core import parallel_state as ps

    from megapack.harness.megatron_cpu import megatron_on_cpu

    megatron_on_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = TinyGPT(num_layers=2, hidden_size=16, num_attention_heads=2, num_query_groups=2).build()
    init_weights(model, seed=7)
    layers = model.decoder.layers
    index = {str(i): str(layer.layer_number - 1) for i, layer in enumerate(layers)}
    out = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = index[parts[2]]
        split = bool(getattr(p, "tensor_model_parallel", False))
        out[".".join(parts)] = (
            p.detach().clone(),
            int(getattr(p, "partition_dim", 0)) if split else None,
        )
    return out


@pytest.mark.distributed
def test_init_weights_are_the_same_full_weights_on_every_grid(dist_pool: Any) -> None:
    (single,) = dist_pool.run(functools.partial(full_weights, 1, 1), 1, timeout=120)
    ranks = dist_pool.run(functools.partial(full_weights, 2, 2), 4, timeout=120)
    seen = set()
    for name, (full, _) in single.items():
        holders = [r for r in ranks if name in r]  # tp rank order: global ranks are tp-fastest
        assert holders, f"{name} is on no rank of tp=2 x pp=2"
        dim = holders[0][name][1]
        got = (
            torch.cat([h[name][0] for h in holders], dim)
            if dim is not None
            else holders[0][name][0]
        )
        torch.testing.assert_close(got, full, rtol=0, atol=0, msg=name)
        seen.add(name)
    assert seen == set(single) and len(seen) > 10
