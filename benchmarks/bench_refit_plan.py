"""Refit planning at scale: shardcore's plan against gather-to-rank-0 + broadcast and Megatron's design.

For each case: time to plan the whole schedule and one rank's part, the busiest sender against the
lower bound, and side by side (same run, same manifest):

- gather + broadcast (OpenRLHF / AReaL): rank 0 receives the whole model and sends it out again,
  so its bytes are at least the model size each way (more with a flat broadcast);
- Megatron-Core 0.19's design: every rank gathers every rank's metadata and replays the whole
  global schedule, so each rank's planning work is every transfer of the plan; shown as the
  global transfer count and the time shardcore takes to enumerate it.

Run: ``python benchmarks/bench_refit_plan.py`` (``--quick`` skips the DeepSeek-V3 cases).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from shardcore.plan.layout import plan_layout
from shardcore.plan.spec import parse_shards
from shardcore.refit import RefitPlan, RefitStats, manifest_from_config, plan_refit
from shardcore.refit.cost import DEFAULT_INTER_GBPS, DEFAULT_INTRA_GBPS
from shardcore.refit.models import PRESET_CONFIGS

GB = 1e9


def _world(spec: str) -> int:
    return sum(shard.world_size for shard in parse_shards(spec))


def _timed(work):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    result = work()
    return result, time.perf_counter() - start


def run_case(
    title: str, model: str, spec: str, dst: list[int], ranks_per_node: int, sample: list[int], **config: int
) -> None:
    manifest = manifest_from_config(dataclasses.replace(PRESET_CONFIGS[model], **config), name=model)
    layout = plan_layout(_world(spec), spec)
    print(f"## {title}\n")
    print(
        f"model {model}: {len(manifest)} tensors, {manifest.nbytes / GB:.1f} GB; world {layout.world_size}; "
        f"shards {spec}; {ranks_per_node} ranks per node\n"
    )
    plan, built = _timed(lambda: plan_refit(layout, 0, dst, manifest, ranks_per_node))
    count, enumerate_s = _timed(lambda: sum(1 for _ in plan.transfers()))
    stats, stats_s = _timed(lambda: RefitStats.of(plan))
    ranks = []
    for rank in sample:
        fresh: RefitPlan = plan_refit(layout, 0, dst, manifest, ranks_per_node)  # no cache from other ranks
        mine, seconds = _timed(lambda: fresh.for_rank(rank))
        ranks.append((rank, seconds, len(mine.sends) + len(mine.recvs) + len(mine.copies)))
    print(f"- plan_refit (checks every shard): {built * 1e3:.1f} ms")
    print(f"- whole schedule: {count:,} transfers enumerated in {enumerate_s:.2f} s; stats in {stats_s:.2f} s")
    for rank, seconds, own in ranks:
        print(f"- for_rank({rank}), cold: {seconds * 1e3:.1f} ms for its {own:,} transfers")
    print(
        f"- busiest sender: rank {stats.busiest_sender}, {stats.busiest_sent / GB:.2f} GB; lower bound "
        f"{stats.lower_bound / GB:.2f} GB; ratio {stats.balance:.3f}"
    )
    print(
        f"- moved {stats.total_bytes / GB:.1f} GB ({stats.intra_node_bytes / GB:.1f} GB intra-node), "
        f"local copies {stats.local_bytes / GB:.1f} GB; estimate {stats.estimate_seconds():.2f} s at "
        f"{DEFAULT_INTRA_GBPS:.0f} / {DEFAULT_INTER_GBPS:.0f} GB/s intra / inter"
    )
    for shard in stats.shards:
        print(
            f"  - shard {shard.index} ({shard.spec}): {shard.bytes / GB:.1f} GB in, busiest rank "
            f"{shard.busiest_rank} {shard.busiest_bytes / GB:.2f} GB, {shard.estimate_seconds():.2f} s alone"
        )
    print()
    print("| scheme | busiest rank's bytes | per-rank planning work |")
    print("|---|---|---|")
    worst = max(seconds for _, seconds, _ in ranks)
    most = max(own for _, _, own in ranks)
    print(
        f"| shardcore | {stats.busiest_sent / GB:.2f} GB sent (bound {stats.lower_bound / GB:.2f}) | "
        f"its own transfers: at most {most:,} in the sampled ranks, {worst * 1e3:.1f} ms |"
    )
    print(f"| gather to rank 0 + broadcast | >= {manifest.nbytes / GB:.1f} GB in and out of rank 0 | none (no plan) |")
    print(
        f"| Megatron-Core 0.19 design | (balances whole tensors) | all {count:,} transfers of the global "
        f"schedule on every rank ({enumerate_s:.2f} s here), after an all-gather of all metadata |"
    )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the DeepSeek-V3 cases")
    args = parser.parse_args()
    if not args.quick:
        run_case(
            "DeepSeek-V3: 1,024-rank training shard to a prefill and a decode shard",
            "deepseek-v3",
            "tp=1,pp=16,dp=64,ep=64,expt_tp=1,role=train + tp=4,dp=8,ep=32,expt_tp=1,role=prefill"
            " + tp=1,dp=64,ep=64,expt_tp=1,role=decode",
            [1, 2],
            8,
            [0, 1023, 1024, 1056],
            first_stage_layers=3,
            last_stage_layers=2,
        )
        run_case(  # crossing replica sets: dense over dp=128, experts over expt_dp=16; the averaging bound decides
            "DeepSeek-V3: tp=8,dp=128 training shard to two inference shards, no pipeline",
            "deepseek-v3",
            "tp=8,dp=128,ep=64,expt_tp=1,role=train + tp=8,dp=8,ep=64,expt_tp=1 + tp=4,dp=32,ep=128,expt_tp=1",
            [1, 2],
            8,
            [0, 1023, 1024, 1088],
        )
    run_case(
        "Llama-3-70B: training tp=8,pp=4,dp=4 to four tp=8 decode shards",
        "llama3-70b",
        "tp=8,pp=4,dp=4,role=train + tp=8,role=decode + tp=8,role=decode + tp=8,role=decode + tp=8,role=decode",
        [1, 2, 3, 4],
        8,
        [0, 127, 128, 159],
    )


if __name__ == "__main__":
    main()
