"""The other batches Megatron's data pipeline emits (issue 10, section 6), on one rank per stage.

Extra keys (dataset_id, cu_seqlens_padded, cu_seqlens_argmin, local_cp_size), multi-token
prediction on the last stage, middle stages without a data iterator, a packed dict with a dense
attention_mask, and PackedSeqParams across megatron-core releases.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from megapack import PackedBatch, Topology, get_batch_on_this_tp_rank
from megapack.core.batch import make_packed_seq_params
from megapack.core.fields import Stage

S = 8


def on_stage(pp_rank: int, pp_size: int, *, mtp: bool = False) -> Topology:
    """A tp=1 rank on pipeline stage ``pp_rank`` of ``pp_size``: no process group needed."""
    return Topology(
        tp_group=None, tp_ranks=(0,), tp_rank=0, pp_rank=pp_rank, pp_size=pp_size, mtp=mtp
    )


def sft(b: int = 2) -> dict[str, Any]:
    """Megatron SFT rows of s=8: documents [3, 5] and [8], -1 sentinels."""
    tokens = torch.arange(1, b * S + 1).reshape(b, S)
    cu = torch.tensor([[0, 3, 8], [0, 8, -1]][:b], dtype=torch.int32)
    return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(b, S),
            "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))][:b]), "cu_seqlens": cu}  # fmt: skip


def plain(b: int = 2) -> dict[str, Any]:
    tokens = torch.arange(b * S).reshape(b, S)
    return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(b, S),
            "position_ids": torch.arange(S).repeat(b, 1)}  # fmt: skip


def one(item: Any, topo: Topology, **kwargs: Any) -> dict[str, Any]:
    return get_batch_on_this_tp_rank(iter([item]), topology=topo, **kwargs)


# ---------------------------------------------------------------- extra keys


@pytest.mark.parametrize("make", [sft, plain], ids=["sft", "plain"])
@pytest.mark.parametrize("pp_rank", [0, 1, 2], ids=["first", "middle", "last"])
def test_dataset_id_reaches_every_stage(make: Any, pp_rank: int) -> None:
    item = {**make(), "dataset_id": torch.tensor([3, 1])}
    out = one(item, on_stage(pp_rank, 3))
    assert out["dataset_id"] is not None and out["dataset_id"].tolist() == [3, 1]
    assert out["dataset_id"].dtype == torch.int64


def test_dataset_id_collated_as_b_by_1_is_flattened_and_bad_ones_are_named() -> None:
    out = one({**sft(), "dataset_id": torch.tensor([[4], [5]])}, on_stage(0, 1))
    assert out["dataset_id"].tolist() == [4, 5]
    with pytest.raises(TypeError, match=r"batch\['dataset_id'\] must be a tensor"):
        one({**sft(), "dataset_id": [4, 5]}, on_stage(0, 1))
    with pytest.raises(ValueError, match=r"batch\['dataset_id'\] has shape \(3,\); expected \[2\]"):
        one({**sft(), "dataset_id": torch.tensor([1, 2, 3])}, on_stage(0, 1))


def test_sft_cu_seqlens_padded_rows_merge_and_travel() -> None:
    item = sft()
    item["cu_seqlens"] = torch.tensor([[0, 3, 5, -1], [0, 6, -1, -1]], dtype=torch.int32)
    item["cu_seqlens_padded"] = torch.tensor([[0, 4, 8], [0, 8, 8]], dtype=torch.int32)
    out = one(item, on_stage(1, 3))  # a middle stage: only the boundaries
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 11]
    assert out["cu_seqlens_padded"].tolist() == [0, 4, 8, 16]
    assert out["max_seqlen"] == 8
    assert out["packed_seq_params"].cu_seqlens_q_padded is out["cu_seqlens_padded"]


def test_sft_cu_seqlens_padded_with_bad_real_row_is_named() -> None:
    item = sft()
    item["cu_seqlens"] = torch.tensor([[0, 3, 5, 7], [0, 6, -1, -1]], dtype=torch.int32)
    item["cu_seqlens_padded"] = torch.tensor([[0, 4, 8], [0, 8, 8]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens row 0 has 7 after its 3 boundaries"):
        one(item, on_stage(0, 1))


def test_cu_seqlens_argmin_is_ignored_and_unknown_keys_are_named() -> None:
    out = one({**sft(), "cu_seqlens_argmin": torch.tensor([[3], [2]])}, on_stage(0, 1))
    assert out["cu_seqlens"].tolist() == [0, 3, 8, 16]
    with pytest.raises(ValueError, match=r"undeclared keys \['seq_ids'\]"):
        one({**sft(), "seq_ids": torch.zeros(2)}, on_stage(0, 1))
    with pytest.raises(ValueError, match=r"undeclared keys \['local_cp_size'\].*need cu_seqlens"):
        one({**plain(), "local_cp_size": 2}, on_stage(0, 1))


@pytest.mark.parametrize("value", [torch.tensor([1], dtype=torch.int32), 1], ids=["tensor", "int"])
@pytest.mark.parametrize("pp_rank", [0, 1, 2], ids=["first", "middle", "last"])
def test_local_cp_size_lands_in_packed_seq_params(value: Any, pp_rank: int) -> None:
    # Without a CP group the only consistent hybrid size is 1 (TE: "turn CP off for this batch");
    # tests/functional/test_megatron_get_batch.py carries local_cp_size == cp on CP grids.
    out = one({**sft(), "local_cp_size": value}, on_stage(pp_rank, 3))
    assert out["local_cp_size"] == 1 and type(out["local_cp_size"]) is int
    assert out["packed_seq_params"].local_cp_size == 1
    assert one(sft(), on_stage(pp_rank, 3))["packed_seq_params"].local_cp_size is None
    with pytest.raises(ValueError, match=r"batch\['local_cp_size'\] must be an int >= 1, got 0"):
        one({**sft(), "local_cp_size": 0}, on_stage(pp_rank, 3))


def test_local_cp_size_must_match_the_topology_cp_group() -> None:
    with pytest.raises(
        ValueError, match=r"local_cp_size=4 but this rank's CP group has 1 ranks.*hybrid CP"
    ):
        one({**sft(), "local_cp_size": 4}, on_stage(0, 1))


# ---------------------------------------------------------------- multi-token prediction


@pytest.mark.parametrize("make", [sft, plain], ids=["sft", "plain"])
def test_mtp_gives_the_last_stage_tokens_and_position_ids(make: Any) -> None:
    item = make()
    assert on_stage(1, 2, mtp=True).stage is Stage.MTP
    out = one(item, on_stage(1, 2, mtp=True))
    for name in ("tokens", "position_ids", "labels", "loss_mask"):
        assert out[name] is not None and out[name].numel() == item[name].numel(), name
    without = one(item, on_stage(1, 2))
    assert without["tokens"] is None and without["position_ids"] is None
    assert on_stage(0, 1, mtp=True).stage is Stage.ONLY  # a single stage already gets everything


# ---------------------------------------------------------------- middle stages without an iterator


def test_plain_middle_stage_without_iterator_gets_the_all_none_batch() -> None:
    out = get_batch_on_this_tp_rank(None, topology=on_stage(1, 3))
    assert all(v is None for v in out.values()), out
    out = get_batch_on_this_tp_rank(None, topology=on_stage(2, 4), packed=False)
    assert all(v is None for v in out.values()), out


def test_packed_middle_stage_without_iterator_says_how_to_build_one() -> None:
    with pytest.raises(
        ValueError, match=r"middle pipeline stage \(pp_rank 1\).*is_dataset_built_on_rank"
    ):
        get_batch_on_this_tp_rank(None, topology=on_stage(1, 3), packed=True)
    with pytest.raises(
        ValueError, match=r"stage 'first', pp_rank 0\); this stage's TP rank 0 must get"
    ):
        get_batch_on_this_tp_rank(None, topology=on_stage(0, 3))


def test_packed_flag_must_match_the_data() -> None:
    with pytest.raises(ValueError, match=r"packed=True\) but the batch has no cu_seqlens"):
        one(plain(), on_stage(0, 1), packed=True)
    with pytest.raises(ValueError, match=r"packed=False\) but the batch has cu_seqlens"):
        one(sft(), on_stage(0, 1), packed=False)


# ---------------------------------------------------------------- dense masks on packed batches


def test_packed_dict_with_dense_attention_mask_names_the_megatron_flag() -> None:
    mask = torch.ones(2, 1, S, S, dtype=torch.bool)
    with pytest.raises(ValueError, match="create_attention_mask_in_dataloader"):
        one({**sft(), "attention_mask": mask}, on_stage(0, 1))
    assert one({**sft(), "attention_mask": None}, on_stage(0, 1))["attention_mask"] is None


# ---------------------------------------------------------------- PackedSeqParams across releases


def _fake_release(monkeypatch: pytest.MonkeyPatch, names: list[str]) -> None:
    from megapack.core.megatron_release import MegatronRelease

    fake = dataclasses.make_dataclass("PackedSeqParams", [(n, Any, None) for n in names])
    release = MegatronRelease(
        version=(0, 0, 0), packed_seq_params=fake, packed_seq_fields=frozenset(names)
    )  # the release megapack.core.seq_params probes once per process
    monkeypatch.setattr("megapack.core.seq_params.megatron_release", lambda: release)


BASE = ["qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
        "max_seqlen_q", "max_seqlen_kv"]  # fmt: skip


def test_packed_seq_params_on_an_older_release_without_cp_fields(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_release(monkeypatch, BASE)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    psp = make_packed_seq_params(
        cu, None, 4, cp_group=object()
    )  # cp_group left to the model config
    assert psp.cu_seqlens_kv is cu and psp.max_seqlen_kv == 4 and not hasattr(psp, "cp_group")
    with pytest.raises(ValueError, match=r"has no field 'local_cp_size' \(given 2\)"):
        make_packed_seq_params(cu, None, 4, local_cp_size=2)


def test_packed_seq_params_on_a_newer_release_with_more_fields(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_release(monkeypatch, [*BASE, "local_cp_size", "cp_group", "total_tokens", "seq_idx"])
    group = object()
    psp = make_packed_seq_params(
        torch.tensor([0, 4], dtype=torch.int32), None, 4, cp_group=group, local_cp_size=1
    )
    assert psp.cp_group is group and psp.local_cp_size == 1 and psp.total_tokens is None


def test_packed_batch_to_packed_seq_params_still_works() -> None:
    b = PackedBatch.from_documents([[1, 2, 3], [4]], pad_to_multiple_of=2)
    psp = b.to_packed_seq_params()
    assert psp.cu_seqlens_q_padded is b.cu_seqlens_padded and psp.cp_group is None


# ---------------------------------------------------------------- Megatron's test_get_batch.py, CPU-only cases


def two_documents_per_row(mbs: int, s: int, sentinel_copies: int = 0) -> dict[str, Any]:
    """Each row: tokens range(s), documents [0, s/2) and [s/2, s), cu_seqlens padded with copies of s."""
    cu = torch.tensor([[0, s // 2, s] + [s] * sentinel_copies] * mbs, dtype=torch.int32)
    tokens = torch.arange(s).repeat(mbs, 1)
    return {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(mbs, s),
            "position_ids": (tokens % (s // 2)), "cu_seqlens": cu,
            "max_seqlen": torch.full((mbs,), s // 2, dtype=torch.int32)}  # fmt: skip


@pytest.mark.parametrize("copies", [0, 3], ids=["unpadded", "padded"])
@pytest.mark.parametrize("s", [16, 1024])
@pytest.mark.parametrize("mbs", [1, 2, 4])
def test_rows_merge_like_flatten_batch_for_packed_sequences(mbs: int, s: int, copies: int) -> None:
    item = two_documents_per_row(mbs, s, copies)
    for pp_rank, stage in ((0, "only"), (1, "middle")):
        out = one(item, on_stage(pp_rank, 1 if stage == "only" else 3))
        want = [0] + [v for i in range(mbs) for v in (i * s + s // 2, (i + 1) * s)]
        assert out["cu_seqlens"].tolist() == want, stage  # 3 + 2 * (mbs - 1) entries, offsets i * s
        assert out["max_seqlen"] == s // 2
        if stage == "only":
            assert out["tokens"].shape == (1, mbs * s)
            assert torch.equal(out["tokens"], item["tokens"].reshape(1, -1))
        else:
            assert out["tokens"] is None and out["labels"] is None and out["position_ids"] is None


@pytest.mark.parametrize("s", [16, 1024])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_per_sequence_balancing_takes_chunks_r_and_2cp_minus_1_minus_r(cp: int, s: int) -> None:
    from megapack.core.cp_share import take_share
    from megapack.core.fields import Stage, schema_of
    from megapack.core.intake import to_batch

    schema = schema_of()
    batch = to_batch(two_documents_per_row(1, s), schema)
    tensors = batch.values
    for rank in range(cp):
        share = take_share(tensors, schema.by_stage[Stage.ONLY], packed=True, cp_size=cp,
                           cp_rank=rank, layout="row")  # fmt: skip
        c = s // (2 * cp)
        want = torch.cat(
            [
                torch.arange(rank * c, (rank + 1) * c),
                torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c),
            ]
        )
        assert torch.equal(share["tokens"], want[None]), rank  # type: ignore[arg-type]
        assert share["cu_seqlens"] is tensors["cu_seqlens"] and share["max_seqlen"] == s // 2
