"""`GraphInputs`: what a static buffer set refuses, naming the field and both sides, before copying.

(`tests/unit/test_static.py` checks that static batches keep their shapes and the buffers their
pointers; `tests/functional/test_graph_step.py` a whole step fed through one set per micro-batch.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from megapack import GraphInputs, PackedBatch, StaticShape, Topology, get_batch_on_this_tp_rank

CPU = Topology.single(torch.device("cpu"))
SHAPE = StaticShape(max_segments=4, max_seqlen=16)


def batch(lengths: list[int]) -> dict[str, Any]:
    docs = [list(range(1, n + 1)) for n in lengths]
    item = PackedBatch.from_documents(docs, seq_len=16)
    return get_batch_on_this_tp_rank(iter([item]), topology=CPU, static=SHAPE)


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
