"""plan_layout: contiguous shard windows and every rank's named groups, by index math alone."""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from .errors import LayoutError
from .grid import Grid
from .spec import ShardSpec, ShardsInput, parse_shards

if TYPE_CHECKING:
    from .topology import TopologyReport

MAX_WORLD_SIZE = 1 << 24
"""Largest world planned: far above any cluster, small enough that a group always fits in memory."""

ORDERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tp-cp-dp-pp": (("tp", "cp", "dp", "pp"), ("expt_tp", "ep", "expt_dp", "pp")),
    "tp-cp-pp-dp": (("tp", "cp", "pp", "dp"), ("expt_tp", "ep", "pp", "expt_dp")),
}
ORDER_ALIASES = {"tp-dp-pp": "tp-cp-dp-pp", "tp-pp-dp": "tp-cp-pp-dp"}

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
EXPERT_GROUPS: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "expt_tp": ("expt_tp",),
    "expt_dp": ("expt_dp",),
    "tp_ep": ("expt_tp", "ep"),
    "tp_ep_pp": ("expt_tp", "ep", "pp"),
}
GROUP_NAMES: tuple[str, ...] = (*DECODER_GROUPS, *EXPERT_GROUPS, "embd", "pos_embd")
"""Megatron ProcessGroupCollection field names, in creation order (embedding groups last)."""

Groups = dict[str, "tuple[int, ...] | None"]


class DistinctGroup(NamedTuple):
    """One rank set to create once, and every group name that shares it."""

    ranks: tuple[int, ...]
    names: tuple[str, ...]


def resolve_order(order: str) -> str:
    """Canonical order name; Megatron's spellings without cp are accepted."""
    canonical = ORDER_ALIASES.get(order, order)
    if canonical not in ORDERS:
        raise LayoutError(f"order={order!r}: expected one of {', '.join(ORDERS)} (Megatron's tp-dp-pp / tp-pp-dp also work)")
    return canonical


@dataclass(frozen=True)
class ShardPlan:
    """One shard's window and its decoder and expert grids."""

    index: int
    spec: ShardSpec
    rank_offset: int
    world_size: int
    decoder_grid: Grid
    expert_grid: Grid

    @property
    def ranks(self) -> range:
        """The shard's global ranks."""
        return range(self.rank_offset, self.rank_offset + self.world_size)

    def __contains__(self, rank: object) -> bool:
        return rank in self.decoder_grid

    def coords(self, rank: int) -> dict[str, int]:
        """The rank's coordinates on both grids (pp is shared)."""
        return {**self.expert_grid.coords(rank), **self.decoder_grid.coords(rank)}

    def groups_of(self, rank: int, names: Collection[str] = GROUP_NAMES) -> Groups:
        """A member rank's named groups (all 15, or those in ``names``, in GROUP_NAMES order).

        embd / pos_embd are None where the rank is not in them. Groups not asked for are not
        computed: at a million ranks one of them can hold a quarter of the world.
        """
        groups: Groups = {}
        for grid, table in ((self.decoder_grid, DECODER_GROUPS), (self.expert_grid, EXPERT_GROUPS)):
            groups.update({name: grid.group_ranks(rank, dims) for name, dims in table.items() if name in names})
        if "embd" in names or "pos_embd" in names:
            pp = self.decoder_grid.group_ranks(rank, "pp")
            embd = (pp[0], pp[-1]) if len(pp) > 1 else (pp[0],)
            groups.update(embd=embd if rank in embd else None, pos_embd=(pp[0],) if rank == pp[0] else None)
        return {name: ranks for name, ranks in groups.items() if name in names}

    def to_dict(self) -> dict[str, Any]:
        grids = {
            key: {"shape": list(grid.shape), "dim_names": list(grid.dim_names)}
            for key, grid in (("decoder_grid", self.decoder_grid), ("expert_grid", self.expert_grid))
        }
        return {
            "index": self.index,
            "spec": self.spec.to_dict(),
            "rank_offset": self.rank_offset,
            "world_size": self.world_size,
            "ranks": [self.rank_offset, self.rank_offset + self.world_size],
            **grids,
        }


