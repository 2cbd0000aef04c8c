"""A packed dataset's identity: a fingerprint over its contents, cheap enough to take at every load.

Two packed directories with the same rows and seed can hold different documents (another input,
another tokenizer, a re-pack): a checkpoint of one would resume on the other without an error,
training on other data. The fingerprint tells them apart. It hashes (BLAKE2b, 128 bits):

* in full, the arrays that say what every row holds: the documents' offsets (so every document's
  length), the rows' slices and the rows' offsets (8 to 24 bytes a document);
* a sample of the tokens and of the loss mask: ``SAMPLES`` windows of ``WINDOW`` tokens, evenly
  spaced from the first token to the last (every token when there are at most
  ``SAMPLES * WINDOW``), so its cost does not grow with the tokens.

So any change of a document's length, of the packing, or of the sampled tokens changes it; a
change confined to unsampled tokens of documents of unchanged lengths does not (the price of not
reading every token). Measured on a 2-core AMD EPYC CPU (2026-11-27, files in the page cache):
1M tokens in 10,000 documents, 0.65 ms; 100M tokens in 200,000 documents (24,411 rows of 4,096),
memory-mapped, 22 ms, mostly hashing the 6.6 MB of offsets and slices. `megapack pack` and
`PackedDataset` record it in ``meta.json``; `PackedDataset.load` takes it again and compares.

Example:
    >>> arrays = {"tokens": np.arange(5), "loss_mask": np.ones(5, np.float32),
    ...           "doc_offsets": np.array([0, 3, 5]), "slices": np.array([[0, 0, 3], [1, 0, 2]]),
    ...           "bin_offsets": np.array([0, 2])}
    >>> fp = fingerprint(arrays)
    >>> fp.startswith("blake2b-128:"), len(fp)
    (True, 44)
    >>> fingerprint({**arrays, "tokens": np.arange(5) + 1}) == fp
    False
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

SAMPLES = 256
"""Windows of tokens sampled."""
WINDOW = 32
"""Tokens a window."""
PREFIX = "blake2b-128:"
"""What every fingerprint starts with (names the hash, so a later scheme cannot be mistaken for it)."""
_LAYOUT = ("doc_offsets", "slices", "bin_offsets")


def fingerprint(arrays: Mapping[str, Any]) -> str:
    """The fingerprint of a packed dataset's arrays (``tokens``, ``loss_mask``, ``doc_offsets``,
    ``slices``, ``bin_offsets``, in memory or memory-mapped); see the module docstring."""
    digest = hashlib.blake2b(digest_size=16, person=b"megapack-fp-v1")
    for name in _LAYOUT:
        values = np.ascontiguousarray(arrays[name], dtype=np.int64)
        digest.update(f"{name}:{values.shape}".encode())
        digest.update(values.tobytes())
    tokens, mask = arrays["tokens"], arrays["loss_mask"]
    picked = sample_positions(len(tokens))
    digest.update(f"tokens:{len(tokens)}".encode())
    digest.update(np.ascontiguousarray(tokens[picked], dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(mask[picked], dtype=np.float32).tobytes())
    return PREFIX + digest.hexdigest()


def sample_positions(count: int) -> np.ndarray:
    """The token positions the fingerprint reads: all of ``count`` up to ``SAMPLES * WINDOW``,
    else ``SAMPLES`` windows of ``WINDOW`` evenly spaced from the first token to the last.

    Example: ``sample_positions(5)`` is ``[0, 1, 2, 3, 4]``; for 10,000 tokens the windows start
    at 0, 39, 78, ... and the last at 9,968 (ending at the last token, 9,999).
    """
    if count <= SAMPLES * WINDOW:
        return np.arange(count, dtype=np.int64)
    starts = np.linspace(0, count - WINDOW, SAMPLES).astype(np.int64)
    return (starts[:, None] + np.arange(WINDOW, dtype=np.int64)).reshape(-1)
