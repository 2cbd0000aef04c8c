"""megapack: packed-sequence (THD) batches for Megatron-style tp x pp training that never hang.

Importing megapack is cheap: megatron-core (~5 s to import) is loaded only when a function needs it.
"""

from megapack.batch import PackedBatch
from megapack.errors import ProtocolError, RemoteDataError
from megapack.topology import Stage, Topology
from megapack.transfer import FIELDS, get_batch_on_this_tp_rank

__all__ = [
    "FIELDS",
    "PackedBatch",
    "ProtocolError",
    "RemoteDataError",
    "Stage",
    "Topology",
    "get_batch_on_this_tp_rank",
]
__version__ = "0.1.0"
