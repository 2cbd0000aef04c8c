"""Documents from numpy token arrays: offsets, eos splitting, lists of arrays, ``.npy``/``.npz`` files.

Contract (every function checks it before yielding anything and names the index and value):

* token ids: an integer dtype (not bool, not float), 1-D, every id >= 0;
* ``offsets`` (cu_seqlens style): 1-D integers, ``offsets[0] == 0``, strictly increasing (no empty
  documents), ``offsets[-1] == len(tokens)`` (no token left out);
* optional ``loss_mask``: one value per token; default 1 everywhere (pretraining).

Worked example, ``tokens [5, 6, 7, 8, 9]``:

    documents_from_offsets(tokens, [0, 3, 5])   -> [5, 6, 7], [8, 9]
    documents_from_eos(tokens, eos_id=7)         -> [5, 6, 7], [8, 9]   (eos ends its document; a
                                                                        tail without eos is kept)
    documents_from_arrays([[5, 6, 7], [8, 9]])   -> [5, 6, 7], [8, 9]

Files (`read_numpy`, loaded with ``allow_pickle=False``; ``.npy`` memory-mapped):

* ``.npy`` 1-D: split at ``eos_id`` (required); ``.npy`` 2-D: one document per row;
* ``.npz`` with a ``tokens`` key: ``offsets`` (and optional ``loss_mask``) keys, or ``eos_id``;
* ``.npz`` without one (as written by ``np.savez(path, *arrays)``): one document per array, in order.

Sources name the array and document: ``"tokens.npy[3]"``. Cost: one vectorized validation pass, then
one int64 copy per document.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from megapack.core.checks import check_int
from megapack.data.document import Document


def documents_from_offsets(
    tokens: Any, offsets: Any, *, loss_mask: Any = None, source: str = "array"
) -> Iterator[Document]:
    """Documents ``tokens[offsets[i]:offsets[i + 1]]``; see the module docstring for the contract.

    Raises:
        TypeError: tokens or offsets are not integers.
        ValueError: bad shape, a negative id, or offsets that do not start at 0, do not increase,
            run past the end or stop short of it (naming the index and value).
    """
    toks = _token_array(tokens, f"{source}: tokens")
    cu = np.asarray(offsets)
    if cu.dtype == np.bool_ or not np.issubdtype(cu.dtype, np.integer) or cu.ndim != 1:
        raise TypeError(
            f"{source}: offsets must be a 1-D integer array, got dtype {cu.dtype} shape {cu.shape}"
        )
    if len(cu) == 0 or cu[0] != 0:
        raise ValueError(
            f"{source}: offsets[0] is {cu[:1].tolist() or 'missing'}; offsets start at 0 "
            "(cu_seqlens style: [0, len0, len0 + len1, ...])"
        )
    step = np.diff(cu)
    if (step <= 0).any():
        i = int(np.flatnonzero(step <= 0)[0]) + 1
        raise ValueError(
            f"{source}: offsets[{i}] is {int(cu[i])} after {int(cu[i - 1])}; offsets must be "
            "strictly increasing (an empty document has no tokens to train on: drop the repeat)"
        )
    n = len(toks)
    if cu[-1] > n:
        i = int(np.flatnonzero(cu > n)[0])
        raise ValueError(
            f"{source}: offsets[{i}] is {int(cu[i])}, past the end of tokens (length {n})"
        )
    if cu[-1] < n:
        raise ValueError(
            f"{source}: offsets end at {int(cu[-1])} but tokens has {n}; the last {n - int(cu[-1])} "
            f"tokens would be lost (append {n} to offsets)"
        )
    mask = np.ones(n, dtype=np.float32) if loss_mask is None else np.asarray(loss_mask)
    if mask.shape != toks.shape:
        raise ValueError(
            f"{source}: loss_mask has shape {mask.shape} but tokens has {toks.shape}; give one "
            "value per token"
        )
    return _slices(toks, mask, cu.tolist(), source)


def documents_from_eos(tokens: Any, eos_id: int, *, source: str = "array") -> Iterator[Document]:
    """Split a 1-D token stream after every ``eos_id``; a trailing piece without eos is kept.

    Example:
        >>> [d.tokens.tolist() for d in documents_from_eos([5, 7, 7, 8], eos_id=7)]
        [[5, 7], [7], [8]]
    """
    toks = _token_array(tokens, f"{source}: tokens")
    check_int(f"{source}: eos_id", eos_id, minimum=0)
    ends = np.flatnonzero(toks == eos_id) + 1
    cu = np.unique(np.concatenate([[0], ends, [len(toks)]]))
    return _slices(toks, np.ones(len(toks), dtype=np.float32), cu.tolist(), source)


def documents_from_arrays(arrays: Iterable[Any], *, source: str = "arrays") -> Iterator[Document]:
    """One document per array (any 1-D integer array-likes), checked lazily in order."""
    for i, array in enumerate(arrays):
        where = f"{source}[{i}]"
        toks = _token_array(array, where)
        if len(toks) == 0:
            raise ValueError(f"{where}: empty array; a document needs at least one token")
        yield Document(
            tokens=np.array(toks, dtype=np.int64),
            loss_mask=np.ones(len(toks), dtype=np.float32),
            source=where,
        )


def documents_from_array(
    array: Any,
    *,
    offsets: Any = None,
    loss_mask: Any = None,
    eos_id: int | None = None,
    source: str = "array",
) -> Iterator[Document]:
    """Dispatch one array: 1-D with ``offsets`` or ``eos_id``, or 2-D (one document per row)."""
    arr = np.asarray(array)
    if arr.ndim == 2 and offsets is None and eos_id is None:
        return documents_from_arrays(arr, source=source)
    if arr.ndim == 1 and offsets is not None:
        return documents_from_offsets(arr, offsets, loss_mask=loss_mask, source=source)
    if arr.ndim == 1 and eos_id is not None and loss_mask is None:
        return documents_from_eos(arr, eos_id, source=source)
    raise ValueError(
        f"{source}: cannot tell where documents end in an array of shape {arr.shape} "
        f"(offsets {'given' if offsets is not None else 'not given'}, eos_id={eos_id!r}); give a "
        "1-D array with offsets=[0, ..., len] or eos_id=... (megapack CLI: --eos-id), or a 2-D "
        "array with one row per document"
    )


def read_numpy(path: str | os.PathLike[str], *, eos_id: int | None = None) -> Iterator[Document]:
    """Documents from a ``.npy`` or ``.npz`` file; see the module docstring for the layouts.

    Raises:
        FileNotFoundError, or ValueError/TypeError naming the file, key, index and value.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such file")
    if file.suffix not in (".npy", ".npz"):
        raise ValueError(f"{file}: read_numpy reads .npy or .npz files, not {file.suffix!r}")
    try:
        if file.suffix == ".npy":
            return documents_from_array(
                np.load(file, mmap_mode="r", allow_pickle=False), eos_id=eos_id, source=file.name
            )
        npz = np.load(file, allow_pickle=False)
        if "tokens" in npz.files:
            offsets = npz["offsets"] if "offsets" in npz.files else None
            mask = npz["loss_mask"] if "loss_mask" in npz.files else None
            return documents_from_array(
                npz["tokens"], offsets=offsets, loss_mask=mask, eos_id=eos_id, source=file.name
            )
        return documents_from_arrays(_npz_arrays(npz, file), source=file.name)
    except ValueError as e:
        if _needs_pickle(e):
            raise _pickle_error(e, file) from e
        raise


