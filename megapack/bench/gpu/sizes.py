"""The GPU kit's sizes: `FULL` on one GPU, `DRY` for the CPU dry run (`KitSizes`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megapack.bench.gpu.attention_rows import AttentionRow
from megapack.bench.gpu.model import PRESET, TOY, GptShape
from megapack.bench.gpu.smoke import SMOKE
from megapack.bench.gpu.throughput import ThroughputSizes


@dataclass(frozen=True, kw_only=True, slots=True)
class KitSizes:
    """Everything the kit runs, at one size."""

    shape: GptShape
    """The throughput model (and the bf16 packed == padded check's)."""
    dtype: torch.dtype
    """Its dtype: bf16 on a GPU, fp32 in the dry run."""
    fp32_shape: GptShape
    """The fp32 packed == padded check's model."""
    attention: dict[str, int]
    """heads, groups, head_dim, max_len of the attention checks."""
    loss_lengths: tuple[int, ...]
    """Document lengths of the packed == padded checks (one row of ``throughput.seq_lens[0]``)."""
    timing_lengths: tuple[int, ...]
    """Document lengths of the one row the attention backends are timed on."""
    timing_repeats: int
    """Timed fwd+bwd calls per backend (the median counts), after 3 untimed ones."""
    throughput: ThroughputSizes
    """The throughput section's sizes."""
    matmul_n: int
    """Side of the square matmul that measures the ceiling."""
    budget_s: float
    """Seconds from the throughput section's start after which no further configuration starts."""
    smoke_shape: GptShape
    """The smoke section's toy GPT (`megapack.bench.gpu.smoke.SMOKE` on a GPU)."""
    smoke_seq_len: int
    """Its row length (a micro-batch: ``throughput.rows`` rows)."""
    attention_rows: tuple[AttentionRow, ...]
    """The attention-rows section's rows: the timed row first (the cuDNN target reads it)."""
    first_throughput: ThroughputSizes
    """The throughput-4k section's sizes: OpenChat at one row length, packed against grouped."""
    first_budget_s: float
    """Its deadline: seconds from its start after which no configuration starts."""
    graph_packs: int
    """Packs the graph-launch section replays and compares with eager (the graph section: 20)."""


TIMED_ROW = (2048, 2048, 1893, 2048, 1207, 2048, 1058, 2048)
"""The one row the attention backends are timed on: 8 documents, 14,398 tokens."""

FULL = KitSizes(
    shape=PRESET,
    dtype=torch.bfloat16,
    fp32_shape=dataclasses.replace(PRESET, num_layers=4),
    attention={"heads": 16, "groups": 4, "head_dim": 128, "max_len": 4096},
    loss_lengths=(1, 7, 1500, 33, 1024, 2, 511, 900),
    timing_lengths=TIMED_ROW,
    timing_repeats=20,
    throughput=ThroughputSizes(
        seq_lens=(4096, 8192),
        pool=4000,
        step_tokens=98_304,  # 12 packed micro-batches of 2 x 4,096, 6 of 2 x 8,192
        documents=64,
        rows=2,
        warmup=1,
        steps=5,
        length_scale=1.0,
    ),
    matmul_n=8192,
    budget_s=280.0,
    smoke_shape=SMOKE,
    smoke_seq_len=1024,
    attention_rows=(
        AttentionRow(label="the timed row", lengths=TIMED_ROW),
        AttentionRow(
            label="the gap row", lengths=(1500, 0, 0, 2048, 1, 0, 777, 333, 0, 1024), tail=29
        ),  # T 5,712: 89.25 x 64
    ),
    first_throughput=ThroughputSizes(
        seq_lens=(4096,),
        pool=4000,
        step_tokens=98_304,
        documents=64,
        rows=2,
        warmup=1,
        steps=6,
        length_scale=1.0,
    ),
    first_budget_s=150.0,
    graph_packs=8,
)
"""One GPU: the 0.84B preset at seq 4,096 and 8,192, steps from plans over 4,000 documents."""
KIT_TARGET_S = 360.0
"""Target: one run of the kit (the sections it was asked for) within 6 minutes on the device."""
FIRST_RUN_S = 300.0
"""Target: the first-run plan (`megapack.bench.gpu.kit.PLANS`) within 5 minutes on the device."""

DRY = KitSizes(
    shape=TOY,
    dtype=torch.float32,
    fp32_shape=TOY,
    attention={"heads": 4, "groups": 2, "head_dim": 16, "max_len": 64},
    loss_lengths=(1, 7, 40, 3, 30, 2, 20),
    timing_lengths=(64, 64, 59, 64, 38, 64, 33, 64),
    timing_repeats=2,
    throughput=ThroughputSizes(
        seq_lens=(128, 256),
        pool=2000,
        step_tokens=1024,  # 4 packed micro-batches of 2 x 128, 2 of 2 x 256
        documents=16,
        rows=2,
        warmup=1,
        steps=3,
        length_scale=1 / 16,
    ),
    matmul_n=512,
    budget_s=600.0,
    smoke_shape=TOY,
    smoke_seq_len=128,
    attention_rows=(
        AttentionRow(label="the timed row", lengths=(64, 64, 59, 64, 38, 64, 33, 64)),
        AttentionRow(label="the gap row", lengths=(40, 0, 0, 64, 1, 0, 17, 9, 0, 23), tail=5),
    ),
    first_throughput=ThroughputSizes(
        seq_lens=(128,),
        pool=2000,
        step_tokens=1024,
        documents=16,
        rows=2,
        warmup=1,
        steps=3,
        length_scale=1 / 16,
    ),
    first_budget_s=600.0,
    graph_packs=3,
)
"""CPU: the same steps, toy sizes, fp32."""
