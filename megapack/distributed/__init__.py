"""Process groups and collectives: `Topology`, control groups, timed collectives, lockstep, grids.

May import `megapack.core` and torch.distributed; never the delivery or anything above it.
"""
