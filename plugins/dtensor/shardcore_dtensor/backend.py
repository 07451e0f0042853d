"""The DTensor backend: a member rank gets dense, expert and dp×cp DeviceMeshes over its window."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Any

from shardcore.engine.backend import Backend
from shardcore.engine.device import device_type
from shardcore.engine.hookspecs import hookimpl
from shardcore.plan.protocols import GridLike, ShardPlanLike


class DTensorShard:
    """A member rank's meshes: ``mesh`` (pp, dp, cp, tp), ``expert_mesh``, and the flat ``dp_cp`` mesh.

    Each mesh is built on first use: wrapping groups is local (no communication) but costs
    milliseconds, and a dense model never needs the expert mesh.
    """

    def __init__(self, plan: ShardPlanLike, groups: Mapping[str, Any], device_type: str) -> None:
        self.plan, self.groups, self.device_type = plan, dict(groups), device_type

    def __repr__(self) -> str:
        return f"DTensorShard(shard={self.plan.index}, spec='{self.plan.spec}', device_type={self.device_type!r})"

    @cached_property
    def mesh(self) -> Any:
        """Dense mesh over the window: (pp, dp, cp, tp), or (dp, pp, cp, tp) under tp-cp-pp-dp."""
        return window_mesh(self.plan.decoder_grid, self.groups, self.device_type)

    @cached_property
    def expert_mesh(self) -> Any:
        """Expert mesh over the window: (pp, expt_dp, ep, expt_tp), or (expt_dp, pp, ep, expt_tp)."""
        return window_mesh(self.plan.expert_grid, self.groups, self.device_type)

    @cached_property
    def dp_cp(self) -> Any:
        """The flattened dp×cp mesh (gradient all-reduce domain)."""
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(self.groups["dp_cp"], self.device_type, mesh_dim_names=("dp_cp",))


def window_mesh(grid: GridLike, groups: Mapping[str, Any], device: str) -> Any:
    """A DeviceMesh over a grid's window that wraps the existing group of each dim (creates none).

    Mesh dims are the grid dims slowest first, because a mesh tensor is row-major; every
    grid dim name is also the name of the group along that dim.
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    dims = tuple(reversed(grid.dim_names))
    ranks = torch.arange(grid.rank_offset, grid.rank_offset + grid.size).reshape(tuple(reversed(grid.shape)))
    return DeviceMesh.from_group([groups[d] for d in dims], device, mesh=ranks, mesh_dim_names=dims)


class DTensorBackend(Backend):
    """DeviceMeshes over each shard's window, wrapping the groups shardcore created."""

    name = "dtensor"
    description = "PyTorch DTensor DeviceMeshes (dense, expert, dp×cp) over each shard's window"
    group_names = ("tp", "cp", "pp", "dp", "dp_cp", "ep", "expt_tp", "expt_dp")
    options = ("device_type",)

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed: pip install torch"
        return None

    def device_note(self) -> str:
        """The mesh device type: cuda, else a working Ascend NPU, else cpu."""
        return f"would use {device_type()}"

    def load_framework(self) -> None:
        import torch.distributed.device_mesh  # noqa: F401

    def make_handle(
        self, plan: ShardPlanLike, rank: int, groups: Mapping[str, Any], options: Mapping[str, Any]
    ) -> DTensorShard:
        return DTensorShard(plan, groups, options.get("device_type") or device_type())


@hookimpl
def shardcore_register_backends(register: Callable[[Backend], None]) -> None:
    """Register the ``dtensor`` backend."""
    register(DTensorBackend())
