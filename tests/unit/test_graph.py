"""`GraphInputs`: what a static buffer set refuses, naming the field and both sides, before copying;
the bucket plan it keeps (so ``auto`` picks for a slot what it picks for the delivered batch) and
``pad_between_seqs`` on padded boundaries where megatron-core has it.

(`tests/unit/test_static.py` checks that static batches keep their shapes and the buffers their
pointers; `tests/functional/test_graph_step.py` a whole step fed through one set per micro-batch.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from megapack import (
    BUCKET_FIELDS,
    GraphInputs,
    PackedBatch,
    StaticShape,
    Topology,
    get_batch_on_this_tp_rank,
)
from megapack.attention.bucketed import bucket_shapes
from megapack.attention.choice import Installed, choose
from megapack.attention.documents import Documents
from megapack.attention.varlen import VarlenForm
from megapack.core.buckets import BUCKET_NAMES
from megapack.core.seq_params import BUCKETS_ATTR

CPU = Topology.single(torch.device("cpu"))
SHAPE = StaticShape(max_segments=4, max_seqlen=16)


HOPPER = Installed(cuda=True, flash_attn=False, te=False, flex=True, sm=90,
                   varlen=VarlenForm(causal="window_size", scale=True, enable_gqa=True))  # fmt: skip
"""A GPU where ``auto`` takes bucketed only with a delivered plan (torch_varlen without one)."""


def batch(lengths: list[int], *, planned: bool = False, align: int = 1) -> dict[str, Any]:
    docs = [list(range(1, n + 1)) for n in lengths]
    item = PackedBatch.from_documents(docs, seq_len=16, pad_to_multiple_of=align)
    return get_batch_on_this_tp_rank(iter([item]), topology=CPU, static=SHAPE,
                                     fields=BUCKET_FIELDS if planned else ())  # fmt: skip


def auto_on_hopper(values: dict[str, Any]) -> str:
    """What a PackedAttention with backend="auto" runs on these values' params (bf16 training)."""
    docs = Documents.from_params(values["packed_seq_params"], total=16)
    planned = docs.buckets is not None
    return choose("cuda", torch.bfloat16, training=True, dropout=0.0, installed=HOPPER,
                  planned=planned)[0]  # fmt: skip


def test_graph_inputs_check_copies_nothing_and_load_refills_in_place() -> None:
    first, second = batch([3, 5]), batch([1, 2, 9])
    inputs = GraphInputs(first)
    inputs.load(first)
    before = {k: v.clone() for k, v in inputs.buffers.items()}
    versions = {k: v._version for k, v in inputs.buffers.items()}
    inputs.check(second)  # fits: no error, and nothing copied
    assert all(torch.equal(v, before[k]) for k, v in inputs.buffers.items())
    assert inputs.load(second) is inputs.batch
    assert inputs.batch["cu_seqlens"].tolist() == [0, 1, 3, 12, 16]
    # in place: a cache keyed on (identity, version) sees the refill
    assert all(v._version > versions[k] for k, v in inputs.buffers.items())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b.update(tokens=b["tokens"].to("meta")),
         "batch['tokens'] is (1, 16) torch.int64 on meta but the captured step reads (1, 16) torch.int64 on cpu"),
        (lambda b: b.update(labels=b["labels"].int()),
         "batch['labels'] is (1, 16) torch.int32 but the captured step reads (1, 16) torch.int64"),
        (lambda b: b.update(loss_mask=None),
         "batch['loss_mask'] is None but the captured step reads (1, 16) torch.float32"),
        (lambda b: b.update(cu_seqlens_padded=torch.zeros(6, dtype=torch.int32)),
         "batch['cu_seqlens_padded'] is a (6,) tensor but the captured step was made from a batch whose 'cu_seqlens_padded' was None"),
        (lambda b: b.update(max_seqlen=8),
         "batch['max_seqlen'] is 8 but the captured step was made for 16"),
    ],
    ids=["device", "dtype", "missing", "new field", "max_seqlen"],
)  # fmt: skip
def test_graph_inputs_refuse_a_batch_naming_the_field_and_loses_nothing(
    change: Callable[[dict[str, Any]], None], message: str
) -> None:
    inputs = GraphInputs(batch([3, 5]))
    loaded = {
        k: v.clone() for k, v in inputs.load(batch([3, 5])).items() if isinstance(v, torch.Tensor)
    }
    bad = batch([2, 2, 2])
    change(bad)
    with pytest.raises(ValueError, match=re.escape(message)):
        inputs.load(bad)
    assert all(torch.equal(inputs.buffers[k], v) for k, v in loaded.items())


