"""The DTensor backend: a member rank gets dense, expert and dp×cp DeviceMeshes over its window.

Flattened meshes (torchtitan's ``mesh["dp", "cp"]._flatten("dp_cp")``) are declared at build
time, ``flatten={"dp_tp": ("dp", "tp")}`` for the dense mesh and ``expert_flatten=`` for the
expert mesh: the engine creates their groups with the rest (one extra grid group each,
shared with any standard group of the same ranks) and the meshes register them, so
``_flatten`` and ``mesh[name]`` return them without creating a group. Every standard group
that flattens several dims of a mesh and was created (``dp_cp`` by default) is registered
under its own name the same way. Flattening anything else later is still safe, but it is a
window-collective creation (see ``shardcore_dtensor.window_mesh``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any

from shardcore import Backend, GridLike, LayoutError, NamedGrids, ShardPlanLike, hookimpl
from shardcore.engine import Window, device_type, window_of
from shardcore.plan import DECODER_GROUPS, EXPERT_GROUPS

if TYPE_CHECKING:
    from shardcore import Layout

MESHES: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "flatten": ("decoder_grid", DECODER_GROUPS),
    "expert_flatten": ("expert_grid", EXPERT_GROUPS),
}
"""Flatten option (of ``mesh``, of ``expert_mesh``) -> (the plan's grid under that mesh, the grid's standard groups)."""


class DTensorShard:
    """A member rank's meshes: ``mesh`` (pp, dp, cp, tp), ``expert_mesh``, and the flat ``dp_cp`` mesh.

    Each mesh is built on first use: wrapping groups is local (no communication) but costs
    milliseconds, and a dense model never needs the expert mesh.
    """

    def __init__(
        self,
        plan: ShardPlanLike,
        groups: Mapping[str, Any],
        device_type: str,
        flatten: Mapping[str, Mapping[str, tuple[str, ...]]] | None = None,
        window: Window | None = None,
    ) -> None:
        self.plan, self.groups, self.device_type = plan, dict(groups), device_type
        self.declared = {option: dict((flatten or {}).get(option) or {}) for option in MESHES}
        """Flatten option -> {flattened name: dims}, as given to build_shards."""
        self.window = window

    def __repr__(self) -> str:
        return f"DTensorShard(shard={self.plan.index}, spec='{self.plan.spec}', device_type={self.device_type!r})"

    @cached_property
    def mesh(self) -> Any:
        """Dense mesh over the window: (pp, dp, cp, tp), or (dp, pp, cp, tp) under tp-cp-pp-dp.

        Its flattened meshes (``dp_cp`` and those declared with ``flatten=``) are registered.
        """
        return self._mesh("flatten")

    @cached_property
    def expert_mesh(self) -> Any:
        """Expert mesh over the window: (pp, expt_dp, ep, expt_tp), or (expt_dp, pp, ep, expt_tp).

        Its flattened meshes (those declared with ``expert_flatten=``) are registered.
        """
        return self._mesh("expert_flatten")

    def flatten(self, *dims: str, name: str | None = None, expert: bool = False) -> Any:
        """The 1-D mesh flattening ``dims`` of ``mesh`` (or of ``expert_mesh``); public spelling of ``_flatten``.

        Declared or already made: returned at no cost. Otherwise created by the window's ranks
        alone, so every rank of this shard (not of the world) must call it, in the same order.

        Args:
            *dims: mesh dim names, in any order.
            name: the flattened dim's name; default the dims joined by ``_`` in mesh order.
            expert: flatten the expert mesh.

        Raises:
            LayoutError: an unknown dim.
            GroupCreationError: a window rank absent or asking for something else within the timeout.
        """
        mesh = self.expert_mesh if expert else self.mesh
        names = tuple(mesh.mesh_dim_names)
        unknown = [dim for dim in dims if dim not in names]
        if unknown or not dims:
            raise LayoutError(f"cannot flatten {dims!r}: name dims of this mesh ({', '.join(names)})")
        ordered = tuple(sorted(dims, key=names.index))
        return mesh[ordered]._flatten(name)

    def _mesh(self, option: str) -> Any:
        grid_attribute, standard = MESHES[option]
        grid: GridLike = getattr(self.plan, grid_attribute)
        mesh = window_mesh(grid, self.groups, self.device_type, self.window)
        flattens = {name: dims for name, dims in standard.items() if len(dims) > 1 and self.groups.get(name)}
        flattens.update(self.declared[option])
        for name, dims in flattens.items():
            group = self.groups.get(f"{option}:{name}") or self.groups[name]
            mesh.register_flatten(name, dims, group)
        return mesh

    @cached_property
    def dp_cp(self) -> Any:
        """The flattened dp×cp mesh (gradient all-reduce domain)."""
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(self.groups["dp_cp"], self.device_type, mesh_dim_names=("dp_cp",))


def window_mesh(grid: GridLike, groups: Mapping[str, Any], device: str, window: Window | None = None) -> Any:
    """A WindowMesh over a grid's window that wraps the existing group of each dim (creates none).

    Mesh dims are the grid dims slowest first, because a mesh tensor is row-major; every
    grid dim name is also the name of the group along that dim. ``window`` creates the
    groups of a later ``_flatten`` / ``_unflatten``; without it they raise GroupCreationError.
    """
    import torch

    from .window_mesh import WindowMesh

    dims = tuple(reversed(grid.dim_names))
    ranks = torch.arange(grid.rank_offset, grid.rank_offset + grid.size).reshape(tuple(reversed(grid.shape)))
    return WindowMesh.over_groups([groups[d] for d in dims], device, ranks, dims, window)


def check_flatten(option: str, value: Any, grid: GridLike) -> dict[str, tuple[str, ...]]:
    """A flatten option as {name: dims}, checked against the grid it flattens.

    Raises:
        LayoutError: not a mapping of new names to known dims, or a name that is a mesh dim
            or a standard group of other dims.
    """
    standard = MESHES[option][1]
    if not isinstance(value, Mapping):
        raise LayoutError(
            f"{option}={value!r}: expected a dict of flattened name -> dims, e.g. {{'dp_tp': ('dp', 'tp')}}"
        )
    checked: dict[str, tuple[str, ...]] = {}
    for name, dims in value.items():
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        if not isinstance(name, str) or not name or name in grid.dim_names:
            raise LayoutError(
                f"{option}: {name!r} is not a new dim name (the mesh has {', '.join(grid.dim_names)}); pick another"
            )
        unknown = [dim for dim in dims if dim not in grid.dim_names]
        if not dims or unknown or len(set(dims)) != len(dims):
            raise LayoutError(
                f"{option}: {name!r} flattens {dims!r}; expected distinct dims of {', '.join(grid.dim_names)}"
            )
        if name in standard and set(standard[name]) != set(dims):
            raise LayoutError(
                f"{option}: {name!r} is shardcore's standard group of dims {standard[name]}, not {dims}: "
                f"pick another name"
            )
        checked[name] = dims
    return checked


class DTensorBackend(Backend):
    """DeviceMeshes over each shard's window, wrapping the groups shardcore created."""

    name = "dtensor"
    description = "PyTorch DTensor DeviceMeshes (dense, expert, dp×cp) over each shard's window"
    group_names = ("tp", "cp", "pp", "dp", "dp_cp", "ep", "expt_tp", "expt_dp")
    options = ("device_type", *MESHES)

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed: pip install torch"
        return None

    def device_note(self) -> str:
        """The mesh device type: cuda, else a working Ascend NPU, else cpu."""
        return f"would use {device_type()}"

    def validate(self, layout: Layout, options: Mapping[str, Any]) -> None:
        for plan in layout.shards:
            self._flattens(plan, options)

    def extra_groups(self, plan: ShardPlanLike, options: Mapping[str, Any]) -> NamedGrids:
        """One grid group per declared flattening, named ``<option>:<name>``."""
        return {
            f"{option}:{name}": (getattr(plan, MESHES[option][0]), dims)
            for option, flattens in self._flattens(plan, options).items()
            for name, dims in flattens.items()
        }

    def load_framework(self) -> None:
        """Import DeviceMesh, and check the torch internals the window meshes rely on (one line if one is gone)."""
        from . import window_mesh  # noqa: F401

    def make_handle(
        self, plan: ShardPlanLike, rank: int, groups: Mapping[str, Any], options: Mapping[str, Any]
    ) -> DTensorShard:
        return DTensorShard(
            plan,
            groups,
            options.get("device_type") or device_type(),
            self._flattens(plan, options),
            window_of(plan.rank_offset, plan.size),
        )

    @staticmethod
    def _flattens(plan: ShardPlanLike, options: Mapping[str, Any]) -> dict[str, dict[str, tuple[str, ...]]]:
        return {
            option: check_flatten(option, options[option], getattr(plan, MESHES[option][0]))
            for option in MESHES
            if options.get(option)
        }


@hookimpl
def shardcore_register_backends(register: Callable[[Backend], None]) -> None:
    """Register the ``dtensor`` backend."""
    register(DTensorBackend())
