"""PackedBatch: worked examples, Megatron SFT merging, validation errors, and a randomized reference check."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from megapack import BatchField, PackedBatch
from megapack.core.rows import merge_rows


def test_worked_example_lengths_3_2_4() -> None:
    b = PackedBatch.from_documents([[5, 6, 7], [8, 9], [1, 2, 3, 4]], pad_token_id=0)
    assert b.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens.dim() == 1
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert b.tokens.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    # No position is trained to predict another document's first token.
    assert b.labels.tolist() == [[6, 7, 0, 9, 0, 2, 3, 4, 0]]
    assert b.loss_mask.tolist() == [[1, 1, 0, 1, 0, 1, 1, 1, 0]]
    assert b.max_seqlen == 4 and type(b.max_seqlen) is int
    assert b.cu_seqlens_padded is None
    assert (b.tokens.dtype, b.labels.dtype, b.position_ids.dtype) == (torch.int64,) * 3
    assert b.loss_mask.dtype == torch.float32


def test_seq_len_padding_is_its_own_segment() -> None:
    b = PackedBatch.from_documents([[5, 6, 7], [8, 9]], seq_len=8, pad_token_id=-1)
    assert b.cu_seqlens.tolist() == [0, 3, 5, 8]
    assert b.tokens.tolist() == [[5, 6, 7, 8, 9, -1, -1, -1]]
    assert b.loss_mask.tolist() == [[1, 1, 0, 1, 0, 0, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert b.max_seqlen == 3


def test_pad_to_multiple_sets_cu_seqlens_padded() -> None:
    b = PackedBatch.from_documents([[5, 6, 7], [8, 9], [1, 2, 3, 4]], pad_to_multiple_of=4)
    assert b.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert b.cu_seqlens_padded is not None
    assert b.cu_seqlens_padded.tolist() == [0, 4, 8, 12]
    assert b.tokens.tolist() == [[5, 6, 7, 0, 8, 9, 0, 0, 1, 2, 3, 4]]
    assert b.loss_mask.tolist() == [[1, 1, 0, 0, 1, 0, 0, 0, 1, 1, 1, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]]
    assert b.max_seqlen == 4


def test_pad_to_multiple_with_seq_len_extends_last_segment() -> None:
    b = PackedBatch.from_documents([[5, 6, 7], [8, 9]], pad_to_multiple_of=4, seq_len=12)
    assert b.cu_seqlens_padded is not None
    assert b.cu_seqlens_padded.tolist() == [0, 4, 12]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert b.max_seqlen == 8


def test_document_loss_mask_marks_learned_tokens() -> None:
    # Prompt [5, 6] is not learned, completion [7, 8] is: positions predicting 7 and 8 are trained.
    b = PackedBatch.from_documents([{"tokens": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}, [1, 2]])
    assert b.labels.tolist() == [[6, 7, 8, 0, 2, 0]]
    assert b.loss_mask.tolist() == [[0, 1, 1, 0, 1, 0]]


def test_from_documents_takes_data_documents_as_read_documents_yields_them() -> None:
    from megapack.data import Document, read_documents

    prompt = Document(tokens=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1], source="a.jsonl:1")
    b = PackedBatch.from_documents([prompt, [1, 2]])
    assert b.labels.tolist() == [[6, 7, 8, 0, 2, 0]]
    assert b.loss_mask.tolist() == [[0, 1, 1, 0, 1, 0]]  # the Document's mask is kept
    docs = list(read_documents(np.array([5, 6, 7, 8, 9]), offsets=[0, 3, 5]))
    b = PackedBatch.from_documents(docs, seq_len=8)
    assert b.cu_seqlens.tolist() == [0, 3, 5, 8] and b.tokens.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]


@pytest.mark.parametrize(
    ("docs", "kwargs", "match"),
    [
        ([], {}, "docs is empty"),
        (
            [5, 6],
            {},
            r"docs\[0\] must be a non-empty 1-D token sequence .* got int 5 with token shape \(\)",
        ),
        (["hello"], {}, r"docs\[0\] is a str \('hello'\); expected token ids: tokenize text first"),
        ([[1, 2], []], {}, r"docs\[1\] must be a non-empty"),
        ([[1.5, 2.0]], {}, r"docs\[0\] tokens must be integers"),
        ([{"text": "x"}], {}, r"docs\[0\] is a dict without 'tokens'"),
        (
            [{"tokens": [1, 2, 3], "loss_mask": [1, 1]}],
            {},
            r"docs\[0\] loss_mask has 2 entries .* 3 tokens",
        ),
        ([[1, 2, 3], [4, 5]], {"seq_len": 4}, "need 5 tokens .* seq_len=4"),
        ([[1, 2, 3]], {"pad_to_multiple_of": 4, "seq_len": 3}, "need 4 tokens"),
        ([[1, 2, 3]], {"pad_to_multiple_of": 0}, "pad_to_multiple_of must be an int >= 1, got 0"),
        ([[1, 2, 3]], {"seq_len": 0}, "seq_len must be an int >= 1, got 0"),
        ([[1, 2, 3]], {"seq_len": 8.0}, "seq_len must be an int >= 1, got float 8.0"),
    ],
)
def test_from_documents_rejects_bad_input(docs: list, kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        PackedBatch.from_documents(docs, **kwargs)


def sft_dict(rows: list[list[int]], s: int, sentinel: str = "-1") -> dict[str, torch.Tensor]:
    """A Megatron SFT-style batch: one row of documents per sample, cu_seqlens padded by ``sentinel``."""
    packed = [
        PackedBatch.from_documents([list(range(10, 10 + n)) for n in lens], seq_len=s)
        for lens in rows
    ]
    k = max(len(p.cu_seqlens) for p in packed) + 1
    cu = torch.full((len(rows), k), -1 if sentinel == "-1" else s, dtype=torch.int32)
    for i, p in enumerate(packed):
        cu[i, : len(p.cu_seqlens)] = p.cu_seqlens
    return {
        "tokens": torch.cat([p.tokens for p in packed]),
        "labels": torch.cat([p.labels for p in packed]),
        "loss_mask": torch.cat([p.loss_mask for p in packed]),
        "position_ids": torch.cat([p.position_ids for p in packed]),
        "cu_seqlens": cu,
    }


@pytest.mark.parametrize("sentinel", ["-1", "s"])
def test_megatron_rows_merge_into_thd(sentinel: str) -> None:
    batch = sft_dict([[3, 5], [2, 2, 4], [8]], s=8, sentinel=sentinel)
    b = merge_rows(batch)
    assert b.cu_seqlens.tolist() == [0, 3, 8, 10, 12, 16, 24]
    assert b.tokens.shape == (1, 24)
    assert torch.equal(b.tokens, batch["tokens"].reshape(1, -1))
    assert torch.equal(b.labels, batch["labels"].reshape(1, -1))
    assert b.max_seqlen == 8


def test_megatron_rows_with_trailing_padding_segment() -> None:
    b = merge_rows(sft_dict([[3], [2, 1]], s=6))
    assert b.cu_seqlens.tolist() == [0, 3, 6, 8, 9, 12]


def test_megatron_one_dim_cu_seqlens_for_single_row_and_max_seqlen_tensor() -> None:
    batch = sft_dict([[3, 5]], s=8)
    batch["cu_seqlens"] = torch.tensor([0, 3, 8], dtype=torch.int32)
    batch["max_seqlen"] = torch.tensor([[6]], dtype=torch.int32)
    b = merge_rows(batch)
    assert b.cu_seqlens.tolist() == [0, 3, 8]
    assert b.max_seqlen == 6 and type(b.max_seqlen) is int


@pytest.mark.parametrize(
    ("cu", "match"),
    [
        (
            [[0, 3, 8, -1], [0, 5, 2, 8]],
            r"row 1 is not strictly increasing: 2 follows 5 at index 2",
        ),
        ([[0, 3, 8, -1], [0, 3, 9, -1]], r"row 1 has boundary 9 past the sequence length s=8"),
        (
            [[0, 3, 8, -1], [0, 3, 7, -1]],
            r"row 1 never reaches the sequence length s=8 \(last boundary 7",
        ),
        ([[0, 3, 8, -1], [1, 3, 8, -1]], r"row 1 must start with 0"),
        ([[0, 3, 8, 5], [0, 3, 8, -1]], r"row 0 has 5 after reaching s=8"),
        ([[0, 3, 8, -1]], r"cu_seqlens has shape \(1, 4\); expected \[b, k\] with b=2"),
    ],
)
def test_megatron_bad_cu_seqlens_named_with_row(cu: list[list[int]], match: str) -> None:
    batch = sft_dict([[3, 5], [3, 5]], s=8)
    batch["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        merge_rows(batch)


def test_megatron_shape_and_dtype_errors_name_the_field() -> None:
    batch = sft_dict([[3, 5]], s=8)
    with pytest.raises(
        ValueError, match=r"batch\['labels'\] has shape \(1, 7\) but tokens has \(1, 8\)"
    ):
        merge_rows({**batch, "labels": batch["labels"][:, :7]})
    with pytest.raises(TypeError, match=r"batch\['tokens'\] has dtype torch.float32"):
        merge_rows({**batch, "tokens": batch["tokens"].float()})
    with pytest.raises(ValueError, match=r"batch is missing 'position_ids'"):
        merge_rows({k: v for k, v in batch.items() if k != "position_ids"})
    with pytest.raises(
        ValueError, match=r"max_seqlen=4 is below the longest document \(5 tokens\)"
    ):
        merge_rows({**batch, "max_seqlen": 4})


def test_validate_names_field_and_value() -> None:
    good = PackedBatch.from_documents([[5, 6, 7], [8, 9]])
    cases = {
        "cu_seqlens is not strictly increasing: 2 follows 3 at index 2": {
            "cu_seqlens": torch.tensor([0, 3, 2, 5], dtype=torch.int32)
        },
        r"cu_seqlens ends at 4 but the buffer has T=5": {
            "cu_seqlens": torch.tensor([0, 3, 4], dtype=torch.int32)
        },
        r"cu_seqlens has dtype torch.int64; expected torch.int32": {
            "cu_seqlens": torch.tensor([0, 3, 5])
        },
        r"cu_seqlens has shape \(1, 3\); expected 1-D": {
            "cu_seqlens": torch.tensor([[0, 3, 5]], dtype=torch.int32)
        },
        r"labels has shape \(1, 4\) but tokens has \(1, 5\)": {"labels": good.labels[:, :4]},
        r"tokens has shape \(5,\); THD batches are \[1, T\]": {"tokens": good.tokens[0]},
        r"loss_mask has dtype torch.int64; expected torch.float32": {
            "loss_mask": good.loss_mask.long()
        },
        r"max_seqlen must be a Python int, got Tensor": {"max_seqlen": torch.tensor(3)},
        r"max_seqlen=2 is below the longest segment \(3\)": {"max_seqlen": 2},
        r"cu_seqlens_padded segment 0 holds 2 positions but document 0 has 3 tokens": {
            "cu_seqlens_padded": torch.tensor([0, 2, 5], dtype=torch.int32)
        },
    }
    for match, change in cases.items():
        with pytest.raises((ValueError, TypeError), match=match):
            dataclasses.replace(good, **change).validate()


class _Tagged(torch.Tensor):
    """A tensor subclass, as tensor-wrapping libraries hand out."""


@pytest.mark.parametrize("name", ["tokens", "labels", "position_ids", "loss_mask"])
def test_validate_names_every_grid_field_it_refuses(name: str) -> None:
    good = PackedBatch.from_documents([[5, 6, 7], [8, 9]])
    value = getattr(good, name)
    wrong = torch.float64 if name == "loss_mask" else torch.int32
    cases = {
        rf"PackedBatch.{name} must be a torch.Tensor, got list": value.tolist(),
        rf"PackedBatch.{name} has dtype torch.{str(wrong)[6:]}": value.to(wrong),
        rf"PackedBatch.{name} has shape \(2, 5\); THD batches are \[1, T\]": value.repeat(2, 1),
    }
    if name != "tokens":
        cases[rf"PackedBatch.{name} has shape \(1, 4\) but tokens has \(1, 5\)"] = value[:, :4]
    for match, bad in cases.items():
        with pytest.raises((ValueError, TypeError), match=match):
            dataclasses.replace(good, **{name: bad}).validate()
    tagged = dataclasses.replace(good, **{name: value.as_subclass(_Tagged)})
    assert tagged.validate() is tagged  # a subclass is a tensor: the careful path accepts it


def reference_pack(docs: list[list[int]], pad: int) -> dict[str, list[int]]:
    """Straightforward per-token construction used as the reference for from_documents."""
    out: dict[str, list[int]] = {"tokens": [], "labels": [], "mask": [], "pos": [], "cu": [0]}
    for doc in docs:
        for j, tok in enumerate(doc):
            last = j == len(doc) - 1
            out["tokens"].append(tok)
            out["labels"].append(pad if last else doc[j + 1])
            out["mask"].append(0 if last else 1)
            out["pos"].append(j)
        out["cu"].append(out["cu"][-1] + len(doc))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_from_documents_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    docs = [
        rng.integers(1, 50_000, size=int(rng.integers(1, 40))).tolist()
        for _ in range(int(rng.integers(1, 12)))
    ]
    b = PackedBatch.from_documents(docs, pad_token_id=7)
    ref = reference_pack(docs, pad=7)
    assert b.tokens[0].tolist() == ref["tokens"]
    assert b.labels[0].tolist() == ref["labels"]
    assert b.loss_mask[0].tolist() == ref["mask"]
    assert b.position_ids[0].tolist() == ref["pos"]
    assert b.cu_seqlens.tolist() == ref["cu"]
    assert b.max_seqlen == max(len(d) for d in docs)


def test_to_packed_seq_params_is_thd_with_int_maxima() -> None:
    b = PackedBatch.from_documents([[5, 6, 7], [8, 9]], pad_to_multiple_of=2)
    p = b.to_packed_seq_params()
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q is b.cu_seqlens and p.cu_seqlens_kv is b.cu_seqlens
    assert p.cu_seqlens_q_padded is b.cu_seqlens_padded
    assert p.max_seqlen_q == 4 and type(p.max_seqlen_q) is int and p.max_seqlen_kv == 4


# ---------------------------------------------------------------- refusals in full, devices, concat


def refusal(batch: PackedBatch, error: type = ValueError) -> str:
    with pytest.raises(error) as info:
        batch.validate()
    return str(info.value)


def i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


GOOD = PackedBatch.from_documents([[5, 6, 7], [8, 9]])  # T = 5, cu_seqlens [0, 3, 5]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cu_seqlens": i32([0, 3, 4])}, "PackedBatch.cu_seqlens ends at 4 but the buffer has T=5 "
         "tokens; cover trailing padding with a final segment or give cu_seqlens_padded"),
        ({"cu_seqlens": i32([1, 3, 5])}, "PackedBatch.cu_seqlens must start at 0 and hold >= 2 entries, got [1, 3, 5]"),
        ({"cu_seqlens": i32([0])}, "PackedBatch.cu_seqlens must start at 0 and hold >= 2 entries, got [0]"),
        ({"cu_seqlens": i32(list(range(1, 11)))},
         "PackedBatch.cu_seqlens must start at 0 and hold >= 2 entries, got [1, 2, 3, 4, 5, 6, 7, 8]"),
        ({"cu_seqlens": i32([0, 1, 1, 5])}, "PackedBatch.cu_seqlens is not strictly increasing: 1 follows 1 at index 2"
         " (only trailing entries may repeat the final offset: zero-length documents that pad a static shape)"),
        ({"cu_seqlens_padded": i32([0, 4])}, "PackedBatch.cu_seqlens_padded has 2 entries but cu_seqlens has 3"),
        ({"cu_seqlens_padded": i32([1, 4, 5])},
         "PackedBatch.cu_seqlens_padded must start at 0 and hold >= 2 entries, got [1, 4, 5]"),
        ({"cu_seqlens": i32([0, 1, 3, 5]), "cu_seqlens_padded": i32([0, 2, 4, 6])},
         "PackedBatch.cu_seqlens_padded ends at 6 but the buffer has T=5 tokens"),
        ({"cu_seqlens": i32([0, 2, 4, 5]), "cu_seqlens_padded": i32([0, 3, 4, 5])},
         "PackedBatch.cu_seqlens_padded segment 1 holds 1 positions but document 1 has 2 tokens"),
    ],
    ids=["ends-short", "not-from-0", "one-entry", "first-8-entries", "repeat", "padded-count",
         "padded-not-from-0", "padded-end", "padded-segment"],
)  # fmt: skip
def test_boundary_refusals_in_full(change: dict, message: str) -> None:
    assert refusal(dataclasses.replace(GOOD, **change)) == message


def test_boundaries_that_are_not_a_tensor_are_refused_in_full() -> None:
    assert refusal(dataclasses.replace(GOOD, cu_seqlens=[0, 3, 5]), TypeError) == (
        "PackedBatch.cu_seqlens must be a torch.Tensor, got list"
    )


def test_an_empty_row_is_refused_and_a_row_of_one_token_is_a_batch() -> None:
    empty = torch.zeros(1, 0, dtype=torch.int64)
    bare = dataclasses.replace(GOOD, tokens=empty, labels=empty, position_ids=empty,
                               loss_mask=torch.zeros(1, 0))  # fmt: skip
    assert refusal(bare) == "PackedBatch.tokens is empty (T == 0)"
    one = PackedBatch.from_documents([[7]])
    assert one.num_tokens == 1 and one.cu_seqlens.tolist() == [0, 1] and one.max_seqlen == 1


@pytest.mark.parametrize("shape", [(2, 5), (1, 1, 5), (5, 1)], ids=str)
def test_grid_fields_that_agree_on_a_shape_other_than_1_by_t_are_refused(
    shape: tuple[int, ...],
) -> None:
    # All four fields share the shape, so only the [1, T] rule can refuse them.
    t = shape[-1]
    ids = torch.arange(math.prod(shape)).reshape(shape)
    bad = dataclasses.replace(GOOD, tokens=ids, labels=ids, position_ids=ids,
                              loss_mask=torch.ones(shape), cu_seqlens=i32([0, t]))  # fmt: skip
    assert refusal(bad) == (
        f"PackedBatch.tokens has shape {shape}; THD batches are [1, T] (concatenate micro-batch "
        "rows into one)"
    )


class _OnCuda(torch.Tensor):
    """A CPU tensor that reports being on cuda:0, as a field left on the GPU would."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)

    def get_device(self) -> int:  # type: ignore[override]
        return 0


