"""Tests of megapack.harness.megatron_cpu: megatron-core's GPTModel and schedules on gloo CPU ranks.

Every patching test runs on the shared ``dist_pool`` workers, never in the pytest process: the
patches are process-wide by design, and the workers are the processes that use them. Expected
values (RNG streams, the loss of an untrained model) are computed here, independently of megatron.
"""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megapack.harness import megatron_cpu
from megapack.harness.megatron_cpu import megatron_on_cpu

VOCAB = 128
SEQ, MICRO_BATCH, MICROBATCHES, STEPS = 16, 2, 2, 2
SEED = 1234

# ---- functions run on the workers -----------------------------------------------------------


def _patched_values() -> list[Any]:
    """The current value of every attribute the patch table names, in table order."""
    import importlib

    return [
        getattr(importlib.import_module("megatron.core." + name), attr)
        for name, attr, _ in megatron_cpu._patch_table()
    ]


def cuda_rule() -> dict[str, bool]:
    """Pretends CUDA is available in an unpatched worker; checks refusal, force and idempotence."""
    megatron_cpu._restore()  # earlier tasks may have patched this worker; tasks re-patch on start
    originals = _patched_values()
    with mock.patch("torch.cuda.is_available", return_value=True):
        refused = megatron_on_cpu()
        same = all(a is b for a, b in zip(_patched_values(), originals, strict=True))
        untouched = same and not megatron_cpu._applied
        forced = megatron_on_cpu(force=True)
        replaced = all(a is not b for a, b in zip(_patched_values(), originals, strict=True))
        again = megatron_on_cpu()  # already in force: True even without force
    return {
        "refused_returns_false": refused is False,
        "refused_left_megatron_untouched": untouched,
        "forced_returns_true": forced is True,
        "forced_replaced_every_attribute": replaced,
        "later_call_returns_true": again is True,
    }


def idempotence() -> dict[str, Any]:
    """Applies the patches twice and probes what the patched modules and global torch see."""
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    first = megatron_on_cpu()
    after_first = _patched_values()
    applied_first = list(megatron_cpu._applied)
    second = megatron_on_cpu()
    view = schedules.torch
    global_cuda_raises = []
    for call in (torch.cuda.current_device, lambda: torch.zeros(1, device="cuda")):
        try:
            call()
            global_cuda_raises.append(False)
        except (AssertionError, RuntimeError):  # "Torch not compiled with CUDA enabled"
            global_cuda_raises.append(True)
    return {
        "returns": (first, second),
        "same_objects": all(a is b for a, b in zip(after_first, _patched_values(), strict=True)),
        "applied_unchanged": applied_first == megatron_cpu._applied,
        "n_applied": len(megatron_cpu._applied),
        "view_device": view.cuda.current_device(),
        "view_zeros_device": view.zeros(2, device="cuda").device.type,
        "view_stream_waits": _stream_waits(view),
        "p2p_shares_view": p2p_communication.torch is view,
        "view_is_not_torch": view is not torch,
        "global_cuda_raises": global_cuda_raises,
    }


def _stream_waits(view: Any) -> bool:
    """The view's current stream takes megatron-core 0.19 DDP's waits and does nothing."""
    stream = view.cuda.current_stream()
    return (
        stream.wait_event(object()) is None
        and stream.wait_stream(view.cuda.current_stream()) is None
        and view.cuda.current_stream() is stream
    )


