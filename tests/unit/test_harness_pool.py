"""Tests of megapack.harness.pool.WorkerPool.

Happy-path and "error" tests use the session's shared ``dist_pool`` (8 workers, megatron
preloaded). Tests that make the pool restart (a rank dies or hangs) use a private 2-worker pool that
preloads only torch, so each restart costs ~2 s instead of ~18 s and the shared pool is untouched.
The worker functions are module-level so spawned workers import them by reference.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from megapack.harness.pool import DistributedTestError, WorkerPool

# ---- functions run on the workers -----------------------------------------------------------


def rank_sum(scale: float, *, offset: float = 0.0) -> tuple[int, int, float, torch.Tensor]:
    """All-reduces ``scale * (rank + 1) + offset`` and returns (rank, world size, sum, tensor)."""
    t = torch.tensor([scale * (dist.get_rank() + 1) + offset])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), t


def pid() -> int:
    return os.getpid()


def thread_settings() -> tuple[str | None, int]:
    return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


def init_megatron_tp2() -> tuple[int, bool]:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.model_parallel_is_initialized(),
    )


def megatron_initialized() -> bool:
    from megatron.core import parallel_state

    return parallel_state.model_parallel_is_initialized()


def raise_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise KeyError("boom on purpose")
    return dist.get_rank()


def sigkill_rank_1() -> int:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return dist.get_rank()


def sleep_on_rank_1() -> int:
    if dist.get_rank() == 1:
        time.sleep(120)
    return dist.get_rank()


def unpicklable_result() -> object:
    return lambda: None


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_pool() -> Iterator[WorkerPool]:
    with WorkerPool(size=2, preload=("torch",)) as pool:
        yield pool


# ---- tests ------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_all_reduce_in_rank_order(dist_pool: WorkerPool, world_size: int) -> None:
    results = dist_pool.run(rank_sum, world_size, 2.0, offset=1.0)
    # sum over r of 2 * (r + 1) + 1 = world_size * (world_size + 1) + world_size
    expected = float(world_size * (world_size + 2))
    assert [r[:3] for r in results] == [(r, world_size, expected) for r in range(world_size)]
    assert all(torch.equal(r[3], torch.tensor([expected])) for r in results)


@pytest.mark.distributed
def test_workers_are_single_threaded(dist_pool: WorkerPool) -> None:
    parent_omp = os.environ.get("OMP_NUM_THREADS")
    assert dist_pool.run(thread_settings, 2) == [("1", 1), ("1", 1)]
    assert os.environ.get("OMP_NUM_THREADS") == parent_omp


@pytest.mark.distributed
def test_megatron_state_is_destroyed_between_tasks(dist_pool: WorkerPool) -> None:
    assert dist_pool.run(init_megatron_tp2, 4) == [(0, True), (1, True), (0, True), (1, True)]
    assert dist_pool.run(megatron_initialized, 4) == [False] * 4


@pytest.mark.distributed
def test_error_names_rank_and_keeps_pool(dist_pool: WorkerPool) -> None:
    pids = dist_pool.run(pid, 3)
    with pytest.raises(DistributedTestError) as info:
        dist_pool.run(raise_on_rank_1, 3)
    message = str(info.value)
    assert "rank 1: error" in message
    assert "Traceback" in message and "KeyError: 'boom on purpose'" in message
    assert "rank 0:" not in message and "rank 2:" not in message
    assert [o.status for o in info.value.outcomes] == ["ok", "error", "ok"]
    assert [o.value for o in info.value.outcomes] == [0, None, 2]
    assert dist_pool.run(pid, 3) == pids


@pytest.mark.distributed
def test_unpicklable_result_is_an_error(dist_pool: WorkerPool) -> None:
    (outcome,) = dist_pool.run_outcomes(unpicklable_result, 1)
    assert outcome.status == "error"
    assert outcome.error is not None and "could not be pickled" in outcome.error
    assert dist_pool.run(rank_sum, 2, 1.0)[1][2] == 3.0


@pytest.mark.distributed
def test_killed_rank_is_died_and_pool_restarts(small_pool: WorkerPool) -> None:
    pids = small_pool.run(pid, 2)
    outcomes = small_pool.run_outcomes(sigkill_rank_1, 2)
    assert [o.status for o in outcomes] == ["ok", "died"]
    assert outcomes[0].value == 0
    assert outcomes[1].error == "killed by signal SIGKILL"
    new_pids = small_pool.run(pid, 2)
    assert set(new_pids).isdisjoint(pids)
    assert small_pool.run(rank_sum, 2, 1.0)[0][2] == 3.0


@pytest.mark.distributed
def test_hung_rank_is_no_answer_and_pool_restarts(small_pool: WorkerPool) -> None:
    pids = small_pool.run(pid, 2)
    start = time.monotonic()
    outcomes = small_pool.run_outcomes(sleep_on_rank_1, 2, timeout=2.0)
    assert time.monotonic() - start < 2.0 + 5.0
    assert [o.status for o in outcomes] == ["ok", "no_answer"]
    assert "rank 1: no_answer" in str(DistributedTestError("sleep_on_rank_1", outcomes))
    new_pids = small_pool.run(pid, 2)
    assert set(new_pids).isdisjoint(pids)


@pytest.mark.parametrize("world_size", [0, 9])
def test_world_size_out_of_range(world_size: int) -> None:
    with (
        WorkerPool(size=8) as pool,
        pytest.raises(
            ValueError, match=rf"^world_size must be an int from 1 to 8, got {world_size}$"
        ),
    ):
        pool.run(pid, world_size)


def test_unpicklable_fn_is_value_error() -> None:
    with WorkerPool(size=1) as pool, pytest.raises(ValueError, match="module level"):
        pool.run(lambda: None, 1)
