"""Refit execution on a live local gloo world, side by side in one run.

Three ways to move a ~0.5 GB bf16 model from a training shard to an inference shard:

* ``shardcore``: ``plan_refit`` + ``shardcore.execute_refit`` (p2p rounds over all peers at once,
  contiguous pieces in place, small ones packed);
* ``gather+bcast``: every tensor gathered to rank 0 from its source shards, then broadcast to
  the destination ranks, tensor by tensor (the OpenRLHF / AReaL way); each destination slices;
* ``full_tensor``: every tensor all-gathered over the source tp group (what ``full_tensor()``
  does), the full tensor sent to each destination rank by one source rank, then sliced.

Also measured: the loopback p2p bandwidth between two ranks (others idle), and the bound it
implies: the busiest rank's bytes (sent or received) divided by that bandwidth (the issue's
bound, which assumes every pair has its own link); and two machine-wide floors for the shared
cores: "1:1" = bytes moved / the aggregate throughput while every rank r < world/2 sends to
r + world/2 at once, and "matrix" = the time to move this plan's own traffic matrix as raw
bytes (one message per pair, all pairs at once, nothing else); and the fair floor for an executor,
"matrix + unpack": the same, then one copy of every received byte that cannot land in place (its
destination slice is not contiguous: row-parallel pieces), measured in the same world, alternating.

Every rank runs ``--threads`` intra-op threads (default 1, torchrun's ``OMP_NUM_THREADS`` default):
with 8-16 processes on a few cores, more threads make every copy fight the others' OpenMP threads.

Usage: python benchmarks/bench_refit.py [--world 8 16] [--layers 12] [--repeat 3] [--threads 1]
[--layout split in-place]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

SPECS = {8: "tp=4,role=train + tp=2,dp=2", 16: "tp=8,role=train + tp=4,dp=2"}
IN_PLACE = {8: "tp=4,role=train + tp=4", 16: "tp=8,role=train + tp=8"}
"""Layouts where every receive lands in place: the same split on both sides, so each piece is a rank's whole
local tensor (``--layout in-place``)."""
LAYOUTS = {"split": SPECS, "in-place": IN_PLACE}


def bench_manifest(layers: int, dtype: str = "bfloat16") -> Any:
    """The benchmarks' transformer (hidden 1024, ffn 4096, 16 heads, vocab 32768; ~0.5 GB bf16 at 12 layers)
    in ``dtype``: the one model ``bench_refit``, ``bench_refit_convert`` and ``bench_refit_variants`` move."""
    from shardcore.refit import TransformerConfig, manifest_from_config

    config = TransformerConfig(layers=layers, hidden=1024, ffn=4096, heads=16, kv_heads=16, vocab=32768, dtype=dtype)
    return manifest_from_config(config, name=f"bench-{layers}l" + ("" if dtype == "bfloat16" else f"-{dtype}"))


def add_world_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a live refit benchmark: the world sizes of ``SPECS``, the model's layers, repeats, threads."""
    parser.add_argument("--world", type=int, nargs="+", default=[8, 16], choices=sorted(SPECS))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (torch.set_num_threads)")


