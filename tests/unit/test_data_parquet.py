"""Parquet / Arrow / HF datasets readers: same documents as JSONL, column mapping, bad rows, shards."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megapack.data import (
    BadLineError,
    ByteTokenizer,
    Fields,
    read_documents,
    read_jsonl,
    read_table,
)
from megapack.data.jsonl import JsonlReader

pa = pytest.importorskip("pyarrow", reason="install megapack[test] (pyarrow) to run these")
pq = pytest.importorskip("pyarrow.parquet")

ROWS: list[dict[str, Any]] = [
    {"text": "hello parquet"},
    {"prompt": "2+2?", "completion": "4"},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    {"text": "é unicode ☃"},
]


def as_table(rows: list[dict[str, Any]]) -> Any:
    keys = list(dict.fromkeys(k for r in rows for k in r))  # from_pylist reads keys of row 0 only
    return pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows])


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text(
        "".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in rows)
    )
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]], row_group_size: int = 2) -> Path:
    pq.write_table(as_table(rows), path, row_group_size=row_group_size)
    return path


def write_arrow(path: Path, rows: list[dict[str, Any]], *, stream: bool, batch: int = 2) -> Path:
    table = as_table(rows)
    new = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
        for b in table.to_batches(max_chunksize=batch):
            writer.write_batch(b)
    return path


def write_hf_dir(path: Path, rows: list[dict[str, Any]]) -> Path:
    """What datasets.Dataset.save_to_disk writes (the real one when datasets is installed)."""
    try:
        import datasets
    except ImportError:
        path.mkdir()
        write_arrow(path / "data-00000-of-00001.arrow", rows, stream=True)
        state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}
        (path / "state.json").write_text(json.dumps(state))
        return path
    datasets.Dataset(as_table(rows)).save_to_disk(str(path))
    return path


def docs_of(reader: Any) -> list[tuple[list[int], list[float], tuple[int, ...]]]:
    return [(d.tokens.tolist(), d.loss_mask.tolist(), d.boundaries) for d in reader]


def test_parquet_arrow_and_hf_dir_give_the_jsonl_documents(tmp_path: Path) -> None:
    expected = docs_of(read_jsonl(write_jsonl(tmp_path / "d.jsonl", ROWS)))
    assert len(expected) == 4
    paths = [
        write_parquet(tmp_path / "d.parquet", ROWS),
        write_arrow(tmp_path / "d.arrow", ROWS, stream=False),
        write_arrow(tmp_path / "s.arrow", ROWS, stream=True),
        write_hf_dir(tmp_path / "hf", ROWS),
    ]
    for path in paths:
        assert docs_of(read_documents(path)) == expected, path
    (doc,) = [d for d in read_table(tmp_path / "d.parquet") if "row 2" in d.source]
    assert doc.source == f"{tmp_path / 'd.parquet'}:row 2"


def test_parquet_directory_of_files_and_dataset_dict(tmp_path: Path) -> None:
    folder = tmp_path / "parts"
    folder.mkdir()
    write_parquet(folder / "a.parquet", ROWS[:2])
    write_parquet(folder / "b.parquet", ROWS[2:])
    expected = docs_of(read_jsonl(write_jsonl(tmp_path / "d.jsonl", ROWS)))
    assert docs_of(read_documents(folder)) == expected
    dd = tmp_path / "dd"
    dd.mkdir()
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['train', 'test'\].*dd/train"):
        read_table(dd)
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        read_table(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \.parquet, \.arrow.*state.json"):
        read_table(tmp_path / "empty")


def test_parquet_column_mapping(tmp_path: Path) -> None:
    rows = [
        {"question": "2+2?", "answer": "4", "id": 1},
        {"question": "hi", "answer": "yo", "id": 2},
    ]
    path = write_parquet(tmp_path / "qa.parquet", rows)
    with pytest.raises(
        ValueError, match=r"none of the columns.*'question', 'answer', 'id'.*--prompt-field"
    ):
        read_table(path)
    fields = Fields(prompt="question", completion="answer")
    got = docs_of(read_table(path, fields=fields))
    plain = [{"prompt": r["question"], "completion": r["answer"]} for r in rows]
    assert got == docs_of(read_jsonl(write_jsonl(tmp_path / "qa.jsonl", plain)))
    chats = [{"conv": ROWS[2]["messages"]}]
    chat_path = write_parquet(tmp_path / "chat.parquet", chats)
    assert docs_of(read_table(chat_path, fields=Fields(messages="conv"))) == docs_of(
        read_jsonl(write_jsonl(tmp_path / "c.jsonl", [ROWS[2]]))
    )
    jsonl = write_jsonl(tmp_path / "body.jsonl", [{"body": "x"}])  # the JSONL reader maps too
    assert docs_of(read_jsonl(jsonl, fields=Fields(text="body"))) == [([120, 257], [1.0, 1.0], ())]


def test_parquet_bad_row_names_file_row_and_column_or_is_counted(tmp_path: Path) -> None:
    rows = [{"text": "good"}, {"text": None}, {"text": ""}, {"text": "fine"}]
    path = write_parquet(tmp_path / "bad.parquet", rows, row_group_size=3)
    with pytest.raises(BadLineError, match=r"bad.parquet:row 1: field 'text': missing"):
        list(read_table(path))
    reader = read_table(path, skip_bad=True)
    assert [d.source for d in reader] == [f"{path}:row 0", f"{path}:row 3"]
    stats = reader.stats
    assert (stats.lines, stats.documents, stats.skipped) == (4, 2, 2)
    assert dict(stats.skipped_by_problem) == {"missing": 1, "empty": 1}


@pytest.mark.parametrize("shard", [(2, 2), (-1, 2), (0, 0)])
def test_parquet_bad_shard_is_a_clear_error(tmp_path: Path, shard: tuple[int, int]) -> None:
    path = write_parquet(tmp_path / "d.parquet", ROWS)
    with pytest.raises(ValueError, match=r"shard=.*need world >= 1 and 0 <= rank < world"):
        read_table(path, shard=shard)
    with pytest.raises(TypeError, match="shard must be a"):
        read_table(path, shard=(0, "2"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value", "error", "message"),
    [
        ("workers", 0, ValueError, "workers must be an int >= 1, got 0"),
        ("workers", "2", TypeError, "workers must be an int >= 1, got str '2'"),
        ("batch_size", 1.5, TypeError, "batch_size must be an int >= 1, got float 1.5"),
        ("skip", -1, ValueError, "skip must be an int >= 0, got -1"),
        ("skip", True, TypeError, "skip must be an int >= 0, got bool True"),
    ],
)
def test_reader_options_of_the_wrong_type_or_value_are_named(
    tmp_path: Path, option: str, value: object, error: type[Exception], message: str
) -> None:
    # the reader every format shares (megapack.data.record_reader), here behind JSONL
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(error, match=re.escape(message)):
        JsonlReader(path, ByteTokenizer(), skip_bad=True, **{option: value})


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(1, 23),
    group=st.integers(1, 7),
    world=st.integers(1, 6),
    kind=st.sampled_from(["parquet", "arrow", "stream", "jsonl", "hf"]),
)
def test_parquet_sharded_reading_covers_every_row_once(
    tmp_path_factory: pytest.TempPathFactory, n: int, group: int, world: int, kind: str
) -> None:
    folder = tmp_path_factory.mktemp("shard")
    rows = [{"text": f"row {i}"} for i in range(n)]
    if kind == "parquet":
        path = write_parquet(folder / "d.parquet", rows, row_group_size=group)
    elif kind == "jsonl":
        path = write_jsonl(folder / "d.jsonl", rows)
    elif kind == "hf":
        path = write_hf_dir(folder / "hf", rows)
    else:
        path = write_arrow(folder / "d.arrow", rows, stream=kind == "stream", batch=group)
    seen: list[str] = []
    for rank in range(world):
        seen += [
            bytes(d.tokens[:-1].tolist()).decode()
            for d in read_documents(path, shard=(rank, world))
        ]
    assert sorted(seen) == sorted(r["text"] for r in rows)


def test_parquet_workers_give_the_same_documents(tmp_path: Path) -> None:
    rows = [{"text": f"document number {i}"} for i in range(40)] + [{"text": " "}]
    path = write_parquet(tmp_path / "d.parquet", rows, row_group_size=7)
    one = read_table(path, skip_bad=True)
    two = read_table(path, skip_bad=True, workers=2)
    assert docs_of(one) == docs_of(two) and one.stats == two.stats
    with pytest.raises(BadLineError, match=r"d.jsonl:41: field 'text': empty"):
        list(read_jsonl(write_jsonl(tmp_path / "d.jsonl", rows), workers=2))


def test_parquet_cli_pack_is_identical_across_formats(tmp_path: Path) -> None:
    import numpy as np

    from megapack.cli import main

    rows = [{"body": f"document {i} " * (i % 7 + 1)} for i in range(30)]
    inputs = {
        "jsonl": write_jsonl(tmp_path / "d.jsonl", rows),
        "parquet": write_parquet(tmp_path / "d.parquet", rows, row_group_size=4),
        "arrow": write_arrow(tmp_path / "d.arrow", rows, stream=False),
        "hf": write_hf_dir(tmp_path / "hf", rows),
    }
    for name, path in inputs.items():
        argv = [
            "pack",
            str(path),
            "--seq-len",
            "64",
            "--text-field",
            "body",
            "--out",
            str(tmp_path / f"o-{name}"),
        ]
        assert main(argv) == 0
    for array in ("tokens", "loss_mask", "doc_offsets", "slices", "bin_offsets"):
        ref = np.load(tmp_path / "o-jsonl" / f"{array}.npy")
        for name in inputs:
            assert np.array_equal(np.load(tmp_path / f"o-{name}" / f"{array}.npy"), ref), (
                name,
                array,
            )
    meta = json.loads((tmp_path / "o-jsonl" / "meta.json").read_text())
    assert all(json.loads((tmp_path / f"o-{n}" / "meta.json").read_text()) == meta for n in inputs)
    halves = []
    for rank in range(2):
        out = tmp_path / f"shard{rank}"
        assert main(["pack", str(inputs["parquet"]), "--seq-len", "256", "--text-field", "body",
                     "--shard", f"{rank}/2", "--out", str(out)]) == 0  # fmt: skip
        halves.append(json.loads((out / "meta.json").read_text())["documents"])
    assert sum(halves) == 30 and min(halves) > 0
    assert (
        main(
            [
                "pack",
                str(inputs["parquet"]),
                "--seq-len",
                "64",
                "--shard",
                "x",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    files=st.lists(
        st.tuples(
            st.sampled_from(["parquet", "arrow", "stream"]), st.integers(1, 9), st.integers(1, 4)
        ),
        min_size=1,
        max_size=4,
    ),
    world=st.integers(1, 4),
    bad=st.integers(0, 10**6),
)
def test_regression_table_rows_are_numbered_within_each_file(
    tmp_path_factory: pytest.TempPathFactory,
    files: list[tuple[str, int, int]],
    world: int,
    bad: int,
) -> None:
    """Issue 27 (9). A document's source and a bad row's error name ``"file:row i"``, ``i`` the
    0-based row of that file: it restarts at 0 in every file of a directory and runs on across
    the file's row groups / record batches, whatever the shard."""
    folder = tmp_path_factory.mktemp("rows")
    paths: list[Path] = []
    for j, (kind, n, group) in enumerate(files):
        rows = [{"text": f"file {j} row {i}"} for i in range(n)]
        if kind == "parquet":
            paths.append(write_parquet(folder / f"{j}.parquet", rows, row_group_size=group))
        else:
            paths.append(
                write_arrow(folder / f"{j}.arrow", rows, stream=kind == "stream", batch=group)
            )
    expected = {
        f"{p}:row {i}": f"file {j} row {i}" for j, p in enumerate(paths) for i in range(files[j][1])
    }
    got: dict[str, str] = {}
    for rank in range(world):
        for doc in read_table(folder, shard=(rank, world)):
            assert doc.source not in got
            got[doc.source] = bytes(doc.tokens[:-1].tolist()).decode()
    assert got == expected
    # one bad row, anywhere: its error names its file and its row within that file
    j = bad % len(paths)
    i = bad // len(paths) % files[j][1]
    rows = [{"text": "" if r == i else f"row {r}"} for r in range(files[j][1])]
    kind, _, group = files[j]
    if kind == "parquet":
        write_parquet(paths[j], rows, row_group_size=group)
    else:
        write_arrow(paths[j], rows, stream=kind == "stream", batch=group)
    with pytest.raises(BadLineError) as error:
        list(read_table(folder))
    assert error.value.where == f"{paths[j]}:row {i}"
    reader = read_table(folder, skip_bad=True)
    assert sum(1 for _ in reader) == len(expected) - 1
    assert reader.stats.first_errors[0].startswith(f"{paths[j]}:row {i}: field 'text': empty")
