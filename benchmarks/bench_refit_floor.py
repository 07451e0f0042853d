"""The floor on piece size on the issue's DeepSeek-V3 layout: transfers per rank and per pair, peers, balance, CPU.

``tp=8,dp=128,ep=64,expt_tp=1,role=train`` to ``tp=8,dp=8,ep=64,expt_tp=1`` + ``tp=4,dp=32,ep=128,expt_tp=1``
(1,216 ranks, 8 per node), one row per floor: every transfer of the plan counted per receiving rank,
per (sender, receiver) pair and per rank's peers (the distinct ranks it sends to or receives from),
decode rank 1088 (the issue's) on its own, the busiest sender against the lower bound, and the CPU
time (``time.process_time``: the machine's cores are shared) of ``plan_refit`` + ``RefitStats.of`` over
the whole plan, and of one cold ``for_rank`` (on a fresh plan) of decode ranks 1100, 1088 and 1024 and
training ranks 0 and 236, the least of three. With ``--fan-out``, every floor again with fan-out.

Run: ``python benchmarks/bench_refit_floor.py [--floor BYTES ...] [--fan-out]`` (default 0, 1 MiB, 4 MiB). It uses
only what the planner had before the floor, so the same command with ``PYTHONPATH`` pointing at an
older checkout gives the "before" rows.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

from shardcore.plan.layout import plan_layout
from shardcore.refit import RefitStats, plan_refit, preset

SPEC = "tp=8,dp=128,ep=64,expt_tp=1,role=train + tp=8,dp=8,ep=64,expt_tp=1 + tp=4,dp=32,ep=128,expt_tp=1"
WORLD, PER_NODE, RANK, COLD = 1216, 8, 1088, (1100, 1088, 1024, 0, 236)
MB = 1e6


def row(floor: int, fan_out: bool) -> str:
    layout, manifest = plan_layout(WORLD, SPEC), preset("deepseek-v3")
    options: dict[str, bool] = {"fan_out": True} if fan_out else {}  # older checkouts may lack the flag
    started = time.process_time()
    plan = plan_refit(layout, 0, [1, 2], manifest, PER_NODE, min_piece_bytes=floor, **options)
    stats = RefitStats.of(plan)
    stats_s = time.process_time() - started
    cold = []
    for rank in COLD:
        best = float("inf")
        for _ in range(3):
            fresh = plan_refit(layout, 0, [1, 2], manifest, PER_NODE, min_piece_bytes=floor, **options)
            started = time.process_time()
            fresh.for_rank(rank)
            best = min(best, time.process_time() - started)
        cold.append(f"{best * 1e3:.0f}")
    into: Counter[int] = Counter()
    pairs: Counter[tuple[int, int]] = Counter()
    small = 0
    for tile, pieces in plan.tiles():
        for piece in pieces:
            src, dst, lo, hi = piece[:4]
            if src != dst:
                into[dst] += 1
                pairs[src, dst] += 1
                small += (hi - lo) * tile.row_bytes < MB
    peers: dict[int, set[int]] = {}
    for src, dst in pairs:
        peers.setdefault(src, set()).add(dst)
        peers.setdefault(dst, set()).add(src)
    counts = sorted(len(others) for others in peers.values())
    busiest, most = into.most_common(1)[0]
    mine = plan.for_rank(RANK)
    rank_small = sum(t.bytes < MB for t in mine.recvs)
    return (
        f"| {floor:,}{' fan-out' if fan_out else ''} | {stats.transfers:,} | {small:,} | {most:,} (rank {busiest}) | "
        f"{pairs.most_common(1)[0][1]:,} | "
        f"{len(mine.recvs):,} from {len({t.src for t in mine.recvs})} peers, {rank_small:,} < 1 MB | "
        f"{counts[-1]} / {counts[(len(counts) - 1) // 2]} | {stats.busiest_sent / 1e9:.3f} / "
        f"{stats.lower_bound / 1e9:.3f} GB (x{stats.balance:.4f}) | {stats.estimate_seconds():.3f} | "
        f"{stats_s:.2f} | {' / '.join(cold)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floor", type=int, nargs="+", default=[0, 1 << 20, 4 << 20], help="floors, in bytes")
    parser.add_argument("--fan-out", action="store_true", help="also each floor with fan_out=True")
    args = parser.parse_args()
    print(
        "| floor B | transfers | pieces < 1 MB | most into one rank | most in one pair | rank 1088 receives | "
        "peers per rank, max / median | busiest sender / bound | estimate s | plan + RefitStats CPU s | "
        "cold for_rank(1100 / 1088 / 1024 / 0 / 236) CPU ms |"
    )
    print("|" + "---:|" * 11)
    for fan_out in (False, True) if args.fan_out else (False,):
        for floor in args.floor:
            print(row(floor, fan_out), flush=True)


if __name__ == "__main__":
    main()
