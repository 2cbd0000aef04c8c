"""The persistent gloo worker pool for distributed tests; it lives in `megapack.launch` (the bench uses it too)."""

from megapack.launch import DistributedTestError, RankOutcome, WorkerPool

__all__ = ["DistributedTestError", "RankOutcome", "WorkerPool"]
