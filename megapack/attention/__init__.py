"""Packed (THD) attention: kernels, backend choice, RoPE, CP; imports torch, numpy and megapack.core's
cp_share, quiet, capture, buckets, seq_params and errors only.

Modules:

    packed.py        `PackedAttention`, megatron-core's ``core_attention`` for THD batches
    functional.py    `packed_attention`: the same attention as a function of q, k, v and boundaries
    choice.py        `BACKENDS`, which backend runs where (`resolve_backend`, ``auto``'s rule
                     `choose`, run-time `fallback`)
    documents.py     `Documents`: a micro-batch's boundaries and what is derived from them, once
    kernels.py       the single-row kernels (`KERNELS`) and `attend`, which runs one
    varlen.py        torch's varlen_attn in each released form (found from its signature)
    flex.py          flex_attention: one block mask per micro-batch, one compiled kernel
    te.py            Transformer Engine's THD attention
    cudnn.py         cuDNN's fused attention over ragged THD tensors (cudnn-frontend); its
                     graphs, described, built in pairs before any kernel runs, cached:
                     cudnn_graph.py
    bucketed.py      the documents in a few dense batches by length, one SDPA call each
    cp_attention.py  context-parallel attention: K/V all-gather (cp_plan.py: the segment plan,
                     cp_kernels.py: its kernels)
    rope.py          rotary position embedding from each token's position in its document

Never imports the delivery (`megapack.delivery`) or megapack's process-group code (the layers:
tests/unit/test_layering.py); megatron-core only lazily, inside calls.
"""

from megapack.attention.choice import BACKENDS, backend_available, resolve_backend
from megapack.attention.functional import packed_attention
from megapack.attention.packed import PackedAttention

__all__ = [
    "BACKENDS",
    "PackedAttention",
    "backend_available",
    "packed_attention",
    "resolve_backend",
]
