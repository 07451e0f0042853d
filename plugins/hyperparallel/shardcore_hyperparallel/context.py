"""MeshContext and DistributedSetup: Hyper-Parallel's own classes when it imports, else compatible ones.

Hyper-Parallel is installed from source only, so the fallback dataclasses carry the
same fields, properties and methods; code written against either works with both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from math import prod
from typing import Any

from shardcore.errors import GroupCreationError

from .topology import StageSizes, check_dense_tp_layout, mesh_groups, resolve_sizes, stage_start

_HP_MODULES = (
    "hyper_parallel.distributed.mesh",
    "hyper_parallel.auto_models.components.distributed.infrastructure",
    "hyper_models.components.distributed.infrastructure",
)
"""Where Hyper-Parallel has kept the two classes, newest first."""


def wrap_mesh(groups: list[Any], shape: tuple[int, ...], names: tuple[str, ...], start: int, device: str) -> Any:
    """A torch DeviceMesh over ``[start, start+prod(shape))`` that wraps existing groups (creates none)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(start, start + prod(shape)).reshape(shape)
    return DeviceMesh.from_group(groups, device, mesh=ranks, mesh_dim_names=names)


def wrap_ranks(group: Any, ranks: list[int], device: str, name: str) -> Any:
    """A 1-D torch DeviceMesh over an existing group whose ranks need not be consecutive."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device, mesh=torch.tensor(ranks), mesh_dim_names=(name,))


def _flat_dp_cp(mesh_context: Any) -> Any:
    """dp x cp as one 1-D mesh: the prebuilt one when present, else flattened from device_mesh."""
    prebuilt = getattr(mesh_context, "_dp_cp_mesh", None)
    if prebuilt is not None:
        return prebuilt
    mesh = mesh_context.device_mesh
    if mesh is None:
        return None
    names = tuple(mesh.mesh_dim_names or ())
    dims = tuple(d for d in ("dp", "cp") if d in names) or tuple(
        d for d in ("dp_replicate", "dp_shard", "cp") if d in names
    )
    if not dims:
        return None
    sub = mesh[dims[0]] if len(dims) == 1 else mesh[dims]
    if sub.ndim > 1:  # Hyper-Parallel's DeviceMesh has flatten(); torch's has _flatten()
        sub = sub.flatten("dp_cp") if hasattr(sub, "flatten") else sub._flatten("dp_cp")
    return sub


@dataclass
class MeshContext:
    """One pipeline stage's topology and mesh domains (Hyper-Parallel-compatible fallback)."""

    device_mesh: Any = None
    fsdp_non_moe_mesh: Any = None
    fsdp_moe_mesh: Any = None
    dp_size: int = 1
    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    edp_shard_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    cp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0
    sequence_parallel: bool = False
    loss_parallel: bool = False

    @property
    def pp_enabled(self) -> bool:
        """Whether pipeline parallelism is on (pp_size > 1)."""
        return self.pp_size > 1

    @property
    def dp_cp_mesh(self) -> Any:
        """The joint dp x cp 1-D mesh that gradients and losses are all-reduced over."""
        return _flat_dp_cp(self)

    @property
    def cp_mesh(self) -> Any:
        """The cp submesh (size 1 when cp is off, as in Hyper-Parallel), None without a device mesh."""
        if self.device_mesh is None or "cp" not in (self.device_mesh.mesh_dim_names or ()):
            return None
        return self.device_mesh["cp"]

    def build_meshs(self, device_type: str, world_size: int) -> None:
        """Standalone use without shardcore: check sizes, then build this stage's meshes.

        Like Hyper-Parallel on torch, every rank creates every stage's groups (a world
        collective); under ``build_shards`` the engine creates them instead.
        """
        sizes = resolve_sizes(
            world_size=world_size,
            dp=self.dp_size,
            cp=self.cp_size,
            tp=self.tp_size,
            pp=self.pp_size,
            ep=self.ep_size,
            dp_replicate=self.dp_replicate_size,
            dp_shard=self.dp_shard_size,
            edp_shard=self.edp_shard_size,
        )
        import torch.distributed as dist

        if not dist.is_initialized():
            raise GroupCreationError("build_meshs needs torch.distributed: call init_process_group() first")
        rank = dist.get_rank()
        start = stage_start(0, sizes, rank // sizes.stage_size)

        def build(shape_names: tuple[tuple[int, ...], tuple[str, ...]]) -> Any:
            shape, names = shape_names
            mine = []
            stages = [mesh_groups(shape, stage * sizes.stage_size) for stage in range(sizes.pp)]
            for dim in range(len(shape)):
                found = None
                for groups_by_dim in stages:
                    for ranks in groups_by_dim[dim]:
                        group = dist.new_group(list(ranks))
                        found = group if rank in ranks else found
                mine.append(found)
            return wrap_mesh(mine, shape, names, start, device_type)

        self.device_mesh = build(sizes.device_mesh())
        self.fsdp_non_moe_mesh = build(sizes.fsdp_non_moe_mesh())
        check_dense_tp_layout(self.device_mesh, self.fsdp_non_moe_mesh)
        expert = sizes.fsdp_moe_mesh()
        self.fsdp_moe_mesh = build(expert) if expert is not None else None
        self._dp_cp_mesh = None
        for stage in range(sizes.pp):  # dp x cp flattened: stride tp inside each stage window
            for t in range(sizes.tp):
                ranks = [stage * sizes.stage_size + i * sizes.tp + t for i in range(sizes.dp * sizes.cp)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    self._dp_cp_mesh = wrap_ranks(group, ranks, device_type, "dp_cp")
        _fill_ranks(self, sizes, rank - start)


def _fill_ranks(context: Any, sizes: StageSizes, local: int) -> None:
    """This rank's coordinates from its index in the stage window (row-major (dp, cp, tp))."""
    context.tp_rank = local % sizes.tp
    context.cp_rank = (local // sizes.tp) % sizes.cp
    context.dp_rank = local // (sizes.tp * sizes.cp)
    context.ep_rank = local % sizes.ep if sizes.ep > 1 else 0


@dataclass
class DistributedSetup:
    """The distributed configuration container that holds a MeshContext (fallback)."""

    mesh_context: MeshContext = field(default_factory=MeshContext)
    strategy_config: Any = None
    pipeline_config: Any = None
    moe_parallel_config: Any = None
    activation_checkpointing: Any = None
    plan_overrides: Any = None
    module_replacements: Any = None
    low_precision_config: Any = None
    fp32_main_params: bool = False


def _import_hyper_parallel() -> tuple[type, type, str] | None:
    """Hyper-Parallel's (MeshContext, DistributedSetup, module) or None; its import may pull torch_npu."""
    import importlib

    for name in _HP_MODULES:
        try:
            module = importlib.import_module(name)
        except (ImportError, OSError, RuntimeError):
            continue
        if hasattr(module, "MeshContext") and hasattr(module, "DistributedSetup"):
            return module.MeshContext, module.DistributedSetup, name
    return None


@cache
def mesh_classes() -> tuple[type, type, str]:
    """(MeshContext class, DistributedSetup class, where they come from), chosen once per process.

    Hyper-Parallel's MeshContext derives dp_cp_mesh with ``DeviceMesh.flatten``, which
    torch's DeviceMesh lacks; the subclass returns the engine's prebuilt dp x cp mesh.
    """
    found = _import_hyper_parallel()
    if found is None:
        return MeshContext, DistributedSetup, __name__
    base, setup, where = found

    class ShardMeshContext(base):  # type: ignore[misc, valid-type]
        """Hyper-Parallel's MeshContext whose dp_cp_mesh is the one shardcore built."""

        @property
        def dp_cp_mesh(self) -> Any:
            return _flat_dp_cp(self)

    return ShardMeshContext, setup, where


__all__ = ["DistributedSetup", "MeshContext", "mesh_classes", "wrap_mesh", "wrap_ranks"]
