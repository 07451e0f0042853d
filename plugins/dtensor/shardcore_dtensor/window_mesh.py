"""DeviceMeshes over one shard's window on which ``_flatten`` and ``_unflatten`` are safe.

A plain DeviceMesh creates the groups of a ``_flatten`` or ``_unflatten`` with default-mode
``new_group``, whose torch name comes from a world-wide counter; two windows doing it at
once pick the same names and gloo mixes their ranks (see ``shardcore.engine.groups.window``).
``WindowMesh`` is a DeviceMesh whose every derived mesh (slice, flatten, unflatten) is again
a ``WindowMesh``, and which creates new groups through the window's agreement instead:

* ``mesh[dims]._flatten(name)`` of a name declared at build time (``flatten=``) or made
  before returns the registered mesh and creates nothing, as torch does for a repeat;
* a new name, or ``_unflatten``, creates its groups window-locally: every rank of the
  window (not of the world) must call it, in the same order; a rank absent or asking for
  something else makes the window's ranks raise GroupCreationError naming it.

This is the one module that relies on DeviceMesh internals (``_layout``, ``_rank_map``,
``_flatten_mapping``, ``_pg_registry``, ``_dim_group_names``, ``_create_sub_mesh``,
``_create_flatten_mesh``, ``_create_unflatten_mesh`` and ``_init_process_groups``, as in
torch 2.13 and 2.14): importing it checks them (``MESH_INTERNALS``; the ones a mesh holds
when the first one is made), so another torch fails in one line naming the internal. It
imports torch, so import it on use.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.distributed.device_mesh

from shardcore import GroupCreationError, TorchInternalsError
from shardcore.engine import Window, check_torch_internals, torch_internal_missing

OWNER = "shardcore-dtensor"
MESH_METHODS = (
    "_create_sub_mesh",
    "_create_flatten_mesh",
    "_create_unflatten_mesh",
    "_init_process_groups",
    "_get_root_mesh",
    "_hash_key",
)
MESH_STATE = ("_device_type", "_layout", "_rank_map", "_flatten_mapping", "_pg_registry")
"""What every DeviceMesh holds: checked on the first mesh made here (``over_groups``)."""


def _has_mesh_layout(distributed: ModuleType) -> bool:
    layout = importlib.import_module(f"{distributed.__name__}._mesh_layout")._MeshLayout
    return callable(layout.collapse) and callable(layout.remap_to_tensor)


def _has_mesh_method(name: str) -> Callable[[ModuleType], bool]:
    """The check of one DeviceMesh method: one each, so a torch without one is told which."""
    return lambda distributed: callable(getattr(distributed.device_mesh.DeviceMesh, name))


MESH_INTERNALS: dict[str, Callable[[ModuleType], bool]] = {
    "device_mesh.DeviceMesh(..., _layout=, _rank_map=, _root_mesh=, _init_backend=)": lambda distributed: (
        {
            "_layout",
            "_rank_map",
            "_root_mesh",
            "_init_backend",
        }
        <= set(inspect.signature(distributed.device_mesh.DeviceMesh.__init__).parameters)
    ),
    **{f"device_mesh.DeviceMesh.{name}": _has_mesh_method(name) for name in MESH_METHODS},
    "_mesh_layout._MeshLayout (collapse, remap_to_tensor)": _has_mesh_layout,
}
"""The torch.distributed internals this module relies on, checked when it is imported."""

check_torch_internals(OWNER, torch.distributed, MESH_INTERNALS)

from torch.distributed._mesh_layout import _MeshLayout  # noqa: E402  # known to be there only now
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402


class _DeclaredFlattens(dict[str, DeviceMesh]):
    """A root mesh's ``_flatten_mapping`` whose declared flattenings are built on first use.

    Building one walks the window's whole rank map in torch (tens of milliseconds for a
    window of 262,144 ranks), so a flattening nobody asks for is never built; to torch, which
    reads the mapping with ``in``, ``[]``, ``len`` and ``items``, every declared name is there.
    """

    def __init__(self, root: WindowMesh) -> None:
        super().__init__()
        self.root = root
        self.pending: dict[str, tuple[tuple[str, ...], Any]] = {}

    def _build(self, name: str) -> None:
        declared = self.pending.pop(name, None)
        if declared is not None:
            dims, group = declared
            flat = self.root._flat_mesh(self.root, _MeshLayout([self.root[dims]._layout.collapse()]), name)
            flat._dim_group_names = [group.group_name]
            self.root._pg_registry[group.group_name] = group
            super().__setitem__(name, flat)

    def _build_all(self) -> None:
        for name in list(self.pending):
            self._build(name)

    def __contains__(self, name: object) -> bool:
        return name in self.pending or super().__contains__(name)

    def __getitem__(self, name: str) -> DeviceMesh:
        self._build(name)
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:
        self._build(name)
        return super().get(name, default)

    def __len__(self) -> int:
        return super().__len__() + len(self.pending)

    def __iter__(self) -> Any:
        self._build_all()
        return super().__iter__()

    def items(self) -> Any:
        self._build_all()
        return super().items()

    def keys(self) -> Any:
        self._build_all()
        return super().keys()

    def values(self) -> Any:
        self._build_all()
        return super().values()


class WindowMesh(DeviceMesh):
    """A DeviceMesh over a shard's window that creates groups only with the window's agreement."""

    _window: Window | None = None
    """Set on the root mesh only; derived meshes read their root's."""

    @classmethod
    def over_groups(
        cls, groups: Sequence[Any], device_type: str, ranks: torch.Tensor, dim_names: tuple[str, ...], window: Any
    ) -> WindowMesh:
        """A root mesh wrapping one existing group per dim (what ``DeviceMesh.from_group`` does), creating none.

        Args:
            groups: this rank's group along each dim, in ``dim_names`` order.
            device_type: the mesh device type.
            ranks: the window's global ranks shaped as the mesh, dims in ``dim_names`` order.
            dim_names: the mesh dim names.
            window: the window that creates later groups (``Shard.window``); None refuses creation.
        """
        mesh = cls(device_type, ranks, mesh_dim_names=dim_names, _init_backend=False)
        for name in MESH_STATE:
            if not hasattr(mesh, name):
                raise TorchInternalsError(
                    torch_internal_missing(OWNER, f"torch.distributed.device_mesh.DeviceMesh.{name}")
                )
        mesh._dim_group_names = [group.group_name for group in groups]
        mesh._pg_registry.update({group.group_name: group for group in groups})
        mesh._window = window
        mesh._flatten_mapping = _DeclaredFlattens(mesh)
        return mesh

    def register_flatten(self, name: str, dims: Sequence[str], group: Any) -> None:
        """Record an existing group as the flattening of ``dims`` named ``name`` (on the root mesh).

        Afterwards ``mesh[dims]._flatten(name)`` and ``mesh[name]`` return it, creating nothing
        (the mesh object itself is built on first use).
        """
        order = self.mesh_dim_names or ()
        self._flatten_mapping.pending[name] = (tuple(sorted(dims, key=order.index)), group)  # type: ignore[attr-defined]

    def _hash_key(self) -> tuple[Any, ...]:
        return (*super()._hash_key(), tuple(getattr(self, "_dim_group_names", ())))

    def __eq__(self, other: object) -> bool:
        """Same ranks, layout and names, and the same groups too.

        torch compares meshes without their groups, so after ``destroy_shards`` and a rebuild
        over the same window DTensor's caches would hand back the old mesh and its destroyed
        groups ("Could not resolve the process group registered under the name ...").
        """
        return super().__eq__(other) and getattr(self, "_dim_group_names", None) == getattr(
            other, "_dim_group_names", None
        )

    __hash__ = DeviceMesh.__hash__

    @staticmethod
    def _adopt(mesh: DeviceMesh) -> WindowMesh:
        """Make a mesh torch derived from a window mesh a window mesh too (same state, safer methods)."""
        mesh.__class__ = WindowMesh
        return mesh  # type: ignore[return-value]  # the class was just set

    @classmethod
    def _flat_mesh(cls, root: DeviceMesh, layout: _MeshLayout, name: str) -> WindowMesh:
        """A 1-D window mesh named ``name`` over ``layout`` of ``root``'s ranks, its group not yet set."""
        return cls._adopt(
            DeviceMesh(
                root._device_type,
                _layout=layout,
                _rank_map=root._rank_map,
                mesh_dim_names=(name,),
                _root_mesh=root,
                _init_backend=False,
            )
        )

    def _create_sub_mesh(self, layout: _MeshLayout, submesh_dim_names: tuple[str, ...]) -> DeviceMesh:
        return self._adopt(super()._create_sub_mesh(layout, submesh_dim_names))

    def _create_unflatten_mesh(
        self,
        dim: int,
        mesh_sizes: tuple[int, ...],
        mesh_dim_names: tuple[str, ...],
        backend_override: tuple[tuple[str | None, Any], ...] = ((None, None),),
    ) -> DeviceMesh:
        return self._adopt(super()._create_unflatten_mesh(dim, mesh_sizes, mesh_dim_names, backend_override))

    def _create_flatten_mesh(self, mesh_dim_name: str, backend_override: tuple[str | None, Any] = (None, None)) -> None:
        root = self._get_root_mesh()
        if mesh_dim_name in root._flatten_mapping or mesh_dim_name in (root.mesh_dim_names or ()):
            super()._create_flatten_mesh(mesh_dim_name, backend_override)  # a repeat, or torch's own ValueError
            return
        layout = _MeshLayout([self._layout.collapse()])
        flat = self._flat_mesh(root, layout, mesh_dim_name)
        flat._dim_group_names = self._init_process_groups(layout, root._rank_map, (mesh_dim_name,), (backend_override,))
        root._flatten_mapping[mesh_dim_name] = flat

    def _init_process_groups(  # type: ignore[override]  # torch's is static; this one needs the window
        self,
        layout: _MeshLayout,
        rank_map: torch.Tensor,
        mesh_dim_names: tuple[str, ...] | None,
        backend_override: tuple[tuple[str | None, Any], ...],
    ) -> list[Any]:
        """Each new dim's groups, created by the window's ranks alone (torch's creates them world-collectively)."""
        root = self._get_root_mesh()
        window = getattr(root, "_window", None)
        dims = mesh_dim_names or tuple(f"dim_{i}" for i in range(len(layout)))
        if window is None:
            raise GroupCreationError(
                f"this window mesh was not made by build_shards, so it cannot create the groups of {', '.join(dims)} "
                f"safely: declare them at build time (build_shards(..., flatten={{'{dims[0]}': (...)}}))"
            )
        names = []
        for index, name in enumerate(dims):
            rows = _MeshLayout([layout[index]]).remap_to_tensor(rank_map).tolist()
            backend, options = backend_override[index]
            group = window.new_groups(rows, backend=backend, pg_options=options, group_desc=f"mesh_{name}")
            if group is not None:
                names.append(group.group_name)
                root._pg_registry[group.group_name] = group
        return names


__all__ = ["WindowMesh"]