def test_graph_inputs_keep_each_batchs_bucket_plan_so_auto_runs_what_eager_runs() -> None:
    a, b = batch([3, 5], planned=True), batch([1, 2, 9], planned=True)
    assert [tuple(x.shape) for x in a["packed_seq_params"].megapack_buckets] != [
        tuple(x.shape) for x in b["packed_seq_params"].megapack_buckets
    ]  # the plan's shapes change with the batch: it cannot be a static buffer
    inputs = GraphInputs(a)
    assert inputs.planned and not any(n in inputs.buffers for n in BUCKET_NAMES)
    for delivered in (a, b, a):
        static = inputs.load(delivered)
        plan = tuple(delivered[n] for n in BUCKET_NAMES if delivered[n] is not None)
        kept = getattr(static["packed_seq_params"], BUCKETS_ATTR)
        assert len(kept) == len(plan) and all(k is p for k, p in zip(kept, plan, strict=True))
        assert all(static[n] is delivered[n] for n in BUCKET_NAMES)
        # the refilled boundaries rebuild the attention's Documents, which reads this batch's plan
        docs = Documents.from_params(static["packed_seq_params"], total=16)
        assert bucket_shapes(docs) == [tuple(p.shape) for p in plan]
        assert auto_on_hopper(static) == auto_on_hopper(delivered) == "bucketed"
    plain = GraphInputs(batch([3, 5]))  # the control: without a plan, auto takes another kernel
    assert not plain.planned and auto_on_hopper(plain.load(batch([1, 2, 9]))) == "torch_varlen"


@pytest.mark.parametrize(
    ("first", "change", "message"),
    [
        (True, lambda b: [b.pop(n) for n in BUCKET_NAMES],
         "the batch has no bucket plan (fields=megapack.BUCKET_FIELDS) but the captured step was "
         "made from a batch with one, so its attention would choose another backend"),
        (False, lambda b: b.update(attention_bucket_0=torch.zeros(2, 8, dtype=torch.int32)),
         "the batch brings a bucket plan (fields=megapack.BUCKET_FIELDS) but the captured step "
         "was made from a batch without one"),
        (True, lambda b: b.update(attention_bucket_0=b["attention_bucket_0"].long()),
         "batch['attention_bucket_0'] is (3, 8) torch.int64, not a bucket of the plan (None or "
         "an int32 [n, L] index"),
        (True, lambda b: b.update(attention_bucket_1=[0, 1]),
         "batch['attention_bucket_1'] is list, not a bucket of the plan"),
    ],
    ids=["plan dropped", "plan added", "bucket dtype", "bucket type"],
)  # fmt: skip
def test_graph_inputs_refuse_a_batch_whose_plan_differs_and_load_nothing(
    first: bool, change: Callable[[dict[str, Any]], None], message: str
) -> None:
    inputs = GraphInputs(batch([3, 5], planned=first))
    static = inputs.load(batch([3, 5], planned=first))
    loaded = {k: v.clone() for k, v in inputs.buffers.items()}
    plan = [static[n] for n in BUCKET_NAMES] if first else None
    bad = batch([2, 2, 2], planned=first)
    change(bad)
    with pytest.raises(ValueError, match=re.escape(message)):
        inputs.load(bad)
    assert all(torch.equal(inputs.buffers[k], v) for k, v in loaded.items())
    if plan is not None:  # the kept plan is still the last loaded batch's
        assert all(static[n] is p for n, p in zip(BUCKET_NAMES, plan, strict=True))


def test_graph_inputs_mark_padded_boundaries_where_megatron_core_has_the_field() -> None:
    import dataclasses

    padded = batch([3, 5], align=4)
    assert padded["cu_seqlens_padded"] is not None
    static = GraphInputs(padded).load(batch([1, 2, 5], align=4))["packed_seq_params"]
    fields = {f.name for f in dataclasses.fields(static)}
    if "pad_between_seqs" in fields:  # megatron-core 0.19: TE is told, any batch may be padded
        assert static.pad_between_seqs is True
        unpadded = GraphInputs(batch([3, 5])).batch["packed_seq_params"]
        assert unpadded.pad_between_seqs is not True  # nothing padded: nothing to tell
    else:  # 0.16.1: no such field (GraphStep refuses TE on padded boundaries there)
        assert not hasattr(static, "pad_between_seqs")
