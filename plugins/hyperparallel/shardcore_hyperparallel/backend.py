"""The ``hyperparallel`` backend: a member rank gets a MeshContext for its pipeline stage.

The engine creates every group; this module only declares the extra ones the three
meshes need (as grids over the shard window) and wraps them in DeviceMeshes:
Hyper-Parallel's own when it is installed, torch's otherwise (``install.mesh_classes``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardcore import (
    Backend,
    BackendUnavailableError,
    Grid,
    Layout,
    LayoutError,
    NamedGrids,
    Order,
    ShardPlanLike,
    hookimpl,
)

from .device import device_note, select_device
from .install import installed_layout, mesh_classes
from .meshes import flatten_existing, wrap_mesh, wrap_ranks
from .topology import StageSizes, check_dense_tp_layout, resolve_sizes, stage_start

OPTIONS = ("dp_replicate", "dp_shard", "edp_shard", "sequence_parallel", "loss_parallel", "device_type")
"""Backend options of ``build_shards(..., backend="hyperparallel", **options)``."""

MESH_GROUPS: dict[str, dict[str, str]] = {
    "device_mesh": {"dp": "dp", "cp": "cp", "tp": "tp"},
    "fsdp_non_moe_mesh": {"fsdp_replicate": "fsdp_replicate", "fsdp_shard": "fsdp_shard", "tp": "tp"},
    "fsdp_moe_mesh": {"edp_replicate": "edp_replicate", "edp_shard": "edp_shard", "ep": "hp_ep"},
}
"""For each mesh, the engine group that each of its dims wraps."""


def _option(options: Mapping[str, Any], key: str, plan: ShardPlanLike) -> Any:
    """An option's value for one shard: one value for all, a sequence by shard index, or a mapping
    keyed by shard index or name (shards differ in dp, so one dp_shard rarely fits all)."""
    value = options.get(key)
    if isinstance(value, Mapping):
        for k in (plan.index, plan.spec.name):
            if k is not None and k in value:
                return value[k]
        return None
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) <= plan.index:
            raise LayoutError(f"{key}={list(value)!r} gives no value for shard {plan.index}: give one per shard")
        return value[plan.index]
    return value


def shard_sizes(plan: ShardPlanLike, options: Mapping[str, Any]) -> StageSizes:
    """The shard's Hyper-Parallel sizes with Hyper-Parallel's checks (a LayoutError says what to change)."""
    spec = plan.spec
    return resolve_sizes(
        world_size=plan.size,
        dp=spec.dp,
        cp=spec.cp,
        tp=spec.tp,
        pp=spec.pp,
        ep=spec.ep,
        dp_replicate=_option(options, "dp_replicate", plan),
        dp_shard=_option(options, "dp_shard", plan),
        edp_shard=_option(options, "edp_shard", plan),
        where=f"shard {plan.index} ('{spec}'): ",
    )


def stage_grids(plan: ShardPlanLike, sizes: StageSizes) -> NamedGrids:
    """The extra groups, as grids over the whole shard with pp slowest (one window per stage).

    Expert groups are Hyper-Parallel's (ep innermost over the flattened stage), not
    Megatron's ``ep`` groups, hence the ``hp_ep`` name.
    """
    offset = plan.rank_offset
    dense = Grid(
        (sizes.tp, sizes.dp_shard, sizes.dp_replicate, sizes.pp), ("tp", "fsdp_shard", "fsdp_replicate", "pp"), offset
    )
    grids: dict[str, tuple[Grid, str]] = {
        "fsdp_shard": (dense, "fsdp_shard"),
        "fsdp_replicate": (dense, "fsdp_replicate"),
    }
    if sizes.ep > 1:
        expert = Grid(
            (sizes.ep, sizes.edp_shard, sizes.edp_replicate, sizes.pp),
            ("ep", "edp_shard", "edp_replicate", "pp"),
            offset,
        )
        grids.update(hp_ep=(expert, "ep"), edp_shard=(expert, "edp_shard"))
        if sizes.edp_replicate > 1:
            grids["edp_replicate"] = (expert, "edp_replicate")
    return grids


class HyperParallelBackend(Backend):
    """Hyper-Parallel MeshContexts per pipeline stage, wrapping the groups shardcore created."""

    name = "hyperparallel"
    description = (
        "Hyper-Parallel MeshContext per shard and pipeline stage (Ascend NPU/HCCL, else CUDA/NCCL, else CPU/gloo)"
    )
    group_names = ("tp", "cp", "dp", "dp_cp")
    options = OPTIONS

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed: pip install torch (and torch-npu with Ascend CANN for NPUs)"
        try:
            installed_layout()
        except BackendUnavailableError as error:
            return str(error)
        return None

    def load_framework(self) -> None:
        """Import Hyper-Parallel's classes (or the fallbacks) ahead of building."""
        mesh_classes()

    def device_note(self) -> str:
        """Which device and collective library this backend would use here, and why."""
        return device_note()

    def validate(self, layout: Layout, options: Mapping[str, Any]) -> None:
        staged = [plan for plan in layout.shards if plan.spec.pp > 1]
        if layout.order != Order.TP_CP_DP_PP and staged:
            raise LayoutError(
                f"order='{layout.order}' interleaves pipeline stages, but Hyper-Parallel's stages are contiguous "
                f"windows of dp*cp*tp ranks (shard {staged[0].index} has pp={staged[0].spec.pp}): "
                f"use order='tp-cp-dp-pp' with backend 'hyperparallel'"
            )
        for plan in layout.shards:
            shard_sizes(plan, options)

    def extra_groups(self, plan: ShardPlanLike, options: Mapping[str, Any]) -> NamedGrids:
        return stage_grids(plan, shard_sizes(plan, options))

    def make_handle(self, plan: ShardPlanLike, rank: int, groups: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
        sizes = shard_sizes(plan, options)
        device = options.get("device_type") or select_device().device_type
        coords = plan.decoder_grid.coords(rank)
        start = stage_start(plan.rank_offset, sizes, coords["pp"])

        def mesh(kind: str, shape_names: tuple[tuple[int, ...], tuple[str, ...]] | None) -> Any:
            if shape_names is None:
                return None
            shape, names = shape_names
            return wrap_mesh([groups[MESH_GROUPS[kind][d]] for d in names], shape, names, start, device)

        device_mesh = mesh("device_mesh", sizes.device_mesh())
        fsdp_mesh = mesh("fsdp_non_moe_mesh", sizes.fsdp_non_moe_mesh())
        check_dense_tp_layout(device_mesh, fsdp_mesh)
        expert_mesh = mesh("fsdp_moe_mesh", sizes.fsdp_moe_mesh())
        context = mesh_classes().mesh_context(
            device_mesh=device_mesh,
            fsdp_non_moe_mesh=fsdp_mesh,
            fsdp_moe_mesh=expert_mesh,
            dp_size=sizes.dp,
            dp_replicate_size=sizes.dp_replicate,
            dp_shard_size=sizes.dp_shard,
            edp_shard_size=sizes.edp_shard,
            tp_size=sizes.tp,
            cp_size=sizes.cp,
            pp_size=sizes.pp,
            ep_size=sizes.ep,
            dp_rank=coords["dp"],
            tp_rank=coords["tp"],
            cp_rank=coords["cp"],
            pp_rank=coords["pp"],
            ep_rank=(rank - start) % sizes.ep,
            sequence_parallel=bool(_option(options, "sequence_parallel", plan)),
            loss_parallel=bool(_option(options, "loss_parallel", plan)),
        )
        context._dp_cp_mesh = dp_cp_mesh(plan, sizes, start, device_mesh, groups["dp_cp"], rank, device)
        return context


def dp_cp_mesh(
    plan: ShardPlanLike, sizes: StageSizes, start: int, device_mesh: Any, group: Any, rank: int, device: str
) -> Any:
    """The engine's dp x cp group as a 1-D mesh: on Hyper-Parallel's DeviceMesh, the flattened dim ``dp_cp`` of
    ``device_mesh``, as its own build makes it (and as its ``MeshContext.dp_cp_mesh`` finds it); on torch's,
    whose flatten would create groups, a mesh of its own."""
    if not hasattr(device_mesh, "add_flatten_mapping"):
        return wrap_ranks(group, list(plan.decoder_grid.group_ranks(rank, ("cp", "dp"))), device, "dp_cp")
    stage = range(start, start + sizes.dp * sizes.cp * sizes.tp)
    rows = {tuple(plan.decoder_grid.group_ranks(r, ("cp", "dp"))) for r in stage}
    return flatten_existing(device_mesh, ("dp", "cp"), "dp_cp", group, sorted(rows))


def distributed_setup(mesh_context: Any, **fields: Any) -> Any:
    """A DistributedSetup (Hyper-Parallel's when it imports) holding ``mesh_context``."""
    return mesh_classes().distributed_setup(mesh_context=mesh_context, **fields)


@hookimpl
def shardcore_register_backends(register: Callable[[Backend], None]) -> None:
    """Register the ``hyperparallel`` backend."""
    register(HyperParallelBackend())
