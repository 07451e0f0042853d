"""Rank functions for the DTensor refit tests: each returns plain data the test compares."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from shardcore import ExecuteOptions, ShardcoreError, build_shards, destroy_shards, my_shard
from shardcore_dtensor import refit
from shardcore_dtensor.cross_mesh import kept_plans

SHAPES = {"embed": (24, 8), "qkv": (16, 12), "proj": (12, 16), "norm": (12,), "odd": (7, 5), "scale": ()}


def global_tensors(dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Known global tensors: every element distinct, so a misplaced byte shows."""
    out, start = {}, 0
    for name, shape in SHAPES.items():
        count = int(torch.tensor(shape).prod())
        out[name] = (torch.arange(start, start + count, dtype=torch.float32) % 251 / 7).to(dtype).reshape(shape)
        start += count
    return out


def _state(mesh: DeviceMesh | None, placements: dict[str, list[Any]], fill: bool) -> dict[str, DTensor]:
    if mesh is None:
        return {}
    full = global_tensors()
    return {
        name: distribute_tensor(full[name] if fill else torch.zeros_like(full[name]), mesh, placements[name])
        for name in placements
    }


def _full(state: dict[str, DTensor]) -> dict[str, bool]:
    full = global_tensors()
    return {name: bool(torch.equal(t.full_tensor(), full[name])) for name, t in state.items()}


def _mesh(ranks: list[list[int]] | list[int], names: tuple[str, ...]) -> DeviceMesh:
    return DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=names)


SRC_2D = {
    "embed": [Replicate(), Shard(0)],
    "qkv": [Replicate(), Shard(0)],
    "proj": [Replicate(), Shard(1)],
    "norm": [Replicate(), Replicate()],
    "odd": [Shard(1), Shard(0)],
    "scale": [Replicate(), Replicate()],
}
DST_1D = {
    "embed": [Shard(1)],
    "qkv": [Shard(0)],
    "proj": [Shard(0)],
    "norm": [Replicate()],
    "odd": [Shard(0)],
    "scale": [Replicate()],
}
DST_2D = {
    "embed": [Shard(0), Shard(0)],
    "qkv": [Shard(1), Replicate()],
    "proj": [Replicate(), Shard(1)],
    "norm": [Shard(0), Replicate()],
    "odd": [Replicate(), Shard(1)],
    "scale": [Replicate(), Replicate()],
}


def collocated(rank: int, world: int) -> dict[str, Any]:
    """Two meshes over the same four ranks: (dp=2, tp=2) to (tp=4,) and to a (2, 2) mesh of other placements,
    then to (tp=4,) again, into fresh tensors: each refit's plans built and kept."""
    src_mesh, flat, other = (
        _mesh([[0, 1], [2, 3]], ("dp", "tp")),
        _mesh([0, 1, 2, 3], ("tp",)),
        _mesh([[0, 2], [1, 3]], ("a", "b")),
    )
    src = _state(src_mesh, SRC_2D, fill=True)
    results = {}
    for label, mesh, placements in (("flat", flat, DST_1D), ("transposed", other, DST_2D), ("again", flat, DST_1D)):
        dst = _state(mesh, placements, fill=False)
        builds, hits = kept_plans.builds, kept_plans.hits
        stats = refit(src, dst, timeout=60, bucket_bytes=256)
        results[label] = {
            "equal": _full(dst),
            "copied": stats.bytes_copied,
            "received": stats.bytes_received,
            "plans": (kept_plans.builds - builds, kept_plans.hits - hits),
        }
    results["source"] = _full(src)
    return results


def disaggregated(rank: int, world: int) -> dict[str, Any]:
    """Training shard (tp=2, dp=2) on ranks 0-3 to inference shards tp=2 (4-5) and tp=1,dp=2 (6-7), via build_shards."""
    shards = build_shards(world, "tp=2,dp=2,role=train + tp=2 + dp=2", backend="dtensor")
    try:
        mine = my_shard(shards)
        src = dst = {}
        if mine is not None and mine.index == 0:
            src = _state(mine.handle.mesh["dp", "tp"], SRC_2D, fill=True)
        elif mine is not None:
            placements = {
                name: [Replicate(), Shard(0) if len(shape) > 0 and mine.index == 1 else Replicate()]
                for name, shape in SHAPES.items()
            }
            dst = _state(mine.handle.mesh["dp", "tp"], placements, fill=False)
        options = ExecuteOptions(timeout=60, bucket_bytes=1024, max_ops=8, verify="checksum", version=3)
        stats = refit(src, dst, options=options)
        return {
            "executed as": (stats.verify, stats.version),
            "shard": None if mine is None else mine.index,
            "source": _full(src),
            "equal": _full(dst),
            "sent": stats.bytes_sent,
            "received": stats.bytes_received,
        }
    finally:
        destroy_shards(shards)


