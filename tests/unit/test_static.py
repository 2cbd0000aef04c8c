"""Static shapes (issue 34): fixed boundaries and max_seqlen, zero-length documents in every
CPU kernel and in the losses, document caps in the packers, and graph inputs that never move."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import megapack
from megapack import GraphInputs, PackedBatch, StaticShape
from megapack.attention import backend_available, packed_attention
from megapack.core.cp_share import CP_LAYOUTS, cp_indices, take_share
from megapack.core.fields import schema_of
from megapack.core.loss_fields import segment_trained, step_loss_fields
from megapack.core.static import pad_static, segments_for, static_batch
from megapack.data import Document, PackedDataset
from megapack.megatron import normalized_loss
from megapack.packing import PackOptions, StreamingPacker, plan
from megapack.testing.host_reads import host_reads

CPU = megapack.Topology.single(torch.device("cpu"))


def test_static_shape_pads_with_the_final_offset_and_refuses_what_does_not_fit() -> None:
    batch = PackedBatch.from_documents([[1, 2, 3], [4, 5]], seq_len=8)
    padded = static_batch(batch, StaticShape(max_segments=5, max_seqlen=8))
    assert padded.cu_seqlens.tolist() == [0, 3, 5, 8, 8, 8] and padded.max_seqlen == 8
    aligned = PackedBatch.from_documents([[1, 2, 3], [4, 5]], seq_len=8, pad_to_multiple_of=4)
    both = static_batch(aligned, StaticShape(4, 8))
    assert both.cu_seqlens.tolist() == [0, 3, 5, 5, 5] and both.cu_seqlens_padded.tolist() == [
        0,
        4,
        8,
        8,
        8,
    ]
    with pytest.raises(
        ValueError, match="3 document segments but the static shape holds max_segments=2"
    ):
        static_batch(batch, StaticShape(2, 8))
    with pytest.raises(
        ValueError, match="longest segment has 3 positions but the static shape's max_seqlen=2"
    ):
        static_batch(batch, StaticShape(5, 2))
    with pytest.raises(ValueError, match=r"StaticShape\.max_segments must be"):
        StaticShape(0, 8)
    assert segments_for(8, rows_per_micro_batch=2) == 18
    with pytest.raises(ValueError, match="not strictly increasing: 3 follows 3 at index 2"):
        dataclasses.replace(
            batch, cu_seqlens=torch.tensor([0, 3, 3, 8], dtype=torch.int32)
        ).validate()


def test_static_loss_fields_are_padded_per_segment() -> None:
    batch = PackedBatch.from_documents([[1, 2, 3], [4, 5]], seq_len=8)
    documents, _ = step_loss_fields([segment_trained(batch.cu_seqlens, batch.loss_mask)])
    values = {"cu_seqlens": batch.cu_seqlens, "cu_seqlens_padded": None, "max_seqlen": 3,
              "loss_documents": torch.from_numpy(documents[0])}  # fmt: skip
    out = pad_static(values, StaticShape(6, 8))
    assert out["loss_documents"].tolist() == [[2, 1], [1, 1], [0, 0], [0, 0], [0, 0], [0, 0]]


def _docs(seed: int, n: int) -> list[Document]:
    rng = np.random.default_rng(seed)
    return [
        Document(tokens=rng.integers(1, 100, k), loss_mask=np.ones(k))
        for k in rng.integers(1, 30, n)
    ]


def test_static_batches_keep_their_shapes_and_graph_inputs_their_pointers() -> None:
    ds = PackedDataset(_docs(1, 200), seq_len=64, rows_per_micro_batch=2, max_documents=6)
    shape = StaticShape(max_segments=segments_for(6, rows_per_micro_batch=2), max_seqlen=64)
    with megapack.prefetch(iter(ds), topology=CPU, depth=2, static=shape) as ahead:
        batches = [next(ahead) for _ in range(20)]
    assert {tuple(b["cu_seqlens"].shape) for b in batches} == {(15,)}
    assert {b["max_seqlen"] for b in batches} == {64} and len(
        {b["cu_seqlens"].tolist()[5] for b in batches}
    ) > 1
    inputs = GraphInputs(batches[0])
    pointers = {k: v.data_ptr() for k, v in inputs.buffers.items()}
    params = inputs.batch["packed_seq_params"]
    for b in batches:
        with host_reads() as reads:
            static = inputs.load(b)
        assert reads.by_module() == {}, reads.report()
        assert static is inputs.batch and static["packed_seq_params"] is params
        assert {k: v.data_ptr() for k, v in inputs.buffers.items()} == pointers
        for k, v in inputs.buffers.items():
            assert torch.equal(v, b[k]), k
    other = megapack.get_batch_on_this_tp_rank(iter([ds[0]]), topology=CPU)  # not static
    with pytest.raises(
        ValueError,
        match=r"batch\['cu_seqlens'\] is \(\d+,\) torch.int32 but the captured step reads \(15,\)",
    ):
        inputs.load(other)


def test_static_over_the_cap_is_an_error_on_the_source() -> None:
    ds = PackedDataset(_docs(2, 100), seq_len=64)  # no cap: rows of up to ~8 documents
    with pytest.raises(
        ValueError, match="static shape holds max_segments=2: cap the documents per row"
    ):
        megapack.get_batch_on_this_tp_rank(iter(ds), topology=CPU, static=StaticShape(2, 64))


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("aligned", [False, True], ids=["cu_seqlens", "cu_seqlens_padded"])
def test_zero_length_documents_change_nothing_in_a_cpu_kernel(backend: str, aligned: bool) -> None:
    train = backend_available(backend, "cpu", training=True)
    if not backend_available(backend, "cpu", training=False):
        pytest.skip(f"{backend} cannot run on cpu here")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(32, h, 8, generator=g) for h in (4, 2, 2))
    real, buffer = [0, 3, 5, 9, 20], [0, 4, 8, 12, 32]
    results = []
    for extra in (0, 3):  # three zero-length documents at the end
        cu = torch.tensor(real + [real[-1]] * extra, dtype=torch.int32)
        padded = torch.tensor(buffer + [buffer[-1]] * extra, dtype=torch.int32) if aligned else None
        if not aligned:
            cu = torch.tensor([0, 3, 5, 9, 20, 32] + [32] * extra, dtype=torch.int32)
        qq, kk, vv = (x.clone().requires_grad_(train) for x in (q, k, v))
        with torch.set_grad_enabled(train):
            out = packed_attention(
                qq, kk, vv, cu_seqlens=cu, cu_seqlens_padded=padded, max_seqlen=32, backend=backend
            )
            grads = torch.autograd.grad(out.sum(), (qq, kk, vv)) if train else ()
        results.append((out.detach(), grads))
    (out0, g0), (out1, g1) = results
    assert torch.equal(out0, out1) and not torch.isnan(out1).any()
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))


@pytest.mark.parametrize("layout", CP_LAYOUTS)
def test_zero_length_documents_take_no_cp_position_and_no_loss_weight(layout: str) -> None:
    cu = [0, 4, 8, 16]
    static = [*cu, 16, 16]
    for rank in range(2):
        assert (
            cp_indices(static, 2, rank, layout=layout).tolist()
            == cp_indices(cu, 2, rank, layout=layout).tolist()
        )
    batch = PackedBatch.from_documents([[1, 2, 3, 4], [5, 6, 7, 8], [9] * 8], seq_len=16)
    shape = StaticShape(5, 16)
    values = {"tokens": batch.tokens, "loss_mask": batch.loss_mask, "cu_seqlens": batch.cu_seqlens,
              "cu_seqlens_padded": None, "max_seqlen": batch.max_seqlen}  # fmt: skip
    fields = [f for f in schema_of().fields if f.name in values]
    shares = [take_share(v, fields, packed=True, cp_size=2, cp_rank=1, layout=layout)
              for v in (values, pad_static(values, shape))]  # fmt: skip
    assert torch.equal(shares[0]["tokens"], shares[1]["tokens"])
    documents, step = step_loss_fields([segment_trained(batch.cu_seqlens, batch.loss_mask)])
    fields_of = {
        "loss_documents": torch.from_numpy(documents[0]),
        "loss_step": torch.from_numpy(step)[None],
    }
    per_token = torch.arange(16, dtype=torch.float32)[None]
    plain = {**values, "packed_seq_params": None, **fields_of}
    padded = {**pad_static({**values, **fields_of}, shape), "packed_seq_params": None}
    for mode in megapack.megatron.LOSS_MODES:
        for per_token_loss in (False, True):
            a = normalized_loss(
                plain, per_token, mode=mode, calculate_per_token_loss=per_token_loss
            )
            b = normalized_loss(
                padded, per_token, mode=mode, calculate_per_token_loss=per_token_loss
            )
            assert torch.equal(a[0], b[0]) and torch.equal(a[-1]["lm loss"], b[-1]["lm loss"]), mode


def test_static_packers_cap_documents_per_row(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 200, 3000)
    free, capped = plan(lengths, 2048), plan(lengths, 2048, max_documents=12)
    assert max(len(b) for b in free.bins) > 12 >= max(len(b) for b in capped.bins)
    assert sorted(tuple(s) for s in capped.slices.tolist()) == sorted(
        tuple(s) for s in free.slices.tolist()
    )
    assert capped.num_bins >= free.num_bins and all(
        sum(e - s for _, s, e in b) <= 2048 for b in capped.bins
    )
    packer = StreamingPacker(PackOptions(seq_len=2048, max_documents=12), buffer_size=500)
    bins = list(packer.pack(lengths.tolist()))
    assert max(len(b) for b in bins) <= 12 and sum(len(b) for b in bins) == len(lengths)
    assert packer.state_dict()["config"]["max_documents"] == 12
    ds = PackedDataset(_docs(4, 300), seq_len=64, max_documents=3)
    assert all(len(ds[i].cu_seqlens) - 1 <= 3 + 1 for i in range(len(ds)))  # + a padding segment
    assert ds.packing.max_documents == 3


def test_static_cli_caps_and_stats_suggests_a_cap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megapack.cli import main

    src = tmp_path / "d.jsonl"
    rng = np.random.default_rng(5)
    src.write_text(
        "".join(json.dumps({"text": "x" * int(n)}) + "\n" for n in rng.integers(1, 60, 400))
    )
    assert (
        main(
            [
                "stats",
                str(src),
                "--seq-len",
                "256",
                "--search-steps",
                "600",
                "--json",
                str(tmp_path / "s.json"),
            ]
        )
        == 0
    )
    figures = json.loads((tmp_path / "s.json").read_text())
    cap = figures["suggested_max_documents"]
    assert (
        figures["rows_kept_at_suggested_cap"] >= 0.99
        and "--max-documents" in capsys.readouterr().out
    )
    assert (
        main(
            [
                "pack",
                str(src),
                "--seq-len",
                "256",
                "--out",
                str(tmp_path / "p"),
                "--max-documents",
                str(cap),
            ]
        )
        == 0
    )
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    assert meta["packing"]["max_documents"] == cap
    assert meta["rows"] == figures["rows_at_suggested_cap"]
    loaded = PackedDataset.load(tmp_path / "p")
    assert max(len(loaded[i].cu_seqlens) for i in range(len(loaded))) <= cap + 2
