"""Tests of megapack.distributed.groups: control groups are created once per group, validated when given."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch.distributed as dist

from megapack.distributed import groups as side_groups


def _cache_and_checks() -> dict[str, Any]:
    world = dist.group.WORLD
    same = side_groups.control_group(None)  # gloo: the group itself, nothing created
    created: list[Any] = []
    original = dist.new_group

    def counting(*args: Any, **kwargs: Any) -> Any:
        created.append(kwargs)
        return original(*args, **kwargs)

    pair, twin = original([0, 1]), original([0, 1], backend="gloo")  # collective: every rank
    if dist.get_rank() == 2:
        return {}
    with (
        mock.patch.object(side_groups, "carries_cpu", lambda g: g is not pair),
        mock.patch.object(dist, "new_group", counting),
    ):  # pretend ``pair`` is NCCL-only: it needs a gloo twin
        first = side_groups.control_group(pair)
        again = [side_groups.control_group(pair) for _ in range(3)]
    errors = []
    for control in (pair, world):
        try:
            side_groups.set_control_group(pair, control)
        except ValueError as exc:
            errors.append(str(exc))
    side_groups.set_control_group(pair, twin)
    return {
        "self_for_gloo": same is None,
        "created": created,
        "twin_is_new": first is not pair and dist.get_process_group_ranks(first) == [0, 1],
        "cached": all(g is first for g in again),
        "errors": errors,
        "registered": side_groups.control_group(pair) is twin,
        "unregistered": side_groups.control_group(world) is world,
    }


@pytest.mark.distributed
def test_control_group_created_once_and_validated(dist_pool: Any) -> None:
    r = dist_pool.run(_cache_and_checks, 3, timeout=60)[0]
    assert r["self_for_gloo"] and r["twin_is_new"] and r["cached"] and r["registered"]
    assert r["unregistered"]
    assert r["created"] == [{"backend": "gloo", "use_local_synchronization": True}]
    assert len(r["errors"]) == 2
    assert "control is the group itself" in r["errors"][0]
    assert "control has ranks [0, 1, 2] but the group has [0, 1]" in r["errors"][1]