def _loopback_bandwidth(rank: int, nbytes: int = 256 << 20) -> float:
    """GB/s of one isend/irecv of ``nbytes`` between ranks 0 and 1 (best of 3)."""
    import torch
    import torch.distributed as dist

    buffer = torch.empty(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        started = time.perf_counter()
        if rank == 0:
            dist.send(buffer, 1)
        elif rank == 1:
            dist.recv(buffer, 0)
        dist.barrier()
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def _aggregate_bandwidth(rank: int, world: int, nbytes: int = 64 << 20) -> float:
    """GB/s the whole machine carries while every rank r < world/2 sends ``nbytes`` to r + world/2 (best of 3)."""
    import torch
    import torch.distributed as dist

    half = world // 2
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        started = time.perf_counter()
        if rank < half:
            dist.send(buffer, rank + half)
        elif rank < 2 * half:
            dist.recv(buffer, rank - half)
        dist.barrier()
        best = min(best, time.perf_counter() - started)
    return half * nbytes / best / 1e9


def _matrix_floors(plan: Any, rank: int, destinations: dict[str, Any]) -> tuple[float, float, int]:
    """Seconds to move the plan's traffic matrix as raw bytes: one message per ordered pair, every
    pair at once, no packing, no order, no checks (best of 3). What the shared cores allow this plan.
    Then the same, plus one copy of every received byte that cannot land in place (a transfer whose slice of
    its destination tensor is not contiguous, such as a row-parallel piece), from the pair's buffer into the
    destination: what any executor must do at least (best of 3, alternating with the first).
    Returns both, and the bytes this rank copies in the second."""
    import torch
    import torch.distributed as dist

    mine = plan.for_rank(rank)
    sends: dict[int, int] = {}
    recvs: dict[int, int] = {}
    for transfer in mine.sends:
        sends[transfer.dst] = sends.get(transfer.dst, 0) + transfer.bytes
    copies: list[tuple[Any, int, int, int]] = []  # (destination view, peer, start in the pair's buffer, bytes)
    for transfer in mine.recvs:
        start = recvs.get(transfer.src, 0)
        recvs[transfer.src] = start + transfer.bytes
        view = destinations[transfer.destination][
            tuple(slice(o, o + n) for o, n in zip(transfer.dst_offset, transfer.shape))
        ]
        if not view.is_contiguous():
            copies.append((view, transfer.src, start, transfer.bytes))
    outgoing = torch.empty(max(sends.values(), default=0), dtype=torch.uint8)  # read-only: shared by all sends
    incoming = {peer: torch.empty(n, dtype=torch.uint8) for peer, n in recvs.items()}
    ops = [dist.P2POp(dist.isend, outgoing[:n], peer) for peer, n in sorted(sends.items())]
    ops += [dist.P2POp(dist.irecv, buffer, peer) for peer, buffer in sorted(incoming.items())]
    unpack = [
        (view, incoming[peer][start : start + size].view(view.dtype).view(view.shape))
        for view, peer, start, size in copies
    ]
    best = [float("inf"), float("inf")]
    for _ in range(3):
        for which in (0, 1):
            dist.barrier()
            started = time.perf_counter()
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()
            if which:
                for view, wire in unpack:
                    view.copy_(wire)
            dist.barrier()
            best[which] = min(best[which], time.perf_counter() - started)
    return best[0], best[1], sum(size for *_, size in copies)


def known_sources(plan: Any, rank: int, shard: Any = None) -> dict[str, Any]:
    """This rank's source shards of the known global tensors (``refit_check.known_tensor``); with ``shard``, its
    parts of them in that shard instead (what a destination must hold after the refit)."""
    from shardcore.engine.live.refit_check import cut, known_tensor

    mine = plan.for_rank(rank)
    manifest, out = plan.manifest, {}
    for name in mine.source_shapes if shard is None else mine.destination_shapes:
        spec = manifest.tensor(name)
        out[name] = cut(known_tensor(spec, manifest.index(name)), spec, shard or plan.source, rank, manifest)
    return out


def empty_destinations(plan: Any, rank: int) -> dict[str, Any]:
    """Fresh destinations in their destination dtypes, written once before the clock starts, as a model's
    parameters are: the page faults of first touch are not what a refit costs, and would otherwise land in
    whichever method runs."""
    import torch

    manifest = plan.manifest
    return {
        name: torch.empty(shape, dtype=getattr(torch, manifest.tensor(name).destination_dtype)).fill_(0)
        for name, shape in plan.for_rank(rank).destination_shapes.items()
    }


def _local(full: Any, spec: Any, shard: Any, rank: int, manifest: Any) -> Any:
    from shardcore.engine.live.refit_check import cut

    return cut(full, spec, shard, rank, manifest)


def _gather_broadcast(plan: Any, rank: int, sources: dict, destinations: dict, group: Any) -> None:
    """Per tensor: rank 0 receives each distinct source box from its first holder, then broadcasts the whole."""
    import torch
    import torch.distributed as dist

    from shardcore.refit import holdings

    manifest, source, target = plan.manifest, plan.source, plan.destinations[0]
    for spec in manifest:
        holders: dict[Any, int] = {}
        for r in source.ranks:
            boxes = holdings(spec, source, r, manifest)
            if boxes and boxes not in holders:
                holders[boxes] = r
        full = torch.empty(spec.shape, dtype=torch.bfloat16) if rank == 0 or rank in target else None
        for boxes, holder in holders.items():
            if rank == holder and rank != 0:
                dist.send(sources[spec.name].contiguous(), 0)
            elif rank == 0:
                local = (
                    sources[spec.name] if holder == 0 else torch.empty(_local_shape(spec, source), dtype=torch.bfloat16)
                )
                if holder != 0:
                    dist.recv(local, holder)
                for box, offset in boxes:
                    view = tuple(slice(o, o + b - a) for o, (a, b) in zip(offset, box))
                    full[tuple(slice(a, b) for a, b in box)] = local[view]
        if rank == 0 or rank in target:
            dist.broadcast(full, 0, group=group)
            if spec.name in destinations:
                destinations[spec.name].copy_(_local(full, spec, target, rank, manifest))


def _local_shape(spec: Any, shard: Any) -> tuple[int, ...]:
    from shardcore.refit.holdings import local_shape_on

    return local_shape_on(spec, shard)


def _full_tensor(plan: Any, rank: int, sources: dict, destinations: dict, tp_group: Any) -> None:
    """Per tensor: all-gather over the source tp group, send the full tensor to destinations, slice."""
    import torch
    import torch.distributed as dist

    manifest, source, target = plan.manifest, plan.source, plan.destinations[0]
    src_ranks, dst_ranks = list(source.ranks), list(target.ranks)
    for spec in manifest:
        full = None
        if rank in source:
            local = sources[spec.name]
            if spec.tp_dim is None:
                full = local
            else:
                parts = [torch.empty_like(local) for _ in src_ranks]
                dist.all_gather(parts, local.contiguous(), group=tp_group)
                full = torch.empty(spec.shape, dtype=torch.bfloat16)
                for r, part in zip(src_ranks, parts):
                    for box, offset in plan_holdings(spec, source, r, manifest):
                        view = tuple(slice(o, o + b - a) for o, (a, b) in zip(offset, box))
                        full[tuple(slice(a, b) for a, b in box)] = part[view]
            for i, d in enumerate(dst_ranks):
                if src_ranks[i % len(src_ranks)] == rank:
                    dist.send(full, d)
        if rank in target:
            full = torch.empty(spec.shape, dtype=torch.bfloat16)
            dist.recv(full, src_ranks[dst_ranks.index(rank) % len(src_ranks)])
            destinations[spec.name].copy_(_local(full, spec, target, rank, manifest))


def plan_holdings(spec: Any, shard: Any, rank: int, manifest: Any) -> Any:
    from shardcore.refit import holdings

    return holdings(spec, shard, rank, manifest)


def _rss_peak_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_rank(rank: int, world: int, spec: str, layers: int, repeat: int, threads: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    from shardcore import execute_refit
    from shardcore.plan.layout import plan_layout
    from shardcore.refit import plan_refit

    layout = plan_layout(world, spec)
    started = time.perf_counter()
    plan = plan_refit(layout, 0, [1], bench_manifest(layers))
    plan_seconds = time.perf_counter() - started
    bandwidth = _loopback_bandwidth(rank)
    aggregate = _aggregate_bandwidth(rank, world)
    floor, unpack_floor, unpacked = _matrix_floors(plan, rank, empty_destinations(plan, rank))
    sources = known_sources(plan, rank)
    expected = None
    out: dict[str, Any] = {
        "rank": rank,
        "plan_s": plan_seconds,
        "bw": bandwidth,
        "aggregate": aggregate,
        "floor": floor,
        "unpack_floor": unpack_floor,
        "unpacked": unpacked,
    }
    source, target = plan.source, plan.destinations[0]
    bcast_group = dist.new_group([0, *target.ranks])
    tp_group = dist.new_group(list(source.ranks))
    for method in ("shardcore", "gather+bcast", "full_tensor"):
        best = float("inf")
        for _ in range(repeat):
            destinations = empty_destinations(plan, rank)
            dist.barrier()
            rss_before = _rss_peak_mib()
            started = time.perf_counter()
            if method == "shardcore":
                stats = execute_refit(plan, sources, destinations, timeout=600)
                out["peak_buffer"] = stats.peak_buffer_bytes
            elif method == "gather+bcast":
                _gather_broadcast(plan, rank, sources, destinations, bcast_group)
            else:
                _full_tensor(plan, rank, sources, destinations, tp_group)
            dist.barrier()
            best = min(best, time.perf_counter() - started)
            out[f"{method}_rss_growth"] = _rss_peak_mib() - rss_before
            if method == "shardcore":
                expected = {n: t.clone() for n, t in destinations.items()}
            else:
                assert all(torch.equal(destinations[n], expected[n]) for n in destinations), method
        out[method] = best
    mine = plan.for_rank(rank)
    out["sent"], out["received"] = mine.bytes_sent, mine.bytes_received
    out["largest_piece"] = max((t.bytes for t in (*mine.sends, *mine.recvs)), default=0)
    return out


def main() -> None:
    from shardcore.engine import DEFAULT_BUCKET_BYTES
    from shardcore.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_world_arguments(parser)
    parser.add_argument(
        "--layout", nargs="+", default=["split"], choices=sorted(LAYOUTS), help="split: SPECS; in-place: IN_PLACE"
    )
    args = parser.parse_args()
    manifest = bench_manifest(args.layers)
    print(
        f"model: {manifest.name}, {len(manifest)} tensors, {manifest.nbytes / 1e9:.3f} GB bf16; "
        f"{args.threads} thread(s) per rank, best of {args.repeat}"
    )
    print(
        "| world | shards | moved GB | busiest rank GB | p2p GB/s | bound s | 1:1 pairs GB/s | 1:1 floor s | "
        "matrix floor s | unpacked MB | matrix + unpack floor s | shardcore s | gather+bcast s | full_tensor s | "
        "shardcore GB/s | vs gather+bcast | vs full_tensor | shardcore / bound | shardcore / 1:1 floor | "
        "shardcore / matrix floor | shardcore / matrix + unpack floor | staging MiB | bucket + largest transfer MiB |"
    )
    print("|" + "---:|" * 23)
    for name in args.layout:
        for world in args.world:
            spec = LAYOUTS[name][world]
            results = run_world(
                world, bench_rank, spec, args.layers, args.repeat, args.threads, timeout=3600, pg_timeout=1200
            )
            moved = sum(r["received"] for r in results)
            busiest = max(max(r["sent"], r["received"]) for r in results)
            bandwidth, aggregate = results[0]["bw"], results[0]["aggregate"]
            bound, floor = busiest / (bandwidth * 1e9), moved / (aggregate * 1e9)
            matrix, unpack = max(r["floor"] for r in results), max(r["unpack_floor"] for r in results)
            times = {m: max(r[m] for r in results) for m in ("shardcore", "gather+bcast", "full_tensor")}
            ours = times["shardcore"]
            allowed = DEFAULT_BUCKET_BYTES + max(r["largest_piece"] for r in results)
            print(
                f"| {world} | `{spec}` | {moved / 1e9:.3f} | {busiest / 1e9:.3f} | {bandwidth:.2f} | "
                f"{bound:.3f} | {aggregate:.2f} | {floor:.3f} | {matrix:.3f} | "
                f"{sum(r['unpacked'] for r in results) / 1e6:.0f} | {unpack:.3f} | {ours:.3f} | "
                f"{times['gather+bcast']:.2f} | {times['full_tensor']:.2f} | {moved / ours / 1e9:.2f} | "
                f"{times['gather+bcast'] / ours:.1f}x | {times['full_tensor'] / ours:.1f}x | "
                f"{ours / bound:.2f}x | {ours / floor:.2f}x | {ours / matrix:.2f}x | {ours / unpack:.2f}x | "
                f"{max(r['peak_buffer'] for r in results) / 2**20:.1f} | {allowed / 2**20:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
