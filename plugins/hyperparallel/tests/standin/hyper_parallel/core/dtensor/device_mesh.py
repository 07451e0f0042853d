"""Test stand-in for Hyper-Parallel's DeviceMesh (see the stand-in's README): the API and behaviour
the hyperparallel backend meets, in plain Python over torch.distributed (no numpy)."""

from __future__ import annotations

from itertools import product
from math import prod
from typing import Any

import torch
import torch.distributed as dist

EXISTING_COMM_GROUPS: dict[str, Any] = {}
"""Process-wide group cache, ``str(tuple(sorted(ranks)))`` -> group, as Hyper-Parallel keeps it."""
CREATED: list[list[int]] = []
"""Every rank list ``split_group`` created a group for, not finding it in the cache (what tests count)."""
_DEVICE_MESH_MAP: dict[tuple[Any, ...], DeviceMesh] = {}


def _key(ranks: Any) -> str:
    return str(tuple(sorted(int(r) for r in ranks)))


def split_group(split_ranks: list[list[int]]) -> Any:
    """One group per rank list, created on every calling rank with torch's counter-named ``new_group``
    (Hyper-Parallel's torch platform does this; it is not torch's ``split_group``); this rank's group."""
    mine = None
    for ranks in split_ranks:
        group = EXISTING_COMM_GROUPS.get(_key(ranks))
        if group is None:
            group = EXISTING_COMM_GROUPS[_key(ranks)] = dist.new_group(ranks=list(ranks))
            CREATED.append(list(ranks))
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _unravel(index: int, shape: tuple[int, ...]) -> list[int]:
    coords = []
    for size in reversed(shape):
        coords.append(index % size)
        index //= size
    return coords[::-1]


def _ravel(coords: list[int], shape: tuple[int, ...]) -> int:
    index = 0
    for coord, size in zip(coords, shape):
        index = index * size + coord
    return index


