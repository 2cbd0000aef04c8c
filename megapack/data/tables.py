"""`read_table`: documents from Parquet, Arrow IPC and Hugging Face ``save_to_disk`` datasets.

Each row is one record, its columns the keys of `megapack.data.records` (``text``; ``prompt`` +
``completion``; ``messages`` as a list of ``{role, content}`` structs, and ``tools``), renamed with
``fields=Fields(text="body", ...)`` (``--text-field`` etc. on the CLI). Rows become documents exactly
as JSONL lines do, so the same content gives the same tokens in every format.

    input                                         read as
    file.parquet                                  Parquet, by row group
    file.arrow / .feather / .ipc                  Arrow IPC, file or stream format, by record batch
    a datasets ``save_to_disk`` directory         its ``state.json`` data files (Arrow IPC streams)
    a directory of .parquet / .arrow files        every file, in name order

Hugging Face datasets are read with pyarrow directly (``pip install pyarrow``; the ``datasets``
package is not needed): ``Dataset.save_to_disk`` writes Arrow IPC streams listed in ``state.json``,
and ``load_dataset("parquet" | "json", data_files=...)`` reads local files this module (or
`read_jsonl`) reads as they are. A ``DatasetDict`` directory is refused with its split names (pass
``dir/train``).

Streaming: one record batch (or row group) is decoded at a time, only the mapped columns; Arrow
files are memory-mapped. Sharding: the units (row groups / record batches over all files, in order)
go round-robin to the ``world`` ranks, unit ``k`` to rank ``k % world``, when there are at least
``world`` of them; otherwise rows do, row ``i`` to rank ``i % world``. Either way the shares are
disjoint and cover every row once. Rows are named ``"path:row i"`` (0-based within the file). A null cell counts as an absent key, so
one table can mix formats (a ``text`` column null where ``messages`` is set).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megapack.data.record_reader import RawRow, RecordReader
from megapack.data.records import DEFAULT_FIELDS, Fields

TABLE_SUFFIXES = (".parquet", ".arrow", ".feather", ".ipc")


class TableReader(RecordReader):
    """A single-pass iterator of Documents over Parquet / Arrow files; open it with `read_table`."""

    OPENER = "read_table"

    @classmethod
    def _locate(cls, path: Path, fields: Fields) -> list[Path]:
        """The data files (module table), each with a mapped column; needs pyarrow."""
        try:
            import pyarrow  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "reading Parquet / Arrow needs pyarrow: pip install pyarrow "
                "(or pip install 'megapack[arrow]')"
            ) from e
        files = table_files(path)
        _check_columns(files, fields)
        return files

    @property
    def files(self) -> list[Path]:
        """The data files, in reading order."""
        files: list[Path] = self.source
        return files

    @property
    def columns(self) -> tuple[str, ...]:
        """The mapped columns (`Fields`), the only ones decoded."""
        fields: Fields = self._options.get("fields", DEFAULT_FIELDS)
        return (fields.text, fields.prompt, fields.completion, fields.messages, fields.tools)

    def _file_units(self, file: Path) -> Iterator[tuple[int, Any]]:
        """``(rows, decode)`` per row group / record batch of ``file``; ``decode()`` gives its table."""
        if file.suffix.lower() == ".parquet":
            source = _parquet(file)
            present = [c for c in self.columns if c in source.schema_arrow.names]
            meta = source.metadata
            for g in range(meta.num_row_groups):
                yield (
                    meta.row_group(g).num_rows,
                    lambda g=g: source.read_row_group(g, columns=present),
                )
            return
        for batch in _ipc_batches(file):
            present = [c for c in self.columns if c in batch.schema.names]
            yield batch.num_rows, lambda batch=batch, present=present: batch.select(present)

    def _rows(self) -> Iterator[RawRow]:
        rank, world = self.shard
        by_unit = sum(1 for file in self.files for _ in self._file_units(file)) >= world
        unit = row = 0  # over all files: units seen, rows seen (for row-level sharding)
        for file in self.files:
            first = 0  # first row of the unit within its file
            for rows, decode in self._file_units(file):
                mine = unit % world == rank if by_unit else (rank - row) % world < rows
                if mine:
                    for i, record in enumerate(decode().to_pylist()):
                        if by_unit or (row + i) % world == rank:  # nulls: absent (mixed formats)
                            present = {k: v for k, v in record.items() if v is not None}
                            yield RawRow(f"{file}:row {first + i}", present)
                unit, row, first = unit + 1, row + rows, first + rows


read_table = TableReader.open
"""``read_table(path, tokenizer=None, *, format, skip_bad, append_eos, chat_template, fields,
shard, workers, skip)``: documents from a Parquet / Arrow file or dataset directory (module table);
the options are `RecordReader.open`'s. Raises ImportError without pyarrow, FileNotFoundError for no
such path or a directory with no data files, and ValueError for a ``DatasetDict`` directory or
files with no mapped column (naming the columns there and the flags that map them).

Example: ``docs = read_table("train.parquet", fields=Fields(text="body"))``.
"""


def table_files(path: Path) -> list[Path]:
    """The data files of a table path: itself, a datasets directory's files, or a folder's."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(
            f"{path} is a datasets DatasetDict with splits {splits}: pass one split's "
            f"directory, e.g. {path / (splits[0] if splits else 'train')}"
        )
    state = path / "state.json"
    if state.is_file():
        names = [f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
        return [path / n for n in names]
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in TABLE_SUFFIXES)
    if not files:
        raise FileNotFoundError(
            f"{path}: no {', '.join(TABLE_SUFFIXES)} files and no datasets state.json in it"
        )
    return files


def _check_columns(files: list[Path], fields: Fields) -> None:
    wanted = (fields.text, fields.prompt, fields.completion, fields.messages)
    for file in files:
        names = _schema_names(file)
        if not any(c in names for c in wanted):
            raise ValueError(
                f"{file}: none of the columns {list(wanted)} is there; its columns are {names}. "
                "Map yours with --text-field / --prompt-field / --completion-field / "
                "--messages-field (fields=Fields(...))"
            )


def _schema_names(file: Path) -> list[str]:
    if file.suffix.lower() == ".parquet":
        return list(_parquet(file).schema_arrow.names)
    return list(_ipc_reader(file).schema.names)


def _parquet(file: Path) -> Any:
    import pyarrow.parquet as pq

    return pq.ParquetFile(file, memory_map=True)


def _ipc_reader(file: Path) -> Any:
    """An Arrow IPC reader of the file format (random access) or the stream format (HF)."""
    import pyarrow as pa

    source = pa.memory_map(str(file))
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(pa.memory_map(str(file)))


def _ipc_batches(file: Path) -> Iterator[Any]:
    reader = _ipc_reader(file)
    if hasattr(reader, "num_record_batches"):
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)
