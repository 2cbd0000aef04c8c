"""Shared pytest fixtures for megapack's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from megapack.harness.pool import WorkerPool


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[WorkerPool]:
    """One pool of 8 gloo workers shared by every distributed test of the session.

    Created the first time a test asks for it (workers start on its first task, ~18 s on the
    2-core dev machine) and closed when the session ends.
    """
    pool = WorkerPool(size=8)
    try:
        yield pool
    finally:
        pool.close()