class DeviceMesh:
    """A mesh of global ranks with named dims, one process group per dim (found in the cache by ranks)."""

    _VALID_DEVICE_TYPES = frozenset({"cpu", "cuda", "npu"})

    def __init__(
        self,
        device_type: str,
        mesh: Any = None,
        *,
        mesh_dim_names: tuple[str, ...] | list[str] | None = None,
        _init_backend: bool = True,
        _root_mesh: DeviceMesh | None = None,
    ) -> None:
        if device_type not in self._VALID_DEVICE_TYPES:
            raise ValueError(f"Invalid device_type '{device_type}'. Valid: {sorted(self._VALID_DEVICE_TYPES)}")
        tensor = torch.as_tensor(list(range(dist.get_world_size())) if mesh is None else mesh)
        if tensor.ndim == 0:
            raise ValueError("mesh must be at least 1-dimensional")
        self.device_type = device_type
        self.mesh = tensor.to(torch.int32)
        self._mesh_shape = tuple(int(n) for n in tensor.shape)
        self._rank_list = tuple(int(r) for r in tensor.flatten().tolist())
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self.mesh_dim_names = tuple(mesh_dim_names) if mesh_dim_names else None
        if self.mesh_dim_names is not None and (
            len(self.mesh_dim_names) != len(self._mesh_shape)
            or len(set(self.mesh_dim_names)) != len(self.mesh_dim_names)
        ):
            raise ValueError(
                f"mesh_dim_names {self.mesh_dim_names} must name each of {len(self._mesh_shape)} dims once"
            )
        self._root_mesh = _root_mesh
        self._root_axes: tuple[tuple[int, ...], ...] | None = tuple((d,) for d in range(self.ndim))
        """For each dim, the root mesh's dims it spans (several for a flattened dim); None for a mesh made
        apart from the root and only registered as its flattening (``add_flatten_mapping``)."""
        self._flatten_mapping: dict[str, DeviceMesh] = {}
        self._sub_mesh_cache: dict[tuple[str, ...], DeviceMesh] = {}
        self._dim_group_names: list[str | None] = [None] * self.ndim
        if _init_backend:
            for dim in range(self.ndim):
                if self._mesh_shape[dim] > 1:  # size-1 dims are created on first use
                    split_group(self._rows(dim))
                    self._dim_group_names[dim] = _key(self._along(dim))

    # ------------------------------------------------------------------ shape and ranks
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self._mesh_shape

    shape = mesh_shape

    @property
    def rank_list(self) -> tuple[int, ...]:
        return self._rank_list

    @property
    def ndim(self) -> int:
        return len(self._mesh_shape)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def root_mesh(self) -> DeviceMesh | None:
        return self._root_mesh

    def _root(self) -> DeviceMesh:
        return self if self._root_mesh is None else self._root_mesh._root()

    def size(self, mesh_dim: int | None = None) -> int:
        return prod(self._mesh_shape) if mesh_dim is None else self._mesh_shape[mesh_dim]

    def _index(self, mesh_dim: int | str | None) -> int:
        if mesh_dim is None:
            if self.ndim > 1:
                raise RuntimeError(f"the mesh has {self.ndim} dims: mesh_dim must be given")
            return 0
        if isinstance(mesh_dim, str):
            if mesh_dim not in (self.mesh_dim_names or ()):
                raise ValueError(f"mesh_dim '{mesh_dim}' not found in mesh_dim_names {self.mesh_dim_names}")
            return (self.mesh_dim_names or ()).index(mesh_dim)
        if not 0 <= mesh_dim < self.ndim:
            raise ValueError(f"mesh_dim must be in [0, {self.ndim}), got {mesh_dim}")
        return mesh_dim

    def get_coordinate(self) -> tuple[int, ...] | None:
        if self._rank not in self._rank_list:
            return None
        return tuple(_unravel(self._rank_list.index(self._rank), self._mesh_shape))

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        coordinate = self.get_coordinate()
        if coordinate is None:
            raise ValueError(f"Current rank {self._rank} not found in rank_list {self._rank_list}")
        return coordinate[self._index(mesh_dim)]

    def _along(self, dim: int, rank: int | None = None) -> list[int]:
        """The ranks sharing every coordinate of ``rank`` (this rank) except along ``dim``."""
        coords = _unravel(self._rank_list.index(self._rank if rank is None else rank), self._mesh_shape)
        out = []
        for k in range(self._mesh_shape[dim]):
            coords[dim] = k
            out.append(self._rank_list[_ravel(coords, self._mesh_shape)])
        return out

    def _rows(self, dim: int) -> list[list[int]]:
        """Every peer group along ``dim``, sorted: what Hyper-Parallel creates for a dim."""
        return sorted({tuple(sorted(self._along(dim, r))) for r in self._rank_list})  # type: ignore[arg-type]

    def get_rank_list_along_axis(self, mesh_dim: str) -> list[int]:
        self.assert_axis(mesh_dim)
        return self._along(self._index(mesh_dim))

    def assert_axis(self, axis: str) -> None:
        if not self.mesh_dim_names:
            raise RuntimeError("mesh_dim_names not specified")
        if axis not in self.mesh_dim_names:
            raise ValueError(f"The axis name must be one of mesh dim name {self.mesh_dim_names}, but got {axis}")

    def axis_id(self, axis: str) -> int:
        """The dim counted from the innermost (Hyper-Parallel's tensor maps use it); -1 for 'None'."""
        if axis == "None":
            return -1
        self.assert_axis(axis)
        return self.ndim - 1 - self._index(axis)

    def axis_index(self, axis: str) -> int:
        self.assert_axis(axis)
        return self._index(axis)

    # ------------------------------------------------------------------ groups
    def get_group(self, mesh_dim: int | str | None = None) -> Any:
        """This rank's group along a dim; a dim with no cached group is created now, via split_group."""
        flattened = self._root()._flatten_mapping
        if isinstance(mesh_dim, str) and mesh_dim in flattened and mesh_dim not in (self.mesh_dim_names or ()):
            return flattened[mesh_dim].get_group(0)
        dim = self._index(mesh_dim)
        key = self._dim_group_names[dim]
        if key is None or key not in EXISTING_COMM_GROUPS:
            split_group(self._rows(dim))
            key = self._dim_group_names[dim] = _key(self._along(dim))
        return EXISTING_COMM_GROUPS[key]

    def get_all_groups(self) -> list[Any]:
        return [self.get_group(dim) for dim in range(self.ndim)]

    @staticmethod
    def from_group(
        group: Any, device_type: str, mesh: Any = None, mesh_dim_names: tuple[str, ...] | list[str] | None = None
    ) -> DeviceMesh:
        """A mesh over existing groups (one, or one per dim); a group is cached only where its ranks are free."""
        groups = group if isinstance(group, list) else [group]
        if not isinstance(group, list):
            ranks = dist.get_process_group_ranks(group)
            if mesh is not None and torch.as_tensor(mesh).tolist() != ranks:
                raise ValueError(f"Invalid mesh_shape {mesh} for 1D group with ranks {ranks}")
            mesh = ranks
        elif mesh is None:
            raise ValueError("mesh_shape is must specified when group is a list.")
        result = DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, _init_backend=False)
        if result.ndim != len(groups):
            raise ValueError("mesh dimensions must match group dimensions.")
        for dim, each in enumerate(groups):
            key = _key(dist.get_process_group_ranks(each))
            EXISTING_COMM_GROUPS.setdefault(key, each)
            result._dim_group_names[dim] = key
        return result

    # ------------------------------------------------------------------ derived meshes
    def get_flatten_mapping(self) -> dict[str, DeviceMesh]:
        return self._flatten_mapping

    def add_flatten_mapping(self, name: str, mesh: DeviceMesh) -> None:
        """Register ``mesh`` as the flattened dim ``name`` as is: a mesh made apart keeps its own root (none)."""
        if mesh._root_mesh is None:
            mesh._root_axes = None
        self._flatten_mapping[name] = mesh

    def _axes_of(self, name: str) -> tuple[int, ...]:
        """The root dims that a dim of this mesh, or a flattened dim of its root, spans (in a multi-dim slice)."""
        if name in (self.mesh_dim_names or ()):
            if self._root_axes is None:
                raise NotImplementedError(f"'{name}' of a mesh made apart from its root cannot be sliced with others")
            return self._root_axes[self._index(name)]
        flat = self._root()._flatten_mapping.get(name)
        if flat is None:
            self._index(name)  # raises: not a dim name
        axes = None if flat is None or flat._root_axes is None else flat._root_axes[0]
        if axes is None or list(axes) != list(range(axes[0], axes[0] + len(axes))):
            raise NotImplementedError(
                f"slicing '{name}' together with other dims: DeviceMesh only allows slicing out a contiguous "
                f"flattened dim of the root mesh"
            )
        return axes

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        names = (names,) if isinstance(names, str) else tuple(names)
        flattened = self._root()._flatten_mapping
        if len(names) == 1 and names[0] in flattened and names[0] not in (self.mesh_dim_names or ()):
            return flattened[names[0]]
        if names == self.mesh_dim_names:
            return self
        if names not in self._sub_mesh_cache:
            spans = [self._axes_of(name) for name in names]
            axes = [axis for span in spans for axis in span]
            if axes != sorted(axes) or len(set(axes)) != len(axes):
                raise ValueError(f"sub_mesh_dim_names {names} must follow the order of {self.mesh_dim_names}")
            self._sub_mesh_cache[names] = self._root()._slice(spans, names, [self._key_of(n) for n in names])
        return self._sub_mesh_cache[names]

    def _key_of(self, name: str) -> str | None:
        """The group-cache key of this rank's group along a dim of this mesh or a flattened dim of its root."""
        if name in (self.mesh_dim_names or ()):
            return self._dim_group_names[self._index(name)]
        return self._root()._flatten_mapping[name]._dim_group_names[0]

    def _slice(self, spans: list[tuple[int, ...]], names: tuple[str, ...], keys: list[str | None]) -> DeviceMesh:
        """The sub-mesh of this root mesh through this rank, one dim per span of its dims; it shares the dims'
        groups (creates none)."""
        coords = _unravel(self._rank_list.index(self._rank), self._mesh_shape)
        axes = [axis for span in spans for axis in span]
        ranks = []
        for picked in product(*(range(self._mesh_shape[d]) for d in axes)):
            for d, k in zip(axes, picked):
                coords[d] = k
            ranks.append(self._rank_list[_ravel(coords, self._mesh_shape)])
        shape = tuple(prod(self._mesh_shape[d] for d in span) for span in spans)
        sub = DeviceMesh(
            self.device_type, torch.tensor(ranks).reshape(shape), mesh_dim_names=names, _init_backend=False,
            _root_mesh=self,
        )  # fmt: skip
        sub._root_axes = tuple(spans)
        sub._dim_group_names = list(keys)
        return sub

    def flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """This mesh as one dim of its root: its groups are created now, for every peer row, via split_group."""
        name = mesh_dim_name or "_".join(self.mesh_dim_names or ())
        if self.ndim == 1 and name in (self.mesh_dim_names or ()):
            return self
        root = self._root()
        if name in (root.mesh_dim_names or ()):
            raise ValueError(f"'{name}' already exists in the root mesh mesh_dim_names {root.mesh_dim_names}")
        axes = None if self._root_axes is None else tuple(axis for span in self._root_axes for axis in span)
        cached = root._flatten_mapping.get(name)
        if cached is not None:
            if cached.rank_list != self.rank_list or cached._root_axes != (axes,):
                raise ValueError(
                    f"Flatten mesh with mesh_dim_name '{name}' has been created before with different layout"
                )
            return cached
        rows = sorted({tuple(sorted(self._peer_rows(root, r))) for r in root.rank_list})
        split_group([list(row) for row in rows])
        flat = DeviceMesh(self.device_type, list(self.rank_list), mesh_dim_names=(name,), _init_backend=False)
        flat._root_mesh = root
        flat._root_axes = None if axes is None else (axes,)
        flat._dim_group_names = [_key(self.rank_list)]
        root._flatten_mapping[name] = flat
        return flat

    def _peer_rows(self, root: DeviceMesh, rank: int) -> list[int]:
        """The ranks of ``root`` that share ``rank``'s coordinates outside the root dims this mesh spans."""
        dims = [axis for span in self._root_axes or () for axis in span]
        coords = _unravel(root._rank_list.index(rank), root._mesh_shape)
        out = []
        for picked in product(*(range(root._mesh_shape[d]) for d in dims)):
            for d, k in zip(dims, picked):
                coords[d] = k
            out.append(root._rank_list[_ravel(coords, root._mesh_shape)])
        return out

    @staticmethod
    def concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
        """Sub-meshes (or flattened dims) of one root joined into one (their groups are shared, none created)."""
        if len(meshes) == 1:
            return meshes[0]
        if len({id(mesh._root()) for mesh in meshes}) > 1:
            raise ValueError("DeviceMesh.concatenate: the meshes must share the same root mesh")
        return meshes[0]._root()[tuple(name for mesh in meshes for name in mesh.mesh_dim_names or ())]

    def __repr__(self) -> str:
        return (
            f"DeviceMesh(device_type='{self.device_type}', mesh_shape={self._mesh_shape}, rank_list={self._rank_list})"
        )


