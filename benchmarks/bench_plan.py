"""Planning at scale: ``plan_layout`` and ``groups_of`` on worlds up to 2^20 ranks, time and peak memory.

Each world is cut into the same number of shards (a mix of dense, MoE, context-parallel and decode
shards), so the rows differ only in world size: time and memory should not grow with it.

    python benchmarks/bench_plan.py            # worlds 2^14, 2^17, 2^20 in 1,024 shards
    python benchmarks/bench_plan.py --quick    # worlds 2^10, 2^12, 2^14 in 64 shards
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dataclasses import replace

from shardcore import Layout, format_shards, plan_layout
from shardcore.plan.spec import ShardSpec

TARGET_S = 0.1


def shard_mix(size: int) -> list[ShardSpec]:
    """Four shards of ``size`` ranks (a power of two >= 16): dense train, MoE and cp prefill, decode."""
    tp = min(8, size)
    pp = min(4, size // tp)
    dense = ShardSpec(tp=tp, pp=pp, dp=size // (tp * pp), role="train", name="policy")
    tp, pp = min(4, size), min(2, size // min(4, size))
    dp = size // (tp * pp)
    moe = ShardSpec(tp=tp, pp=pp, dp=dp, ep=min(8, tp * dp), expt_tp=1, role="prefill")
    cp = ShardSpec(tp=2, cp=2, dp=size // 4, ep=min(4, size // 4), role="prefill")
    decode = ShardSpec(tp=min(4, size), dp=size // min(4, size), role="decode")
    return [dense, moe, cp, decode]


def spec_for(world: int, shards: int) -> str:
    """The spec string of ``shards`` equal windows over ``world`` ranks, cycling the mix (names are unique)."""
    mix = shard_mix(world // shards)
    specs = [mix[i % len(mix)] for i in range(shards)]
    return format_shards([replace(spec, name=f"{spec.name}{i}") if spec.name else spec for i, spec in enumerate(specs)])


def best_of(repeat: int, call: Callable[[], Any]) -> float:
    """Fastest of ``repeat`` timed calls, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def peak_bytes(call: Callable[[], Any]) -> int:
    """Peak bytes allocated while ``call`` runs (its result is kept alive until measured)."""
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    result = call()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del result
    return peak


def sample_ranks(world: int, count: int) -> list[int]:
    return [0, world - 1, *random.Random(world).sample(range(1, world - 1), count)]


def measure(world: int, shards: int, repeat: int, samples: int) -> dict[str, Any]:
    spec = spec_for(world, shards)
    plan_s = best_of(repeat, lambda: plan_layout(world, spec))
    plan_peak = peak_bytes(lambda: plan_layout(world, spec))
    layout: Layout = plan_layout(world, spec)
    assert len(layout.shards) == shards and layout.shards[-1].ranks.stop == world
    ranks = sample_ranks(world, samples)
    groups_s = [best_of(repeat, partial(layout.groups_of, rank)) for rank in ranks]
    distinct_s = [best_of(repeat, partial(layout.distinct_groups, rank)) for rank in ranks]
    groups_peak = max(peak_bytes(partial(layout.groups_of, rank)) for rank in ranks[:8])
    return {
        "world": world,
        "shards": shards,
        "per_shard": world // shards,
        "plan_s": plan_s,
        "plan_peak": plan_peak,
        "groups_max": max(groups_s),
        "groups_median": statistics.median(groups_s),
        "distinct_max": max(distinct_s),
        "groups_peak": groups_peak,
        "ranks": len(ranks),
    }


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| world | shards | ranks/shard | plan_layout | plan_layout peak | groups_of worst | groups_of median "
        "| distinct_groups worst | groups_of peak |"
    )
    lines = [header, "|" + "---:|" * 9]
    for r in rows:
        lines.append(
            f"| {r['world']:,} | {r['shards']:,} | {r['per_shard']:,} | {r['plan_s'] * 1e3:.2f} ms "
            f"| {r['plan_peak'] / 1024:,.0f} KiB | {r['groups_max'] * 1e3:.3f} ms | {r['groups_median'] * 1e3:.3f} ms "
            f"| {r['distinct_max'] * 1e3:.3f} ms | {r['groups_peak'] / 1024:,.0f} KiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small worlds, fewer repeats (a smoke run)")
    parser.add_argument("--repeat", type=int, help="timed calls per measurement; the best counts")
    parser.add_argument("--samples", type=int, help="random ranks timed besides the first and the last")
    args = parser.parse_args(argv)
    worlds, shards = ([1 << 10, 1 << 12, 1 << 14], 64) if args.quick else ([1 << 14, 1 << 17, 1 << 20], 1024)
    repeat = args.repeat or (3 if args.quick else 7)
    samples = args.samples or (30 if args.quick else 200)
    rows = [measure(world, shards, repeat, samples) for world in worlds]
    print(
        f"python {platform.python_version()} on {platform.machine()}, best of {repeat}; groups_of over "
        f"{rows[0]['ranks']} ranks per world (first, last and random)\n"
    )
    print(table(rows))
    slow = [(r["world"], key) for r in rows for key in ("plan_s", "groups_max", "distinct_max") if r[key] >= TARGET_S]
    print(f"\ntarget < {TARGET_S} s each: " + ("met" if not slow else f"MISSED for {slow}"))
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
