"""Force `get_batch_on_this_tp_rank`'s split path (header on a control group) on gloo, for tests.

On NCCL groups megapack sends the header on a CPU gloo control group and the payload on the
NCCL group (`megapack.split_transfer`). CPU tests get the same protocol by registering a second
gloo group as the control group of a gloo TP group.
"""

from __future__ import annotations

import torch.distributed as dist

from megapack.side_groups import set_control_group
from megapack.topology import Topology


def force_split_path(topo: Topology) -> dist.ProcessGroup | None:
    """Give ``topo``'s TP group a separate gloo control group; returns it (None without TP peers).

    Every rank of the TP group must call it at the same point (only they take part).
    """
    if topo.tp_group is None:
        return None
    control = dist.new_group(list(topo.tp_ranks), backend="gloo", use_local_synchronization=True)
    set_control_group(topo.tp_group, control)
    return control
