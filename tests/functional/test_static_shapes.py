"""Static-shape batches through megatron-core's GPTModel (issue 34), CPU gloo: the per-token losses
and every parameter gradient equal the unpadded batch's, with RoPE and on CP grids in both layouts."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from megapack import PackedBatch, StaticShape
from megapack.harness.gpt import TinyGPT, global_parameters, init_weights

pytestmark = pytest.mark.distributed

S = 32
GPT = TinyGPT(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=128,
              max_sequence_length=S)  # fmt: skip


def run_static(cp: int, layout: str) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack import Topology, get_batch_on_this_tp_rank
    from megapack.harness.megatron_cpu import megatron_on_cpu

    megatron_on_cpu()
    ps.initialize_model_parallel(context_parallel_size=cp)
    model_parallel_cuda_manual_seed(1)
    model = dataclasses.replace(GPT, cp_layout=layout).build()  # type: ignore[arg-type]
    init_weights(model, seed=3)
    topology = Topology.from_parallel_state(cp_layout=layout)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 127, n).tolist() for n in (5, 1, 7, 3, 6)]
    row = PackedBatch.from_documents(
        docs, seq_len=S, pad_to_multiple_of=2 * cp if layout == "document" else 1
    )
    out = {}
    for static in (None, StaticShape(max_segments=9, max_seqlen=S)):
        model.zero_grad()
        batch = get_batch_on_this_tp_rank(iter([row]), topology=topology, static=static)
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       packed_seq_params=batch["packed_seq_params"])  # fmt: skip
        (losses * batch["loss_mask"]).sum().backward()
        out["static" if static else "plain"] = (
            losses.detach(),
            {n: p.grad.clone() for n, p, _ in global_parameters(model)},
            batch["cu_seqlens"].tolist(),
        )
    return out


@pytest.mark.parametrize(("cp", "layout"), [(1, "document"), (2, "document"), (2, "row")])
def test_static_batches_train_as_the_unpadded_ones(dist_pool: Any, cp: int, layout: str) -> None:
    for result in dist_pool.run(run_static, cp, cp, layout, timeout=180):
        (loss_a, grads_a, cu_a), (loss_b, grads_b, cu_b) = result["plain"], result["static"]
        assert len(cu_b) == 10 and cu_b[len(cu_a) :] == [cu_a[-1]] * (10 - len(cu_a))  # zero-length
        assert torch.equal(loss_a, loss_b) and not torch.isnan(loss_b).any()
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), name
