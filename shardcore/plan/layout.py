"""plan_layout: contiguous shard windows and every rank's named groups, by index math alone.

This module owns the group recipe: which grid and dims define each of Megatron's 15 group
names, and the embedding rule. Everyone else (engine, CLI, topology, picture) asks a
``ShardPlan``.
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from math import prod
from typing import Any, NamedTuple

from ..errors import LayoutError
from .arguments import MAX_WORLD_SIZE, check_count, check_flag, check_names, shown
from .grid import Grid
from .spec import ShardsInput, ShardSpec, format_shards, parse_shards


class Order(StrEnum):
    """Megatron's rank orders (first dim fastest): pipeline stages contiguous, or model replicas contiguous."""

    TP_CP_DP_PP = "tp-cp-dp-pp"
    TP_CP_PP_DP = "tp-cp-pp-dp"


DEFAULT_ORDER = Order.TP_CP_DP_PP
ORDER_ALIASES: dict[str, Order] = {"tp-dp-pp": Order.TP_CP_DP_PP, "tp-pp-dp": Order.TP_CP_PP_DP}
"""Megatron's spellings without cp."""

GRID_DIMS: dict[Order, tuple[tuple[str, ...], tuple[str, ...]]] = {
    Order.TP_CP_DP_PP: (("tp", "cp", "dp", "pp"), ("expt_tp", "ep", "expt_dp", "pp")),
    Order.TP_CP_PP_DP: (("tp", "cp", "pp", "dp"), ("expt_tp", "ep", "pp", "expt_dp")),
}
"""Decoder and expert grid dims per order."""


def pipelines_differ(order: Order, tp: int, cp: int, pp: int, expt_tp: int, ep: int) -> bool:
    """Whether a shard's decoder and expert pipeline groups differ under ``order``: the one rule an expert grid adds.

    Under ``tp-cp-pp-dp`` with pp > 1, pp is the third dim of both grids, so a stage's ranks are the same on both
    only when their first two dims span as many ranks (expt_tp*ep = tp*cp); Megatron requires it. ``plan_layout``
    refuses such a shard, and ``choices.valid_specs`` never yields one.
    """
    return order == Order.TP_CP_PP_DP and pp > 1 and expt_tp * ep != tp * cp


class GroupName(StrEnum):
    """Megatron ProcessGroupCollection field names, in creation order (embedding groups last)."""

    TP = "tp"
    CP = "cp"
    PP = "pp"
    DP = "dp"
    MP = "mp"
    TP_CP = "tp_cp"
    DP_CP = "dp_cp"
    TP_DP_CP = "tp_dp_cp"
    EP = "ep"
    EXPT_TP = "expt_tp"
    EXPT_DP = "expt_dp"
    TP_EP = "tp_ep"
    TP_EP_PP = "tp_ep_pp"
    EMBD = "embd"
    POS_EMBD = "pos_embd"


DECODER_GROUPS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "pp": ("pp",),
    "dp": ("dp",),
    "mp": ("tp", "pp"),
    "tp_cp": ("tp", "cp"),
    "dp_cp": ("cp", "dp"),
    "tp_dp_cp": ("tp", "cp", "dp"),
}
"""Groups along dims of the decoder grid."""
EXPERT_GROUPS: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "expt_tp": ("expt_tp",),
    "expt_dp": ("expt_dp",),
    "tp_ep": ("expt_tp", "ep"),
    "tp_ep_pp": ("expt_tp", "ep", "pp"),
}
"""Groups along dims of the expert grid."""
GRID_GROUP_NAMES: tuple[str, ...] = (*DECODER_GROUPS, *EXPERT_GROUPS)
"""The 13 names defined by a grid and dims (embd and pos_embd are subsets of pp groups)."""
GROUP_NAMES: tuple[GroupName, ...] = tuple(GroupName)
"""All 15 names, in creation order."""