@pytest.mark.parametrize(
    "names", [("labels", "position_ids"), ("position_ids",), ("loss_mask",)], ids="+".join
)
def test_grid_fields_on_another_device_than_tokens_are_refused(names: tuple[str, ...]) -> None:
    moved = {n: getattr(GOOD, n).as_subclass(_OnCuda) for n in names}
    assert refusal(dataclasses.replace(GOOD, **moved)) == (
        f"PackedBatch.{names[0]} is on cuda:0 but tokens is on cpu"
    )


class _CudaBoundaries(_OnCuda):
    """Boundaries on cuda:0: numpy() fails as it does on a GPU; cpu() is the one host copy."""

    def numpy(self, *args: object, **kwargs: object) -> np.ndarray:  # type: ignore[override]
        raise TypeError("can't convert cuda:0 device type tensor to numpy")

    def cpu(self, *args: object, **kwargs: object) -> torch.Tensor:  # type: ignore[override]
        return self.as_subclass(torch.Tensor)


def test_boundaries_on_a_gpu_are_checked_through_one_host_copy() -> None:
    b = dataclasses.replace(GOOD, cu_seqlens=GOOD.cu_seqlens.as_subclass(_CudaBoundaries))
    assert b.validate() is b
    bad = dataclasses.replace(b, cu_seqlens=i32([0, 3, 3, 5]).as_subclass(_CudaBoundaries))
    assert (
        refusal(bad) == "PackedBatch.cu_seqlens is not strictly increasing: 3 follows 3 at index 2"
        " (only trailing entries may repeat the final offset: zero-length documents that pad a static shape)"
    )


