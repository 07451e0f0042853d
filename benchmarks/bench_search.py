"""Layout search at scale: DeepSeek-V3 from a 1,024-rank training shard to 256 inference ranks, Llama-3-70B.

For each case: specs enumerated, those the model splits over, those within memory, refit classes
estimated, candidates planned exactly, and the wall time; then the best few, and for the best the
estimate against the plan's own stats (``--plan 1``), side by side in one run.

Run: ``python benchmarks/bench_search.py`` (``--quick`` skips DeepSeek-V3's exact plan).
"""

from __future__ import annotations

import argparse
import time

from shardcore.plan.layout import plan_layout
from shardcore.refit import preset, search

GB = 1e9
CASES = [
    # (title, model, source spec, destination ranks, memory GB, axes limits, candidates planned exactly)
    (
        "DeepSeek-V3: training tp=8,dp=128,ep=64 (1,024 ranks) to 256 ranks, 80 GB, tp within a node",
        "deepseek-v3",
        "tp=8,dp=128,ep=64,expt_tp=1,role=train",
        256,
        80,
        {"tp": 8, "pp": 256, "dp": 256, "ep": 256, "expt_tp": 8, "cp": 256},
        1,
    ),
    (
        "DeepSeek-V3: the same, every axis free",
        "deepseek-v3",
        "tp=8,dp=128,ep=64,expt_tp=1,role=train",
        256,
        80,
        None,
        0,
    ),
    (
        "Llama-3-70B: training tp=8,pp=4,dp=4 (128 ranks) to 64 ranks, 80 GB, tp within a node",
        "llama3-70b",
        "tp=8,pp=4,dp=4,role=train",
        64,
        80,
        {"tp": 8, "pp": 64, "dp": 64, "cp": 64},
        3,
    ),
]


def run_case(
    title: str, model: str, source: str, ranks: int, memory: float, axes: dict[str, int] | None, plan: int
) -> None:
    manifest = preset(model)
    world = plan_layout(10**6, source, allow_idle=True).shards[0].size + ranks
    layout = plan_layout(world, source, allow_idle=True)
    options = {} if axes is None else {"axes": axes}
    started = time.perf_counter()
    result = search(layout, 0, manifest, ranks, memory * GB, ranks_per_node=8, **options)  # type: ignore[arg-type]
    estimate_only = time.perf_counter() - started
    print(f"## {title}\n")
    print(
        f"- {result.enumerated:,} specs enumerated, {result.split:,} split the model, {result.fit_memory:,} fit "
        f"{memory:g} GB, {result.estimated:,} refit classes estimated, 0 planned: {estimate_only:.2f} s"
    )
    for candidate in result.candidates[:3]:
        rank, size = candidate.busiest
        print(
            f"  - {candidate.spec}: {candidate.weight_bytes / GB:.1f} GB per rank, estimate {candidate.seconds:.3f} s, "
            f"busiest rank {rank} {size / GB:.2f} GB{' (front)' if candidate.pareto else ''}"
        )
    if plan:
        started = time.perf_counter()
        planned = search(layout, 0, manifest, ranks, memory * GB, ranks_per_node=8, plan=plan, **options)  # type: ignore[arg-type]
        seconds = time.perf_counter() - started
        print(f"- with plan={plan}: {seconds:.2f} s")
        for best in (c for c in planned.candidates if c.stats is not None):
            stats = best.stats
            assert stats is not None
            print(
                f"  - '{best.spec}' planned: {stats.transfers:,} transfers; time estimate {best.estimate.seconds:.4f} s"
                f" -> plan {best.seconds:.4f} s; busiest sender even share {best.estimate.sent / GB:.3f} GB -> plan"
                f" {stats.busiest_sent / GB:.3f} GB; moved {best.estimate.total_bytes / GB:.1f} GB -> "
                f"{stats.total_bytes / GB:.1f} GB"
            )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="plan no DeepSeek-V3 candidate exactly")
    args = parser.parse_args()
    for title, model, source, ranks, memory, axes, plan in CASES:
        run_case(title, model, source, ranks, memory, axes, 0 if args.quick and model == "deepseek-v3" else plan)


if __name__ == "__main__":
    main()
