"""Functions run on every rank of a live gloo world by the hyperparallel tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardcore import build_shards, destroy_shards, my_shard


def _probe(mesh: Any) -> dict[str, Any]:
    """For each dim: the all-reduced sum of ones, the all-gathered ranks, this rank's local index."""
    out = {}
    for dim in mesh.mesh_dim_names:
        group = mesh.get_group(dim)
        size = dist.get_world_size(group)
        ones = torch.ones(1)
        dist.all_reduce(ones, group=group)
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(gathered, torch.tensor([dist.get_rank()]), group=group)
        out[dim] = {
            "sum": int(ones.item()),
            "ranks": [int(t.item()) for t in gathered],
            "local": mesh.get_local_rank(dim),
            "mesh_size": mesh.size(mesh.mesh_dim_names.index(dim)),
        }
    return out


def build_and_probe(
    rank: int, world: int, shards: str, options: dict[str, Any], standalone: dict[str, int]
) -> dict[str, Any]:
    """Build with the hyperparallel backend, probe every mesh dim, destroy; then the same for a
    standalone ``MeshContext.build_meshs`` over the world (one world start serves both: spawning is slow)."""
    built = build_shards(world, shards, backend="hyperparallel", timeout=60, **options)
    shard = my_shard(built)
    ctx = shard.handle
    report: dict[str, Any] = {"shard": shard.index, "type": type(ctx).__name__}
    for name in ("device_mesh", "fsdp_non_moe_mesh", "fsdp_moe_mesh"):
        mesh = getattr(ctx, name)
        report[name] = None if mesh is None else {"names": list(mesh.mesh_dim_names), "dims": _probe(mesh)}
    report["dp_cp"] = _probe(ctx.dp_cp_mesh)["dp_cp"]
    report["cp"] = _probe(ctx.cp_mesh)["cp"]
    report["fields"] = {
        k: getattr(ctx, k)
        for k in (
            "dp_size",
            "dp_replicate_size",
            "dp_shard_size",
            "edp_shard_size",
            "tp_size",
            "cp_size",
            "pp_size",
            "ep_size",
            "dp_rank",
            "tp_rank",
            "cp_rank",
            "pp_rank",
            "ep_rank",
            "sequence_parallel",
            "loss_parallel",
        )
    }
    report["pp_enabled"] = ctx.pp_enabled
    destroy_shards(built)
    report["standalone"] = standalone_build_meshs(rank, world, standalone)
    return report


def standalone_build_meshs(rank: int, world: int, sizes: dict[str, int]) -> dict[str, Any]:
    """The fallback MeshContext used without shardcore: build_meshs over the whole world."""
    from shardcore_hyperparallel import MeshContext

    ctx = MeshContext(**sizes)
    ctx.build_meshs("cpu", world)
    report = {
        name: _probe(getattr(ctx, name))
        for name in ("device_mesh", "fsdp_non_moe_mesh", "fsdp_moe_mesh")
        if getattr(ctx, name) is not None
    }
    report["dp_cp"] = _probe(ctx.dp_cp_mesh)["dp_cp"]
    report["ranks"] = [ctx.dp_rank, ctx.cp_rank, ctx.tp_rank, ctx.ep_rank]
    return report
