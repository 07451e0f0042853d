"""shardcore backend ``dtensor``: torch DeviceMeshes over a shard's window, from the engine's groups,
``refit(src_state, dst_state)``: a DTensor state dict from one mesh to another, and ``local_shards(module)``: a
module's DTensors as the local tensors ``shardcore.execute_refit`` takes."""

from __future__ import annotations

from .backend import DTensorBackend, DTensorShard, shardcore_register_backends
from .cross_mesh import local_shards, refit
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
    "local_shards",
    "refit",
    "resolve_data_parallel_partition",
    "resolve_tensor_parallel_group_size",
    "shardcore_register_backends",
]
