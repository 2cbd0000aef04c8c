"""`read_indexed`: documents from a megatron-core indexed dataset (a ``.bin``/``.idx`` pair).

The format (``megatron/core/datasets/indexed_dataset.py``, written by ``IndexedDatasetBuilder`` and
``tools/preprocess_data.py``): the ``.bin`` file is every token back to back in one dtype (uint16
for small vocabularies, int32 otherwise); the ``.idx`` file starts with the magic
``b"MMIDIDX\\x00\\x00"``, version 1 and the dtype code, then per *sequence* a length and a byte
pointer, then ``document_indices``: sequence numbers where each *document* starts (``[0, ..., S]``).
Usually one sequence is one document; with ``--split-sentences`` each sentence is a sequence.

Each megatron document becomes one `Document` (loss on every token, source ``"prefix[d]"``) whose
boundaries are the starts of its sequences, so `split_document` cuts long documents between
sentences when it can. Example: a document of sequences ``[5, 6, 7]`` and ``[8, 9]`` becomes
``tokens [5, 6, 7, 8, 9]``, ``boundaries (3,)``. Documents with no tokens are skipped.

Reading goes through megatron-core's own ``IndexedDataset`` (memory-mapped, so only the documents
read are paged in), imported on first use because importing megatron-core takes ~3-5 s. Before that,
this module checks what megatron would only ``assert`` (removed under ``python -O``): both files
exist, the header, the version, an integer dtype, and that the ``.bin`` is long enough.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from megapack.data.document import Document

MAGIC = b"MMIDIDX\x00\x00"
# megatron-core's DType codes; 6 (float64) and 7 (float32) cannot hold token ids.
TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def read_indexed(path_prefix: str | os.PathLike[str]) -> Iterator[Document]:
    """Documents of a megatron-core indexed dataset, in order.

    Args:
        path_prefix: the common prefix of ``<prefix>.bin`` and ``<prefix>.idx``; a path ending in
            ``.bin`` or ``.idx`` is accepted too.

    Returns:
        An iterator of Documents (int64 tokens, loss mask all ones, boundaries at sequence starts).
        The files are checked and opened here; documents are read as the iterator advances.

    Raises:
        FileNotFoundError: ``.bin`` or ``.idx`` is missing.
        ValueError: the ``.idx`` header or version is wrong, or the ``.bin`` is truncated.
        TypeError: the dataset stores floats, not token ids.

    Example:
        >>> docs = list(read_indexed("corpus_text_document"))  # doctest: +SKIP
        >>> docs[0].source, docs[0].tokens[:3].tolist()  # doctest: +SKIP
        ('corpus_text_document[0]', [464, 2068, 7586])
    """
    prefix = str(path_prefix)
    if prefix.endswith((".bin", ".idx")):
        prefix = prefix[:-4]
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    missing = [str(p) for p in (idx, bin_) if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"megatron indexed dataset {prefix!r}: missing {' and '.join(missing)}; give the prefix "
            "shared by the .bin and .idx files (e.g. 'corpus_text_document')"
        )
    itemsize = _check_header(idx)
    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():  # lazy: importing megatron takes ~3-5 s
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix, multimodal=False, mmap=True)
    _check_sizes(dataset, bin_, itemsize)
    return _documents(dataset, prefix)


def _check_header(idx: Path) -> int:
    """Validate the ``.idx`` header; return the token itemsize."""
    with idx.open("rb") as f:
        head = f.read(len(MAGIC) + 9)
    if len(head) < len(MAGIC) + 9 or head[: len(MAGIC)] != MAGIC:
        raise ValueError(
            f"{idx}: not a megatron-core index file (starts with {head[: len(MAGIC)]!r}, expected "
            f"{MAGIC!r}); build it with megatron's tools/preprocess_data.py or IndexedDatasetBuilder"
        )
    (version,) = struct.unpack("<Q", head[len(MAGIC) : len(MAGIC) + 8])
    if version != 1:
        raise ValueError(f"{idx}: index version {version}; only version 1 is supported")
    code = head[-1]
    if code not in TOKEN_DTYPES:
        raise TypeError(
            f"{idx}: dtype code {code} is not an integer token dtype (integer codes: "
            f"{sorted(TOKEN_DTYPES)}); this dataset does not hold token ids"
        )
    return int(np.dtype(TOKEN_DTYPES[code]).itemsize)


def _check_sizes(dataset: Any, bin_: Path, itemsize: int) -> None:
    lengths = dataset.index.sequence_lengths
    doc_idx = dataset.document_indices
    if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != len(lengths):
        raise ValueError(
            f"{bin_.with_suffix('.idx')}: document_indices run from {doc_idx[:1].tolist()} to "
            f"{doc_idx[-1:].tolist()} but there are {len(lengths)} sequences; the index is corrupt"
        )
    if len(lengths):
        need = int(dataset.index.sequence_pointers[-1]) + int(lengths[-1]) * itemsize
        have = bin_.stat().st_size
        if need > have:
            raise ValueError(
                f"{bin_}: {have} bytes but the index needs {need}; the .bin is truncated or "
                "belongs to another .idx (rebuild the pair together)"
            )


def _documents(dataset: Any, prefix: str) -> Iterator[Document]:
    doc_idx = dataset.document_indices
    lengths = dataset.index.sequence_lengths
    for d in range(len(doc_idx) - 1):
        first, last = int(doc_idx[d]), int(doc_idx[d + 1])
        if last <= first:
            continue
        counts = np.asarray(lengths[first:last], dtype=np.int64)
        total = int(counts.sum())
        if total == 0:
            continue
        tokens = dataset.get(first, 0, total) if last - first > 1 else dataset.get(first)
        starts = np.cumsum(counts)[:-1]
        yield Document(
            tokens=np.asarray(tokens, dtype=np.int64),
            loss_mask=np.ones(total, dtype=np.float32),
            boundaries=tuple(sorted({int(s) for s in starts if 0 < s < total})),
            source=f"{prefix}[{d}]",
        )
