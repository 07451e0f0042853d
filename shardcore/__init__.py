"""shardcore: lay out heterogeneous parallel jobs and build each rank's process groups.

The core is pure Python (no torch at import time); backends arrive as plugins.
"""

from __future__ import annotations

from .errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    GroupCreationError,
    LayoutError,
    LayoutMismatchError,
    ShardcoreError,
    ShardSpecError,
)
from .grid import Grid
from .hookspecs import hookimpl
from .layout import GROUP_NAMES, DistinctGroup, Layout, ShardPlan, plan_layout
from .plugins import BackendInfo, get_backend, list_backends, register_backend
from .protocols import Backend, GridLike, ShardPlanLike
from .shards import Shard, build_shards, destroy_shards, my_shard
from .spec import ShardSpec, format_shards, parse_shards

__version__ = "0.1.0"

__all__ = [
    "GROUP_NAMES",
    "Backend",
    "BackendInfo",
    "Shard",
    "build_shards",
    "destroy_shards",
    "get_backend",
    "hookimpl",
    "list_backends",
    "my_shard",
    "register_backend",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "DistinctGroup",
    "Grid",
    "GridLike",
    "GroupCreationError",
    "Layout",
    "LayoutError",
    "LayoutMismatchError",
    "ShardPlan",
    "ShardPlanLike",
    "ShardSpec",
    "ShardSpecError",
    "ShardcoreError",
    "format_shards",
    "parse_shards",
    "plan_layout",
]
