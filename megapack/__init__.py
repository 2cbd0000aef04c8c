"""megapack: packed-sequence (THD) batches for Megatron-style tp x pp training that never hang.

Importing megapack is cheap: its names load on first use (PEP 562), so ``megapack --help`` never
imports torch, and megatron-core (~5 s to import) is loaded only when a function needs it.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

logging.getLogger("megapack").addHandler(
    logging.NullHandler()
)  # the application configures logging

if TYPE_CHECKING:
    from megapack.align import align_by_kind
    from megapack.comm import long_operation
    from megapack.core.batch import PackedBatch
    from megapack.core.fields import BUILTIN_FIELDS, BatchField
    from megapack.delivery.get_batch import get_batch_on_this_tp_rank
    from megapack.delivery.prefetch import Prefetcher, prefetch
    from megapack.errors import (
        CollectiveError,
        DesyncError,
        ProtocolError,
        RemoteDataError,
        RemoteRankError,
    )
    from megapack.sync import check_in_sync, lockstep
    from megapack.topology import Stage, Topology

_EXPORTS = {
    "BUILTIN_FIELDS": "megapack.core.fields",
    "BatchField": "megapack.core.fields",
    "CollectiveError": "megapack.errors",
    "DesyncError": "megapack.errors",
    "PackedBatch": "megapack.core.batch",
    "Prefetcher": "megapack.delivery.prefetch",
    "ProtocolError": "megapack.errors",
    "RemoteDataError": "megapack.errors",
    "RemoteRankError": "megapack.errors",
    "Stage": "megapack.topology",
    "Topology": "megapack.topology",
    "align_by_kind": "megapack.align",
    "check_in_sync": "megapack.sync",
    "get_batch_on_this_tp_rank": "megapack.delivery.get_batch",
    "lockstep": "megapack.sync",
    "long_operation": "megapack.comm",
    "prefetch": "megapack.delivery.prefetch",
}
"""Public name -> the module defining it, imported on first access."""

__all__ = [
    "BUILTIN_FIELDS",
    "BatchField",
    "CollectiveError",
    "DesyncError",
    "PackedBatch",
    "Prefetcher",
    "ProtocolError",
    "RemoteDataError",
    "RemoteRankError",
    "Stage",
    "Topology",
    "align_by_kind",
    "check_in_sync",
    "get_batch_on_this_tp_rank",
    "lockstep",
    "long_operation",
    "prefetch",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a submodule, e.g. `import megapack; megapack.comm.collective_timeout()`
        try:
            return importlib.import_module(f"megapack.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"megapack.{name}":
                raise
            raise AttributeError(f"module 'megapack' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
