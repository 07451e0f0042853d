"""shardcore backend ``hyperparallel``: a Hyper-Parallel MeshContext per shard and pipeline stage."""

from __future__ import annotations

from .backend import HyperParallelBackend, distributed_setup, shard_sizes, shardcore_register_backends, stage_grids
from .context import DistributedSetup, MeshContext
from .device import DeviceChoice, device_note, select_device
from .install import CURRENT_LAYOUT, MeshClasses, installed_layout, mesh_classes
from .topology import StageSizes, check_dense_tp_layout, resolve_sizes

__all__ = [
    "CURRENT_LAYOUT",
    "DeviceChoice",
    "DistributedSetup",
    "HyperParallelBackend",
    "MeshClasses",
    "MeshContext",
    "StageSizes",
    "check_dense_tp_layout",
    "device_note",
    "distributed_setup",
    "installed_layout",
    "mesh_classes",
    "resolve_sizes",
    "select_device",
    "shard_sizes",
    "shardcore_register_backends",
    "stage_grids",
]
