"""Fan-out and partial refits against the plain full refit, executed on one live local gloo world, side by side.

The layout: 2 nodes of 4 ranks (``ranks_per_node=4``, simulated: every rank is a process on this
machine). Node 0 holds the training shard ``tp=4``, node 1 two decode shards ``tp=2 + tp=2`` sliced
alike; the model is ``bench_refit``'s ~0.5 GB bf16 transformer. Each variant is planned, executed
(best of ``--repeat``, the slowest rank's time) and checked bitwise against the known tensors:

* ``full``: every tensor, each sent from node 0 to both decode shards;
* ``full, fan-out``: every tensor once across the "node" boundary, forwarded inside node 1;
* ``partial: attention``: the attention weights only (``*.self_attention.*``), as after an
  adapter-only or attention-only update;
* ``partial: norms``: the layer norms only: small tensors, per-message cost dominates.

Wire bytes and inter-node bytes come from the plan (``RefitStats``); "estimate" is the cost model
at 200 GB/s intra-node and 25 GB/s inter-node. On loopback every "link" is the same shared memory
copy, so the measured time shows what fan-out's second hop costs, not what it saves on a network.

Usage: python benchmarks/bench_refit_variants.py [--layers 12] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench_refit import bench_manifest

SPEC = "tp=4,role=train + tp=2,role=decode + tp=2,role=decode"
WORLD, PER_NODE = 8, 4
VARIANTS: dict[str, dict[str, Any]] = {
    "full": {},
    "full, fan-out": {"fan_out": True},
    "partial: attention": {"tensors": "*.self_attention.*"},
    "partial: norms": {"tensors": "*layernorm*"},
}


def _plan(layers: int, variant: str) -> Any:
    from shardcore.plan.layout import plan_layout
    from shardcore.refit import plan_refit, tensors_matching

    options = dict(VARIANTS[variant])
    patterns = options.pop("tensors", None)
    manifest = bench_manifest(layers)
    plan = plan_refit(plan_layout(WORLD, SPEC), 0, [1, 2], manifest, PER_NODE, **options)
    return plan.subset(tensors_matching(manifest, patterns)) if patterns else plan


def bench_rank(rank: int, world: int, layers: int, repeat: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from shardcore import execute_refit
    from shardcore.engine.live.refit_check import cut, known_tensor

    out: dict[str, Any] = {}
    for variant in VARIANTS:
        plan = _plan(layers, variant)
        manifest, mine = plan.manifest, plan.for_rank(rank)
        target = next((shard for shard in plan.destinations if rank in shard), None)

        def known(name: str) -> Any:
            return known_tensor(manifest.tensor(name), manifest.index(name))

        sources = {
            name: cut(known(name), manifest.tensor(name), plan.source, rank, manifest) for name in mine.source_shapes
        }
        best = float("inf")
        for _ in range(repeat):
            destinations = {
                name: torch.empty(shape, dtype=torch.bfloat16).fill_(0)
                for name, shape in mine.destination_shapes.items()
            }
            dist.barrier()
            started = time.perf_counter()
            execute_refit(plan, sources, destinations, timeout=600)
            dist.barrier()
            best = min(best, time.perf_counter() - started)
        for name, got in destinations.items():
            expected = cut(known(name), manifest.tensor(name), target, rank, manifest)
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), (variant, rank, name)
        out[variant] = best
    return out


def main() -> None:
    from shardcore.refit import RefitStats
    from shardcore.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    manifest = bench_manifest(args.layers)
    print(
        f"model: {manifest.name}, {len(manifest)} tensors, {manifest.nbytes / 1e9:.3f} GB bf16; world {WORLD} "
        f"({PER_NODE} ranks per node), shards `{SPEC}`; best of {args.repeat}, checked bitwise"
    )
    results = run_world(WORLD, bench_rank, args.layers, args.repeat, timeout=3600, pg_timeout=1200)
    print(
        "| variant | tensors | transfers | wire GB | inter-node GB | relayed GB | estimate s | "
        "measured s (loopback) | vs full |"
    )
    print("|---|" + "---:|" * 8)
    full_time = max(r["full"] for r in results)
    for variant in VARIANTS:
        plan = _plan(args.layers, variant)
        stats = RefitStats.of(plan)
        measured = max(r[variant] for r in results)
        count = len(plan.manifest) if plan.tensors is None else len(plan.tensors)
        print(
            f"| {variant} | {count} | {stats.transfers:,} | {stats.total_bytes / 1e9:.3f} | "
            f"{stats.inter_node_bytes / 1e9:.3f} | {stats.relayed_bytes / 1e9:.3f} | {stats.estimate_seconds():.4f} | "
            f"{measured:.3f} | {measured / full_time:.2f}x |"
        )


if __name__ == "__main__":
    main()
