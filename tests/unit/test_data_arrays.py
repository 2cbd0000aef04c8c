"""Token arrays: offsets, eos splitting, lists of arrays, .npy/.npz files, and every contract error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megapack.data import (
    documents_from_array,
    documents_from_arrays,
    documents_from_eos,
    documents_from_offsets,
    read_numpy,
)

TOKENS = np.array([5, 6, 7, 8, 9], dtype=np.int32)


def tokens_of(docs: Any) -> list[list[int]]:
    return [d.tokens.tolist() for d in docs]


def test_worked_examples() -> None:
    docs = list(documents_from_offsets(TOKENS, [0, 3, 5], source="t"))
    assert tokens_of(docs) == [[5, 6, 7], [8, 9]]
    assert [d.source for d in docs] == ["t[0]", "t[1]"]
    assert all(d.tokens.dtype == np.int64 and d.loss_mask.tolist() == [1] * len(d) for d in docs)
    assert tokens_of(documents_from_eos(TOKENS, eos_id=7)) == [[5, 6, 7], [8, 9]]
    assert tokens_of(documents_from_arrays([[5, 6, 7], np.array([8, 9], np.uint8)])) == [
        [5, 6, 7],
        [8, 9],
    ]


def test_offsets_with_loss_mask_and_copies() -> None:
    tokens = TOKENS.astype(np.int64)
    docs = list(documents_from_offsets(tokens, np.array([0, 2, 5]), loss_mask=[0, 1, 0, 1, 1]))
    assert [d.loss_mask.tolist() for d in docs] == [[0, 1], [0, 1, 1]]
    tokens[0] = 99  # documents own their tokens
    assert docs[0].tokens.tolist() == [5, 6]


def test_eos_splitting_keeps_every_token() -> None:
    assert tokens_of(documents_from_eos([7, 5, 7, 7, 8], eos_id=7)) == [[7], [5, 7], [7], [8]]
    assert tokens_of(documents_from_eos([5, 6], eos_id=7)) == [[5, 6]]
    assert tokens_of(documents_from_eos(np.array([], dtype=np.int64), eos_id=7)) == []
    with pytest.raises(ValueError, match="eos_id must be an int >= 0, got -1"):
        documents_from_eos(TOKENS, eos_id=-1)


OFFSET_ERRORS: list[tuple[Any, Any, type[Exception], str]] = [
    (TOKENS.astype(np.float32), [0, 5], TypeError, "t: tokens has dtype float32; token ids need"),
    (TOKENS.astype(bool), [0, 5], TypeError, "tokens has dtype bool"),
    (TOKENS.reshape(1, 5), [0, 5], ValueError, r"shape \(1, 5\); expected a 1-D"),
    ([5, -2, 7], [0, 3], ValueError, r"t: tokens\[1\] is -2; token ids must be >= 0"),
    (TOKENS, [0.0, 5.0], TypeError, "offsets must be a 1-D integer array, got dtype float64"),
    (TOKENS, [1, 5], ValueError, r"offsets\[0\] is \[1\]; offsets start at 0"),
    (TOKENS, np.array([], dtype=np.int64), ValueError, r"offsets\[0\] is missing"),
    (TOKENS, [0, 3, 2, 5], ValueError, r"offsets\[2\] is 2 after 3; offsets must be strictly"),
    (TOKENS, [0, 3, 3, 5], ValueError, r"offsets\[2\] is 3 after 3; .* drop the repeat"),
    (TOKENS, [0, 3, 6, 9], ValueError, r"offsets\[2\] is 6, past the end of tokens \(length 5\)"),
    (
        TOKENS,
        [0, 3],
        ValueError,
        "offsets end at 3 but tokens has 5; the last 2 tokens would be lost",
    ),
]


@pytest.mark.parametrize(("tokens", "offsets", "error", "pattern"), OFFSET_ERRORS)
def test_offset_errors_name_index_and_value(
    tokens: Any, offsets: Any, error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        documents_from_offsets(tokens, np.asarray(offsets), source="t")  # raised before iterating


def test_other_contract_errors() -> None:
    with pytest.raises(ValueError, match=r"loss_mask has shape \(2,\) but tokens has \(5,\)"):
        documents_from_offsets(TOKENS, [0, 5], loss_mask=[1, 1])
    with pytest.raises(TypeError, match=r"arrays\[1\] has dtype float64"):
        list(documents_from_arrays([[1, 2], [1.5]]))
    with pytest.raises(ValueError, match=r"arrays\[0\]: empty array"):
        list(documents_from_arrays([np.array([], dtype=np.int32)]))
    with pytest.raises(
        ValueError, match=r"cannot tell where documents end in an array of shape \(5,\)"
    ):
        documents_from_array(TOKENS)


def test_documents_from_array_dispatch() -> None:
    assert tokens_of(documents_from_array(TOKENS.reshape(1, 5))) == [[5, 6, 7, 8, 9]]
    assert tokens_of(documents_from_array(TOKENS, offsets=[0, 1, 5])) == [[5], [6, 7, 8, 9]]
    assert tokens_of(documents_from_array(TOKENS, eos_id=6)) == [[5, 6], [7, 8, 9]]


def test_npy_files(tmp_path: Path) -> None:
    stream = tmp_path / "stream.npy"
    np.save(stream, np.array([1, 2, 0, 3, 0], dtype=np.uint16))
    docs = list(read_numpy(stream, eos_id=0))
    assert tokens_of(docs) == [[1, 2, 0], [3, 0]]
    assert [d.source for d in docs] == ["stream.npy[0]", "stream.npy[1]"]
    with pytest.raises(ValueError, match=r"stream.npy: cannot tell where documents end .* eos_id="):
        read_numpy(stream)
    rows = tmp_path / "rows.npy"
    np.save(rows, np.arange(6, dtype=np.int32).reshape(2, 3))
    assert tokens_of(read_numpy(rows)) == [[0, 1, 2], [3, 4, 5]]
    floats = tmp_path / "floats.npy"
    np.save(floats, np.ones((2, 3)))
    with pytest.raises(TypeError, match=r"floats.npy\[0\] has dtype float64"):
        list(read_numpy(floats))


def test_npz_files(tmp_path: Path) -> None:
    packed = tmp_path / "packed.npz"
    np.savez(
        packed, tokens=TOKENS, offsets=np.array([0, 2, 5]), loss_mask=np.array([0, 1, 0, 0, 1])
    )
    docs = list(read_numpy(packed))
    assert tokens_of(docs) == [[5, 6], [7, 8, 9]]
    assert [d.loss_mask.tolist() for d in docs] == [[0, 1], [0, 0, 1]]
    stream = tmp_path / "stream.npz"
    np.savez(stream, tokens=TOKENS)
    assert tokens_of(read_numpy(stream, eos_id=8)) == [[5, 6, 7, 8], [9]]
    listed = tmp_path / "listed.npz"
    np.savez(
        listed,
        *[np.array(a) for a in ([3], [4, 5], [6], [7], [8], [9], [10], [11], [12], [13], [14])],
    )
    assert tokens_of(read_numpy(listed)) == [[3], [4, 5], *[[v] for v in range(6, 15)]]
    bad = tmp_path / "bad.npz"
    np.savez(bad, tokens=TOKENS, offsets=np.array([0, 4]))
    with pytest.raises(ValueError, match=r"bad\.npz: offsets end at 4 but tokens has 5"):
        read_numpy(bad)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.npy: no such file"):
        read_numpy(tmp_path / "nope.npy")
    objects = tmp_path / "objects.npz"
    np.savez(objects, np.array([np.array([1]), np.array([1, 2])], dtype=object))
    with pytest.raises(
        ValueError, match=r"objects.npz: holds Python objects .* np.savez\(path, \*arrays\)"
    ):
        list(read_numpy(objects))
    text = tmp_path / "data.txt"
    text.write_text("1 2 3")
    with pytest.raises(ValueError, match=r"reads .npy or .npz files, not '.txt'"):
        read_numpy(text)


def test_default_sources_and_the_dispatch_message() -> None:
    assert [d.source for d in documents_from_array(TOKENS, offsets=[0, 2, 5])] == [
        "array[0]", "array[1]",
    ]  # fmt: skip
    assert [d.source for d in documents_from_offsets(TOKENS, [0, 5])] == ["array[0]"]
    assert [d.source for d in documents_from_eos(TOKENS, eos_id=6)] == ["array[0]", "array[1]"]
    assert [d.source for d in documents_from_arrays([[1], [2, 3]])] == ["arrays[0]", "arrays[1]"]
    with pytest.raises(TypeError, match=r"^array: tokens has dtype float64; token ids need"):
        documents_from_eos(np.ones(3), eos_id=1)
    hint = (
        r"; give a 1-D array with offsets=\[0, \.\.\., len\] or eos_id=\.\.\. \(megapack CLI: "
        r"--eos-id\), or a 2-D array with one row per document$"
    )
    with pytest.raises(ValueError, match=r"^array: cannot tell where documents end in an array "
                       rf"of shape \(5,\) \(offsets not given, eos_id=None\){hint}"):  # fmt: skip
        documents_from_array(TOKENS)
    with pytest.raises(ValueError, match=rf"shape \(1, 5\) \(offsets given, eos_id=None\){hint}"):
        documents_from_array(TOKENS.reshape(1, 5), offsets=[0, 5])


@pytest.mark.parametrize(
    ("tokens", "offsets", "message"),
    [
        (TOKENS, [0, 1, 1], r"offsets\[2\] is 1 after 1; offsets must be strictly increasing "
         r"\(an empty document has no tokens to train on: drop the repeat\)"),
        (TOKENS, [0, 2, 9], r"offsets\[2\] is 9, past the end of tokens \(length 5\)"),
        (TOKENS, [0, 5, 9], r"offsets\[2\] is 9, past the end of tokens \(length 5\)"),
        (TOKENS, [0, 2, 3], r"offsets end at 3 but tokens has 5; the last 2 tokens would be lost "
         r"\(append 5 to offsets\)"),
        (TOKENS, [1, 5], r"offsets\[0\] is \[1\]; offsets start at 0 \(cu_seqlens style: \[0, "
         r"len0, len0 \+ len1, \.\.\.\]\)"),
        ([0, 5, -3], [0, 3], r"tokens\[2\] is -3; token ids must be >= 0"),
    ],
)  # fmt: skip
def test_offset_errors_whole_messages(tokens: Any, offsets: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=f"^t: {message}$"):
        documents_from_offsets(tokens, offsets, source="t")


def test_loss_mask_shape_message() -> None:
    with pytest.raises(
        ValueError,
        match=r"^array: loss_mask has shape \(2,\) but tokens has \(5,\); give one value per token$",
    ):
        documents_from_offsets(TOKENS, [0, 5], loss_mask=[1, 1])


def test_object_arrays_are_refused_in_every_layout(tmp_path: Path) -> None:
    """Python objects need pickle to load; every layout refuses them naming the file, numpy's
    reason and the fix, instead of running pickled code."""
    ragged = np.array([np.array([1]), np.array([1, 2])], dtype=object)
    files = {"objects.npy": lambda p: np.save(p, ragged, allow_pickle=True),
             "tokens.npz": lambda p: np.savez(p, tokens=ragged, offsets=np.array([0, 2])),
             "listed.npz": lambda p: np.savez(p, np.array([3, 4]), ragged)}  # fmt: skip
    reasons = {
        "objects.npy": r"Array can't be memory-mapped: Python objects in dtype\.",  # .npy: mmap
        "tokens.npz": r"Object arrays cannot be loaded when allow_pickle=False",
        "listed.npz": r"Object arrays cannot be loaded when allow_pickle=False",
    }
    for name, write in files.items():
        write(tmp_path / name)
        with pytest.raises(
            ValueError,
            match=rf"^{tmp_path / name}: holds Python objects \({reasons[name]}\); save plain "
            r"integer arrays instead, e\.g\. np\.savez\(path, \*arrays\)$",
        ):
            list(read_numpy(tmp_path / name))
    np.savez(tmp_path / "plain.npz", np.array([3, 4]), np.array([5]))
    assert [d.source for d in read_numpy(tmp_path / "plain.npz")] == [
        "plain.npz[0]",
        "plain.npz[1]",
    ]
