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
from .layout import GROUP_NAMES, DistinctGroup, Layout, ShardPlan, plan_layout
from .protocols import GridLike, ShardPlanLike
from .spec import ShardSpec, format_shards, parse_shards

__version__ = "0.1.0"

__all__ = [
    "GROUP_NAMES",
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
