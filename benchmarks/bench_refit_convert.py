"""Converting refits against plain ones on a live local gloo world, side by side in one run.

The 12-layer model of ``bench_refit.py`` (hidden 1024, 75 tensors) from its training shard to its inference
shard, at 8 and 16 ranks, five ways: bf16 -> bf16 (plain), bf16 -> fp8 with per-tensor scales, bf16 -> fp8
with 128x128 block scales, fp32 -> fp32 (plain) and fp32 -> bf16. Per case: the wire bytes the plan moves
(what the cost model counts), of them the scale tensors', the time of ``execute_refit`` (slowest rank, best
of ``--repeat``, barrier to barrier, destinations written once before the clock as in ``bench_refit.py``),
and of that the scales' own cost: the time each source rank spends computing its scale tensors (the
partial-amax exchange included; slowest rank). Every destination is then compared bitwise with the
reference conversion of the global tensors (``refit_check.reference``).

Usage: python benchmarks/bench_refit_convert.py [--world 8 16] [--layers 12] [--repeat 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench_refit import SPECS, add_world_arguments, bench_manifest, empty_destinations, known_sources

CASES = [
    ("bf16 -> bf16", "bfloat16", None),
    ("bf16 -> fp8, per tensor", "bfloat16", ("float8_e4m3fn", "tensor")),
    ("bf16 -> fp8, per block", "bfloat16", ("float8_e4m3fn", "block")),
    ("fp32 -> fp32", "float32", None),
    ("fp32 -> bf16", "float32", ("bfloat16", None)),
]


def manifest_of(layers: int, dtype: str, conversion: tuple[str, str | None] | None) -> Any:
    """``bench_refit``'s model in ``dtype``, converted as the case says (None: a plain refit)."""
    manifest = bench_manifest(layers, dtype)
    return manifest if conversion is None else manifest.converted(*conversion)


def _mismatches(plan: Any, rank: int, destinations: dict[str, Any]) -> int:
    """Destination tensors of this rank that differ bitwise from the reference conversion (one global at a time)."""
    import torch

    from shardcore.engine.live.refit_check import cut, known_tensor, reference

    manifest, target = plan.manifest, plan.destinations[0]
    bad = 0
    for name, got in destinations.items():
        spec = manifest.tensor(name)
        weight = manifest.tensor(spec.scale_of or name)
        full = known_tensor(weight, manifest.index(weight.name))
        wanted = reference(manifest, name, lambda _: full)
        expected = cut(wanted, spec, target, rank, manifest)
        bad += not torch.equal(got.view(torch.uint8), expected.contiguous().view(torch.uint8))
    return bad


def bench_rank(rank: int, world: int, layers: int, repeat: int, threads: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    from shardcore import execute_refit
    from shardcore.engine.transfer import convert
    from shardcore.plan.layout import plan_layout
    from shardcore.refit import plan_refit

    prepared: list[float] = []
    real_prepare = convert.Conversion.prepare

    def timed_prepare(self: Any, *args: Any) -> None:
        started = time.perf_counter()
        real_prepare(self, *args)
        prepared.append(time.perf_counter() - started)

    convert.Conversion.prepare = timed_prepare  # type: ignore[method-assign]
    layout = plan_layout(world, SPECS[world])
    sources: dict[str, dict[str, Any]] = {}
    out = []
    for label, dtype, conversion in CASES:
        plan = plan_refit(layout, 0, [1], manifest_of(layers, dtype, conversion))
        if dtype not in sources:
            sources.clear()  # one source dtype's tensors at a time
            sources[dtype] = known_sources(plan, rank)
        best, prepare = float("inf"), 0.0
        for _ in range(repeat):
            destinations = empty_destinations(plan, rank)
            prepared.clear()
            dist.barrier()
            started = time.perf_counter()
            execute_refit(plan, dict(sources[dtype]), destinations, timeout=600)
            dist.barrier()
            elapsed = time.perf_counter() - started
            if elapsed < best:
                best, prepare = elapsed, sum(prepared)
        out.append({"case": label, "seconds": best, "prepare": prepare, "bad": _mismatches(plan, rank, destinations)})
    return out


def main() -> None:
    from shardcore.plan.layout import plan_layout
    from shardcore.refit import RefitStats, plan_refit
    from shardcore.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_world_arguments(parser)
    args = parser.parse_args()
    print(f"{args.layers} layers, {args.threads} thread(s) per rank, best of {args.repeat}")
    print(
        "| world | shards | case | wire GB | of it scales kB | transfers | seconds | wire GB/s | "
        "vs plain (same source) | scales computed s (slowest rank) | destinations bitwise |"
    )
    print("|" + "---:|" * 11)
    for world in args.world:
        started = time.perf_counter()
        results = run_world(world, bench_rank, args.layers, args.repeat, args.threads, timeout=3600, pg_timeout=1200)
        plain: dict[str, float] = {}
        for index, (label, dtype, conversion) in enumerate(CASES):
            stats = RefitStats.of(
                plan_refit(plan_layout(world, SPECS[world]), 0, [1], manifest_of(args.layers, dtype, conversion))
            )
            seconds = max(r[index]["seconds"] for r in results)
            prepare = max(r[index]["prepare"] for r in results)
            bad = sum(r[index]["bad"] for r in results)
            if conversion is None:
                plain[dtype] = seconds
            print(
                f"| {world} | `{SPECS[world]}` | {label} | {stats.total_bytes / 1e9:.3f} | "
                f"{stats.scale_bytes / 1e3:.1f} | {stats.transfers} | {seconds:.3f} | "
                f"{stats.total_bytes / seconds / 1e9:.2f} | {seconds / plain[dtype]:.2f}x | "
                f"{prepare:.3f} | {'yes' if bad == 0 else f'NO ({bad} tensors differ)'} |"
            )
        print(f"<!-- world {world}: {time.perf_counter() - started:.0f} s -->")


if __name__ == "__main__":
    main()
