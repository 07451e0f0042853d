"""The plan: shard specs, grids and layouts, by pure index math (no torch, no numpy).

``valid_specs(R)`` enumerates every valid spec of R ranks (the candidates of layout search and of
elastic re-layout). Also the checks every public argument goes through (``check_count``, ``as_timedelta``, ...), which
backends use for their own options so that a bad value reads alike everywhere.
"""

from __future__ import annotations

from .arguments import (
    DEFAULT_TIMEOUT,
    MAX_TIMEOUT,
    MAX_WORLD_SIZE,
    as_timedelta,
    check_choice,
    check_count,
    check_flag,
    check_names,
    format_bytes,
    shown,
)
from .choices import AXES, check_axes, divisors, valid_specs
from .grid import Dims, Grid
from .layout import (
    DECODER_GROUPS,
    DEFAULT_ORDER,
    EXPERT_GROUPS,
    GROUP_NAMES,
    ORDER_ALIASES,
    DistinctGroup,
    GroupName,
    Layout,
    Order,
    RankGroups,
    ShardPlan,
    distinct_groups,
    plan_layout,
)
from .protocols import GridLike, NamedGrids, ShardPlanLike
from .spec import INT_KEYS, ROLES, ShardsInput, ShardSpec, format_shards, parse_shards

__all__ = [
    "AXES",
    "DECODER_GROUPS",
    "DEFAULT_ORDER",
    "DEFAULT_TIMEOUT",
    "EXPERT_GROUPS",
    "GROUP_NAMES",
    "INT_KEYS",
    "MAX_TIMEOUT",
    "MAX_WORLD_SIZE",
    "ORDER_ALIASES",
    "ROLES",
    "Dims",
    "DistinctGroup",
    "Grid",
    "GridLike",
    "GroupName",
    "Layout",
    "NamedGrids",
    "Order",
    "RankGroups",
    "ShardPlan",
    "ShardPlanLike",
    "ShardSpec",
    "ShardsInput",
    "as_timedelta",
    "check_axes",
    "check_choice",
    "check_count",
    "check_flag",
    "check_names",
    "distinct_groups",
    "divisors",
    "format_bytes",
    "format_shards",
    "parse_shards",
    "plan_layout",
    "shown",
    "valid_specs",
]
