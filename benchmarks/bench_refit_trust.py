"""What agreement and checking cost per refit, on a live local gloo world: ``verify="size"`` and ``"checksum"``.

Each refit agrees before a byte moves (every rank checks its tensors, then the ranks compare the plan's
fingerprint at a store meeting) and after (an end meeting where each rank brings its outcome); every message is
checked against its sender's ledger (its size, and with ``verify="checksum"`` a checksum the sender computed).
Per case, over ``--repeat`` refits of the same plan: the median refit time (the slowest rank's
``execute_refit`` call, ``TransferStats.seconds``), of it the overhead beyond the exchange (the refit time less
the longest exchange of any rank: ``TransferStats.seconds`` less its ``agreement_seconds``, i.e. the checks
and the two meetings; waiting for a slower peer inside the exchange is the exchange's), its share, and the
same refit with checksums. For scale, the same world's two gloo barriers: the least that any two points where
every rank waits for every other cost on this machine. Every destination is checked bitwise once.

Cases (the issue's): ``tiny-dense`` at 8 ranks and ``bench_refit``'s 12-layer model at 16 ranks, on
``bench_refit.SPECS``.

Usage: python benchmarks/bench_refit_trust.py [--repeat 9] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench_refit import SPECS, bench_manifest, empty_destinations, known_sources

VERIFY = ("size", "checksum")


def _manifest(model: str) -> Any:
    from shardcore.refit import preset

    return bench_manifest(12) if model == "12-layer" else preset(model)


def bench_rank(rank: int, world: int, model: str, repeat: int, threads: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    from shardcore import execute_refit
    from shardcore.plan.layout import plan_layout
    from shardcore.refit import plan_refit

    plan = plan_refit(plan_layout(world, SPECS[world]), 0, [1], _manifest(model))
    sources, destinations = known_sources(plan, rank), empty_destinations(plan, rank)
    out: dict[str, Any] = {}
    for verify in VERIFY:
        calls, exchanges = [], []
        for _ in range(repeat + 1):  # the first refit warms the store's connections and the allocator
            dist.barrier()
            stats = execute_refit(plan, sources, destinations, timeout=600, verify=verify)
            calls.append(stats.seconds)
            exchanges.append(stats.seconds - stats.agreement_seconds)
        out[verify] = (calls[1:], exchanges[1:])
    barriers = []
    for _ in range(repeat + 1):
        dist.barrier()
        started = time.perf_counter()
        dist.barrier()
        dist.barrier()
        barriers.append(time.perf_counter() - started)
    out["barriers"] = barriers[1:]
    expected = known_sources(plan, rank, plan.destinations[0]) if destinations else {}
    out["bitwise"] = all(torch.equal(destinations[name], expected[name]) for name in destinations)
    return out


def _slowest(results: list[dict[str, Any]], verify: str, which: int) -> list[float]:
    """Per repeat, the slowest rank's figure (0: its execute_refit call, 1: its exchange)."""
    return [max(r[verify][which][i] for r in results) for i in range(len(results[0][verify][which]))]


def main() -> None:
    from shardcore.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (torch.set_num_threads)")
    args = parser.parse_args()
    print(f"median of {args.repeat} refits after a warm-up one; {args.threads} thread(s) per rank")
    print(
        "| model | world | shards | MB moved | refit s (size) | of it beyond the exchange s | share | "
        "two gloo barriers s | beyond the exchange / two barriers | refit s (checksum) | checksum cost | bitwise |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for model, world in (("tiny-dense", 8), ("12-layer", 16)):
        from shardcore.plan.layout import plan_layout
        from shardcore.refit import RefitStats, plan_refit

        moved = RefitStats.of(plan_refit(plan_layout(world, SPECS[world]), 0, [1], _manifest(model))).total_bytes
        results = run_world(world, bench_rank, model, args.repeat, args.threads, timeout=3600, pg_timeout=1200)
        walls, exchanges = _slowest(results, "size", 0), _slowest(results, "size", 1)
        size = statistics.median(walls)
        agreement = statistics.median(wall - exchange for wall, exchange in zip(walls, exchanges))
        checksum = statistics.median(_slowest(results, "checksum", 0))
        barriers = statistics.median(max(r["barriers"][i] for r in results) for i in range(args.repeat))
        print(
            f"| {model} | {world} | `{SPECS[world]}` | {moved / 1e6:,.1f} | {size:.4f} | {agreement:.4f} | "
            f"{agreement / size:.1%} | {barriers:.4f} | {agreement / barriers:.2f}x | {checksum:.4f} | "
            f"{checksum / size - 1:+.1%} | "
            f"{'yes' if all(r['bitwise'] for r in results) else 'NO'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
