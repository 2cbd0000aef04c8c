"""The persistent gloo worker pool for distributed tests; it lives in `megapack.harness.pool` (the bench uses it too)."""

from megapack.harness.pool import DistributedTestError, RankOutcome, WorkerPool

__all__ = ["DistributedTestError", "RankOutcome", "WorkerPool"]