def test_concat_of_padded_rows_offsets_both_boundaries_row_by_row() -> None:
    # Rows: real [3, 2] in buffers [4, 4]; real [2] in [4]; real [1] in [2].
    rows = [PackedBatch.from_documents(d, pad_to_multiple_of=m)
            for d, m in (([[1, 2, 3], [4, 5]], 4), ([[6, 7]], 4), ([[8]], 2))]  # fmt: skip
    b = PackedBatch.concat(rows)
    assert b.cu_seqlens.tolist() == [0, 3, 5, 7, 8]
    assert b.cu_seqlens_padded is not None
    assert b.cu_seqlens_padded.tolist() == [0, 4, 8, 12, 14]
    assert b.tokens.tolist() == [[1, 2, 3, 0, 4, 5, 0, 0, 6, 7, 0, 0, 8, 0]]
    assert b.max_seqlen == 4


def test_concat_of_three_unpadded_rows_and_of_one_row() -> None:
    rows = [PackedBatch.from_documents(d) for d in ([[1, 2, 3], [4]], [[5, 6]], [[7], [8, 9]])]
    b = PackedBatch.concat(rows)
    assert b.cu_seqlens.tolist() == [0, 3, 4, 6, 7, 9] and b.cu_seqlens_padded is None
    alone = PackedBatch.concat(rows[:1])
    assert alone.cu_seqlens.tolist() == [0, 3, 4] and torch.equal(alone.tokens, rows[0].tokens)