def rng_streams() -> dict[str, Any]:
    """Seeds megatron's RNG tracker on tp=2 and draws inside and outside a tracker fork."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    megatron_on_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(SEED)
    before = torch.rand(3)
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(3)
    after = torch.rand(3)
    return {
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "draws": (before, inside, after),
    }


def train_gpt(tp: int, pp: int, causal_mask: bool) -> dict[str, Any]:
    """Trains a tiny megatron-core GPTModel for STEPS steps with the real pipeline schedule.

    Every step sees the same MICROBATCHES batches (so the loss must fall). ``causal_mask=False``
    passes ``attention_mask=None``, which makes megatron build its own causal mask.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    megatron_on_cpu()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    model_parallel_cuda_manual_seed(SEED)  # also seeds the CPU generator used for the weights
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        tensor_model_parallel_size=tp,  # config must repeat the layout parallel_state has
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=32,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,  # no cross-stage tie: no finalize_model_grads
        position_embedding_type="rope",
    )
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=0.1)

    def batches() -> Any:
        g = torch.Generator().manual_seed(0)
        for _ in range(MICROBATCHES):
            yield torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        sample = next(data_iterator)  # every stage draws the same batch; only stage 0 uses tokens
        tokens, labels = sample[:, :-1].contiguous(), sample[:, 1:].contiguous()
        position_ids = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1) if causal_mask else None
        loss_per_token = model(tokens, position_ids, mask, labels=labels)  # [b, s] on last stage

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = output.float().mean()
            return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place

        return loss_per_token, loss_func

    forward_backward = get_forward_backward_func()
    losses, grads_nonzero = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        reduced = forward_backward(
            forward_step_func=forward_step,
            data_iterator=batches(),
            model=[model],
            num_microbatches=MICROBATCHES,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        grads_nonzero.append(all(p.grad is not None and p.grad.abs().sum() > 0 for p in params))
        optimizer.step()
        losses.append([r["loss"].item() for r in reduced])  # [] on every stage but the last
    return {
        "rank": dist.get_rank(),
        "last_stage": parallel_state.is_pipeline_last_stage(),
        "losses": losses,
        "grads_nonzero": grads_nonzero,
        "all_params_moved": all(not torch.equal(p, s) for p, s in zip(params, start, strict=True)),
    }


def ddp_grad_sync() -> dict[str, Any]:
    """megatron-core's DDP on 2 DP ranks: each rank's own gradient, then the synced one."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    megatron_on_cpu()
    parallel_state.initialize_model_parallel()  # tp = pp = 1: both ranks are DP ranks
    model_parallel_cuda_manual_seed(SEED)  # the same weights on both ranks
    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=False,
    )
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    g = torch.Generator().manual_seed(dist.get_rank())  # each DP rank its own batch
    sample = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
    position_ids = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    ddp.zero_grad_buffer()
    ddp(sample[:, :-1], position_ids, mask, labels=sample[:, 1:]).float().mean().backward()
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    local = [p.main_grad.clone() for p in params]
    ddp.finish_grad_sync()  # megatron-core 0.19: start_grad_sync takes the current stream
    return {"local": local, "synced": [p.main_grad.clone() for p in params]}


# ---- tests -----------------------------------------------------------------------------------


def test_import_does_not_import_megatron() -> None:
    code = (
        "import sys, megapack.harness.megatron_cpu; "
        "print(sorted(m for m in sys.modules if m.startswith('megatron')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.distributed
def test_cuda_machines_left_alone_unless_forced(dist_pool: Any) -> None:
    (result,) = dist_pool.run(cuda_rule, 1, timeout=120)
    assert result == dict.fromkeys(result, True)


@pytest.mark.distributed
def test_idempotent_and_global_torch_untouched(dist_pool: Any) -> None:
    (r,) = dist_pool.run(idempotence, 1, timeout=120)
    assert r["returns"] == (True, True)
    assert r["same_objects"] and r["applied_unchanged"]
    assert r["n_applied"] == len(megatron_cpu._patch_table()) == 10
    assert (r["view_device"], r["view_zeros_device"]) == ("cpu", "cpu")
    assert r["view_stream_waits"]
    assert r["p2p_shares_view"] and r["view_is_not_torch"]
    assert r["global_cuda_raises"] == [True, True]  # global torch still has no CUDA


@pytest.mark.distributed
def test_rng_tracker_streams_per_tp_rank(dist_pool: Any) -> None:
    results = dist_pool.run(rng_streams, 2, timeout=120)
    default = torch.Generator().manual_seed(SEED)  # the data-parallel ("default") stream
    want_before, want_after = torch.rand(3, generator=default), torch.rand(3, generator=default)
    for r in results:
        before, inside, after = r["draws"]
        # megatron's model-parallel stream: seed + 2718 + tp_rank
        tp_stream = torch.Generator().manual_seed(SEED + 2718 + r["tp_rank"])
        assert torch.equal(before, want_before)
        assert torch.equal(inside, torch.rand(3, generator=tp_stream))
        assert torch.equal(after, want_after)  # the fork left the default stream where it was
    assert not torch.equal(results[0]["draws"][1], results[1]["draws"][1])


@pytest.mark.distributed
def test_gpt_model_trains_on_tp2_pp2(dist_pool: Any) -> None:
    with_mask = dist_pool.run(train_gpt, 4, 2, 2, True, timeout=120)
    without_mask = dist_pool.run(train_gpt, 4, 2, 2, False, timeout=120)
    assert [r["last_stage"] for r in with_mask] == [False, False, True, True]
    for r in with_mask:
        assert r["grads_nonzero"] == [True] * STEPS, f"rank {r['rank']}: a parameter got no grad"
        assert r["all_params_moved"], f"rank {r['rank']}: the optimizer did not move a parameter"
        if not r["last_stage"]:
            assert r["losses"] == [[]] * STEPS
    losses = with_mask[2]["losses"]
    assert len(losses) == STEPS and all(len(step) == MICROBATCHES for step in losses)
    assert all(math.isfinite(x) for step in losses for x in step)
    assert with_mask[3]["losses"] == losses, "the two TP ranks of the last stage disagree"
    # An untrained model with small weights predicts ~uniformly: cross entropy ~ ln(VOCAB).
    first, second = (sum(step) / len(step) for step in losses)
    assert abs(first - math.log(VOCAB)) < 0.1
    assert second < first - 1e-3, f"loss did not fall: {losses}"
    # Megatron's own causal mask (attention_mask=None) must give the very same run.
    assert without_mask[2]["losses"] == losses


@pytest.mark.distributed
def test_megatron_ddp_averages_gradients_over_dp_ranks(dist_pool: Any) -> None:
    ranks = dist_pool.run(ddp_grad_sync, 2, timeout=120)
    first, second = (r["local"] for r in ranks)
    assert not all(torch.equal(a, b) for a, b in zip(first, second, strict=True))  # two batches
    want = [(a + b) / 2 for a, b in zip(first, second, strict=True)]  # DDP's default: the mean
    for r in ranks:
        for got, expected in zip(r["synced"], want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_rope_table_share_of_a_cp_rank_is_its_zigzag_chunks() -> None:
    from types import SimpleNamespace

    table = torch.arange(16.0).view(16, 1, 1, 1)
    for rank, want in [(0, [0, 1, 2, 3, 12, 13, 14, 15]), (1, [4, 5, 6, 7, 8, 9, 10, 11])]:
        group = SimpleNamespace(size=lambda: 2, rank=lambda r=rank: r)
        got = megatron_cpu._pos_emb_on_this_cp_rank(table, 0, group)
        assert got.flatten().tolist() == want
