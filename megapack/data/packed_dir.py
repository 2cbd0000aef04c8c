"""A packed directory: what `PackedDataset.save` and ``megapack pack`` write and `load` reads.

One implementation for both writers, so the in-memory dataset and the streamed ``megapack pack``
cannot drift apart (same arrays, same ``meta.json``):

* `plan_packed_dir` plans rows from the documents' lengths alone (`megapack.packing.plan` with the
  `PackOptions`: every document padded to the options' ``multiple``, so alignment padding never
  overflows a row) and returns the ``doc_offsets``, ``slices`` (doc, start, stop; padding holds no
  tokens) and ``bin_offsets`` arrays with the directory's meta;
* `write_packed_dir` and `read_packed_dir` store the arrays (``name.npy``, memory-mapped back) and
  ``meta.json``, written last: a directory with ``meta.json`` is finished. ``meta.json`` records
  how the rows were packed (``"packing"``: the `PackOptions`, read back by `read_packed_dir`), what
  came out (rows, efficiency, what the long-document policy lost), the contents' fingerprint
  (`megapack.data.fingerprint`), which `read_packed_dir` checks against the arrays (and computes,
  saying so, for a directory packed before it was recorded), and the tokenizer's name, vocabulary
  size and eos id where the packer knew them (None otherwise).

Worked example: lengths ``[3, 5]``, seq_len 8, pad_to_multiple_of 2: padded ``[4, 6]`` -> two rows;
``doc_offsets [0, 3, 8]``, ``slices [[1, 0, 5], [0, 0, 3]]`` (order as the plan gives it),
``padding_tokens`` 2, efficiency 8 / 16.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from megapack.data.fingerprint import fingerprint
from megapack.packing.options import PackOptions

log = logging.getLogger(__name__)  # library code logs; the CLI prints


class NothingToPack(ValueError):
    """No documents at all to plan (an empty input, or every record skipped)."""


FORMAT_VERSION = 2
"""Version of the packed directory (``meta.json``'s "version"; 2: the `PackOptions` under
"packing")."""


def plan_packed_dir(
    lengths: np.ndarray, packing: PackOptions, *, pad_token_id: int
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Plan rows for documents of ``lengths`` (with ``long_docs="split"``, already split where
    long: every length at most ``seq_len``).

    Returns:
        ``({"doc_offsets", "slices", "bin_offsets"}, meta)``; see the module docstring.

    Raises:
        NothingToPack: no documents (a ValueError).
        ValueError: a long document the policy refuses.
    """
    from dataclasses import replace

    from megapack.packing import plan

    if len(lengths) == 0:
        raise NothingToPack("documents is empty: nothing to pack")
    lengths = np.asarray(lengths, dtype=np.int64)
    # "split": the caller split long documents already (at message boundaries); one left over is
    # an error, not a second split that `split_documents` and the origins would not count
    policy = "error" if packing.long_docs == "split" else packing.long_docs
    packed = plan(lengths, replace(packing, long_docs=policy))
    arrays = {
        "doc_offsets": np.concatenate([[0], np.cumsum(lengths)]),
        "slices": np.array(packed.slices, dtype=np.int64).reshape(-1, 3),
        "bin_offsets": np.array(packed.bin_offsets, dtype=np.int64),
    }
    meta: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "packing": packing.to_dict(),
        "documents": len(lengths),
        "rows": packed.num_bins,
        "lower_bound": packed.lower_bound,
        "efficiency": packed.efficiency,  # real tokens: alignment padding is waste
        "padding_tokens": packed.padding_tokens,
        "truncated_tokens": packed.truncated_tokens,
        "dropped_tokens": packed.dropped_tokens,
        "pad_token_id": pad_token_id,
        "truncated_documents": packed.num_truncated_docs,
        "dropped_documents": packed.num_dropped_docs,
        "tokenizer": None,  # what tokenized the documents, where the packer knows it
        "vocab_size": None,
        "eos_id": None,
    }
    log.info(
        "planned %d documents into %d rows of %d tokens (%.2f%% efficiency; %d truncated, %d dropped)",
        len(lengths),
        packed.num_bins,
        packing.seq_len,
        100 * meta["efficiency"],
        packed.num_truncated_docs,
        packed.num_dropped_docs,
    )
    return arrays, meta


ARRAY_NAMES = ("tokens", "loss_mask", "doc_offsets", "slices", "bin_offsets")
"""The arrays of every packed directory; ``origins`` (each stored document's input document) is
written since split documents are tracked and read where present."""


def write_packed_dir(directory: str | Path, arrays: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Save ``arrays`` as ``directory/<name>.npy``, then ``meta.json`` (last: it marks the
    directory finished)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        np.save(out / f"{name}.npy", np.asarray(array))
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_packed_dir(
    directory: str | Path,
) -> tuple[PackOptions, dict[str, Any], dict[str, np.ndarray]]:
    """(how it was packed, meta, memory-mapped arrays) of a directory `write_packed_dir` or
    ``megapack pack`` wrote.

    The contents' fingerprint is taken again and compared with the recorded one; a directory
    packed before fingerprints were recorded gets it computed here (logged).

    Raises:
        FileNotFoundError: no ``meta.json`` (not a finished pack).
        ValueError: another format version, naming both; recorded packing options that are not
            `PackOptions`'s; arrays whose fingerprint is not the recorded one (changed after
            packing), naming both.
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
            f"{meta_file}: format version {meta.get('version')!r}, this megapack reads "
            f"{FORMAT_VERSION}: pack it again"
        )
    packing = PackOptions.from_dict(meta.get("packing"), where=f'{meta_file}\'s "packing"')
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
    return packing, meta, arrays
