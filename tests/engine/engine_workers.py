"""Functions run on every rank of a live gloo world by the engine tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardcore import GroupCreationError, build_shards
from shardcore.engine.backends.shards import destroy_shards, my_shard
from shardcore.engine.torch_state import live_group_count
from shardcore.plan.layout import distinct_groups


def gather_ranks(group: Any, size: int) -> list[int]:
    """Global ranks of a group's members, as an all-gather over the group reports them."""
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(out, torch.tensor([dist.get_rank()]), group=group)
    return [int(t.item()) for t in out]


def build_verify_destroy(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each case: build, all-gather over every group, destroy; report what was seen."""
    reports = []
    for case in cases:
        before = live_group_count()
        shards = build_shards(world, case["shards"], **case.get("kwargs", {}))
        mine = my_shard(shards)
        seen: dict[str, list[int]] = {}
        if mine is not None:
            for ranks, names in distinct_groups(mine.group_ranks):
                group = mine.groups[names[0]]
                if any(mine.groups[n] is not group for n in names):
                    raise AssertionError(f"names {names} share ranks {ranks} but not one group object")
                seen.update(dict.fromkeys(names, gather_ranks(group, len(ranks))))
        created = live_group_count() - before
        handle_type = type(mine.handle).__name__ if mine else None
        non_member_groups = [s.groups for s in shards if not s.is_member]
        destroy_shards(shards)
        reports.append(
            {
                "shard": None if mine is None else mine.index,
                "seen": seen,
                "planned": {} if mine is None else {k: list(v) for k, v in mine.group_ranks.items() if v is not None},
                "created": created,
                "distinct": 0 if mine is None else len(distinct_groups(mine.group_ranks)),
                "leftover": live_group_count() - before,
                "handle": handle_type,
                "non_member_all_none": all(all(v is None for v in g.values()) for g in non_member_groups),
            }
        )
    return reports


def extra_group_then_build(rank: int, world: int, strategy: str, local_sync: bool) -> str:
    """Rank 1 alone created one more process group than the others before building."""
    if rank == 1:
        dist.new_group([1], use_local_synchronization=local_sync)
    try:
        shards = build_shards(world, "tp=2+tp=2", strategy=strategy, timeout=20)
    except GroupCreationError as error:
        return f"error: {error}"
    mine = my_shard(shards)
    result = f"ok: tp={gather_ranks(mine.groups['tp'], 2)}" if mine else "ok"
    destroy_shards(shards)
    return result


def dtensor_roundtrip(rank: int, world: int) -> dict[str, Any]:
    """distribute_tensor over mesh['tp'] and redistribute, on a two-shard layout."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    shards = build_shards(world, "tp=2,dp=2,role=prefill+tp=4,role=decode")
    mine = my_shard(shards)
    handle = mine.handle
    tp_mesh = handle.mesh["tp"]
    full = torch.arange(8, dtype=torch.float32) + 100 * mine.index
    sharded = distribute_tensor(full, tp_mesh, [Shard(0)])
    local = sharded.to_local().tolist()
    replicated = sharded.redistribute(tp_mesh, [Replicate()]).to_local().tolist()
    result = {
        "shard": mine.index,
        "local": local,
        "replicated": replicated,
        "mesh_dims": list(handle.mesh.mesh_dim_names),
        "mesh_shape": list(handle.mesh.mesh.shape),
        "expert_dims": list(handle.expert_mesh.mesh_dim_names),
        "tp_group_is_engine_group": handle.mesh.get_group("tp") is mine.groups["tp"],
        "dp_cp_ranks": handle.dp_cp.mesh.tolist(),
    }
    destroy_shards(shards)
    return result


def bad_calls(rank: int, world: int) -> dict[str, str]:
    """Each bad argument's error message (nothing is created)."""
    from shardcore import ShardcoreError, plan_layout

    calls = {
        "world": lambda: build_shards(4, "tp=4"),
        "strategy": lambda: build_shards(world, "tp=2", strategy="nowhere"),
        "backend": lambda: build_shards(world, "tp=2", backend="nope"),
        "timeout": lambda: build_shards(world, "tp=2", timeout=-1),
        "groups": lambda: build_shards(world, "tp=2", groups=["tp", "bogus"]),
        "layout": lambda: build_shards(world, plan_layout(2 * world, f"tp={2 * world}")),
    }
    messages = {}
    for key, call in calls.items():
        try:
            call()
            messages[key] = "no error"
        except ShardcoreError as error:
            messages[key] = str(error)
    return messages


def sessions_on_one_store_thread(rank: int, world: int, sessions: int) -> list[str]:
    """Run ``sessions`` sessions of two meetings (as a refit does); the store threads alive after them."""
    import threading
    from datetime import timedelta

    from shardcore.engine.agreement import Party, Purpose, convene, meet

    purpose = Purpose("check", "sessions_on_one_store_thread", GroupCreationError)
    for _ in range(sessions):
        epoch = convene(Party.world(), purpose, "check:same", timedelta(seconds=60)).epoch
        meet(Party.world(), purpose, epoch, "end", timedelta(seconds=60), linger=True)
    return sorted(thread.name for thread in threading.enumerate() if thread.name.startswith("shardcore-store"))
