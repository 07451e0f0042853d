"""A refit into a separate engine job against the same refit inside one world, side by side in one run.

In one world: 8 ranks of one default group, the trainer's shard ``tp=2,pp=2,role=train`` on ranks 0-3 and the
engine's ``tp=2,dp=2`` on ranks 4-7, refit on the default group. Across jobs: the same 8 processes as two jobs
of 4, each with a world of its own, meeting in a refit group (``connect_refit``) on a store the trainer's rank 0
serves; the same plan over the group's numbering. Per case, over ``--repeat`` refits after a warm-up one: the
median refit time (the slowest rank's ``execute_refit``, ``TransferStats.seconds``) and of it the agreement
(the two meetings). Forming the group: ``connect_refit``'s time on the slowest rank (the join round, the gloo
process group connecting every pair, a final meeting; it includes waiting for the last process to come) and
on the fastest rank (the last to come: what forming costs once everyone is there), the first time and when
both jobs connect again (a restarted engine). Every destination is checked bitwise once.

Usage: python benchmarks/bench_refit_group.py [--layers 4] [--repeat 9]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench_refit import bench_manifest, empty_destinations, known_sources

TRAINER, ENGINE = "tp=2,pp=2,role=train", "tp=2,dp=2"


def _plan(layers: int) -> Any:
    from shardcore.refit import RefitRequest

    return RefitRequest(bench_manifest(layers), f"{TRAINER} + {ENGINE}", 0, (1,)).plan(8)


def _refits(plan: Any, rank: int, repeat: int, **where: Any) -> dict[str, Any]:
    """A warm-up refit, then ``repeat`` timed ones, on this rank; the destinations checked once."""
    import torch

    from shardcore import execute_refit

    sources = known_sources(plan, rank)
    destinations = empty_destinations(plan, rank)
    seconds, agreement = [], []
    for step in range(repeat + 1):
        stats = execute_refit(plan, sources, destinations, version=step, **where)
        if step:
            seconds.append(stats.seconds)
            agreement.append(stats.agreement_seconds)
    target = next((shard for shard in plan.destinations if rank in shard), None)
    expected = known_sources(plan, rank, target) if target is not None else {}
    bitwise = all(torch.equal(destinations[name], expected[name]) for name in expected)
    moved = sum(t.bytes for t in plan.for_rank(rank).recvs)
    return {"seconds": seconds, "agreement": agreement, "bitwise": bitwise, "moved": moved}


def one_world(rank: int, world: int, layers: int, repeat: int, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    return _refits(_plan(layers), rank, repeat)


def one_job(rank: int, world: int, side: str, address: str, layers: int, repeat: int, threads: int) -> dict[str, Any]:
    import torch

    from shardcore import connect_refit

    torch.set_num_threads(threads)
    counts = {"trainer_ranks": 4, "engine_ranks": 4}
    group = connect_refit(address, side=side, rank=rank, timeout=120, **counts)  # type: ignore[arg-type]
    out = _refits(_plan(layers), group.rank, repeat, group=group)
    group.close()
    again = connect_refit(address, side=side, rank=rank, timeout=120, **counts)  # type: ignore[arg-type]
    again.close()
    return {**out, "formed": group.seconds, "formed again": again.seconds}


def main() -> None:
    from shardcore.engine.live.ports import free_port
    from shardcore.testing import run_jobs, run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    settings = (args.layers, args.repeat, args.threads)
    single = run_world(8, one_world, *settings, timeout=900)
    address = f"127.0.0.1:{free_port()}"
    trainer, engine = run_jobs(
        [(4, one_job, ("trainer", address, *settings)), (4, one_job, ("engine", address, *settings))], timeout=900
    )
    plan = _plan(args.layers)
    mb = sum(t.bytes for t in plan.transfers()) / 1e6
    print(f"model: bench-{args.layers}l ({mb:,.1f} MB moved), {TRAINER} -> {ENGINE}, {args.repeat} refits")
    columns = "refit s (median) | of it agreement s | group formed s (slowest / fastest rank) | formed again s"
    print(f"| where | {columns} | bitwise |")
    print("|---|---:|---:|---:|---:|---|")
    for label, ranks in (("one world of 8", single), ("two jobs of 4 (refit group)", trainer + engine)):
        refit = statistics.median(max(r["seconds"][i] for r in ranks) for i in range(args.repeat))
        agreed = statistics.median(max(r["agreement"][i] for r in ranks) for i in range(args.repeat))
        shown = ["-", "-"]
        for index, key in enumerate(("formed", "formed again")):
            times = [r[key] for r in ranks if key in r]
            shown[index] = f"{max(times):.3f} / {min(times):.3f}" if times else "-"
        bitwise = "yes" if all(r["bitwise"] for r in ranks) else "NO"
        print(f"| {label} | {refit:.4f} | {agreed:.4f} | {shown[0]} | {shown[1]} | {bitwise} |")


if __name__ == "__main__":
    main()
