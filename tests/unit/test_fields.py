"""Trainers' own fields (issue 26): declarations, Megatron dicts and PackedBatch extras, one rank.

The RL and multimodal fields a trainer declares with `megapack.BatchField` travel like the built-in
ones: per token merged with the rows like labels, per sample and ragged whole; each stage gets
what its declaration says, bit-exact, and every bad input is an error naming field and value.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack import BatchField, PackedBatch, Topology, get_batch_on_this_tp_rank
from megapack.core.fields import Stage, schema_of
from megapack.packing import align_by_kind
from megapack.packing.align import has_rows, zero_loss

ADV = BatchField("advantages", "token", torch.float32, "last", at="label")
OLD = BatchField("old_logprobs", "token", torch.bfloat16, "last", at="label")
REWARD = BatchField("reward", "sample", torch.float64, "all")
PIXELS = BatchField("pixel_values", "ragged", torch.float16, "first")
GRID = BatchField("image_grid_thw", "ragged", torch.int64, "first")
FIELDS = (ADV, OLD, REWARD, PIXELS, GRID)
S = 8


def on_stage(pp_rank: int, pp_size: int, *, mtp: bool = False) -> Topology:
    return Topology(
        tp_group=None, tp_ranks=(0,), tp_rank=0, pp_rank=pp_rank, pp_size=pp_size, mtp=mtp
    )


def sft(sentinel: int = -1) -> dict[str, Any]:
    """Megatron SFT rows of s=8 (documents [3, 5] and [8]) with every declared field."""
    tokens = torch.arange(1, 2 * S + 1).reshape(2, S)
    gen = torch.Generator().manual_seed(0)
    return {
        "tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(2, S),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))]),
        "cu_seqlens": torch.tensor([[0, 3, 8], [0, 8, sentinel]], dtype=torch.int32),
        "advantages": torch.randn(2, S, generator=gen),
        "old_logprobs": torch.randn(2, S, generator=gen).to(torch.bfloat16),
        "reward": torch.tensor([0.25, -1.5], dtype=torch.float64),
        "pixel_values": [torch.ones(3, 4, dtype=torch.float16), torch.empty(0, 4, dtype=torch.float16)],
        "image_grid_thw": [torch.tensor([[1, 1, 3]]), torch.empty(0, 3, dtype=torch.int64)],
    }  # fmt: skip


def one(item: Any, topo: Topology, fields: tuple[BatchField, ...] = FIELDS) -> dict[str, Any]:
    return get_batch_on_this_tp_rank(iter([item]), topology=topo, fields=fields)


def test_a_declaration_is_checked() -> None:
    for name in ("1x", "class", "a-b", ""):
        with pytest.raises(ValueError, match="must be a Python identifier"):
            BatchField(name, "token", torch.float32, "last")
    with pytest.raises(
        ValueError, match=r"per='tokens'; expected one of \('token', 'sample', 'ragged'\)"
    ):
        BatchField("x", "tokens", torch.float32, "last")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"stages='loss'; expected one of \('first', 'last', 'all'\)"
    ):
        BatchField("x", "token", torch.float32, "loss")  # type: ignore[arg-type]
    for dtype in (torch.bool, torch.complex64):
        with pytest.raises(ValueError, match="expected a float or integer dtype"):
            BatchField("x", "token", dtype, "last")
    with pytest.raises(TypeError, match="dtype must be a torch\\.dtype"):
        BatchField("x", "token", "float32", "last")  # type: ignore[arg-type]


def test_a_schema_refuses_collisions_and_built_in_kinds() -> None:
    with pytest.raises(ValueError, match="'labels' collides with a built-in output") as info:
        schema_of((BatchField("labels", "token", torch.float32, "last"),))
    assert "'labels'," in str(info.value).split("(", 1)[1]  # the list of names names it
    with pytest.raises(ValueError, match="'packed_seq_params', 'position_ids'"):
        schema_of((BatchField("packed_seq_params", "sample", torch.int64, "all"),))
    with pytest.raises(ValueError, match="declares 'advantages' twice"):
        schema_of((ADV, ADV))
    with pytest.raises(ValueError, match="per='boundary' is for megapack's built-in fields"):
        schema_of((BatchField("bounds", "boundary", torch.int32, "all"),))
    with pytest.raises(
        TypeError, match=r"fields= takes megapack\.BatchField declarations, got tuple"
    ):
        schema_of((("advantages", "token"),))  # type: ignore[arg-type]
    assert schema_of(FIELDS) is schema_of(FIELDS) and schema_of(FIELDS).key != schema_of().key


@pytest.mark.parametrize("sentinel", [-1, S], ids=["sentinel-1", "sentinel-s"])
@pytest.mark.parametrize(("pp_rank", "pp_size", "stage"), [(0, 1, "only"), (0, 3, "first"),
                         (1, 3, "middle"), (2, 3, "last")])  # fmt: skip
def test_each_stage_gets_what_its_declaration_says(
    pp_rank: int, pp_size: int, stage: str, sentinel: int
) -> None:
    item = sft(sentinel)
    out = one(item, on_stage(pp_rank, pp_size))
    assert set(out) >= {f.name for f in FIELDS}
    last, first = stage in ("only", "last"), stage in ("only", "first")
    if last:  # merged into [1, b * s] exactly as labels are
        assert torch.equal(out["advantages"], item["advantages"].reshape(1, -1))
        assert out["old_logprobs"].dtype == torch.bfloat16
        assert torch.equal(
            out["old_logprobs"].view(torch.int16),
            item["old_logprobs"].reshape(1, -1).view(torch.int16),
        )
        assert out["labels"].shape == out["advantages"].shape
    else:
        assert out["advantages"] is None and out["old_logprobs"] is None
    assert out["reward"].tolist() == [0.25, -1.5] and out["reward"].dtype == torch.float64
    if first:  # ragged: one tensor in sample order
        assert out["pixel_values"].shape == (3, 4) and out["pixel_values"].dtype == torch.float16
        assert out["image_grid_thw"].tolist() == [[1, 1, 3]]
    else:
        assert out["pixel_values"] is None and out["image_grid_thw"] is None


def test_mtp_stage_gets_what_first_and_last_get() -> None:
    out = one(sft(), on_stage(2, 3, mtp=True))
    assert all(out[f.name] is not None for f in FIELDS)


def test_plain_rows_carry_declared_fields_as_they_are() -> None:
    item = {k: v for k, v in sft().items() if k != "cu_seqlens"}
    out = one(item, on_stage(0, 1))
    assert torch.equal(out["advantages"], item["advantages"]) and out["cu_seqlens"] is None


def test_a_ragged_field_may_be_one_tensor_of_all_samples_rows() -> None:
    item = sft() | {"pixel_values": torch.zeros(5, 4, dtype=torch.float16)}
    assert one(item, on_stage(0, 1))["pixel_values"].shape == (5, 4)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"junk": torch.zeros(2)}, ValueError, r"undeclared keys \['junk'\].*fields=\(megapack.BatchField\('junk'"),
        ({"advantages": None}, ValueError, r"batch is missing 'advantages', declared in fields="),
        ({"advantages": torch.zeros(2, 7)}, ValueError, r"batch\['advantages'\] has shape \(2, 7\) but tokens has \(2, 8\)"),
        ({"advantages": torch.zeros(2, 8, dtype=torch.float64)}, TypeError, r"has dtype torch.float64 but fields= declares torch.float32"),
        ({"reward": torch.zeros(3, dtype=torch.float64)}, ValueError, r"batch\['reward'\] has shape \(3,\); a per-sample field is \[b, ...\] with b=2"),
        ({"pixel_values": [torch.ones(1, 4, dtype=torch.float16)]}, ValueError, r"list of 1 tensors; a ragged field has one per sample \(b=2\)"),
        ({"pixel_values": [torch.ones(1, 4, dtype=torch.float16), torch.ones(1, 5, dtype=torch.float16)]},
         ValueError, r"pixel_values'\]\[1\] has trailing dims \(5,\) but .*\[0\] has \(4,\)"),
        ({"pixel_values": [torch.ones(1, 4), torch.ones(1, 4)]}, TypeError, r"\[0\] has dtype torch.float32 but fields= declares torch.float16"),
    ],
    ids=["undeclared", "missing", "token-shape", "dtype", "sample-count", "ragged-count", "trailing", "ragged-dtype"],
)  # fmt: skip
def test_bad_fields_are_named_and_the_next_batch_goes_on(
    change: dict, error: type, match: str
) -> None:
    bad = {k: v for k, v in (sft() | change).items() if v is not None}
    data = iter([bad, sft()])
    with pytest.raises(error, match=match):
        get_batch_on_this_tp_rank(data, topology=on_stage(0, 1), fields=FIELDS)
    assert get_batch_on_this_tp_rank(data, topology=on_stage(0, 1), fields=FIELDS)[
        "pixel_values"
    ].shape == (3, 4)


def test_packed_batch_from_documents_places_per_document_values() -> None:
    # The extras module's worked example: documents of 3 and 2 tokens in a row of 6.
    fields = (BatchField("advantages", "token", torch.float32, "last", at="label"), PIXELS, REWARD)
    docs = [{"tokens": [5, 6, 7], "advantages": [0.5, 0.5, 0.5], "pixel_values": torch.ones(2, 4, dtype=torch.float16), "reward": 1.0},
            {"tokens": [8, 9], "advantages": [-1.0, -1.0], "reward": 2.0}]  # fmt: skip
    b = PackedBatch.from_documents(docs, seq_len=6, fields=fields)
    assert b.extras["advantages"].tolist() == [[0.5, 0.5, 0.5, -1.0, -1.0, 0.0]]
    assert b.extras["pixel_values"].shape == (2, 4) and b.extras["reward"].tolist() == [1.0, 2.0]
    both = PackedBatch.concat([b, b], fields)
    assert both.extras["advantages"].shape == (1, 12) and both.extras["pixel_values"].shape == (
        4,
        4,
    )
    assert both.extras["reward"].tolist() == [1.0, 2.0, 1.0, 2.0]
    out = one(both, on_stage(0, 1), fields)
    assert torch.equal(out["advantages"], both.extras["advantages"])
    with pytest.raises(ValueError, match=r"rows hold extras .* but fields= declares \[\]"):
        PackedBatch.concat([b, b])
    with pytest.raises(
        ValueError,
        match=r"docs\[1\]\['advantages'\] has shape \(1,\); a per-token field has one value per token of the document \(2\)",
    ):
        PackedBatch.from_documents([docs[0], {**docs[1], "advantages": [1.0]}], fields=fields)
    with pytest.raises(ValueError, match=r"docs\[1\] has no 'reward', declared in fields="):
        PackedBatch.from_documents([docs[0], {"tokens": [1], "advantages": [0.0]}], fields=fields)


def test_packed_batch_extras_must_be_declared_where_delivered() -> None:
    b = PackedBatch.from_documents([{"tokens": [1, 2], "advantages": [1.0, 2.0]}], fields=(ADV,))
    with pytest.raises(
        ValueError, match=r"PackedBatch.extras has undeclared keys \['advantages'\]"
    ):
        one(b, on_stage(0, 1), ())
    with pytest.raises(
        ValueError, match=r"PackedBatch.extras has no 'old_logprobs', declared in fields="
    ):
        one(b, on_stage(0, 1), (ADV, OLD))


@settings(max_examples=30, deadline=None)
@given(kinds=st.lists(st.booleans(), min_size=1, max_size=12), ranks=st.integers(1, 4))
def test_align_by_a_ragged_field_puts_images_at_the_same_micro_step(
    kinds: list[bool], ranks: int
) -> None:
    micro = [{"tokens": torch.full((1, 2), i), "loss_mask": torch.ones(1, 2),
              "pixel_values": [torch.ones(2 if image else 0, 4)]} for i, image in enumerate(kinds)]  # fmt: skip
    dealt = align_by_kind(micro, ranks, kind="pixel_values", make_padding=zero_loss)
    for step in zip(*dealt, strict=True):
        assert len({has_rows(mb, "pixel_values") for mb in step}) == 1
    everything = [mb for rank in dealt for mb in rank]
    real = [mb for mb in everything if mb["loss_mask"].sum() > 0]
    assert sorted(int(mb["tokens"][0, 0]) for mb in real) == list(range(len(kinds)))  # once each
    assert len(everything) - len(real) < 2 * ranks  # padding: fewer than ranks per kind


def test_has_rows_reads_packed_batches_and_dicts() -> None:
    b = PackedBatch.from_documents(
        [{"tokens": [1, 2], "pixel_values": torch.ones(1, 4, dtype=torch.float16)}],
        fields=(PIXELS,),
    )
    assert has_rows(b, "pixel_values") and not has_rows(b, "other")
    assert not has_rows({"pixel_values": [torch.empty(0, 4)]}, "pixel_values")
    assert zero_loss(b).loss_mask.sum() == 0 and b.loss_mask.sum() > 0


def test_bool_is_a_mask_fields_dtype_only() -> None:
    mask = BatchField("causal", "mask", torch.bool, "all")  # as the built-in attention_mask
    assert (mask.dtype, mask.share, mask.stage_set) == (torch.bool, "queries", frozenset(Stage))
    for per in ("token", "sample", "ragged", "boundary", "scalar"):
        with pytest.raises(ValueError) as info:
            BatchField("flag", per, torch.bool, "all")  # type: ignore[arg-type]
        assert str(info.value) == (
            "BatchField 'flag': dtype=torch.bool; expected a float or integer dtype"
        )


def test_align_a_per_token_field_states_where_its_values_sit() -> None:
    """No default: a trainer's per-token field without ``at`` is an error naming the field and
    both options; ``at`` on another kind, or another value, is refused; built-ins need none."""
    with pytest.raises(ValueError, match=r"BatchField 'advantages': a per-token field needs at=: 'token' "
                                         r"when value i belongs to input token i .* or 'label' when value i "
                                         r"already pairs with labels\[i\]"):  # fmt: skip
        BatchField("advantages", "token", torch.float32, "last")
    for per in ("sample", "ragged"):
        with pytest.raises(ValueError, match=rf"BatchField 'x': at='label' is for per-token fields; a "
                                             rf"per='{per}' field has no label alignment"):  # fmt: skip
            BatchField("x", per, torch.float32, "all", at="label")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"BatchField 'x': at='labels'; expected 'token' or 'label'"
    ):
        BatchField("x", "token", torch.float32, "last", at="labels")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"BatchField 'x': at must be 'token' or 'label', got int 1"
    ):
        BatchField("x", "token", torch.float32, "last", at=1)  # type: ignore[arg-type]
    from megapack.core.fields import BUILTIN_FIELDS

    assert all(f.at is None for f in BUILTIN_FIELDS)
    assert repr(BatchField("lp", "token", torch.float32, "last", at="token")).endswith(
        "at='token')"
    )


def test_align_is_part_of_what_tp_ranks_compare() -> None:
    """Ranks that declare a field at other alignments build schemas of other keys, so they fail
    at the first call (`_agree`; the header's key), naming each rank's declarations."""
    token = schema_of((BatchField("lp", "token", torch.float32, "last", at="token"),))
    label = schema_of((BatchField("lp", "token", torch.float32, "last", at="label"),))
    assert token.key != label.key
    assert schema_of((PIXELS,)).key == schema_of((PIXELS,)).key
    plain = schema_of(())  # the built-in fields' key is what it was before `at` existed
    import hashlib

    from megapack.core.fields import BUILTIN_FIELDS

    text = ";".join(f"{f.name}:{f.per}:{f.dtype}:{f.stages}" for f in BUILTIN_FIELDS)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    assert plain.key == int.from_bytes(digest, "little") >> 1


def test_align_token_values_shift_to_the_labels_as_loss_mask_does() -> None:
    """The extras module's worked example: at="token" places value i + 1 at position i (the
    label that predicts token i + 1), 0 at each document's last position and on padding;
    at="label" as given; with per-document padding and across concatenated rows alike."""
    logp = BatchField("logp", "token", torch.float32, "last", at="token")
    adv = BatchField("advantages", "token", torch.float32, "last", at="label")
    docs = [{"tokens": [5, 6, 7], "loss_mask": [0, 1, 1], "logp": [0.1, 0.2, 0.3], "advantages": [0.5] * 3},
            {"tokens": [8, 9], "loss_mask": [0, 1], "logp": [0.4, 0.5], "advantages": [-1.0] * 2}]  # fmt: skip
    b = PackedBatch.from_documents(docs, seq_len=6, fields=(logp, adv))
    assert b.labels.tolist() == [[6, 7, 0, 9, 0, 0]]
    assert b.loss_mask.tolist() == [[1, 1, 0, 1, 0, 0]]
    assert b.extras["logp"].tolist() == [[pytest.approx(0.2), pytest.approx(0.3), 0, 0.5, 0, 0]]
    assert b.extras["advantages"].tolist() == [[0.5, 0.5, 0.5, -1.0, -1.0, 0.0]]
    padded = PackedBatch.from_documents(docs, seq_len=8, pad_to_multiple_of=4, fields=(logp, adv))
    assert padded.labels.tolist() == [[6, 7, 0, 0, 9, 0, 0, 0]]
    assert padded.extras["logp"].tolist() == [
        [pytest.approx(0.2), pytest.approx(0.3), 0, 0, 0.5, 0, 0, 0]
    ]
    tail = PackedBatch.from_documents(docs[1:], seq_len=4, fields=(logp, adv))
    both = PackedBatch.concat([b, tail], (logp, adv))
    assert both.extras["logp"][0, 6:].tolist() == [0.5, 0, 0, 0]
    one_token = PackedBatch.from_documents([{"tokens": [3], "logp": [0.7], "advantages": [1.0]}],
                                           fields=(logp, adv))  # fmt: skip
    assert one_token.extras["logp"].tolist() == [[0.0]]  # no label: nothing of it is placed


def test_align_token_field_in_a_dict_is_refused() -> None:
    """A Megatron dict's per-token fields travel as given beside its labels: a field declared
    at="token" there (megapack cannot shift it: it holds no documents' values) is refused."""
    token_old = BatchField("old_logprobs", "token", torch.bfloat16, "last", at="token")
    with pytest.raises(ValueError, match=r"batch\['old_logprobs'\] is declared at='token' .*declare "
                                         r"at='label' with values aligned to batch\['labels'\]"):  # fmt: skip
        one(sft(), on_stage(0, 1), (ADV, token_old, REWARD, PIXELS, GRID))