RankGroups = dict[str, "tuple[int, ...] | None"]
"""Group name -> the sorted global ranks of one rank's group (None where the rank is in none)."""


def embedding_groups(first: int, last: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(embd, pos_embd) of the pp group whose first and last ranks are given.

    Megatron's default: embd holds the first and last stage (the first alone when pp = 1),
    pos_embd the first stage.
    """
    return ((first, last) if last != first else (first,)), (first,)


class DistinctGroup(NamedTuple):
    """One rank set to create once, and every group name that shares it."""

    ranks: tuple[int, ...]
    names: tuple[str, ...]


def resolve_order(order: str) -> Order:
    """Canonical order; Megatron's spellings without cp are accepted.

    Raises:
        LayoutError: not one of the orders, naming them.
    """
    if isinstance(order, str):
        if order in ORDER_ALIASES:
            return ORDER_ALIASES[order]
        if order in tuple(Order):
            return Order(order)
    raise LayoutError(
        f"order={shown(order)}: expected one of {', '.join(Order)} (Megatron's tp-dp-pp / tp-pp-dp also work)"
    )


@dataclass(frozen=True)
class ShardPlan:
    """One shard's window and its decoder and expert grids."""

    index: int
    spec: ShardSpec
    rank_offset: int
    size: int
    """Ranks in the shard's window (tp*cp*pp*dp)."""
    decoder_grid: Grid
    expert_grid: Grid

    @property
    def ranks(self) -> range:
        """The shard's global ranks."""
        return range(self.rank_offset, self.rank_offset + self.size)

    def __contains__(self, rank: object) -> bool:
        return rank in self.decoder_grid

    def coords(self, rank: int) -> dict[str, int]:
        """The rank's coordinates on both grids (pp is shared)."""
        return {**self.expert_grid.coords(rank), **self.decoder_grid.coords(rank)}

    def grid_of(self, name: str) -> tuple[Grid, tuple[str, ...]]:
        """The grid (decoder or expert) and dims that define the group ``name`` (one of GRID_GROUP_NAMES)."""
        if isinstance(name, str):
            if name in DECODER_GROUPS:
                return self.decoder_grid, DECODER_GROUPS[name]
            if name in EXPERT_GROUPS:
                return self.expert_grid, EXPERT_GROUPS[name]
        raise LayoutError(f"group {shown(name)} is not defined by a grid: choose from {', '.join(GRID_GROUP_NAMES)}")

    def group_span(self, rank: int, name: str) -> tuple[int, int, int]:
        """(size, first rank, last rank) of ``rank``'s group ``name`` (a grid group), in O(dims).

        Listing ``--rank`` on a world of millions must not build lists of millions of ranks.
        """
        grid, dims = self.grid_of(name)
        coords = grid.coords(rank)
        first = rank - sum(coords[d] * grid.stride_of(d) for d in dims)
        last = first + sum((grid.size_of(d) - 1) * grid.stride_of(d) for d in dims)
        return prod(grid.size_of(d) for d in dims), first, last

    def groups_of(self, rank: int, names: Collection[str] = GROUP_NAMES) -> RankGroups:
        """A member rank's named groups (all 15, or those in ``names``, in GROUP_NAMES order).

        embd / pos_embd are None where the rank is not in them. Groups not asked for are not
        computed: at a million ranks one of them can hold a quarter of the world.
        """
        names = _check_group_names(names)
        groups: RankGroups = {}
        for name in GROUP_NAMES:
            if name not in names:
                continue
            if name in GRID_GROUP_NAMES:
                grid, dims = self.grid_of(name)
                groups[name] = grid.group_ranks(rank, dims)
            else:
                _, first, last = self.group_span(rank, "pp")
                embd, pos_embd = embedding_groups(first, last)
                member = embd if name == GroupName.EMBD else pos_embd
                groups[name] = member if rank in member else None
        return groups

    def iter_groups(self, name: str) -> Iterator[tuple[int, ...]]:
        """Every group ``name`` of the shard (any of the 15), in Megatron's enumeration order."""
        (name,) = _check_group_names(name)
        if name in GRID_GROUP_NAMES:
            grid, dims = self.grid_of(name)
            yield from grid.iter_groups(dims)
            return
        for pp_group in self.decoder_grid.iter_groups("pp"):
            embd, pos_embd = embedding_groups(pp_group[0], pp_group[-1])
            yield embd if name == GroupName.EMBD else pos_embd

    def to_dict(self) -> dict[str, Any]:
        grids = {
            key: {"shape": list(grid.shape), "dim_names": list(grid.dim_names)}
            for key, grid in (("decoder_grid", self.decoder_grid), ("expert_grid", self.expert_grid))
        }
        return {
            "index": self.index,
            "spec": self.spec.to_dict(),
            "rank_offset": self.rank_offset,
            "size": self.size,
            "ranks": [self.rank_offset, self.rank_offset + self.size],
            **grids,
        }


def _check_group_names(names: object) -> tuple[str, ...]:
    """One of the 15 group names, or a collection of them."""
    return check_names("names", names, GROUP_NAMES)


def distinct_groups(groups: RankGroups) -> tuple[DistinctGroup, ...]:
    """Each distinct rank set once, in creation order, with the names that share it.

    Creation order is GROUP_NAMES, then any backend-specific names sorted: the same on
    every rank, which is what keeps members-only creation free of wait cycles.
    """
    names_by_ranks: dict[tuple[int, ...], list[str]] = {}
    for name in [*GROUP_NAMES, *sorted(set(groups) - set(GROUP_NAMES))]:
        ranks = groups.get(name)
        if ranks is not None:
            names_by_ranks.setdefault(ranks, []).append(name)
    return tuple(DistinctGroup(ranks, tuple(names)) for ranks, names in names_by_ranks.items())


@dataclass(frozen=True)
class Layout:
    """Shards laid out in contiguous windows over a world; idle ranks are listed, never lost."""

    world_size: int
    """Ranks in the whole world, idle ones included."""
    order: Order
    rank_offset: int
    shards: tuple[ShardPlan, ...]
    idle: tuple[range, ...]
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", tuple(plan.rank_offset for plan in self.shards))

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {shown(rank)} is outside the world [0, {self.world_size})")

    def shard_of(self, rank: int) -> ShardPlan | None:
        """The shard owning ``rank``, or None for an idle rank; O(log shards)."""
        self._check_rank(rank)
        position = bisect_right(self._starts, rank) - 1
        if position >= 0 and rank in self.shards[position]:
            return self.shards[position]
        return None

    def groups_of(self, rank: int) -> RankGroups:
        """The rank's 15 named groups as sorted tuples of global ranks; {} for an idle rank."""
        plan = self.shard_of(rank)
        return plan.groups_of(rank) if plan is not None else {}

    def distinct_groups(self, rank: int) -> tuple[DistinctGroup, ...]:
        """The rank's groups, each distinct rank set once, in creation order."""
        return distinct_groups(self.groups_of(rank))

    @property
    def idle_ranks(self) -> list[int]:
        """Every rank that belongs to no shard."""
        return [rank for window in self.idle for rank in window]

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "order": self.order,
            "rank_offset": self.rank_offset,
            "shards": [plan.to_dict() for plan in self.shards],
            "idle": [[window.start, window.stop] for window in self.idle],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def fingerprint(self) -> str:
        """A short digest that equal layouts share: ranks compare it before creating groups."""
        return hashlib.sha256(self.to_json(indent=None).encode()).hexdigest()[:16]


def _check_world(total_world_size: object, rank_offset: object) -> None:
    world = check_count("total_world_size", total_world_size)
    check_count("rank_offset", rank_offset, minimum=0, maximum=world - 1)


def _plan_shard(index: int, spec: ShardSpec, offset: int, order: Order) -> ShardPlan:
    decoder_dims, expert_dims = GRID_DIMS[order]
    sizes = {**spec.to_dict(), "expt_dp": spec.expt_dp}
    if pipelines_differ(order, spec.tp, spec.cp, spec.pp, spec.expt_tp, spec.ep):
        raise LayoutError(
            f"shard {index} ('{spec}'): under order tp-cp-pp-dp its decoder and expert pp groups differ "
            f"(tp*cp = {spec.tp * spec.cp}, expt_tp*ep = {spec.expt_tp * spec.ep}); make expt_tp*ep equal tp*cp "
            f"or use order tp-cp-dp-pp"
        )
    return ShardPlan(
        index=index,
        spec=spec,
        rank_offset=offset,
        size=spec.world_size,
        decoder_grid=Grid([sizes[d] for d in decoder_dims], decoder_dims, offset),
        expert_grid=Grid([sizes[d] for d in expert_dims], expert_dims, offset),
    )


def plan_layout(
    total_world_size: int,
    shards: ShardsInput,
    *,
    order: str = DEFAULT_ORDER,
    rank_offset: int = 0,
    allow_idle: bool = False,
) -> Layout:
    """Place ``shards`` in spec order as contiguous windows starting at ``rank_offset``.

    Ranks before ``rank_offset`` are left to the caller (idle here); ranks after the last
    shard are a LayoutError unless ``allow_idle``, because a rank nobody planned for is
    usually a mistake in the spec.

    Args:
        total_world_size: ranks in the whole world, 1 to MAX_WORLD_SIZE.
        shards: anything ``parse_shards`` takes.
        order: one of ``Order`` (or Megatron's ``tp-dp-pp`` / ``tp-pp-dp``).
        rank_offset: first rank of the first shard, in ``[0, total_world_size)``.
        allow_idle: True to let ranks after the last shard stay idle.

    Returns:
        The layout: every shard's window and grids, and the idle ranks.

    Raises:
        ShardSpecError: a bad spec (see ``parse_shards``).
        LayoutError: a bad argument, or shards that do not fill (or do not fit) the world.
    """
    _check_world(total_world_size, rank_offset)
    order = resolve_order(order)
    check_flag("allow_idle", allow_idle)
    specs = parse_shards(shards)
    needed = sum(spec.world_size for spec in specs)
    end = rank_offset + needed
    if end > total_world_size:
        fix = (
            f"shrink the shards: shardcore plans at most {MAX_WORLD_SIZE} ranks"
            if end > MAX_WORLD_SIZE
            else f"shrink the shards or grow the world to {end}"
        )
        raise LayoutError(
            f"shards {shown(format_shards(specs))} need {needed} ranks from rank {rank_offset}, "
            f"but the world has {total_world_size}: {fix}"
        )
    if end < total_world_size and not allow_idle:
        raise LayoutError(
            f"shards cover ranks [{rank_offset}, {end}) of a world of {total_world_size}; ranks "
            f"[{end}, {total_world_size}) would be idle: add a shard for them or pass allow_idle=True (--allow-idle)"
        )
    plans, offset = [], rank_offset
    for index, spec in enumerate(specs):
        plans.append(_plan_shard(index, spec, offset, order))
        offset += spec.world_size
    idle = tuple(window for window in (range(0, rank_offset), range(end, total_world_size)) if window)
    return Layout(total_world_size, order, rank_offset, tuple(plans), idle)


__all__ = [
    "DECODER_GROUPS",
    "DEFAULT_ORDER",
    "EXPERT_GROUPS",
    "GRID_DIMS",
    "GRID_GROUP_NAMES",
    "GROUP_NAMES",
    "ORDER_ALIASES",
    "DistinctGroup",
    "GroupName",
    "Layout",
    "Order",
    "RankGroups",
    "ShardPlan",
    "distinct_groups",
    "embedding_groups",
    "pipelines_differ",
    "plan_layout",
    "resolve_order",
]
