"""Functions run on every rank of a live gloo world by the hyperparallel tests."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardcore import build_shards, destroy_shards, my_shard
from shardcore.testing import outcomes

STAND_IN = Path(__file__).resolve().parent / "standin"
"""The directory holding the Hyper-Parallel stand-in package (see standin/README.md)."""
FIELDS = (
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
MESHES = ("device_mesh", "fsdp_non_moe_mesh", "fsdp_moe_mesh")


def _choose(modules: dict[str, Any], path: str | None) -> None:
    """Make the next ``mesh_classes()`` see exactly ``modules`` (None hides one) and ``path`` on sys.path."""
    from shardcore_hyperparallel import mesh_classes

    for name in [n for n in sys.modules if n.split(".")[0] in ("hyper_parallel", "hyper_models")]:
        del sys.modules[name]
    sys.modules.update(modules)
    if path is not None and path not in sys.path:
        sys.path.insert(0, path)
    mesh_classes.cache_clear()


def hide_hyper_parallel() -> None:
    """The plugin's fallback classes and torch's DeviceMesh, whatever is installed."""
    _choose({"hyper_parallel": None, "hyper_models": None}, None)


def use_stand_in() -> None:
    """Hyper-Parallel's classes from the stand-in package."""
    _choose({}, str(STAND_IN))


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


def _describe(mesh: Any) -> dict[str, Any] | None:
    """What both DeviceMesh classes can say about a mesh: its class, names, shape, ranks, coordinate."""
    if mesh is None:
        return None
    return {
        "class": f"{type(mesh).__module__}.{type(mesh).__name__}",
        "names": list(mesh.mesh_dim_names),
        "shape": list(mesh.mesh.shape),
        "ranks": [int(r) for r in mesh.mesh.flatten().tolist()],
        "coordinate": list(mesh.get_coordinate()),
    }


def _hyper_parallel_api(mesh: Any) -> dict[str, Any]:
    """What only Hyper-Parallel's DeviceMesh answers, per dim."""
    return {
        "rank_list": list(mesh.rank_list),
        "mesh_shape": list(mesh.mesh_shape),
        "axis_id": {dim: mesh.axis_id(dim) for dim in mesh.mesh_dim_names},
        "along": {dim: list(mesh.get_rank_list_along_axis(dim)) for dim in mesh.mesh_dim_names},
    }


def _report(ctx: Any) -> dict[str, Any]:
    report: dict[str, Any] = {"type": f"{type(ctx).__module__}.{type(ctx).__name__}"}
    report["bases"] = [f"{c.__module__}.{c.__name__}" for c in type(ctx).__mro__]
    for name in MESHES:
        mesh = getattr(ctx, name)
        report[name] = None if mesh is None else {"names": list(mesh.mesh_dim_names), "dims": _probe(mesh)}
        report[f"{name}_seen"] = _describe(mesh)
    report["dp_cp"] = _probe(ctx.dp_cp_mesh)["dp_cp"]
    report["cp"] = _probe(ctx.cp_mesh)["cp"]
    report["fields"] = {k: getattr(ctx, k) for k in FIELDS}
    report["pp_enabled"] = ctx.pp_enabled
    return report


def build_and_probe(
    rank: int,
    world: int,
    shards: str,
    options: dict[str, Any],
    standalone: dict[str, int],
    compare: tuple[str, dict[str, int]],
    staged: str,
) -> dict[str, Any]:
    """One world start serves every run (spawning is slow). With the fallback classes: build, probe,
    destroy, then a standalone ``MeshContext.build_meshs``. With the stand-in's: its own
    ``build_meshs`` next to shardcore's (``compare_with_build_meshs``), then the pipelined shard
    ``staged`` (``pipelined_probe``)."""
    hide_hyper_parallel()
    built = build_shards(world, shards, backend="hyperparallel", timeout=60, **options)
    shard = my_shard(built)
    report = {"shard": shard.index, **_report(shard.handle)}
    destroy_shards(built)
    report["standalone"] = standalone_build_meshs(rank, world, standalone)
    use_stand_in()
    report["compare"] = compare_with_build_meshs(rank, world, *compare)
    report["stand_in"] = pipelined_probe(rank, world, staged)
    report["apart"] = dp_cp_made_apart(world, staged)
    return report


def standalone_build_meshs(rank: int, world: int, sizes: dict[str, int]) -> dict[str, Any]:
    """The fallback MeshContext used without shardcore: build_meshs over the whole world."""
    from shardcore_hyperparallel import MeshContext

    ctx = MeshContext(**sizes)
    ctx.build_meshs("cpu", world)
    report = {name: _probe(getattr(ctx, name)) for name in MESHES if getattr(ctx, name) is not None}
    report["dp_cp"] = _probe(ctx.dp_cp_mesh)["dp_cp"]
    report["ranks"] = [ctx.dp_rank, ctx.cp_rank, ctx.tp_rank, ctx.ep_rank]
    destroy_shards(ctx._shards)
    return report


