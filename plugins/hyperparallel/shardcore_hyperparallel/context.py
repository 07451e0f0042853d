"""MeshContext and DistributedSetup: Hyper-Parallel's own classes when it imports, else compatible ones.

Hyper-Parallel is installed from source only, so the fallback dataclasses carry the
same fields, properties and methods; code written against either works with both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from math import prod
from typing import Any

from shardcore import GroupCreationError

from .topology import resolve_sizes

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
        """Standalone use without a shardcore layout: check sizes, then build this stage's meshes.

        Like Hyper-Parallel's own ``build_meshs``, every rank of the world calls it. The groups
        come from shardcore's engine (one shard ``tp, cp, dp, pp, ep`` over the world with the
        ``hyperparallel`` backend), so this package never creates process groups itself.

        Raises:
            LayoutError: sizes Hyper-Parallel rejects.
            GroupCreationError: torch.distributed is not initialised, or creation failed.
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

        from shardcore import ShardSpec, build_shards, my_shard

        if not dist.is_initialized():
            raise GroupCreationError("build_meshs needs torch.distributed: call init_process_group() first")
        # expt_tp=1: Hyper-Parallel's ep folds over the whole stage, which shardcore accepts for ep | dp*cp*tp
        spec = ShardSpec(tp=sizes.tp, cp=sizes.cp, dp=sizes.dp, pp=sizes.pp, ep=sizes.ep, expt_tp=1)
        self._shards = build_shards(
            world_size,
            [spec],
            backend="hyperparallel",
            device_type=device_type,
            dp_replicate=sizes.dp_replicate,
            dp_shard=sizes.dp_shard,
            edp_shard=sizes.edp_shard,
        )
        mine = my_shard(self._shards)
        if mine is None:  # the shard spans the whole world, so every rank is a member
            raise GroupCreationError(f"rank {dist.get_rank()} is outside a shard of {world_size} ranks")
        built = mine.handle
        for name in (
            "device_mesh",
            "fsdp_non_moe_mesh",
            "fsdp_moe_mesh",
            "_dp_cp_mesh",
            "dp_rank",
            "tp_rank",
            "cp_rank",
            "pp_rank",
            "ep_rank",
        ):
            setattr(self, name, getattr(built, name))


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
