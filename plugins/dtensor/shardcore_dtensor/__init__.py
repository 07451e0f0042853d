"""shardcore backend ``dtensor``: torch DeviceMeshes over a shard's window, from the engine's groups."""

from __future__ import annotations

from .backend import DTensorBackend, DTensorShard, shardcore_register_backends
from .helpers import (
    build_device_mesh,
    ensure_distributed_initialized,
    resolve_data_parallel_partition,
    resolve_tensor_parallel_group_size,
)

__all__ = [
    "DTensorBackend",
    "DTensorShard",
    "build_device_mesh",
    "ensure_distributed_initialized",
    "resolve_data_parallel_partition",
    "resolve_tensor_parallel_group_size",
    "shardcore_register_backends",
]
