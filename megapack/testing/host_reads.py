"""`host_reads`: record every host read of a tensor made by megapack's own code, to test for none.

On a GPU, reading a device tensor's value on the host (``.item()``, ``.tolist()``, ``if t:``,
``int(t)``, ...) waits for every queued kernel: a synchronization that stalls the CPU's run-ahead.
On a CPU the same calls cost nothing, so a CPU test cannot see them by timing. `host_reads` patches
the Python entry points of those reads for the duration of a ``with`` block and records each call
whose *immediate caller* is a file under one of ``roots`` (default: the megapack package, without
``megapack/testing``), with the module, function, file and line:

    Tensor methods   item, tolist, numpy, cpu, nonzero, __bool__, __int__, __float__, __index__
    torch functions  equal, nonzero; tensor / as_tensor given Python data and a non-CPU ``device=``
                     (a blocking host-to-device copy)

A read made by torch or megatron-core code that megapack calls is not megapack's and is not
recorded unless their directory is among ``roots``. Not seen: reads made in C++ (e.g. boolean-mask
indexing, ``repeat_interleave`` without ``output_size``, which also synchronize on CUDA).

``allow`` names the modules (or packages: ``"megapack.attention"`` allows its submodules) that may
read the host, e.g. the TP source validating its host input; `HostReads.unexpected` lists the
others' reads and `HostReads.report` tells them apart. The patches are process-wide (every thread)
and removed when the outermost block exits.

Example:
    >>> import torch
    >>> from megapack.attention.documents import Documents
    >>> cu = torch.tensor([0, 3, 5])
    >>> with host_reads(allow={"megapack.attention"}) as reads:
    ...     bounds = Documents(cu, cu, 3, 5).host_bounds()  # the SDPA reference's one read
    >>> reads.by_module(), reads.unexpected()
    ({'megapack.attention.documents': 1}, [])
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import megapack

PACKAGE = Path(megapack.__file__).resolve().parent
"""The megapack package directory: its files are megapack's own code."""
TESTING = PACKAGE / "testing"
"""Excluded from the default roots: test helpers are not the code under test."""
TENSOR_METHODS = (
    "item",
    "tolist",
    "numpy",
    "cpu",
    "nonzero",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
)
"""The ``torch.Tensor`` methods that read a tensor on the host."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HostRead:
    """One recorded host read."""

    kind: str
    """What was called: a Tensor method name, ``torch.equal``, ``torch.tensor(device=meta)``..."""
    module: str
    """The calling module's ``__name__`` (e.g. ``megapack.attention.documents``)."""
    function: str
    """The calling function's name."""
    file: str
    """The calling file."""
    line: int
    """The calling line."""

    def where(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


class HostReads:
    """The reads recorded inside one `host_reads` block (its ``as`` value)."""

    def __init__(self, allow: Collection[str], roots: Collection[Path]) -> None:
        self.allow = frozenset(allow)
        self.roots = tuple(roots)
        self.records: list[HostRead] = []

    def is_allowed(self, read: HostRead) -> bool:
        """Whether ``read`` comes from an allowed module or package."""
        return any(read.module == a or read.module.startswith(a + ".") for a in self.allow)

    def unexpected(self) -> list[HostRead]:
        """The reads of modules not in ``allow``."""
        return [r for r in self.records if not self.is_allowed(r)]

    def by_module(self) -> dict[str, int]:
        """Number of reads per calling module."""
        return dict(Counter(r.module for r in self.records))

    def by_site(self) -> dict[tuple[str, str, str], int]:
        """Number of reads per (module, function, kind)."""
        return dict(Counter((r.module, r.function, r.kind) for r in self.records))

    def report(self) -> str:
        """One line per read site, allowed ones marked, for an assertion message."""
        lines = [f"{len(self.records)} host reads ({len(self.unexpected())} not allowed)"]
        sites = Counter((r.kind, r.module, r.where(), self.is_allowed(r)) for r in self.records)
        for (kind, module, where, ok), n in sites.most_common():
            lines.append(f"  {n} x {kind} {module} {where}{' (allowed)' if ok else ''}")
        return "\n".join(lines)

    def _record(self, kind: str, frame: FrameType) -> None:
        path = Path(frame.f_code.co_filename).resolve()
        if not _under(path, self.roots) or (_under(path, (TESTING,)) and TESTING not in self.roots):
            return
        self.records.append(
            HostRead(
                kind=kind,
                module=str(frame.f_globals.get("__name__", "?")),
                function=frame.f_code.co_name,
                file=str(path),
                line=frame.f_lineno,
            )
        )


_ACTIVE: list[HostReads] = []
_LOCK = threading.Lock()
_SAVED: dict[tuple[Any, str], Any] = {}
_MISSING = object()


@contextmanager
def host_reads(
    *, allow: Collection[str] = (), roots: Collection[str | Path] | None = None
) -> Iterator[HostReads]:
    """Record the host reads made by code under ``roots`` (default: megapack) inside the block.

    Args:
        allow: module or package names whose reads are expected (see `HostReads.unexpected`).
        roots: directories whose files count as "our code"; default the megapack package without
            ``megapack/testing``. Pass e.g. megatron-core's directory too to count its reads.
    """
    for name in allow:
        if not isinstance(name, str) or not name:
            raise TypeError(f"allow must hold module names (str), got {name!r}")
    dirs = [PACKAGE] if roots is None else [Path(r).resolve() for r in roots]
    reads = HostReads(allow, dirs)
    with _LOCK:
        if not _ACTIVE:
            _install()
        _ACTIVE.append(reads)
    try:
        yield reads
    finally:
        with _LOCK:
            _ACTIVE.remove(reads)
            if not _ACTIVE:
                _uninstall()


def _seen(kind: str, frame: FrameType | None) -> None:
    if frame is not None:
        for reads in list(_ACTIVE):
            reads._record(kind, frame)


def _method(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        _seen(name, sys._getframe(1))
        return original(self, *args, **kwargs)

    read.__name__ = name
    return read


def _function(name: str, original: Callable[..., Any], device_arg: bool) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if not device_arg:
            _seen(f"torch.{name}", sys._getframe(1))
        else:
            device = kwargs.get("device")
            python_data = bool(args) and not isinstance(args[0], torch.Tensor)
            if python_data and device is not None and torch.device(device).type != "cpu":
                _seen(f"torch.{name}(device={torch.device(device).type})", sys._getframe(1))
        return original(*args, **kwargs)

    call.__name__ = name
    return call


def _install() -> None:
    for name in TENSOR_METHODS:
        _SAVED[(torch.Tensor, name)] = torch.Tensor.__dict__.get(name, _MISSING)
        setattr(torch.Tensor, name, _method(name, getattr(torch.Tensor, name)))
    for name, device_arg in (
        ("equal", False),
        ("nonzero", False),
        ("tensor", True),
        ("as_tensor", True),
    ):
        _SAVED[(torch, name)] = getattr(torch, name)
        setattr(torch, name, _function(name, getattr(torch, name), device_arg))


def _uninstall() -> None:
    for (owner, name), original in _SAVED.items():
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _SAVED.clear()


def _under(path: Path, roots: Collection[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)
