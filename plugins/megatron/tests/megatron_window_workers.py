"""Functions run on every rank of a live gloo world by the Megatron window-local group tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plugins.megatron.tests.megatron_recipe import megatron_shards
from shardcore import destroy_shards, my_shard
from shardcore.engine import all_gather_objects
from shardcore.engine.torch_state import group_counter
from shardcore_megatron import add_group


def summed(group: Any) -> int:
    value = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(value, group=group)
    return int(value.item())


def extra_groups(rank: int, world: int, spec: str, dims_by_window: dict[int, tuple[str, ...]]) -> dict[str, Any]:
    """Each window adds a group named ``extra`` along its own dims; then a world-collective group."""
    shards = megatron_shards(world, spec, timeout=30)
    mine = my_shard(shards)
    assert mine is not None
    group = add_group(mine, "extra", dims_by_window[mine.index])
    counters = all_gather_objects(group_counter())
    world_group = dist.new_group(list(range(world)))
    result = {
        "extra_sum": summed(mine.handle.extra),
        "on_handle": mine.handle.extra is group,
        "tp_sum": summed(mine.handle.tp),
        "counters": counters,
        "world_sum": summed(world_group),
    }
    dist.destroy_process_group(world_group)
    destroy_shards(shards)
    return result
