"""MeshContext and DistributedSetup compatible with Hyper-Parallel's, for when it is not installed.

Hyper-Parallel is installed from source only, so these dataclasses carry the same fields,
defaults, properties and methods (``shardcore_hyperparallel.install`` picks Hyper-Parallel's
own classes when its current layout is installed); code written against either works with
both. ``build_meshs`` here, and on the subclass of Hyper-Parallel's class, builds through
shardcore's engine, so no group is ever created by Hyper-Parallel's own mesh code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardcore import GroupCreationError

from .topology import resolve_sizes

BUILT_FIELDS = (
    "device_mesh",
    "fsdp_non_moe_mesh",
    "fsdp_moe_mesh",
    "_dp_cp_mesh",
    "dp_rank",
    "tp_rank",
    "cp_rank",
    "pp_rank",
    "ep_rank",
)
"""What a standalone ``build_meshs`` copies from the handle shardcore built."""


def flat_dp_cp(mesh_context: Any) -> Any:
    """dp x cp as one 1-D mesh: the engine's prebuilt one when present, else flattened from device_mesh."""
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


def build_through_shardcore(mesh_context: Any, device_type: str, world_size: int) -> None:
    """``MeshContext.build_meshs`` without a shardcore layout: check sizes, then build this stage's meshes.

    Like Hyper-Parallel's own ``build_meshs``, every rank of the world calls it. The groups
    come from shardcore's engine (one shard ``tp, cp, dp, pp, ep`` over the world with the
    ``hyperparallel`` backend), so no process group is created by Hyper-Parallel's code or
    this package, and pipeline stages never share a group name.

    Raises:
        LayoutError: sizes Hyper-Parallel rejects.
        GroupCreationError: torch.distributed is not initialised, or creation failed.
    """
    sizes = resolve_sizes(
        world_size=world_size,
        dp=mesh_context.dp_size,
        cp=mesh_context.cp_size,
        tp=mesh_context.tp_size,
        pp=mesh_context.pp_size,
        ep=mesh_context.ep_size,
        dp_replicate=mesh_context.dp_replicate_size,
        dp_shard=mesh_context.dp_shard_size,
        edp_shard=mesh_context.edp_shard_size,
    )
    import torch.distributed as dist

    from shardcore import ShardSpec, build_shards, my_shard

    if not dist.is_initialized():
        raise GroupCreationError("build_meshs needs torch.distributed: call init_process_group() first")
    # expt_tp=1: Hyper-Parallel's ep folds over the whole stage, which shardcore accepts for ep | dp*cp*tp
    spec = ShardSpec(tp=sizes.tp, cp=sizes.cp, dp=sizes.dp, pp=sizes.pp, ep=sizes.ep, expt_tp=1)
    mesh_context._shards = build_shards(
        world_size,
        [spec],
        backend="hyperparallel",
        device_type=device_type,
        dp_replicate=sizes.dp_replicate,
        dp_shard=sizes.dp_shard,
        edp_shard=sizes.edp_shard,
    )
    mine = my_shard(mesh_context._shards)
    if mine is None:  # the shard spans the whole world, so every rank is a member
        raise GroupCreationError(f"rank {dist.get_rank()} is outside a shard of {world_size} ranks")
    for name in BUILT_FIELDS:
        setattr(mesh_context, name, getattr(mine.handle, name))


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
        return flat_dp_cp(self)

    @property
    def cp_mesh(self) -> Any:
        """The cp submesh (size 1 when cp is off, as in Hyper-Parallel), None without a device mesh."""
        if self.device_mesh is None or "cp" not in (self.device_mesh.mesh_dim_names or ()):
            return None
        return self.device_mesh["cp"]

    build_meshs = build_through_shardcore


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


__all__ = ["DistributedSetup", "MeshContext", "build_through_shardcore", "flat_dp_cp"]
