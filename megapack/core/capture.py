"""Whether a CUDA-graph capture is under way, and which one: what batch-derived caches key on.

A CUDA graph records only the kernels launched while it is captured. A tensor computed from a
batch before the capture (the segment ids of its boundaries, RoPE's cos/sin at its positions, a
flex block mask) and found in a cache inside it launches nothing: the graph reads that tensor's
memory on every replay, so every replay sees the first batch. The rule megapack keeps, in one
place (`megapack.attention.documents.Documents`, which owns everything derived from a micro-batch's
boundaries): a cache entry is valid only under the `capture_token` it was built under.

    outside any capture                       token None
    inside a capture                          ("capture", id) of that capture

so a warm-up's entries are rebuilt, and recorded, when the capture starts; what the capture built
is reused by the capture's other layers (and its backward), and dropped again after it ends.

The capture's id comes from the CUDA runtime (``cudaStreamGetCaptureInfo``: through
``cuda.bindings`` when installed, else libcudart loaded by torch). Where neither answers, the id is
an epoch that advances each time a lookup sees no capture under way: two captures in a row with no
eager megapack call between them then share one token (say so with `new_capture_epoch`).

Worked example: warm-up (token None) builds entry A; ``torch.cuda.graph(g)`` starts: the first
layer's lookup has token ("capture", 7) != None, builds B inside the capture (recorded), the other
layers reuse B; after the capture the next eager lookup (token None) builds C.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Hashable
from typing import Any

import torch

from megapack.core.errors import CaptureError

logger = logging.getLogger("megapack.capture")

_epoch = [0, False]
"""[epoch, whether the last lookup saw a capture]: the fallback capture id (module docstring)."""


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a CUDA graph (False on CPU-only torch)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except RuntimeError:  # a CPU-only torch build: no CUDA, so no capture
        return False


def capture_token() -> Hashable:
    """None outside a capture; inside one, a token that differs from every other capture's.

    Example:
        >>> capture_token() is None   # nothing is being captured here
        True
    """
    if not capturing():
        _epoch[1] = False
        return None
    ident = _runtime_capture_id()
    if ident is not None:
        return ("capture", ident)
    if not _epoch[1]:  # the first lookup of a new capture
        _epoch[0] += 1
        _epoch[1] = True
    return ("capture-epoch", _epoch[0])


def new_capture_epoch() -> None:
    """Start a new fallback epoch: call between two captures that run with no eager megapack
    call between them, where the CUDA runtime gives no capture id (module docstring)."""
    _epoch[0] += 1
    _epoch[1] = False


def refuse_under_capture(what: str, because: str, fix: str) -> None:
    """Raise `CaptureError` naming ``what``, why (``because``) and ``fix`` when a capture is under way.

    Example:
        >>> refuse_under_capture("x", "it reads the host", "run it eagerly")  # no capture: nothing
    """
    if capturing():
        raise CaptureError(f"{what} cannot run inside a CUDA-graph capture: {because}; {fix}")


def _runtime_capture_id() -> int | None:
    """The id of the capture under way on the current stream, from the CUDA runtime, or None."""
    query = _capture_query()
    if query is None:
        return None
    try:
        return query(torch.cuda.current_stream().cuda_stream)
    except Exception as exc:  # an unexpected runtime: fall back to epochs, say so once
        _warn_once(f"cudaStreamGetCaptureInfo failed ({exc}); capture ids fall back to epochs")
        return None


@functools.cache
def _capture_query() -> Any:
    """A function stream -> capture id, from cuda.bindings or libcudart; None without either."""
    try:
        from cuda.bindings import runtime

        def through_bindings(stream: int) -> int | None:
            result = runtime.cudaStreamGetCaptureInfo(stream)
            return int(result[2]) if int(result[0]) == 0 and int(result[1]) == 1 else None

        return through_bindings
    except ImportError:
        pass
    lib = _libcudart()
    if lib is None:
        _warn_once("no CUDA runtime answers cudaStreamGetCaptureInfo: capture ids are epochs")
        return None
    fn = lib.cudaStreamGetCaptureInfo
    fn.restype = ctypes.c_int

    def through_ctypes(stream: int) -> int | None:
        status, ident = ctypes.c_int(0), ctypes.c_ulonglong(0)
        # (stream, status*, id*, graph*, deps*, [edges*,] count*): the first three are the same in
        # CUDA 12 and 13; the trailing out-pointers may be NULL.
        nulls = (None, None, None, None)
        err = fn(ctypes.c_void_p(stream), ctypes.byref(status), ctypes.byref(ident), *nulls)
        return int(ident.value) if err == 0 and status.value == 1 else None

    return through_ctypes


def _libcudart() -> Any:
    """libcudart as torch loaded it (by its soname), or None."""
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)
