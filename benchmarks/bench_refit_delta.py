"""Delta refits against dense ones, side by side in one run on a live local gloo world.

The benchmarks' bf16 transformer (``bench_refit.bench_manifest``) moves from a training shard to an inference
shard (``bench_refit.SPECS``). After a first refit of each kind, every round changes a fraction of the source
elements (each source rank steps its own shard: the training shard has no replicas) and then runs a dense refit
into one set of destinations and a delta refit into another, in alternating order; the two sets must stay
bitwise equal. Per fraction: wire bytes, measured seconds (median of ``--repeat``), and the plan's time estimate
at 25 GB/s on every link (``RefitStats``, the bytes scaled by the measured wire ratio) plus the measured cost of
encoding and applying per byte, from the single-process measurement printed first.

Usage: python benchmarks/bench_refit_delta.py [--world 8] [--layers 12] [--repeat 3]
       python benchmarks/bench_refit_delta.py --device cuda   (the encode and apply measurement alone, on a GPU)
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.bench_refit import SPECS, bench_manifest, empty_destinations, known_sources

FRACTIONS = (0.001, 0.02, 0.3, 1.0)
LINK_GBPS = 25.0


def _encode_apply_ns_per_byte(
    fraction: float, elements: int = 32 << 20, device: str = "cpu"
) -> tuple[float, float, float]:
    """One process (one thread on a CPU): (encode, apply) ns per dense byte of a bf16 piece of ``elements`` on
    ``device`` with ``fraction`` of them changed, and the encoded size as a fraction of the dense one. Encoding
    is what a sender does beyond a dense send: find the changes, encode them, refresh its snapshot. On a GPU
    the clock stops after the device finishes (the best of more rounds: the first ones load kernels)."""
    import torch

    from shardcore.engine.transfer.delta_codec import DENSE, apply_piece, encode_piece, write_encoding
    from shardcore.engine.transfer.exchange import as_bytes

    on_cpu = device == "cpu"
    if on_cpu:
        torch.set_num_threads(1)
    finish = (lambda: None) if on_cpu else torch.cuda.synchronize
    before = torch.randn(elements).to(torch.bfloat16).to(device)
    chosen = torch.rand(elements).to(device) < fraction
    after = torch.where(chosen, (before.float() + 1).to(torch.bfloat16), before)
    snapshot, target = before.clone(), before.clone()
    out = torch.empty(elements * 2, dtype=torch.uint8, device=device)
    now = as_bytes(after)
    best_encode = best_apply = float("inf")
    for _ in range(3 if on_cpu else 10):
        snapshot.copy_(before)
        target.copy_(before)
        finish()
        started = time.perf_counter()
        kind, count, parts = encode_piece(now, as_bytes(snapshot), 2)
        size = 0 if parts is None else write_encoding(out, *parts)
        finish()
        best_encode = min(best_encode, time.perf_counter() - started)
        if kind == DENSE:  # a dense piece is the dense refit's own copy: nothing more to apply
            best_apply = 0.0
            continue
        started = time.perf_counter()
        assert apply_piece(target, out[:size], kind, count, torch.bfloat16) is None
        finish()
        best_apply = min(best_apply, time.perf_counter() - started)
        assert torch.equal(target.view(torch.int16), after.view(torch.int16))
        assert torch.equal(snapshot.view(torch.int16), after.view(torch.int16))
    dense = elements * 2
    return best_encode / dense * 1e9, best_apply / dense * 1e9, (size if kind != DENSE else dense) / dense


def _step(sources: dict[str, Any], manifest: Any, rank: int, step: int, fraction: float) -> None:
    from shardcore.engine.live.refit_check import changed_step

    for name, local in sources.items():
        local.copy_(changed_step(local, manifest.index(name) * 4096 + rank, step, fraction))


def bench_rank(rank: int, world: int, layers: int, repeat: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from shardcore import ExecuteOptions, execute_refit
    from shardcore.plan.layout import plan_layout
    from shardcore.refit import plan_refit

    plan = plan_refit(plan_layout(world, SPECS[world]), 0, [1], bench_manifest(layers))
    sources = known_sources(plan, rank)
    dense, delta = empty_destinations(plan, rank), empty_destinations(plan, rank)
    version = 1

    def refit(into: dict[str, Any], as_delta: bool) -> tuple[float, Any]:
        dist.barrier()
        started = time.perf_counter()
        stats = execute_refit(plan, sources, into, options=ExecuteOptions(timeout=600, version=version, delta=as_delta))
        dist.barrier()
        return time.perf_counter() - started, stats

    refit(dense, False)
    refit(delta, True)
    out: dict[str, Any] = {"snapshot_bytes": 0}
    for fraction in FRACTIONS:
        times: dict[bool, list[float]] = {False: [], True: []}
        wire = received = sent_wire = sent = 0
        equal = True
        for round_ in range(repeat):
            version += 1
            _step(sources, plan.manifest, rank, version, fraction)
            for as_delta in (round_ % 2 == 1, round_ % 2 == 0):
                seconds, stats = refit(delta if as_delta else dense, as_delta)
                times[as_delta].append(seconds)
                if as_delta:
                    wire, received = stats.wire_bytes_received, stats.bytes_received
                    sent_wire, sent = stats.wire_bytes_sent, stats.bytes_sent
                    out["snapshot_bytes"] = stats.snapshot_bytes
            equal = equal and all(torch.equal(dense[n].view(torch.int16), delta[n].view(torch.int16)) for n in dense)
        out[fraction] = {
            "dense_s": statistics.median(times[False]),
            "delta_s": statistics.median(times[True]),
            "wire": wire,
            "received": received,
            "sent_wire": sent_wire,
            "sent": sent,
            "equal": equal,
        }
    return out


def _print_costs(costs: dict[float, tuple[float, float, float]]) -> None:
    """The encode and apply table: per fraction changed, the encoded size and the cost per dense byte."""
    print("| changed | encoded / dense | encode ns/B | apply ns/B | encode GB/s | apply GB/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for fraction, (encode, apply, ratio) in costs.items():
        shown_apply = f"{1 / apply:.2f}" if apply > 0 else "-"
        print(f"| {fraction:.1%} | {ratio:.3f} | {encode:.4f} | {apply:.4f} | {1 / encode:.1f} | {shown_apply} |")


def main() -> None:
    import os

    from shardcore.plan.layout import plan_layout
    from shardcore.refit import RefitStats, plan_refit
    from shardcore.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8, choices=sorted(SPECS))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", help="measure encoding and applying alone, on this device (cuda)")
    parser.add_argument("--elements", type=int, default=32 << 20, help="bf16 elements of the measured piece")
    args = parser.parse_args()
    if args.device:
        import torch

        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
        size = f"a {args.elements * 2 >> 20} MiB bf16 piece"
        print(f"encode and apply alone on {name} (torch {torch.__version__}), {size}:\n")
        _print_costs({f: _encode_apply_ns_per_byte(f, args.elements, args.device) for f in FRACTIONS})
        return
    manifest = bench_manifest(args.layers)
    print(f"model: {manifest.name}, {manifest.nbytes / 1e9:.3f} GB bf16; world {args.world} `{SPECS[args.world]}`")
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    costs = {fraction: _encode_apply_ns_per_byte(fraction) for fraction in FRACTIONS}
    print("\nencode and apply alone (one process, one thread, a 64 MiB bf16 piece):\n")
    _print_costs(costs)
    plan = plan_refit(plan_layout(args.world, SPECS[args.world]), 0, [1], manifest)
    stats = RefitStats.of(plan)
    dense_estimate = stats.estimate_seconds(LINK_GBPS, LINK_GBPS)
    busiest_received = max(stats.received.values())
    results = run_world(args.world, bench_rank, args.layers, args.repeat, timeout=3600)
    print(f"\nlive: {args.repeat} rounds per fraction, medians; estimate at {LINK_GBPS:g} GB/s on every link\n")
    print(
        "| changed | dense wire MB | delta wire MB | wire ratio | dense estimate ms | delta estimate ms "
        "| estimate ratio | dense s | delta s | measured ratio | bitwise equal |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for fraction in FRACTIONS:
        rows = [result[fraction] for result in results]
        wire, received = sum(r["wire"] for r in rows), sum(r["received"] for r in rows)
        ratio = wire / received
        encode, apply, _ = costs[fraction]
        delta_estimate = dense_estimate * ratio + (encode * stats.busiest_sent + apply * busiest_received) / 1e9
        dense_s = max(r["dense_s"] for r in rows)
        delta_s = max(r["delta_s"] for r in rows)
        print(
            f"| {fraction:.1%} | {received / 1e6:.1f} | {wire / 1e6:.1f} | {ratio:.3f} | {dense_estimate * 1e3:.2f} "
            f"| {delta_estimate * 1e3:.2f} | {delta_estimate / dense_estimate:.2f} | {dense_s:.3f} | {delta_s:.3f} "
            f"| {delta_s / dense_s:.2f} | {'yes' if all(r['equal'] for r in rows) else 'NO'} |"
        )
    snapshots = max(result["snapshot_bytes"] for result in results)
    print(
        f"\nsnapshot memory, largest rank: {snapshots / 1e6:.1f} MB (its bytes sent: {stats.busiest_sent / 1e6:.1f} MB)"
    )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
