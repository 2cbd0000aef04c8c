"""Shared pytest fixtures for megapack's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.fixture
def world(tmp_path: Path) -> Iterator[Any]:
    """A gloo world of this one process (``dist.group.WORLD``), for code that takes process groups
    (a ProcessGroupCollection's, Bridge's forms, the lockstep's collective paths), destroyed after."""
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - another test left one behind
        pytest.fail("a process group is already initialised in the test process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)  # fmt: skip
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
