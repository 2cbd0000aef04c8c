"""megapack.delivery.callers on one rank: which form a call is, each form's checks and refusals
(exact messages), and the layout each caller reads. The grids, with the re-created callers, are
tests/functional/test_megatron_callers.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import megapack
from megapack import PackedBatch, Topology, get_batch_on_this_tp_rank
from megapack.delivery.callers import (
    MEGATRON_BATCH_KEYS,
    Form,
    _fold_empty_tail,
    form_of,
    pretrain_gpt_get_batch,
)
from tests.functional.callers import megatron_core, megatron_training
from tests.functional.callers.data import S, bridge_item, megatron_item, reference

ONLY = Topology.single()
MIDDLE = Topology(tp_group=None, tp_ranks=(0,), tp_rank=0, pp_rank=1, pp_size=3)


def keywords(**overrides: Any) -> dict[str, Any]:
    """Megatron-LM main's keywords for one rank of a tp 1 x pp 1 grid, mbs 2, seq_length S."""
    kw = dict(has_cu_seqlens=True, is_hybrid_cp=False, create_attention_mask_in_dataloader=False,
              broadcast_src_rank=0, broadcast_group=None, cp_size=1, tp_rank=0,
              micro_batch_size=2, seq_length=S, mtp_on_this_rank=False)  # fmt: skip
    return {**kw, **overrides}


def middle(**overrides: Any) -> dict[str, Any]:
    """The same for the middle stage of three (pp_rank 1)."""
    stage = {"pipeline_model_parallel_size": 3, "is_pipeline_first_stage": False,
             "is_pipeline_last_stage": False}  # fmt: skip
    return keywords(**{**stage, **overrides})


# -- which form -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("first", "args", "kwargs", "form"),
    [
        ({}, (), {"has_cu_seqlens": True}, Form.MEGATRON),
        ({"tokens": 1}, (), {}, Form.MEGATRON),
        (iter([]), (), {"mtp_on_this_rank": True}, Form.MEGATRON_PRE_4103),
        (iter([]), (False,), {}, Form.MEGATRON_PRE_4103),
        (None, (), {"mtp_on_this_rank": False}, Form.MEGATRON_PRE_4103),
        (iter([]), (object(),), {}, Form.BRIDGE),
        (iter([]), (object(), True), {}, Form.BRIDGE),
        (iter([]), (), {"cfg": object()}, Form.BRIDGE),
        (None, (), {"cfg": object(), "use_mtp": True}, Form.BRIDGE),
        (iter([]), (), {}, Form.MEGAPACK),
        (None, (), {}, Form.MEGAPACK),
    ],
)
def test_each_form_is_told_apart_by_its_arguments(
    first: Any, args: tuple[Any, ...], kwargs: dict[str, Any], form: Form
) -> None:
    assert form_of(first, args, kwargs) is form


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: get_batch_on_this_tp_rank(iter([]), False, cfg=object()),
         "get_batch_on_this_tp_rank: ambiguous call, it mixes Megatron-LM's older form "
         "(data_iterator, mtp_on_this_rank=...) and Megatron-Bridge's (data_iterator, cfg, "
         "use_mtp, *, pg_collection): got 1 more positional arguments and keywords ['cfg']; pass "
         "one form's arguments"),
        (lambda: get_batch_on_this_tp_rank(iter([]), object(), mtp_on_this_rank=True),
         "ambiguous call"),
        (lambda: get_batch_on_this_tp_rank(iter([]), has_cu_seqlens=True, tp_rank=0),
         "get_batch_on_this_tp_rank got Megatron-LM's keywords ['has_cu_seqlens', 'tp_rank'] "
         "with a list_iterator first: Megatron-LM's form takes the batch dict first "
         "(next(data_iterator) on TP rank 0, {} on the other TP ranks), as pretrain_gpt.py passes "
         "it; megapack's own form takes the iterator and megapack's keywords"),
        (lambda: get_batch_on_this_tp_rank(iter([]), topolgy=ONLY),
         "get_batch_on_this_tp_rank got unexpected keywords ['topolgy']"),
        (lambda: get_batch_on_this_tp_rank({}, **keywords(), fields=megapack.LOSS_FIELDS),
         "get_batch_on_this_tp_rank in Megatron-LM's form got megapack's options ['fields'], which "
         "only megapack's own form takes (an iterator first, keywords only): drop them, or call "
         "megapack's form"),
        (lambda: get_batch_on_this_tp_rank(iter([]), mtp_on_this_rank=False, packed=True),
         "Megatron-LM before PR #4103's form got megapack's options ['packed']"),
        (lambda: get_batch_on_this_tp_rank({}, has_cu_seqlens=True),
         "get_batch_on_this_tp_rank in Megatron-LM's form: missing a required argument: "
         "'is_hybrid_cp'"),
        (lambda: get_batch_on_this_tp_rank(iter([]), object()),
         "Megatron-Bridge's form needs pg_collection= (keyword only, as Bridge's own"),
        (lambda: get_batch_on_this_tp_rank(iter([]), mtp_on_this_rank=1),
         "mtp_on_this_rank must be True or False, got int 1"),
    ],
)  # fmt: skip
def test_calls_that_fit_no_form_are_refused(call: Any, message: str) -> None:
    with pytest.raises(TypeError) as info:
        call()
    assert message in str(info.value)


