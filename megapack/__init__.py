"""megapack: packed-sequence (THD) batches for Megatron-style tp x pp training that never hang.

Importing megapack is cheap: megatron-core (~5 s to import) is loaded only when a function needs it.
"""

from megapack.align import align_by_kind
from megapack.batch import PackedBatch
from megapack.comm import long_operation
from megapack.errors import (
    CollectiveError,
    DesyncError,
    ProtocolError,
    RemoteDataError,
    RemoteRankError,
)
from megapack.prefetcher import Prefetcher, prefetch
from megapack.sync import check_in_sync, lockstep
from megapack.topology import Stage, Topology
from megapack.transfer import get_batch_on_this_tp_rank
from megapack.wire import FIELDS

__all__ = [
    "FIELDS",
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