def pipelined_probe(rank: int, world: int, staged: str) -> dict[str, Any]:
    """Hyper-Parallel's classes over a shard with pp > 1: what the handle is, what its meshes answer,
    that every dim resolves to shardcore's group, also after destroy_shards and a rebuild, and (where
    Hyper-Parallel's group creation can be counted: the stand-in) that none came from it."""
    from shardcore_hyperparallel import mesh_classes

    module = sys.modules[mesh_classes().device_mesh.__module__]
    created = getattr(module, "CREATED", None)
    before = None if created is None else len(created)
    reports = []
    for _ in range(2):  # build, destroy, build again
        built = build_shards(world, staged, backend="hyperparallel", timeout=60)
        shard = my_shard(built)
        ctx = shard.handle
        report = _report(ctx)
        report["api"] = {name: _hyper_parallel_api(getattr(ctx, name)) for name in MESHES}
        report["dp_cp_registered"] = ctx.device_mesh["dp_cp"] is ctx.dp_cp_mesh
        report["groups_are_shardcores"] = all(
            ctx.device_mesh.get_group(dim) is shard.groups[dim] for dim in ("dp", "cp", "tp")
        )
        report["flattened_dp_cp"] = _flattened_dp_cp(ctx, shard.groups)
        reports.append(report)
        destroy_shards(built)
    return {"builds": reports, "created": None if created is None or before is None else len(created) - before}


def _flattened_dp_cp(ctx: Any, groups: dict[str, Any]) -> dict[str, Any]:
    """What Hyper-Parallel code does with the flattened ``dp_cp`` dim (see the plugin README), on the handle."""
    from hyper_parallel.distributed.mesh import MeshContext

    mesh = ctx.device_mesh
    sliced = mesh["dp_cp", "tp"]
    joined = type(mesh).concatenate([mesh["dp_cp"], mesh["tp"]])
    return {
        "sliced": {"ranks": list(sliced.rank_list), "shape": list(sliced.mesh_shape)},
        "sliced_groups_are_shardcores": [sliced.get_group(d) is groups[d] for d in ("dp_cp", "tp")],
        "joined_is_the_slice": [list(joined.rank_list), joined.mesh_dim_names]
        == [list(sliced.rank_list), ("dp_cp", "tp")],
        "root_is_device_mesh": ctx.dp_cp_mesh.root_mesh is mesh and ctx.cp_mesh.root_mesh is mesh,
        "upstream_property": MeshContext.dp_cp_mesh.fget(ctx) is ctx.dp_cp_mesh,  # type: ignore[attr-defined]
    }


def dp_cp_made_apart(world: int, staged: str) -> dict[str, Any]:
    """The stand-in's answers where ``dp_cp`` is a mesh of its own only registered on ``device_mesh`` (what the
    plugin made before): each call the README lists, and the exception it raises (or what it returns)."""
    from hyper_parallel import DeviceMesh
    from hyper_parallel.distributed.mesh import MeshContext

    from shardcore_hyperparallel.meshes import wrap_mesh, wrap_ranks

    built = build_shards(world, staged, backend="hyperparallel", timeout=60)
    shard = my_shard(built)
    groups, own = shard.groups, shard.handle.device_mesh
    names = ("dp", "cp", "tp")
    mesh = wrap_mesh([groups[d] for d in names], tuple(own.mesh_shape), names, own.rank_list[0], "cpu")
    apart = wrap_ranks(groups["dp_cp"], dist.get_process_group_ranks(groups["dp_cp"]), "cpu", "dp_cp")
    mesh.add_flatten_mapping("dp_cp", apart)
    context = MeshContext(device_mesh=mesh, dp_size=2, tp_size=2)
    calls = {
        "slice": lambda: mesh["dp_cp", "tp"],
        "concatenate": lambda: DeviceMesh.concatenate([mesh["dp_cp"], mesh["tp"]]),
        "upstream_property": lambda: context.dp_cp_mesh,
    }
    out: dict[str, Any] = {"root_mesh": apart.root_mesh, **outcomes(calls)}
    destroy_shards(built)
    return out


def compare_with_build_meshs(rank: int, world: int, spec: str, sizes: dict[str, int]) -> dict[str, Any]:
    """Hyper-Parallel's own ``build_meshs`` (one stage: every rank creates the same groups, safe) next to
    shardcore's handle for the same sizes: each mesh as ``_describe`` sees it, and the size and rank fields."""
    from hyper_parallel.distributed.mesh import MeshContext

    own = MeshContext(**sizes)
    own.build_meshs("cpu", world)
    built = build_shards(world, spec, backend="hyperparallel", timeout=60, dp_shard=sizes["dp_shard_size"])
    ctx = my_shard(built).handle
    result = {
        side: {
            "meshes": {name: _describe(getattr(c, name)) for name in MESHES},
            "fields": {k: getattr(c, k) for k in FIELDS},
            "cp_mesh": _describe(c.cp_mesh),
            "dp_cp_mesh": _describe(c.dp_cp_mesh),
            "dp_cp_tp": _describe(c.device_mesh["dp_cp", "tp"]),
            "joined": _describe(type(c.device_mesh).concatenate([c.device_mesh["dp_cp"], c.device_mesh["tp"]])),
            "dp_cp_root_is_device_mesh": c.dp_cp_mesh.root_mesh is c.device_mesh,
        }
        for side, c in (("hyper_parallel", own), ("shardcore", ctx))
    }
    result["shardcore_is_a_hyper_parallel_context"] = isinstance(ctx, MeshContext)
    destroy_shards(built)
    return result


def installed_probe(rank: int, world: int, compare: tuple[str, dict[str, int]], staged: str) -> dict[str, Any]:
    """What ``build_and_probe`` checks with the stand-in, with whatever Hyper-Parallel is installed."""
    from shardcore_hyperparallel import mesh_classes

    mesh_class = mesh_classes().device_mesh
    return {
        "mesh_class": f"{mesh_class.__module__}.{mesh_class.__name__}",
        "compare": compare_with_build_meshs(rank, world, *compare),
        "staged": pipelined_probe(rank, world, staged),
    }