def test_megapack_options_at_their_defaults_are_no_mix() -> None:
    item = megatron_item(1, 2)
    out = get_batch_on_this_tp_rank(dict(item), **keywords(), topology=ONLY, fields=[], packed=None)
    assert out["cu_seqlens"].tolist() == [reference(item)["cu_seqlens"]]


# -- Megatron-LM main's form ------------------------------------------------------------------------
HYBRID = (
    "get_batch_on_this_tp_rank(is_hybrid_cp=True): megapack cannot honour Megatron-LM's hybrid "
    "context parallelism (--hybrid-context-parallel): the CP group of each micro-batch is chosen "
    "after delivery from its local_cp_size, and its sequence length varies; keep "
    "megatron.core.utils.get_batch_on_this_tp_rank for hybrid-CP runs, or use megapack's context "
    "parallelism (docs/context-parallelism.md)"
)


def test_hybrid_cp_is_refused_with_the_documented_message() -> None:
    with pytest.raises(ValueError) as info:
        get_batch_on_this_tp_rank({}, **keywords(is_hybrid_cp=True), topology=ONLY)
    assert str(info.value) == HYBRID
    assert f"ValueError: {HYBRID}" in (megapack_docs := _guide())  # the guide shows it verbatim
    assert "is_hybrid_cp" in megapack_docs


def _guide() -> str:
    from tests.functional.callers import GUIDE

    return GUIDE.read_text()


