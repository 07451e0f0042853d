"""Plain-DTensor conveniences: start the default group, build a mesh, read DP/TP facts off a mesh.

Errors are shardcore's typed ones, which are also the ValueError / RuntimeError callers expect.
"""

from __future__ import annotations

import inspect
import os
from math import prod
from typing import Any

from shardcore import GroupCreationError, LayoutError
from shardcore.engine import comm_backend, device_type, import_torch
from shardcore.plan import MAX_WORLD_SIZE, check_count, check_flag, shown


def _check_optional_text(name: str, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise LayoutError(f"{name}={shown(value)}: expected a string or None")


def ensure_distributed_initialized(
    backend: str | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> bool:
    """Initialise the default process group unless it already is; True when this call did it.

    The backend defaults to the device's collective library (nccl, hccl, else gloo). Under
    nccl each process uses the GPU of its ``LOCAL_RANK`` (set by torchrun; else the current
    device): it is made the current device and the default group is bound to it where torch
    supports ``device_id``. A bound group makes torch create groups with every rank taking
    part, so ``build_shards``'s default strategy ``auto`` then creates every group on every rank.

    Raises:
        LayoutError: a bad argument (checked before torch is touched).
        GroupCreationError: no torch.distributed, or ``LOCAL_RANK`` names no visible GPU.
    """
    _check_optional_text("backend", backend)
    _check_optional_text("init_method", init_method)
    if world_size is not None:
        check_count("world_size", world_size)
    if rank is not None:
        check_count("rank", rank, minimum=0, maximum=(world_size or MAX_WORLD_SIZE) - 1)
    torch = import_torch()  # shardcore's guard: without numpy, torch's import warns about it on every rank
    import torch.distributed as dist

    if not dist.is_available():
        raise GroupCreationError("this torch build has no torch.distributed; install a build with distributed support")
    if dist.is_initialized():
        return False
    backend = backend or comm_backend(device_type())
    kwargs: dict[str, Any] = {
        key: value
        for key, value in (("init_method", init_method), ("rank", rank), ("world_size", world_size))
        if value is not None
    }
    if backend == "nccl" and torch.cuda.is_available():
        index = local_device_index(os.environ.get("LOCAL_RANK"), torch.cuda.device_count())
        index = torch.cuda.current_device() if index is None else index
        torch.cuda.set_device(index)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = torch.device("cuda", index)
    dist.init_process_group(backend=backend, **kwargs)
    return True


def local_device_index(local_rank: str | None, device_count: int) -> int | None:
    """The GPU index ``LOCAL_RANK`` names (None when unset): one process per GPU, as torchrun starts them.

    Raises:
        GroupCreationError: not an integer, or no such GPU among the ``device_count`` visible.
    """
    if local_rank is None:
        return None
    try:
        index = int(local_rank)
    except ValueError:
        raise GroupCreationError(f"LOCAL_RANK={local_rank!r}: expected an integer, the process's GPU index") from None
    if not 0 <= index < device_count:
        raise GroupCreationError(
            f"LOCAL_RANK={index} but {device_count} GPU(s) are visible: start at most {device_count} processes "
            f"per node (torchrun --nproc-per-node {device_count}) or check CUDA_VISIBLE_DEVICES"
        )
    return index


def build_device_mesh(
    device_type: str = "cuda",
    mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None,
) -> Any:
    """A DeviceMesh over the whole initialised world; the shape must use every rank exactly.

    Raises:
        LayoutError: a bad argument, or a shape whose product is not the world size.
        GroupCreationError: torch.distributed is not initialised.
    """
    if not isinstance(device_type, str):
        raise LayoutError(f"device_type={shown(device_type)}: expected a device type such as 'cuda' or 'cpu'")
    if mesh_shape is not None:
        if not isinstance(mesh_shape, (tuple, list)) or not mesh_shape:
            raise LayoutError(f"mesh_shape={shown(mesh_shape)}: expected a tuple of sizes, e.g. (2, 4)")
        for size in mesh_shape:
            check_count("mesh_shape size", size)
    if mesh_dim_names is not None:
        names = mesh_dim_names
        if (
            not isinstance(names, (tuple, list))
            or not all(isinstance(name, str) and name for name in names)
            or len(set(names)) != len(names)
            or len(names) != (len(mesh_shape) if mesh_shape is not None else 1)
        ):
            raise LayoutError(
                f"mesh_dim_names={shown(names)}: expected one distinct name per dim of mesh_shape={shown(mesh_shape)}"
            )
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise GroupCreationError("torch.distributed is not initialized: call ensure_distributed_initialized() first")
    world = dist.get_world_size()
    shape = tuple(mesh_shape) if mesh_shape is not None else (world,)
    if prod(shape) != world:
        raise LayoutError(
            f"mesh_shape={shape} holds {prod(shape)} ranks but the world has {world}: make their product {world}"
        )
    return init_device_mesh(device_type, shape, mesh_dim_names=mesh_dim_names)


def _mesh_shape_and_coordinate(device_mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    shape = tuple(int(size) for size in device_mesh.mesh.shape)
    coordinate = device_mesh.get_coordinate() if hasattr(device_mesh, "get_coordinate") else None
    return shape, None if coordinate is None else tuple(int(c) for c in coordinate)


def _dim_index(device_mesh: Any, dim: int | str, shape: tuple[int, ...], what: str) -> int:
    """A mesh dim given by position or by name."""
    if isinstance(dim, bool) or not isinstance(dim, (int, str)):
        raise LayoutError(f"{what}={shown(dim)}: expected a mesh dim's index or name")
    if isinstance(dim, str):
        names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
        if dim not in names:
            raise LayoutError(f"{what}={dim!r} is not a dim of this mesh (dims: {', '.join(names) or 'unnamed'})")
        return names.index(dim)
    if not 0 <= dim < len(shape):
        raise LayoutError(f"{what}={shown(dim)} is out of range for a mesh with shape {shape}")
    return dim


def resolve_data_parallel_partition(
    device_mesh: Any, dp_mesh_dim: int | str | None, sharded_by_data_parallel: bool
) -> tuple[int, int]:
    """(number of data partitions, this rank's partition) for a data loader's sampler.

    Unsharded data or no mesh is one partition; a mesh-like object without ``.mesh``
    shards by the whole world.

    Raises:
        LayoutError: a bad argument, or a rank outside the mesh.
    """
    import torch.distributed as dist

    if not check_flag("sharded_by_data_parallel", sharded_by_data_parallel) or device_mesh is None:
        return 1, 0
    if getattr(device_mesh, "mesh", None) is None:
        if dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0
    shape, coordinate = _mesh_shape_and_coordinate(device_mesh)
    if dp_mesh_dim is None:
        if len(shape) != 1:
            raise LayoutError(f"dp_mesh_dim is required to shard data over a {len(shape)}-D mesh of shape {shape}")
        index = 0
    else:
        index = _dim_index(device_mesh, dp_mesh_dim, shape, "dp_mesh_dim")
    if coordinate is None:
        raise LayoutError("this rank is not in the supplied DeviceMesh, so it has no data-parallel partition")
    return shape[index], coordinate[index]


def resolve_tensor_parallel_group_size(device_mesh: Any, tp_mesh_dim: int | str, tensor_parallel_enabled: bool) -> int:
    """The TP group size from a mesh: 1 when TP is off or there is no mesh.

    Raises:
        LayoutError: a bad argument.
    """
    import torch.distributed as dist

    if not check_flag("tensor_parallel_enabled", tensor_parallel_enabled) or device_mesh is None:
        return 1
    if getattr(device_mesh, "mesh", None) is None:
        return dist.get_world_size() if dist.is_initialized() else 1
    shape = tuple(int(size) for size in device_mesh.mesh.shape)
    return shape[_dim_index(device_mesh, tp_mesh_dim, shape, "tp_mesh_dim")]


__all__ = [
    "build_device_mesh",
    "ensure_distributed_initialized",
    "local_device_index",
    "resolve_data_parallel_partition",
    "resolve_tensor_parallel_group_size",
]
