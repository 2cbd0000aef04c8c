"""No host reads in the model path: a packed GPTModel forward + backward reads nothing on the host.

On a GPU every host read of a device tensor (``.tolist()``, ``int(t)``, ``if t:``...) is a sync
that stalls the CPU's run-ahead; megatron-core 0.16's THD RoPE made 8 of the 9 syncs of a 2-layer
forward + backward (colleague's H100 measurement, issue 24). This CPU test counts reads instead of
timing them (`megapack.testing.host_reads`), in megapack's code and in megatron-core's, on one rank
of the worker pool: megatron-core's real ``GPTModel`` with `megapack.megatron.packed_gpt_layer_spec`
(RoPE, grouped-query attention, 2 layers) and batches from `megapack.get_batch_on_this_tp_rank`,
delivered before the measured block (the delivery path is tested on its own).

What may read, and why: the SDPA reference (the only CPU backend with a backward) slices documents
on the host, so it reads the boundaries once per micro-batch (`Documents.host_bounds`, cached on
``packed_seq_params`` for every later layer and the backward); nothing else in megapack may read.
flex (forward only on CPU) reads nothing. The first micro-batch warms up (backend choice, flex
compilation) and is not counted.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.distributed

S = 32
DOCS = [  # micro-batches -> rows -> document lengths; 1-token and padded documents included
    [[5, 11, 1], [20, 3]],
    [[1, 1, 7, 9], [30]],
    [[16], [2, 2, 2, 2, 13]],
]
SDPA_READ = ("megapack.attention.documents", "host_bounds", "tolist")


def model_path_reads(backend: str, pad: int, megatron_rope: bool) -> list[dict[str, Any]]:
    """On one rank: the host reads of each micro-batch's forward (+ backward for sdpa), by site."""
    import megatron.core
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megapack
    from megapack import Topology
    from megapack.harness.gpt import TinyGPT, init_weights
    from megapack.harness.megatron_cpu import megatron_on_cpu
    from megapack.megatron import spec

    megatron_on_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    model = TinyGPT(num_layers=2, backend=backend, max_sequence_length=2 * S).build()
    init_weights(model, seed=7)
    topology = Topology.from_parallel_state()
    roots = [Path(megapack.__file__).parent, Path(megatron.core.__file__).parent]
    hand_over = spec.hand_over
    if megatron_rope:  # the control: megatron-core applies its own THD RoPE (restored below)
        spec.hand_over = lambda params, tables: False
    try:
        return [reads_of(model, rows, topology, roots, backend, pad) for rows in DOCS]
    finally:
        spec.hand_over = hand_over


def reads_of(
    model: Any, rows: list[list[int]], topology: Any, roots: list[Path], backend: str, pad: int
) -> dict[str, Any]:
    """Deliver one micro-batch, then record the reads of the model's forward (+ backward)."""
    import torch

    from megapack import get_batch_on_this_tp_rank
    from megapack.harness.gpt import packed_micro_batch
    from megapack.testing.host_reads import host_reads

    docs = [[list(range(1, n + 1)) for n in row] for row in rows]
    micro = packed_micro_batch(docs, S, pad_to_multiple_of=pad)
    batch = get_batch_on_this_tp_rank(iter([micro]), topology=topology)
    training = backend == "sdpa"  # flex has no backward on CPU
    with host_reads(roots=roots) as reads, torch.set_grad_enabled(training):
        loss = model(
            batch["tokens"], batch["position_ids"], batch["attention_mask"],
            labels=batch["labels"], packed_seq_params=batch["packed_seq_params"],
        ).sum()  # fmt: skip
        if training:
            loss.backward()
    return {"sites": reads.by_site(), "report": reads.report()}


def split(sites: dict[tuple[str, str, str], int], package: str) -> dict[tuple[str, str, str], int]:
    return {site: n for site, n in sites.items() if site[0].split(".")[0] == package}


@pytest.mark.parametrize("pad", [1, 4], ids=["unpadded", "padded"])
def test_sync_free_model_path_sdpa_reads_boundaries_once_per_micro_batch(
    dist_pool: Any, pad: int
) -> None:
    (results,) = dist_pool.run(functools.partial(model_path_reads, "sdpa", pad, False), 1, timeout=180)  # fmt: skip
    for i, got in enumerate(results[1:], start=1):  # after the warm-up micro-batch
        # megapack: the reference's one boundary read; megatron-core: none (its RoPE is not run)
        assert got["sites"] == {SDPA_READ: 1}, f"micro-batch {i}\n{got['report']}"


def test_sync_free_model_path_flex_reads_nothing(dist_pool: Any) -> None:
    (results,) = dist_pool.run(functools.partial(model_path_reads, "flex", 4, False), 1, timeout=300)  # fmt: skip
    for i, got in enumerate(results[1:], start=1):
        assert got["sites"] == {}, f"micro-batch {i}\n{got['report']}"


def test_sync_control_megatron_thd_rope_reads_the_host_in_every_layer(dist_pool: Any) -> None:
    """Without the handover megatron-core's own THD RoPE runs: the recorder sees its reads."""
    (results,) = dist_pool.run(functools.partial(model_path_reads, "sdpa", 1, True), 1, timeout=180)  # fmt: skip
    for got in results[1:]:
        rope = {kind: n for (module, _, kind), n in got["sites"].items() if module.endswith("rope_utils")}  # fmt: skip
        # per layer (2), for q and for k: the lengths' .tolist() and one read of the row's total,
        # `freqs.size(0) == cu_seqlens[-1]` (__bool__) up to megatron-core 0.16, `.item()` in 0.19
        total = {kind: n for kind, n in rope.items() if kind != "tolist"}
        assert rope.get("tolist") == 4 and list(total.values()) == [4], got["report"]
        assert set(total) <= {"__bool__", "item"}, got["report"]
        assert split(got["sites"], "megapack") == {SDPA_READ: 1}, got["report"]