@pytest.mark.parametrize(
    ("overrides", "topology", "message"),
    [
        ({"broadcast_src_rank": 1}, ONLY,
         "get_batch_on_this_tp_rank: broadcast_src_rank=1 but this rank's TP source (TP rank 0) "
         "is global rank 0 (per the topology given): pass mpu.get_tensor_model_parallel_src_rank()"),
        ({"cp_size": 2}, ONLY,
         "cp_size=2 but this rank's CP group has 1 ranks (per the topology given): pass "
         "args.context_parallel_size"),
        ({"pipeline_model_parallel_size": 2}, ONLY,
         "pipeline_model_parallel_size=2 but this rank's pipeline has 1 stages"),
        ({"is_pipeline_first_stage": True}, "middle",
         "is_pipeline_first_stage=True but this rank's pipeline rank is 1 (per the topology "
         "given): pass mpu.is_pipeline_first_stage()"),
        ({"is_pipeline_last_stage": True}, "middle",
         "is_pipeline_last_stage=True but this rank's pipeline rank is 1 of 3"),
        ({"create_attention_mask_in_dataloader": True}, ONLY,
         "get_batch_on_this_tp_rank(has_cu_seqlens=True, create_attention_mask_in_dataloader="
         "True): packed batches mask by document from cu_seqlens, never by a dense mask; pass "
         "--no-create-attention-mask-in-dataloader"),
    ],
)  # fmt: skip
def test_each_keyword_is_checked_against_the_topology(
    overrides: dict[str, Any], topology: Any, message: str
) -> None:
    kw = middle(**overrides) if topology == "middle" else keywords(**overrides)
    topo = MIDDLE if topology == "middle" else topology
    with pytest.raises(ValueError) as info:
        get_batch_on_this_tp_rank(dict(megatron_item(1, 2)), **kw, topology=topo)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("item", "overrides", "message"),
    [
        (megatron_item(1, 2, kind="plain"), {},
         "has_cu_seqlens=True but the batch has no cu_seqlens: has_cu_seqlens is Megatron's "
         "args.sft or args.dataloader_inter_document_masking, which must match the dataset"),
        (megatron_item(1, 2), {"has_cu_seqlens": False}, "has_cu_seqlens=False but the batch has cu_seqlens"),
        (megatron_item(1, 2), {"micro_batch_size": 1},
         "batch['tokens'] has shape (2, 16) but micro_batch_size=1, seq_length=16 (Megatron's "
         "--micro-batch-size, --seq-length"),
        ({}, {}, "the batch is empty on the TP source (TP rank 0)"),
        ({**megatron_item(1, 2), "local_cp_size": torch.tensor([2])}, {},
         "the batch has local_cp_size, a hybrid-CP batch: megapack cannot honour"),
        (megatron_item(1, 2, kind="plain"),
         {"has_cu_seqlens": False, "create_attention_mask_in_dataloader": True},
         "create_attention_mask_in_dataloader=True but the batch has no attention_mask"),
    ],
)  # fmt: skip
def test_the_batch_is_checked_against_the_keywords(
    item: dict[str, Any], overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        get_batch_on_this_tp_rank(item, **keywords(**overrides), topology=ONLY)
    assert message in str(info.value)


@pytest.mark.parametrize("sentinel", [-1, S])
@pytest.mark.parametrize("mbs", [1, 2])
def test_megatron_layout_and_flatten_changes_nothing(sentinel: int, mbs: int) -> None:
    item = {**megatron_item(3, mbs, sentinel=sentinel), "dataset_id": torch.arange(mbs)}
    want = reference(item)
    out = get_batch_on_this_tp_rank(dict(item), **keywords(micro_batch_size=mbs), topology=ONLY)
    assert list(out) == [
        "tokens",
        "labels",
        "loss_mask",
        "position_ids",
        "attention_mask",
        "cu_seqlens",
        "cu_seqlens_padded",
        "max_seqlen",
        "local_cp_size",
        "hybrid_cp_group",
    ]  # fmt: skip  (Megatron's receivers' keys: no dataset_id)
    assert sorted(out) == sorted(MEGATRON_BATCH_KEYS)
    assert out["cu_seqlens"].shape == (1, len(want["cu_seqlens"]))
    assert out["cu_seqlens"].dtype == torch.int32 and out["tokens"].shape == (1, mbs * S)
    max_seqlen = out["max_seqlen"]
    assert max_seqlen.dtype == torch.int32 and max_seqlen.device.type == "cpu"
    assert max_seqlen.tolist() == [want["max_seqlen"]]
    flat = megatron_core.flatten_batch_for_packed_sequences(dict(out))
    for key in ("cu_seqlens", "max_seqlen", "tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(flat[key], out[key]), key


@pytest.mark.parametrize("mbs", [1, 2])
def test_a_middle_stage_gets_boundaries_without_sentinels(mbs: int) -> None:
    item = megatron_item(4, mbs, sentinel=-1)
    out = get_batch_on_this_tp_rank(dict(item), **middle(micro_batch_size=mbs), topology=MIDDLE)
    assert [out[k] for k in ("tokens", "labels", "loss_mask", "position_ids")] == [None] * 4
    flat = megatron_core.flatten_batch_for_packed_sequences(out)
    assert flat["cu_seqlens"].tolist() == [reference(item)["cu_seqlens"]]
    megatron = {"tokens": None, "labels": None, "loss_mask": None, "position_ids": None,
                "cu_seqlens": item["cu_seqlens"].clone(), "cu_seqlens_padded": None,
                "max_seqlen": item["max_seqlen"]}  # fmt: skip
    assert (
        -1 in megatron_core.flatten_batch_for_packed_sequences(megatron)["cu_seqlens"].tolist()[0]
    )


def test_flatten_still_cuts_padded_boundaries_on_a_middle_stage_as_the_guide_says() -> None:
    """Megatron's flatten, after the import line, on a middle stage whose real total (28) is an
    inner padded boundary: it cuts cu_seqlens_padded at 28 (docs/megatron.md says so)."""
    item = megatron_item(32, 2, kind="padded")
    want = reference(item)
    assert want["cu_seqlens"][-1] == 28 and 28 in want["cu_seqlens_padded"][1:-1]
    out = get_batch_on_this_tp_rank(dict(item), **middle(), topology=MIDDLE)
    assert out["cu_seqlens_padded"].tolist() == [want["cu_seqlens_padded"]]  # megapack's: whole
    flat = megatron_core.flatten_batch_for_packed_sequences(out)
    cut = want["cu_seqlens_padded"][: want["cu_seqlens_padded"].index(28) + 1]
    assert flat["cu_seqlens_padded"].tolist() == [cut]


def test_create_attention_mask_false_sends_no_mask_and_true_sends_it() -> None:
    item = megatron_item(5, 2, kind="plain", mask=True)
    plain = keywords(has_cu_seqlens=False)
    out = get_batch_on_this_tp_rank(dict(item), **plain, topology=ONLY)
    assert out["attention_mask"] is None and out["cu_seqlens"] is None and out["max_seqlen"] is None
    plain["create_attention_mask_in_dataloader"] = True
    out = get_batch_on_this_tp_rank(dict(item), **plain, topology=ONLY)
    assert torch.equal(out["attention_mask"], item["attention_mask"])
    assert out["tokens"].shape == (2, S)  # plain rows stay [b, s]


def test_mtp_on_this_rank_gives_a_middle_stage_both_ends() -> None:
    item = megatron_item(6, 2)
    out = get_batch_on_this_tp_rank(dict(item), **middle(mtp_on_this_rank=True), topology=MIDDLE)
    assert out["tokens"].tolist() == reference(item)["tokens"] and out["labels"] is not None


def test_tp_rank_is_checked_on_this_rank() -> None:
    with pytest.raises(ValueError, match=r"tp_rank=1 but global rank 0 is TP rank 0 of \(0,\)"):
        get_batch_on_this_tp_rank(dict(megatron_item(1, 2)), **keywords(tp_rank=1), topology=ONLY)


# -- Megatron-LM before PR #4103 --------------------------------------------------------------------
def test_pre_4103_layout() -> None:
    item = megatron_item(7, 2, kind="padded")
    want = reference(item)
    out = get_batch_on_this_tp_rank(iter([item]), mtp_on_this_rank=False, topology=ONLY)
    assert list(out) == ["tokens", "labels", "loss_mask", "attention_mask", "position_ids",
                         "cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size"]  # fmt: skip
    assert out["cu_seqlens"].tolist() == [want["cu_seqlens"]]  # [1, n + 1], as it asserts
    assert (
        out["cu_seqlens_padded"].tolist() == want["cu_seqlens_padded"]
    )  # 1-D, for PackedSeqParams
    assert out["max_seqlen"].tolist() == [want["max_seqlen"]] and out["local_cp_size"] is None
    with pytest.raises(StopIteration):
        get_batch_on_this_tp_rank(iter([]), False, topology=ONLY)


def test_pre_4103_refuses_hybrid_cp_batches() -> None:
    item = {**megatron_item(7, 1), "local_cp_size": torch.tensor([2])}
    with pytest.raises(ValueError, match="the batch has local_cp_size, a hybrid-CP batch"):
        get_batch_on_this_tp_rank(iter([item]), mtp_on_this_rank=False, topology=ONLY)


# -- pretrain_gpt_get_batch -------------------------------------------------------------------------
def test_pretrain_gpt_get_batch_refuses_hybrid_cp() -> None:
    args = megatron_training.sft_args(hybrid_context_parallel=True)
    with pytest.raises(ValueError, match=r"args\.hybrid_context_parallel is set: megapack cannot"):
        pretrain_gpt_get_batch(iter([]), None, args=args)


# -- Megatron-Bridge --------------------------------------------------------------------------------
def test_fold_empty_tail_worked_example() -> None:
    real = torch.tensor([[0, 3, 7, 7, 7], [0, 5, 9, 9, 9]], dtype=torch.int32)
    padded = torch.tensor([[0, 4, 8, 16, 16], [0, 6, 10, 16, 16]], dtype=torch.int32)
    got_real, got_padded = _fold_empty_tail(real, padded)
    assert got_real.tolist() == [[0, 3, 7], [0, 5, 9]]
    assert got_padded is not None and got_padded.tolist() == [[0, 4, 16], [0, 6, 16]]
    assert _fold_empty_tail(real, None) == (real, None)


def bridge_cfg(pp: int = 1) -> Any:
    return SimpleNamespace(model=SimpleNamespace(pipeline_model_parallel_size=pp),
                           dataset=SimpleNamespace(enable_offline_packing=True))  # fmt: skip


def test_bridge_rows_with_a_padding_only_tail_arrive_folded(world: Any) -> None:
    item = {"tokens": torch.arange(16)[None], "labels": torch.arange(1, 17)[None],
            "loss_mask": torch.ones(1, 16, dtype=torch.long), "position_ids": torch.arange(16)[None],
            "cu_seqlens_q": torch.tensor([[0, 3, 7, 7, 7]], dtype=torch.int32),
            "cu_seqlens_q_padded": torch.tensor([[0, 4, 8, 16, 16]], dtype=torch.int32),
            "max_seqlen_q": torch.tensor([[8]], dtype=torch.int32), "attention_mask": None,
            "padding_mask": torch.tensor([[0, 0, 0, 1, 0, 0, 0, 0] + [1] * 8], dtype=torch.bool),
            "token_count": [7]}  # fmt: skip
    item |= {"cu_seqlens_kv": item["cu_seqlens_q"], "max_seqlen_kv": item["max_seqlen_q"]}
    pg = SimpleNamespace(tp=world, pp=world, cp=None)
    out = get_batch_on_this_tp_rank(iter([item]), bridge_cfg(), False, pg_collection=pg)
    assert list(out) == ["tokens", "labels", "loss_mask", "attention_mask", "position_ids",
                         "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                         "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv", "padding_mask"]  # fmt: skip
    assert out["cu_seqlens_q"].tolist() == [0, 3, 7] and out["cu_seqlens_kv"] is out["cu_seqlens_q"]
    assert out["cu_seqlens_q_padded"].tolist() == [0, 4, 16]  # the tail joined document 2's padding
    assert out["max_seqlen_q"].tolist() == [12] and out["max_seqlen_q"].device.type == "cpu"
    assert torch.equal(out["padding_mask"], item["padding_mask"])
    assert out["loss_mask"].dtype == torch.float32 and out["loss_mask"].sum() == 16


def test_bridge_checks_the_pipeline_size_and_needs_pg_collection(world: Any) -> None:
    pg = SimpleNamespace(tp=world, pp=world, cp=None)
    with pytest.raises(ValueError) as info:
        get_batch_on_this_tp_rank(iter([]), bridge_cfg(pp=2), pg_collection=pg)
    assert str(info.value) == (
        "cfg.model.pipeline_model_parallel_size=2 but pg_collection.pp has 1 ranks: pass the "
        "model's pg_collection (get_pg_collection(model))"
    )
    with pytest.raises(ValueError, match="got topology= beside its pg_collection="):
        get_batch_on_this_tp_rank(iter([]), bridge_cfg(), topology=ONLY, pg_collection=pg)


def test_bridge_legacy_keys_map_onto_the_current_ones(world: Any) -> None:
    item = bridge_item(12, 2, legacy=True)
    want = reference(item)
    pg = SimpleNamespace(tp=world, pp=None, cp=None)
    out = get_batch_on_this_tp_rank(iter([item]), bridge_cfg(), pg_collection=pg)
    assert out["cu_seqlens_q"].tolist() == want["cu_seqlens"]
    assert out["cu_seqlens_q_padded"].tolist() == want["cu_seqlens_padded"]
    assert out["padding_mask"] is None


def test_bridge_refuses_kv_boundaries_unlike_q() -> None:
    from megapack.delivery.callers import _bridge_item

    item = bridge_item(9, 1)
    item["cu_seqlens_kv"] = item["cu_seqlens_q"] + 0
    item["cu_seqlens_kv"][0, 1] += 1
    with pytest.raises(
        ValueError, match=r"batch\['cu_seqlens_kv'\] differs from batch\['cu_seqlens_q'\]"
    ):
        _bridge_item(item, keep_mask=False)


def test_bridge_padding_mask_must_have_the_tokens_shape() -> None:
    from megapack.delivery.callers import _bridge_item

    item = bridge_item(9, 1)
    item["padding_mask"] = item["padding_mask"][:, :-1]
    with pytest.raises(
        ValueError, match=r"batch\['padding_mask'\] has shape \(1, 15\) but tokens has \(1, 16\)"
    ):
        _bridge_item(item, keep_mask=False)


def test_bridge_takes_a_packed_batch_without_a_padding_mask() -> None:
    from megapack.delivery.callers import _bridge_item

    batch = PackedBatch.from_documents([[5, 6, 7], [8, 9]], seq_len=8)
    assert _bridge_item(batch, keep_mask=False).extras["padding_mask"].numel() == 0


def test_mtp_stages_follow_megatrons_rule() -> None:
    """Without a layout MTP layers sit on the last stage; with one, where it puts "m" layers
    (with virtual chunks: stage index vp_stage * pp + pp_rank, as megatron-core parses it)."""
    from megapack.delivery.callers import _mtp_here

    def on(pp_rank: int, pp: int, vp_stage: int | None = None, vp: int | None = None) -> Topology:
        return Topology(tp_group=None, tp_ranks=(0,), tp_rank=0, pp_rank=pp_rank, pp_size=pp,
                        vp_stage=vp_stage, vp_size=vp)  # fmt: skip

    three = [on(r, 3) for r in range(3)]
    assert [_mtp_here(1, None, t) for t in three] == [False, False, True]
    assert [_mtp_here(1, "Ett|tm|tL", t) for t in three] == [False, True, False]
    assert [_mtp_here(None, "Ett|tm|tL", t) for t in three] == [False] * 3
    chunks = [on(r, 2, k, 2) for r in range(2) for k in range(2)]
    assert [_mtp_here(1, "Et|t|tm|L", t) for t in chunks] == [False, True, False, False]
