"""Meshes over groups shardcore created, as Hyper-Parallel's or torch's DeviceMesh; none creates a group.

Both classes wrap existing groups (``DeviceMesh.from_group``). Hyper-Parallel's then finds a
dim's group by its sorted ranks in a process-wide cache that ``from_group`` fills only where
those ranks are not cached yet: after ``destroy_shards`` and a rebuild it would hand back
the destroyed group, and a group of the same ranks made elsewhere would shadow shardcore's.
So shardcore's groups are put in that cache first, and every wrapped dim is checked to
resolve to shardcore's group: one that did not would be created on first use through
Hyper-Parallel's ``split_group``, whose stage-local, counter-named groups collide across
pipeline stages.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from math import prod
from typing import Any

from shardcore import GroupCreationError

from .install import mesh_classes

GROUP_CACHE = "EXISTING_COMM_GROUPS"
"""The name of Hyper-Parallel's group cache in its DeviceMesh's module: ``str(tuple(sorted(ranks)))`` -> group."""


def _adopt(mesh_class: type, groups: Sequence[Any]) -> None:
    """Make the mesh class's group cache, if it keeps one, hold shardcore's groups for their ranks."""
    cache = getattr(sys.modules.get(mesh_class.__module__), GROUP_CACHE, None)
    if not isinstance(cache, dict):
        return
    import torch.distributed as dist

    for group in groups:
        cache[str(tuple(sorted(dist.get_process_group_ranks(group))))] = group


def _checked(mesh: Any, names: tuple[str, ...], groups: Sequence[Any]) -> Any:
    """``mesh``, once each of its dims is known to resolve to shardcore's group."""
    for name, group in zip(names, groups):
        if mesh.get_group(name) is not group:
            raise GroupCreationError(
                f"{type(mesh).__module__}.{type(mesh).__name__} resolves mesh dim {name!r} to a group other than "
                f"the one shardcore created (its group cache changed shape?): this version of the mesh class "
                f"cannot wrap existing groups safely; uninstall it to use torch's DeviceMesh"
            )
    return mesh


def wrap_mesh(groups: list[Any], shape: tuple[int, ...], names: tuple[str, ...], start: int, device: str) -> Any:
    """A DeviceMesh over ``[start, start+prod(shape))`` (row-major) wrapping one existing group per dim."""
    import torch

    mesh_class: Any = mesh_classes().device_mesh
    _adopt(mesh_class, groups)
    ranks = torch.arange(start, start + prod(shape)).reshape(shape)
    return _checked(mesh_class.from_group(groups, device, mesh=ranks, mesh_dim_names=names), names, groups)


def wrap_ranks(group: Any, ranks: list[int], device: str, name: str) -> Any:
    """A 1-D DeviceMesh over an existing group whose ranks need not be consecutive."""
    import torch

    mesh_class: Any = mesh_classes().device_mesh
    _adopt(mesh_class, [group])
    mesh = mesh_class.from_group(group, device, mesh=torch.tensor(ranks), mesh_dim_names=(name,))
    return _checked(mesh, (name,), [group])


def flatten_existing(mesh: Any, dims: tuple[str, ...], name: str, group: Any, rows: Sequence[Sequence[int]]) -> Any:
    """``mesh[dims].flatten(name)``: the flattened dim Hyper-Parallel's own build makes (a dim of ``mesh``'s
    root, found by name, sliceable and concatenable with its other dims), over shardcore's ``group``.

    Hyper-Parallel's flatten asks ``split_group`` for every peer row of the root, which takes a row from the
    group cache when it is there: so every row is put there first, this rank's as ``group`` and the others
    as what ``new_group`` hands a non-member (torch's ``GroupMember.NON_GROUP_MEMBER``), and the flatten
    creates nothing. That it created nothing, and that the new dim resolves to ``group``, is checked.

    Args:
        mesh: a Hyper-Parallel DeviceMesh (a root: its flattened dims are found through it).
        dims: the dims to flatten, in ``mesh``'s order.
        name: the flattened dim's name.
        group: this rank's group over the flattened dim (created by shardcore).
        rows: every peer row of the flattening in ``mesh`` (the groups of all ranks of ``mesh``).

    Raises:
        GroupCreationError: the flatten created a group anyway, or resolves the new dim to another group.
    """
    import torch.distributed as dist

    from shardcore.engine import live_group_count

    _adopt(type(mesh), [group])
    cache = getattr(sys.modules.get(type(mesh).__module__), GROUP_CACHE, None)
    if isinstance(cache, dict):
        for row in rows:
            cache.setdefault(str(tuple(sorted(row))), dist.GroupMember.NON_GROUP_MEMBER)
    before = live_group_count()
    flat = mesh[dims].flatten(name)
    if live_group_count() != before:
        raise GroupCreationError(
            f"{type(mesh).__module__}.{type(mesh).__name__}.flatten({name!r}) created process groups although "
            f"shardcore had put every row in its group cache (its flatten changed?): uninstall it to use torch's "
            f"DeviceMesh"
        )
    return _checked(flat, (name,), [group])


__all__ = ["GROUP_CACHE", "flatten_existing", "wrap_mesh", "wrap_ranks"]
