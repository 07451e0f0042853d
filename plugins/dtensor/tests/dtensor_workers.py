"""Functions run on every rank of a live gloo world by the DTensor helper tests."""

from __future__ import annotations

from typing import Any

from shardcore import ShardcoreError
from shardcore_dtensor import (
    build_device_mesh,
    ensure_distributed_initialized,
    resolve_data_parallel_partition,
    resolve_tensor_parallel_group_size,
)


def _error(call: Any) -> str:
    try:
        call()
    except ShardcoreError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


class _NoMesh:
    """A mesh-like object without a rank tensor: data is sharded over the whole world."""

    mesh = None


def helpers(rank: int, world: int) -> dict[str, Any]:
    mesh = build_device_mesh("cpu", (2, 2), ("dp", "tp"))
    flat = build_device_mesh("cpu")
    return {
        "already": ensure_distributed_initialized(),
        "dp": resolve_data_parallel_partition(mesh, 0, True),
        "dp_by_name": resolve_data_parallel_partition(mesh, "dp", True),
        "unsharded": resolve_data_parallel_partition(mesh, 0, False),
        "no_mesh": resolve_data_parallel_partition(None, 0, True),
        "no_tensor": resolve_data_parallel_partition(_NoMesh(), None, True),
        "flat": resolve_data_parallel_partition(flat, None, True),
        "tp": resolve_tensor_parallel_group_size(mesh, 1, True),
        "tp_by_name": resolve_tensor_parallel_group_size(mesh, "tp", True),
        "tp_off": resolve_tensor_parallel_group_size(mesh, 1, False),
        "bad_shape": _error(lambda: build_device_mesh("cpu", (3, 2))),
        "nd_without_dim": _error(lambda: resolve_data_parallel_partition(mesh, None, True)),
        "dim_out_of_range": _error(lambda: resolve_data_parallel_partition(mesh, 5, True)),
        "unknown_name": _error(lambda: resolve_tensor_parallel_group_size(mesh, "ep", True)),
    }
