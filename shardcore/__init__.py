"""shardcore: lay out heterogeneous parallel jobs and build each rank's process groups.

Subpackages, imported one way only (cli -> engine -> plan; views and refit -> plan):

* ``plan``: shard specs, grids and layouts, pure index math (no torch, no numpy);
* ``views``: topology findings, tables and pictures of a plan (no torch);
* ``engine``: backend discovery, group creation, live checks (torch imported on use);
* ``cli``: the ``shardcore`` command.
"""

from __future__ import annotations

from .engine.backend import Backend, NamedGrids
from .engine.groups import Strategy
from .engine.hookspecs import hookimpl
from .engine.plugins import BackendInfo, get_backend, list_backends, register_backend, unregister_backend
from .engine.shards import Shard, build_shards, destroy_shards, my_shard
from .errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    GroupCreationError,
    LayoutError,
    LayoutMismatchError,
    ShardcoreError,
    ShardSpecError,
    ShardSpecWarning,
)
from .plan.grid import Grid
from .plan.layout import DEFAULT_ORDER, GROUP_NAMES, DistinctGroup, GroupName, Layout, Order, ShardPlan, plan_layout
from .plan.protocols import GridLike, ShardPlanLike
from .plan.spec import ShardSpec, format_shards, parse_shards

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ORDER",
    "GROUP_NAMES",
    "Backend",
    "BackendInfo",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "DistinctGroup",
    "Grid",
    "GridLike",
    "GroupCreationError",
    "GroupName",
    "Layout",
    "LayoutError",
    "LayoutMismatchError",
    "NamedGrids",
    "Order",
    "Shard",
    "ShardPlan",
    "ShardPlanLike",
    "ShardSpec",
    "ShardSpecError",
    "ShardSpecWarning",
    "ShardcoreError",
    "Strategy",
    "build_shards",
    "destroy_shards",
    "format_shards",
    "get_backend",
    "hookimpl",
    "list_backends",
    "my_shard",
    "parse_shards",
    "plan_layout",
    "register_backend",
    "unregister_backend",
]
