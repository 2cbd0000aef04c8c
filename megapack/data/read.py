"""`read_documents`: one entry point that picks the reader from the file suffix.

    suffix                          reader            options
    .jsonl, .json (+ .gz)           `read_jsonl`       format, skip_bad, append_eos, chat_template,
                                                      fields, shard, workers
    .parquet, .arrow, .feather,     `read_table`       the same as read_jsonl
      .ipc, or a directory (HF datasets save_to_disk, or .parquet/.arrow files)
    .bin, .idx, or a bare prefix    `read_indexed`     (none)
    .npy, .npz                      `read_numpy`       eos_id
    an in-memory array or list      `documents_from_array` / `documents_from_arrays`

``.json`` is read as JSON lines too (one object per line), as most "JSON" training sets are. A
bare prefix (``corpus_text_document``) is an indexed dataset when ``<prefix>.idx`` exists. Options
are checked against the chosen reader, so a typo or an option for another format is a TypeError
naming it, not silently ignored. Only JSONL and tables need a tokenizer (default `ByteTokenizer`); the others
hold token ids already and ignore it.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from megapack.data.arrays import documents_from_array, documents_from_arrays, read_numpy
from megapack.data.document import Document
from megapack.data.indexed import read_indexed
from megapack.data.jsonl import read_jsonl
from megapack.data.tables import TABLE_SUFFIXES, read_table
from megapack.data.tokenizers import Tokenizer

SUFFIXES = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".bin": "indexed",
    ".idx": "indexed",
    ".npy": "numpy",
    ".npz": "numpy",
    **dict.fromkeys(TABLE_SUFFIXES, "table"),
}


def read_documents(
    path_or_source: str | os.PathLike[str] | np.ndarray | list[Any] | tuple[Any, ...],
    tokenizer: Tokenizer | None = None,
    **options: Any,
) -> Iterator[Document]:
    """Documents from a file (chosen by suffix) or an in-memory array; see the module table.

    Args:
        path_or_source: a path, or a numpy array (options ``offsets``, ``loss_mask``,
            ``eos_id``, ``source``), or a list/tuple of 1-D token arrays (option ``source``, a
            label for messages).
        tokenizer: for JSONL files; default `ByteTokenizer()`.
        **options: passed to the chosen reader.

    Returns:
        A one-pass iterator of Documents (for JSONL, the `JsonlReader`, whose ``.stats`` count skipped
        lines): it reads the source once, as it is consumed. To use the documents twice (two
        PackedDatasets, a count then a pack), call ``read_documents`` again or keep
        ``list(read_documents(...))``.

    Raises:
        ValueError: an unknown suffix.
        TypeError: an option the chosen reader does not take.

    Example:
        >>> docs = read_documents("sft.jsonl", skip_bad=True)  # doctest: +SKIP
        >>> docs = read_documents(np.array([5, 6, 7, 8]), offsets=[0, 3, 4])
        >>> [d.tokens.tolist() for d in docs]
        [[5, 6, 7], [8]]
    """
    if isinstance(path_or_source, np.ndarray):
        return _call(documents_from_array, "array", path_or_source, options)
    if isinstance(path_or_source, list | tuple):
        return _call(documents_from_arrays, "list of arrays", path_or_source, options)
    path = Path(path_or_source)
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes[-1:] == [".gz"]:
        suffixes = suffixes[:-1]
    kind = SUFFIXES.get(suffixes[-1]) if suffixes else None
    if kind is None and Path(str(path) + ".idx").is_file():
        kind = "indexed"
    if kind is None and path.is_dir():
        kind = "table"
    if kind == "jsonl":
        return _call(read_jsonl, "JSONL", path, options, tokenizer=tokenizer)
    if kind == "table" and path.suffix.lower() != ".gz":
        return _call(read_table, "Parquet/Arrow", path, options, tokenizer=tokenizer)
    if kind == "indexed":
        return _call(read_indexed, "megatron indexed", path, options)
    if kind == "numpy" and path.suffix.lower() != ".gz":
        return _call(read_numpy, "numpy", path, options)
    raise ValueError(
        f"{path}: cannot tell the format from the suffix {''.join(path.suffixes) or '(none)'!r}; "
        "read_documents reads .jsonl/.json (JSON lines, optionally .gz), .parquet/.arrow/.feather/"
        ".ipc or a datasets directory (tables), .bin/.idx or a prefix (megatron-core indexed "
        "dataset), .npy/.npz (token arrays). Rename the file or call read_jsonl / read_table / "
        "read_indexed / read_numpy directly"
    )


def _call(
    reader: Callable[..., Iterator[Document]],
    what: str,
    source: Any,
    options: dict[str, Any],
    **fixed: Any,
) -> Iterator[Document]:
    accepted = [
        name
        for name, p in inspect.signature(reader).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        name = getattr(getattr(reader, "__self__", None), "OPENER", reader.__name__)
        raise TypeError(
            f"{source if not isinstance(source, np.ndarray | list | tuple) else what}: option "
            f"{unknown[0]!r} does not apply to {what} data; {name} takes "
            f"{', '.join(accepted) or 'no options'}"
        )
    return reader(source, **fixed, **options)