def init_device_mesh(
    device_type: str,
    mesh_shape: tuple[int, ...],
    *,
    mesh_dim_names: tuple[str, ...] | list[str] | None = None,
    rank_list: tuple[int, ...] | None = None,
    init_backend: bool = True,
) -> DeviceMesh:
    """A mesh over ``rank_list`` (default: the contiguous window of ``prod(mesh_shape)`` ranks around
    this rank), its groups created now when ``init_backend``; meshes are cached by shape, names, ranks."""
    if not isinstance(mesh_shape, tuple) or not all(isinstance(n, int) and n > 0 for n in mesh_shape):
        raise ValueError(f"mesh_shape must be a tuple of positive ints, got {mesh_shape}")
    total = prod(mesh_shape)
    if rank_list is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        rank_list = tuple(range(rank - rank % total, rank - rank % total + total))
    if len(rank_list) != total:
        raise ValueError(f"rank_list has {len(rank_list)} ranks, mesh_shape {mesh_shape} needs {total}")
    key = (mesh_shape, tuple(mesh_dim_names or ()), tuple(rank_list))
    if key not in _DEVICE_MESH_MAP:
        mesh = torch.tensor(list(rank_list)).reshape(mesh_shape)
        _DEVICE_MESH_MAP[key] = DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, _init_backend=init_backend)
    return _DEVICE_MESH_MAP[key]


__all__ = ["CREATED", "EXISTING_COMM_GROUPS", "DeviceMesh", "init_device_mesh", "split_group"]