def distinct_groups(groups: Groups) -> tuple[DistinctGroup, ...]:
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
    order: str
    rank_offset: int
    shards: tuple[ShardPlan, ...]
    idle: tuple[range, ...]
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", tuple(plan.rank_offset for plan in self.shards))

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank!r} is outside the world [0, {self.world_size})")

    def shard_of(self, rank: int) -> ShardPlan | None:
        """The shard owning ``rank``, or None for an idle rank; O(log shards)."""
        self._check_rank(rank)
        position = bisect_right(self._starts, rank) - 1
        if position >= 0 and rank in self.shards[position]:
            return self.shards[position]
        return None

    def groups_of(self, rank: int) -> Groups:
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

    def check_topology(self, ranks_per_node: int) -> TopologyReport:
        """Which groups cross a node of ``ranks_per_node`` ranks; see shardcore.topology."""
        from .topology import check_topology  # topology imports this module

        return check_topology(self, ranks_per_node)

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
    if isinstance(total_world_size, bool) or not isinstance(total_world_size, int) or total_world_size < 1:
        raise LayoutError(f"world size {total_world_size!r}: expected a positive integer")
    if total_world_size > MAX_WORLD_SIZE:
        raise LayoutError(f"world size {total_world_size} is over shardcore's limit of {MAX_WORLD_SIZE} ranks")
    if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or not 0 <= rank_offset < total_world_size:
        raise LayoutError(f"rank_offset={rank_offset!r}: expected an integer in [0, {total_world_size})")


def _plan_shard(index: int, spec: ShardSpec, offset: int, order: str) -> ShardPlan:
    decoder_dims, expert_dims = ORDERS[order]
    sizes = {**spec.to_dict(), "expt_dp": spec.expt_dp}
    if order == "tp-cp-pp-dp" and spec.pp > 1 and spec.tp * spec.cp != spec.expt_tp * spec.ep:  # type: ignore[operator]
        raise LayoutError(
            f"shard {index} ('{spec}'): under order tp-cp-pp-dp its decoder and expert pp groups differ "
            f"(tp*cp = {spec.tp * spec.cp}, expt_tp*ep = {spec.expt_tp * spec.ep}); make expt_tp*ep equal tp*cp "
            f"or use order tp-cp-dp-pp"  # type: ignore[operator]
        )
    return ShardPlan(
        index=index,
        spec=spec,
        rank_offset=offset,
        world_size=spec.world_size,
        decoder_grid=Grid([sizes[d] for d in decoder_dims], decoder_dims, offset),
        expert_grid=Grid([sizes[d] for d in expert_dims], expert_dims, offset),
    )


def plan_layout(
    total_world_size: int,
    shards: ShardsInput,
    *,
    order: str = "tp-cp-dp-pp",
    rank_offset: int = 0,
    allow_idle: bool = False,
) -> Layout:
    """Place ``shards`` in spec order as contiguous windows starting at ``rank_offset``.

    Ranks before ``rank_offset`` are left to the caller (idle here); ranks after the last
    shard are a LayoutError unless ``allow_idle``, because a rank nobody planned for is
    usually a mistake in the spec.
    """
    _check_world(total_world_size, rank_offset)
    order = resolve_order(order)
    specs = parse_shards(shards)
    needed = sum(spec.world_size for spec in specs)
    end = rank_offset + needed
    if end > total_world_size:
        raise LayoutError(
            f"shards '{'+'.join(map(str, specs))}' need {needed} ranks from rank {rank_offset}, "
            f"but the world has {total_world_size}: shrink the shards or grow the world to {end}"
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
    "EXPERT_GROUPS",
    "GROUP_NAMES",
    "MAX_WORLD_SIZE",
    "ORDERS",
    "DistinctGroup",
    "Layout",
    "ShardPlan",
    "distinct_groups",
    "plan_layout",
    "resolve_order",
]
