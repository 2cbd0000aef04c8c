"""megapack: packed-sequence (THD) batches for Megatron-style tp x pp training that never hang.

Importing megapack is cheap: its names load on first use (PEP 562), so ``megapack --help`` never
imports torch, and megatron-core (~5 s to import) is loaded only when a function needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# No handler of its own (no NullHandler): with no logging configured, Python's last-resort
# handler prints megapack's warnings and errors on stderr (not INFO); an application that
# configures logging gets them through its own handlers.

if TYPE_CHECKING:
    from megapack.core.batch import PackedBatch
    from megapack.core.buckets import BUCKET_FIELDS
    from megapack.core.errors import (
        CaptureError,
        CollectiveError,
        DesyncError,
        ProtocolError,
        RemoteDataError,
        RemoteRankError,
    )
    from megapack.core.fields import BatchField
    from megapack.core.loss_fields import LOSS_FIELDS
    from megapack.core.static import StaticShape
    from megapack.data.loss_steps import with_loss_fields
    from megapack.delivery.get_batch import get_batch_on_this_tp_rank
    from megapack.delivery.graph import GraphInputs
    from megapack.delivery.prefetch import prefetch
    from megapack.delivery.steps import lockstep_steps
    from megapack.distributed.comm import long_operation
    from megapack.distributed.sync import check_in_sync, lockstep
    from megapack.distributed.topology import Topology

_EXPORTS = {
    "BUCKET_FIELDS": "megapack.core.buckets",
    "CaptureError": "megapack.core.errors",
    "BatchField": "megapack.core.fields",
    "CollectiveError": "megapack.core.errors",
    "DesyncError": "megapack.core.errors",
    "GraphInputs": "megapack.delivery.graph",
    "LOSS_FIELDS": "megapack.core.loss_fields",
    "PackedBatch": "megapack.core.batch",
    "ProtocolError": "megapack.core.errors",
    "RemoteDataError": "megapack.core.errors",
    "RemoteRankError": "megapack.core.errors",
    "StaticShape": "megapack.core.static",
    "Topology": "megapack.distributed.topology",
    "check_in_sync": "megapack.distributed.sync",
    "get_batch_on_this_tp_rank": "megapack.delivery.get_batch",
    "lockstep": "megapack.distributed.sync",
    "lockstep_steps": "megapack.delivery.steps",
    "long_operation": "megapack.distributed.comm",
    "prefetch": "megapack.delivery.prefetch",
    "with_loss_fields": "megapack.data.loss_steps",
}
"""Public name -> the module defining it, imported on first access."""

__all__ = [
    "BUCKET_FIELDS",
    "LOSS_FIELDS",
    "BatchField",
    "CaptureError",
    "CollectiveError",
    "DesyncError",
    "GraphInputs",
    "PackedBatch",
    "ProtocolError",
    "RemoteDataError",
    "RemoteRankError",
    "StaticShape",
    "Topology",
    "check_in_sync",
    "get_batch_on_this_tp_rank",
    "lockstep",
    "lockstep_steps",
    "long_operation",
    "prefetch",
    "with_loss_fields",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if (
        module is None
    ):  # a submodule, e.g. `import megapack; megapack.distributed.comm.collective_timeout()`
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