def errors(rank: int, world: int) -> dict[str, str]:
    """Disagreeing conventions and unsupported placements: the same typed error on every rank, before any byte."""
    mesh = _mesh([0, 1, 2, 3], ("tp",))
    full = global_tensors()
    out = {}

    def attempt(label: str, src: dict, dst: dict) -> None:
        try:
            refit(src, dst, timeout=30)
            out[label] = "no error"
        except ShardcoreError as error:
            out[label] = f"{type(error).__name__}: {error}"

    src = {"qkv": distribute_tensor(full["qkv"], mesh, [Shard(0)])}
    attempt("shape", src, {"qkv": distribute_tensor(torch.zeros(16, 10, dtype=torch.bfloat16), mesh, [Shard(0)])})
    attempt("dtype", src, {"qkv": distribute_tensor(torch.zeros(16, 12), mesh, [Shard(0)])})
    attempt("missing", src, {"proj": distribute_tensor(torch.zeros(12, 16, dtype=torch.bfloat16), mesh, [Shard(0)])})
    partial = DTensor.from_local(full["qkv"], mesh, [Partial()], run_check=False)
    attempt("partial", {"qkv": partial}, {"qkv": distribute_tensor(torch.zeros_like(full["qkv"]), mesh, [Shard(0)])})
    return out


def module_into_a_layout(rank: int, world: int) -> dict[str, Any]:
    """A module's DTensors (tp=4 over the world) refit with a shardcore layout's plan into another module's (tp=2,
    dp=2 over the same ranks), each side's tensors from ``local_shards``; then its plain-tensor and Partial refusals."""
    from shardcore import execute_refit, plan_layout
    from shardcore.refit import Manifest, TensorSpec, plan_refit
    from shardcore_dtensor import local_shards

    dims = {"qkv": 0, "proj": 1, "norm": None}
    manifest = Manifest(
        tuple(TensorSpec(n, SHAPES[n], "bfloat16", tp_dim=d, stage=("all",)) for n, d in dims.items()), name="m"
    )
    flat, square = _mesh(list(range(world)), ("tp",)), _mesh([[0, 1], [2, 3]], ("dp", "tp"))
    full = global_tensors()

    def module(mesh: DeviceMesh, placements: list[list[Any]], fill: bool) -> torch.nn.Module:
        out = torch.nn.Module()
        for name, where in zip(dims, placements):
            tensor = full[name] if fill else torch.zeros_like(full[name])
            out.register_parameter(name, torch.nn.Parameter(distribute_tensor(tensor, mesh, where)))
        return out

    source = module(flat, [[Shard(0)], [Shard(1)], [Replicate()]], fill=True)
    target = module(square, [[Replicate(), Shard(0)], [Replicate(), Shard(1)], [Replicate(), Replicate()]], False)
    plan = plan_refit(plan_layout(world, "tp=4"), 0, [plan_layout(world, "tp=2,dp=2").shards[0]], manifest)
    sources, destinations = local_shards(source), local_shards(target)
    mine = plan.for_rank(rank)
    shapes = {n: tuple(t.shape) for n, t in sources.items()} == mine.source_shapes
    with torch.no_grad():
        execute_refit(plan, sources, destinations, timeout=60)
    equal = {name: bool(torch.equal(p.full_tensor(), full[name])) for name, p in target.named_parameters()}
    refused = {}
    for label, state in (
        ("plain", {"norm": full["norm"]}),
        ("partial", {"norm": DTensor.from_local(full["norm"], flat, [Partial()])}),
    ):
        try:
            local_shards(state)
        except ShardcoreError as error:
            refused[label] = f"{type(error).__name__}: {error}"
    return {"shapes": shapes, "equal": equal, "refused": refused}