def test_concat_refusals_in_full() -> None:
    with pytest.raises(ValueError) as info:
        PackedBatch.concat([])
    assert str(info.value) == "PackedBatch.concat needs at least one row"
    padded = PackedBatch.from_documents([[1, 2, 3]], pad_to_multiple_of=2)
    with pytest.raises(ValueError) as info:
        PackedBatch.concat([GOOD, padded])
    assert str(info.value) == (
        "PackedBatch.concat: some rows have cu_seqlens_padded and some do not"
    )
    adv = PackedBatch.from_documents([{"tokens": [1, 2], "adv": [0.5, 1.0]}],
                                     fields=(BatchField("adv", "token", torch.float32, "last", at="label"),))  # fmt: skip
    with pytest.raises(ValueError) as info:
        PackedBatch.concat([adv, adv])
    assert str(info.value) == (
        "PackedBatch.concat: rows hold extras ['adv'] but fields= declares []: every row must "
        "hold every declared field and no other (its declaration says how to join it)"
    )


def test_from_documents_refusals_in_full() -> None:
    with pytest.raises(ValueError) as info:
        PackedBatch.from_documents([])
    assert str(info.value) == "docs is empty: a PackedBatch needs at least one document"
    with pytest.raises(TypeError) as info:
        PackedBatch.from_documents(["hello"])
    assert str(info.value) == (
        "docs[0] is a str ('hello'); expected token ids: tokenize text first, e.g. with "
        "megapack.data.read_documents or a Tokenizer"
    )
    with pytest.raises(ValueError) as info:
        PackedBatch.from_documents([{"tokens": [1, 2, 3], "loss_mask": 1}])
    assert str(info.value) == "docs[0] loss_mask has 0 entries but the document has 3 tokens"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("a" * 38, "'" + "a" * 38 + "'"),  # a repr of 40 characters is shown whole
        ("a" * 39, "'" + "a" * 36 + "..."),  # 41: cut to 37 and "..."
        ("a" * 60, "'" + "a" * 36 + "..."),
    ],
    ids=["40", "41", "62"],
)
def test_a_text_document_is_previewed_in_at_most_40_characters(text: str, shown: str) -> None:
    with pytest.raises(TypeError) as info:
        PackedBatch.from_documents([[1], text])
    assert str(info.value).startswith(f"docs[1] is a str ({shown}); expected token ids")


