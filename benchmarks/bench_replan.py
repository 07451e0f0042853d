"""Elastic re-layout at scale: a 65,536-rank layout loses one node of 8; how long replan takes, and what survives.

For each case: the wall time of ``replan`` (every option proposed, evaluated and ranked), then per option the
new spec, the ranks used and released, the ranks that need weights, the groups kept and rebuilt, and the
parts of tensors with no surviving copy.

Run: ``python benchmarks/bench_replan.py``.
"""

from __future__ import annotations

import time

from shardcore.plan.layout import plan_layout
from shardcore.refit import preset
from shardcore.replan import replan

CASES = [
    (
        "Llama-3-70B, 65,536 ranks: train tp=8,pp=8,dp=512 + decode tp=8,dp=2048 + prefill tp=8,pp=2,dp=1024; "
        "node 100 (ranks 800-807, in train) lost",
        "llama3-70b",
        "tp=8,pp=8,dp=512,role=train+tp=8,dp=2048,role=decode+tp=8,pp=2,dp=1024,role=prefill",
        range(800, 808),
    ),
    (
        "DeepSeek-V3, 65,536 ranks: train tp=8,dp=4096,ep=64 + decode tp=8,dp=2048,ep=64 + prefill "
        "tp=4,dp=4096,ep=128; node 100 (ranks 800-807, in train) lost",
        "deepseek-v3",
        "tp=8,dp=4096,ep=64,expt_tp=1,role=train+tp=8,dp=2048,ep=64,expt_tp=1,role=decode"
        "+tp=4,dp=4096,ep=128,expt_tp=1,role=prefill",
        range(800, 808),
    ),
    (
        "DeepSeek-V3, the same layout; node 5000 (ranks 40000-40007, in decode) lost",
        "deepseek-v3",
        "tp=8,dp=4096,ep=64,expt_tp=1,role=train+tp=8,dp=2048,ep=64,expt_tp=1,role=decode"
        "+tp=4,dp=4096,ep=128,expt_tp=1,role=prefill",
        range(40000, 40008),
    ),
]


def main() -> None:
    for title, model, spec, lost in CASES:
        manifest = preset(model)
        layout = plan_layout(65536, spec)
        started = time.perf_counter()
        result = replan(layout, manifest, lost=lost, ranks_per_node=8, memory_bytes=80e9)
        seconds = time.perf_counter() - started
        print(f"## {title}\n")
        print(f"replan: {seconds:.2f} s, {len(result.options)} options\n")
        print("| # | kind | new spec | used | released | need weights | restore GB | groups kept | rebuilt | missing |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for number, option in enumerate(result.options, 1):
            specs = " + ".join(str(plan.spec) for plan in option.layout.shards)
            needing = sum(move.needs_weights for move in option.moves)
            print(
                f"| {number} | {option.kind} | `{specs}` | {option.used:,} | {len(option.renumbering.released):,} | "
                f"{needing:,} | {option.restore_bytes / 1e9:,.0f} | {option.kept_groups:,} | "
                f"{option.rebuilt_groups:,} | {len(option.missing)} |"
            )
        best = result.best
        rebuilt = ", ".join(f"{f.name} {f.rebuilt}" for f in best.fates if f.rebuilt)
        print(f"\nbest ({best.kind}): rebuilt by name: {rebuilt}\n")


if __name__ == "__main__":
    main()
