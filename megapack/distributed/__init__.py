"""Process groups and collectives: `Topology` (topology.py), control groups (groups.py), timed
collectives and `long_operation` (comm.py), `lockstep` and `check_in_sync` (sync.py).

May import `megapack.core` and torch.distributed; never the delivery or anything above it.
"""