def _npz_arrays(npz: Any, file: Path) -> Iterator[np.ndarray]:
    """The arrays of an ``.npz``, loaded one at a time, in the order they were saved."""
    for key in npz.files:
        try:
            array = npz[key]
        except ValueError as e:
            if _needs_pickle(e):
                raise _pickle_error(e, file) from e
            raise
        yield array


def _needs_pickle(error: ValueError) -> bool:
    """numpy refused an array of Python objects: loading (``allow_pickle``) or memory-mapping it."""
    return "pickle" in str(error) or "Python objects" in str(error)


def _pickle_error(error: ValueError, file: Path) -> ValueError:
    return ValueError(
        f"{file}: holds Python objects ({error}); save plain integer arrays instead, e.g. "
        "np.savez(path, *arrays)"
    )


def _token_array(value: Any, where: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(
            f"{where} has dtype {arr.dtype}; token ids need an integer dtype (e.g. int32, int64)"
        )
    if arr.ndim != 1:
        raise ValueError(f"{where} has shape {arr.shape}; expected a 1-D token array")
    if len(arr) and arr.min() < 0:
        i = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{where}[{i}] is {int(arr[i])}; token ids must be >= 0")
    return arr


def _slices(tokens: np.ndarray, mask: np.ndarray, cu: list[int], source: str) -> Iterator[Document]:
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        yield Document(
            tokens=np.array(tokens[a:b], dtype=np.int64),  # a copy: no view into a caller's array
            loss_mask=np.array(mask[a:b], dtype=np.float32),
            source=f"{source}[{i}]",
        )
