"""Functions run on every rank of a live gloo world by the window-local group tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardcore import ShardcoreError, build_shards
from shardcore.engine import all_gather_objects
from shardcore.engine.backends.shards import destroy_shards, my_shard
from shardcore.engine.torch_state import group_counter


def summed(group: Any) -> int:
    """The sum of the members' global ranks, as an all-reduce over ``group`` computes it."""
    value = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(value, group=group)
    return int(value.item())


def gathered(value: Any) -> list[Any]:
    """``value`` from every rank of the world (no numpy: the dtensor env has none)."""
    return all_gather_objects(value)


def error(call: Any) -> str:
    try:
        call()
    except ShardcoreError as caught:
        return f"{type(caught).__name__}: {caught}"
    return "no error"


def window_groups(rank: int, world: int, spec: str, extra: Any = None) -> dict[str, Any]:
    """Each window creates groups alone (all its ranks; pairs), one disagrees, then world creation and rebuilds."""
    counter = group_counter()
    shards = build_shards(world, spec, backend="dtensor", groups=["tp"], timeout=20)
    mine = my_shard(shards)
    assert mine is not None
    built = group_counter()
    whole = mine.new_group(list(mine.ranks))
    pairs = mine.new_groups([list(mine.ranks)[i : i + 2] for i in range(0, mine.size, 2)], group_desc="pairs")
    result: dict[str, Any] = {
        "window": mine.index,
        "whole": summed(whole),
        "pair": summed(pairs),
        "none_unless_member": (mine.new_group([mine.ranks[0]]) is None) == (rank != mine.ranks[0]),
        "counter_moved_by_build": built != counter,
        "counter_kept": group_counter() == built,
        "overlap": error(lambda: mine.new_groups([[mine.ranks[0]], [mine.ranks[0]]])),
    }
    if mine.index == 0:  # rank 0 asks for another group than the rest of its window, then fails on its own
        asked = [0] if rank == 0 else list(mine.ranks)
        result["disagree"] = error(lambda: mine.new_group(asked, timeout=10))
        outside = [world - 1] if rank == 1 else list(mine.ranks)
        result["failed_alone"] = error(lambda: mine.new_group(outside, timeout=10))
        result["recovered"] = summed(mine.new_group(list(mine.ranks), timeout=10))
    result["counters"] = gathered(group_counter())
    world_group = dist.new_group(list(range(world)))
    result["world_sum"] = summed(world_group)
    second = build_shards(world, spec, backend="dtensor", groups=["tp"], timeout=20)
    result["second_whole"] = summed(my_shard(second).new_group(list(mine.ranks)))  # type: ignore[union-attr]
    destroy_shards(second)
    destroy_shards(shards)
    dist.destroy_process_group(world_group)
    rebuilt = build_shards(world, spec, backend="dtensor", groups=["tp"], timeout=20)
    result["rebuilt_whole"] = summed(my_shard(rebuilt).new_group(list(mine.ranks)))  # type: ignore[union-attr]
    destroy_shards(rebuilt)
    result["counters_end"] = gathered(group_counter())
    return result
