"""Per-rank cost of building 128 shards of tp=8 in a 1,024-rank fake world, side by side.

    python plugins/megatron/bench_shards.py [--world 1024] [--shards 128] [--tp 8] [--ranks 0,511,1023]

Rows: shardcore's drop-in ``build_inference_pg_collections_for_shards`` with its default
``local`` strategy and with ``world``, and Megatron's own recipe (HyperCommGrid.create_pg
per field plus the embedding new_groups, every rank for every shard). Each sampled rank
runs in its own fake world (torch's ``fake`` backend: no communication, so the times are
the calling rank's own bookkeeping, the part that grows with the world).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardcore.engine import live_group_count
from tests.megatron_fields import DECODER_FIELDS as DECODER  # this folder's tests/: run as a script
from tests.megatron_fields import EXPERT_FIELDS as EXPERT


def megatron_recipe(world: int, shards: int, tp: int) -> None:
    """Megatron's inference builder, per its documented recipe (cp = pp = ep = 1, expt_tp = tp)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    size = world // shards
    for index in range(shards):
        dec = HyperCommGrid([tp, 1, size // tp, 1], ["tp", "cp", "dp", "pp"], rank_offset=index * size)
        for dims in DECODER.values():
            dec.create_pg(dims)
        exp = HyperCommGrid([tp, 1, size // tp, 1], ["tp", "ep", "dp", "pp"], rank_offset=index * size)
        for dims in EXPERT.values():
            exp.create_pg(dims)
        for p in dec.get_rank_enum("pp"):
            dist.new_group([p[0], p[-1]] if len(p) > 1 else [p[0]])
            dist.new_group([p[0]])


def shardcore_builder(strategy: str) -> Callable[[int, int, int], None]:
    def build(world: int, shards: int, tp: int) -> None:
        from shardcore_megatron.shards import build_inference_pg_collections_for_shards

        build_inference_pg_collections_for_shards(world, "+".join([f"tp={tp}"] * shards), strategy=strategy)

    return build


def measure(fn: Callable[[int, int, int], None], rank: int, world: int, shards: int, tp: int) -> dict[str, float]:
    """Time one rank's build in a fresh fake world; count its new_group calls and groups it holds."""
    os.environ["WORLD_SIZE"] = str(world)
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    calls = 0
    real = c10d.new_group

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    dist.new_group = c10d.new_group = counting  # Megatron reaches it through c10d, shardcore through dist
    before = live_group_count()
    try:
        started = time.perf_counter()
        fn(world, shards, tp)
        seconds = time.perf_counter() - started
    finally:
        dist.new_group = c10d.new_group = real
    held = live_group_count() - before
    dist.destroy_process_group()
    return {"seconds": seconds, "calls": calls, "held": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=128)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--ranks", default="0,511,1023", help="comma-separated ranks to simulate")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    ranks = [int(r) for r in args.ranks.split(",")]
    from megatron.core.hyper_comm_grid import HyperCommGrid  # noqa: F401  (import time is not build time)

    from shardcore_megatron.backend import collection_class

    collection_class()
    rows = [
        ("shardcore `local` (default)", shardcore_builder("local")),
        ("shardcore `world` (Megatron's call pattern)", shardcore_builder("world")),
        ("Megatron recipe (HyperCommGrid.create_pg per field)", megatron_recipe),
    ]
    print(f"world {args.world}, {args.shards} shards of tp={args.tp}, ranks {ranks} simulated one at a time\n")
    print("| builder | per-rank time (mean, s) | new_group calls per rank | communicators held per rank |")
    print("| --- | ---: | ---: | ---: |")
    for label, fn in rows:
        results = [measure(fn, rank, args.world, args.shards, args.tp) for rank in ranks]
        mean = statistics.mean(r["seconds"] for r in results)
        calls = sorted({r["calls"] for r in results})
        held = sorted({r["held"] for r in results})
        print(f"| {label} | {mean:.3f} | {'/'.join(map(str, calls))} | {'/'.join(map(str, held))} |", flush=True)


if __name__ == "__main__":
    main()
