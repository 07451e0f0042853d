"""Rank functions for the survivor-world tests: several small worlds, each formed and checked in one spawn."""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from typing import Any

from shardcore import build_shards, destroy_shards, form_survivor_world
from shardcore.engine.agreement import Party, Purpose, barrier
from shardcore.engine.torch_state import group_counter, world_token
from shardcore.errors import GroupCreationError, ShardcoreError
from shardcore.testing import outcomes

READY = Purpose("elastic test", "the elastic test's worker", GroupCreationError)
WAIT = timedelta(seconds=60)


def _sum_of_old_ranks(rank: int) -> int:
    """An all_reduce over the current world of every member's old rank: who is in it."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([rank], dtype=torch.int64)
    dist.all_reduce(value)
    return int(value.item())


def form(rank: int, world: int, gone: list[int], port: int) -> dict[str, Any] | None:
    """Build ``tp=2,dp=2``, lose ``gone`` (SIGKILL), form the survivors' world, check it and build on it."""
    import torch.distributed as dist

    shards = build_shards(world, "tp=2,dp=2", timeout=WAIT)
    try:
        barrier(Party.world(), READY, WAIT, linger=True)
    except GroupCreationError:
        if 0 not in gone:
            raise  # else rank 0, the store's host, left as soon as every rank had arrived
    if rank in gone:
        os.kill(os.getpid(), signal.SIGKILL)
    token, counter = world_token(), group_counter()
    survivors = form_survivor_world(gone, shards=shards, rendezvous=("127.0.0.1", port), timeout=WAIT)
    members = _sum_of_old_ranks(rank)
    after = build_shards(survivors.world_size, f"tp={survivors.world_size}", timeout=WAIT)
    tp = after[0].groups["tp"]
    out = {
        "how": survivors.how,
        "rank": survivors.rank,
        "world": dist.get_world_size(),
        "members": members,
        "tp_size": dist.get_world_size(tp),
        "new_token": world_token() != token,
        "counter_kept": group_counter() >= counter,
        "default_desc": dist.group.WORLD.group_desc,
        "store": survivors.store,
    }
    destroy_shards(after)
    return out


def bad_inputs(rank: int, world: int) -> dict[str, str]:
    """Every bad call fails before anything is destroyed: the old world still answers afterwards."""
    shards = build_shards(world, "tp=2,dp=2", timeout=WAIT)
    other = [(rank + 1) % world]  # never checked against the other ranks: each call fails alone
    calls = {
        "outside": lambda: form_survivor_world([4], shards=shards),
        "self": lambda: form_survivor_world([rank], shards=shards),
        "empty": lambda: form_survivor_world([], shards=shards),
        "text": lambda: form_survivor_world("3", shards=shards),
        "rendezvous": lambda: form_survivor_world(other, shards=shards, rendezvous=("127.0.0.1", 0)),
        "no rendezvous": lambda: form_survivor_world([0], shards=shards),
        "timeout": lambda: form_survivor_world(other, shards=shards, timeout=-1),
    }
    out = outcomes(calls, ShardcoreError)
    out["members"] = str(_sum_of_old_ranks(rank))
    destroy_shards(shards)
    return out


def disagree(rank: int, world: int) -> str:
    """Ranks 0 and 1 leave rank 3 behind, ranks 2 and 3 rank 1: no world forms, and every rank says so in time."""
    gone = [3] if rank < 2 else [1]
    try:
        form_survivor_world(gone, timeout=5)
    except GroupCreationError as error:
        return str(error)
    return "formed"
