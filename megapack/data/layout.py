"""`check_layout` and `plan_layout`: the row layout `PackedDataset` and `PackWriter` both write.

One implementation for both, so the in-memory dataset and the streamed ``megapack pack`` cannot
drift apart (same arrays, same ``meta.json``):

* `check_layout` validates ``seq_len`` against the padding multiple, lcm(pad_to_multiple_of,
  2 * cp_size) (`megapack.core.cp_pad.cp_pad_multiple`), and the long-document policy;
* `write_layout` and `read_layout` store the arrays (``name.npy``, memory-mapped back) and
  ``meta.json``, written last: a directory with ``meta.json`` is finished; ``meta.json`` holds
  the contents' fingerprint (`megapack.data.fingerprint`), which `read_layout` checks against
  the arrays (and computes, saying so, for a directory packed before it was recorded), and the
  tokenizer's name, vocabulary size and eos id where the packer knew them (None otherwise);
* `plan_layout` plans rows from the documents' lengths alone, on their *aligned* lengths
  (``ceil(len / multiple) * multiple``, so alignment padding never overflows a row), and returns
  the ``doc_offsets``, ``slices`` (doc, start, stop; padding holds no tokens) and ``bin_offsets``
  arrays with the directory's meta.

Worked example: lengths ``[3, 5]``, seq_len 8, multiple 2: aligned ``[4, 6]`` -> two rows;
``doc_offsets [0, 3, 8]``, ``slices [[1, 0, 5], [0, 0, 3]]`` (order as the plan gives it),
``padding_tokens`` 2, efficiency 8 / 16.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from megapack.core.checks import check_int
from megapack.data.fingerprint import fingerprint
from megapack.packing.names import LONG_DOC_POLICIES

log = logging.getLogger(__name__)  # library code logs; the CLI prints

FORMAT_VERSION = 1
"""Version of the packed directory (``meta.json``'s "version")."""


def check_layout(seq_len: int, pad_to_multiple_of: int, cp_size: int, long_docs: str) -> int:
    """Validate the settings; returns the padding multiple (lcm with 2 * cp_size).

    Raises:
        ValueError: a non-positive setting, ``seq_len`` not a multiple of the padding multiple, or
            an unknown ``long_docs``, each naming the argument and the value.
    """
    from megapack.core.cp_pad import cp_pad_multiple

    for name, value in (
        ("seq_len", seq_len),
        ("pad_to_multiple_of", pad_to_multiple_of),
        ("cp_size", cp_size),
    ):
        check_int(name, value, minimum=1)
    multiple = cp_pad_multiple(cp_size, pad_to_multiple_of)
    if seq_len % multiple:
        why = (
            f"pad_to_multiple_of={multiple}"
            if cp_size == 1
            else f"{multiple} (pad_to_multiple_of={pad_to_multiple_of}, cp_size={cp_size}: "
            "lcm(pad_to_multiple_of, 2 * cp_size))"
        )
        raise ValueError(f"seq_len={seq_len} must be a multiple of {why}")
    if long_docs not in LONG_DOC_POLICIES:
        raise ValueError(f"long_docs={long_docs!r}; choose one of {LONG_DOC_POLICIES}")
    return multiple


def plan_layout(
    lengths: np.ndarray,
    seq_len: int,
    *,
    multiple: int,
    cp_size: int,
    algorithm: str,
    long_docs: str,
    seed: int,
    pad_token_id: int,
    max_documents: int | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Plan rows for documents of ``lengths`` (already split when ``long_docs="split"``), at most
    ``max_documents`` a row when given (static shapes: `megapack.core.static`).

    Returns:
        ``({"doc_offsets", "slices", "bin_offsets"}, meta)``; see the module docstring.

    Raises:
        ValueError: no documents, or a long document the policy refuses.
    """
    from megapack.packing import plan

    if len(lengths) == 0:
        raise ValueError("documents is empty: nothing to pack")
    lengths = np.asarray(lengths, dtype=np.int64)
    aligned = -(-lengths // multiple) * multiple
    packing = plan(
        aligned,
        seq_len,
        algorithm=algorithm,
        seed=seed,
        max_documents=max_documents,
        long_docs="error" if long_docs == "split" else long_docs,
    )
    slices = np.array(packing.slices, dtype=np.int64).reshape(-1, 3)  # in aligned units
    slices[:, 2] = np.minimum(slices[:, 2], lengths[slices[:, 0]])  # padding holds no tokens
    real_tokens = int((slices[:, 2] - slices[:, 1]).clip(min=0).sum())
    arrays = {
        "doc_offsets": np.concatenate([[0], np.cumsum(lengths)]),
        "slices": slices,
        "bin_offsets": np.array(packing.bin_offsets, dtype=np.int64),
    }
    meta: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "seq_len": seq_len,
        "pad_to_multiple_of": multiple,
        "algorithm": algorithm,
        "long_docs": long_docs,
        "seed": seed,
        "documents": len(lengths),
        "cp_size": cp_size,
        "rows": packing.num_bins,
        "lower_bound": packing.lower_bound,
        "efficiency": real_tokens
        / max(packing.num_bins * seq_len, 1),  # alignment padding is waste
        "padding_tokens": packing.packed_tokens - real_tokens,
        "truncated_tokens": packing.truncated_tokens,
        "dropped_tokens": packing.dropped_tokens,
        "pad_token_id": pad_token_id,
        "truncated_documents": packing.num_truncated_docs,
        "dropped_documents": packing.num_dropped_docs,
        "max_documents": max_documents,
        "tokenizer": None,  # what tokenized the documents, where the packer knows it
        "vocab_size": None,
        "eos_id": None,
    }
    log.info(
        "planned %d documents into %d rows of %d tokens (%.2f%% efficiency; %d truncated, %d dropped)",
        len(lengths),
        packing.num_bins,
        seq_len,
        100 * meta["efficiency"],
        packing.num_truncated_docs,
        packing.num_dropped_docs,
    )
    return arrays, meta


ARRAY_NAMES = ("tokens", "loss_mask", "doc_offsets", "slices", "bin_offsets")
"""The arrays of every packed directory; ``origins`` (each stored document's input document) is
written since split documents are tracked and read where present."""


def write_layout(directory: str | Path, arrays: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Save ``arrays`` as ``directory/<name>.npy``, then ``meta.json`` (last: it marks the
    directory finished)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        np.save(out / f"{name}.npy", np.asarray(array))
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_layout(directory: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, memory-mapped arrays) of a directory `write_layout` or ``megapack pack`` wrote.

    The contents' fingerprint is taken again and compared with the recorded one; a directory
    packed before fingerprints were recorded gets it computed here (logged).

    Raises:
        FileNotFoundError: no ``meta.json`` (not a finished pack).
        ValueError: another format version, naming both; arrays whose fingerprint is not the
            recorded one (changed after packing), naming both.
    """
    path = Path(directory)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(
            f"{meta_file} not found: is {path} a directory written by `megapack pack`?"
        )
    meta = json.loads(meta_file.read_text())
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{meta_file}: format version {meta.get('version')!r}, this megapack reads {FORMAT_VERSION}"
        )
    names = ARRAY_NAMES + (("origins",) if (path / "origins.npy").is_file() else ())
    arrays = {name: np.load(path / f"{name}.npy", mmap_mode="r") for name in names}
    found = fingerprint(arrays)
    recorded = meta.get("fingerprint")
    if recorded is None:
        log.info(
            "%s records no fingerprint (packed by an earlier megapack): computed it from the "
            "arrays, %s",
            meta_file,
            found,
        )
        meta["fingerprint"] = found
    elif recorded != found:
        raise ValueError(
            f"{meta_file}: the arrays' fingerprint is {found}, meta.json records {recorded}: "
            f"the files of {path} changed after they were packed; pack it again"
        )
    return meta, arrays