def test_an_object_with_tokens_but_no_loss_mask_is_not_a_data_document() -> None:
    class Holder:
        tokens = (1, 2, 3)

    with pytest.raises(ValueError, match=r"docs\[0\] must be a non-empty 1-D token sequence"):
        PackedBatch.from_documents([Holder()])


def test_a_numpy_pad_id_still_gives_int64_tokens_and_labels() -> None:
    b = PackedBatch.from_documents([[5, 6, 7]], seq_len=5, pad_token_id=np.int32(2))
    assert b.tokens.dtype == b.labels.dtype == torch.int64
    assert b.tokens.tolist() == [[5, 6, 7, 2, 2]] and b.labels.tolist() == [[6, 7, 2, 2, 2]]


def test_a_valid_batch_passes_the_one_pass_check_without_the_field_by_field_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # validate runs on every transfer: a batch that keeps the contract must not pay for the walk
    # that names the broken field (it only runs when the one-pass check fails).
    def walk(self: PackedBatch) -> None:
        raise AssertionError("the field-by-field walk ran on a valid batch")

    monkeypatch.setattr(PackedBatch, "_check_grid", walk)
    for b in (GOOD, PackedBatch.from_documents([[1, 2, 3]], pad_to_multiple_of=4, seq_len=8)):
        assert b.validate() is b
    with pytest.raises(AssertionError, match="walk ran"):
        dataclasses.replace(GOOD, labels=GOOD.labels[:, :4]).validate()
