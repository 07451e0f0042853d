"""Simulate ranks of a large world with torch's fake backend; run as a script, one process per call.

``python fake_world.py '[{"world": N, "shards": SPEC, "ranks": [...], "strategy": "local", ...}, ...]'``
prints one JSON line: for each request, for each simulated rank, how its built groups compare
with the plan.
A fresh fake world is initialised per simulated rank and destroyed after it, so the fake
world lives only in this process (tests run it with subprocess, never in pytest's process).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def simulate(
    world: int,
    shards: str,
    ranks: list[int],
    strategy: str = "local",
    allow_idle: bool = False,
    order: str = "tp-cp-dp-pp",
    backend: str | None = None,
) -> list[dict[str, Any]]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import shardcore
    from shardcore.engine.torch_state import live_group_count

    layout = shardcore.plan_layout(world, shards, order=order, allow_idle=allow_idle)
    reports = []
    for rank in ranks:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            before = live_group_count()
            started = time.perf_counter()
            built = shardcore.build_shards(
                world, layout, strategy=strategy, backend=backend, groups=shardcore.GROUP_NAMES
            )
            seconds = time.perf_counter() - started
            created = live_group_count() - before
            mine = shardcore.my_shard(built)
            planned = layout.groups_of(rank)
            wrong = []
            if mine is not None:
                for name in shardcore.GROUP_NAMES:
                    group, want = mine.groups[name], planned[name]
                    got = None if group is None else tuple(dist.get_process_group_ranks(group))
                    if got != want:
                        wrong.append(f"{name}: got {_short(got)}, planned {_short(want)}")
            others_none = all(g is None for s in built if not s.is_member for g in s.groups.values())
            has_handle = mine is not None and mine.handle is not None
            shardcore.destroy_shards(built)
            reports.append(
                {
                    "rank": rank,
                    "shard": None if mine is None else mine.index,
                    "names": 0 if mine is None else len(mine.groups),
                    "wrong": wrong,
                    "created": created,
                    "distinct": len(layout.distinct_groups(rank)),
                    "leftover": live_group_count() - before,
                    "others_none": others_none,
                    "has_handle": has_handle,
                    "seconds": seconds,
                }
            )
        finally:
            dist.destroy_process_group()
    return reports


def _short(ranks: tuple[int, ...] | None) -> str:
    if ranks is None or len(ranks) <= 8:
        return str(ranks)
    return f"({ranks[0]}, {ranks[1]}, ..., {ranks[-1]}; {len(ranks)} ranks)"


if __name__ == "__main__":
    print(json.dumps([simulate(**request) for request in json.loads(sys.argv[1])]))
