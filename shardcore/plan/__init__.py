"""The plan: shard specs, grids and layouts, by pure index math (no torch, no numpy)."""

from __future__ import annotations

from .grid import Dims, Grid
from .layout import (
    DEFAULT_ORDER,
    GROUP_NAMES,
    DistinctGroup,
    GroupName,
    Layout,
    Order,
    RankGroups,
    ShardPlan,
    distinct_groups,
    plan_layout,
)
from .protocols import GridLike, ShardPlanLike
from .spec import ShardsInput, ShardSpec, format_shards, parse_shards

__all__ = [
    "DEFAULT_ORDER",
    "GROUP_NAMES",
    "Dims",
    "DistinctGroup",
    "Grid",
    "GridLike",
    "GroupName",
    "Layout",
    "Order",
    "RankGroups",
    "ShardPlan",
    "ShardPlanLike",
    "ShardSpec",
    "ShardsInput",
    "distinct_groups",
    "format_shards",
    "parse_shards",
    "plan_layout",
]
