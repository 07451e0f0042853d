"""What a new layout does to each rank and each group of the old one.

A rank **moves** when its shard changes or the weights it must hold change (its stage's layers, its tp or
expt_tp slice, its experts): it then needs weights from the survivors. A new group **survives** when its
processes are exactly those of an old group of the same name (the communicator could be kept); else it
is rebuilt. Shards that kept their spec and a whole window of survivors keep every group and rank, and
are not walked; the others are walked group by group, each checked in O(1) when no gone rank lies
inside its span (the group is then the old one shifted, if it starts where an old group starts and has
its shape).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..plan.layout import GRID_GROUP_NAMES, GROUP_NAMES, Layout, ShardPlan
from ..plan.topology import BANDWIDTH_GROUPS, node_crossings
from ..refit.holdings import expert_range
from ..refit.manifest import Manifest
from .renumbering import Renumbering

HoldingsKey = tuple[int, ...]


class _Keys:
    """``holdings_key`` for every rank of one shard, by index arithmetic (a shard of 10^5 ranks is walked)."""

    def __init__(self, plan: ShardPlan, manifest: Manifest) -> None:
        spec, dense, expert = plan.spec, plan.decoder_grid, plan.expert_grid
        self.offset = plan.rank_offset
        self.steps = [
            (grid.stride_of(dim), grid.size_of(dim))
            for grid, dim in ((dense, "tp"), (dense, "pp"), (expert, "ep"), (expert, "expt_tp"))
        ]
        self.layers = manifest.stage_layers(spec.pp)
        self.experts = [expert_range(plan, manifest, e) for e in range(spec.ep)]
        self.spec = spec

    def __call__(self, rank: int) -> HoldingsKey:
        local = rank - self.offset
        tp, stage, ep, expt_tp = ((local // stride) % size for stride, size in self.steps)
        layers, experts, spec = self.layers[stage], self.experts[ep], self.spec
        slicing = (spec.expt_tp, expt_tp) if experts else (0, 0)
        ends = (stage == 0, stage == spec.pp - 1)
        return (layers.start, layers.stop, *ends, spec.tp, tp, *slicing, experts.start, experts.stop)


def holdings_key(plan: ShardPlan, rank: int, manifest: Manifest) -> HoldingsKey:
    """What fixes the weights ``rank`` holds in ``plan``: its stage's layers (and whether it is the first or
    last stage), its tp slice, and its experts with their expt_tp slice. Equal keys, equal holdings."""
    return _Keys(plan, manifest)(rank)


@dataclass(frozen=True)
class RankMove:
    """A rank of a new shard that changes shard or weights.

    Attributes:
        new: Its rank in the new world.
        old: Its old rank, or None for an added rank.
        old_shard: The shard it was in, or None (it was idle, or added).
        new_shard: The shard it is in now.
        needs_weights: It must receive weights it does not hold (False: same weights, another shard).
    """

    new: int
    old: int | None
    old_shard: int | None
    new_shard: int
    needs_weights: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "new": self.new,
            "old": self.old,
            "old_shard": self.old_shard,
            "new_shard": self.new_shard,
            "needs_weights": self.needs_weights,
        }


@dataclass(frozen=True)
class GroupFate:
    """Of one new shard's groups of one name: how many there are, how many survive, how many cross nodes.

    Attributes:
        shard / name: The new shard and the group name.
        total: Its groups of that name.
        kept: Those whose processes are exactly an old group's of that name (the communicator can stay).
        crossing: Bandwidth-hungry groups (tp, cp, ep, expt_tp, tp_ep) spanning physical nodes (0 without a
            node size, and for the other names).
        rebuilt_example: The first rebuilt group's new ranks (None when every group survives).
    """

    shard: int
    name: str
    total: int
    kept: int
    crossing: int = 0
    rebuilt_example: tuple[int, ...] | None = None

    @property
    def rebuilt(self) -> int:
        return self.total - self.kept

    def to_dict(self) -> dict[str, Any]:
        example = self.rebuilt_example
        return {
            "shard": self.shard,
            "name": self.name,
            "total": self.total,
            "kept": self.kept,
            "rebuilt": self.rebuilt,
            "crossing": self.crossing,
            "rebuilt_example": None if example is None or len(example) > 64 else list(example),
        }


def unchanged(old: Layout, new: ShardPlan, renumbering: Renumbering) -> ShardPlan | None:
    """The old shard that ``new`` is, renumbered (same index and spec, every rank of its window kept), or None."""
    first = renumbering.old_of(new.rank_offset)
    if first is None:
        return None
    plan = old.shard_of(first)
    if plan is None or plan.index != new.index or plan.spec != new.spec or plan.rank_offset != first:
        return None
    last = renumbering.old_of(new.ranks.stop - 1)
    if last is None or last - first != new.size - 1:
        return None
    return None if renumbering.replaces_within(first, last) else plan  # a replacement inside needs weights


class _Owners:
    """The old shard holding an old rank, by bisection over the shards' first ranks (cheaper than
    ``Layout.shard_of``, which checks its argument, for the hundreds of thousands of lookups of a walk)."""

    def __init__(self, old: Layout) -> None:
        self.shards = old.shards
        self.starts = [plan.rank_offset for plan in old.shards]

    def __call__(self, rank: int) -> ShardPlan | None:
        position = bisect_right(self.starts, rank) - 1
        if position < 0 or rank >= self.shards[position].ranks.stop:
            return None
        return self.shards[position]


def rank_moves(old: Layout, new: ShardPlan, renumbering: Renumbering, manifest: Manifest) -> Iterator[RankMove]:
    """The ranks of new shard ``new`` that change shard or weights (none when it is ``unchanged``)."""
    if unchanged(old, new, renumbering) is not None:
        return
    keys = {plan.index: _Keys(plan, manifest) for plan in old.shards}
    mine, owner = _Keys(new, manifest), _Owners(old)
    for rank, before in zip(new.ranks, renumbering.old_ranks(new.ranks)):
        plan = None if before is None else owner(before)
        if plan is None:
            yield RankMove(rank, before, None, new.index, True)
            continue
        needs = keys[plan.index](before) != mine(rank)  # type: ignore[arg-type]
        if needs or plan.index != new.index:
            yield RankMove(rank, before, plan.index, new.index, needs)


class _Shape:
    """The groups of one grid name in one shard, as arithmetic: their members' (stride, size) steps, their
    span (last minus first rank) and their runs (neighbouring steps merged: equal runs, equal sets of
    offsets between members)."""

    def __init__(self, plan: ShardPlan, name: str) -> None:
        grid, dims = plan.grid_of(name)
        self.offset, self.stop = plan.rank_offset, plan.ranks.stop
        self.steps = sorted((grid.stride_of(d), grid.size_of(d)) for d in dims if grid.size_of(d) > 1)
        self.span = sum((size - 1) * stride for stride, size in self.steps)
        runs: list[tuple[int, int]] = []
        for stride, size in self.steps:
            if runs and runs[-1][0] * runs[-1][1] == stride:
                runs[-1] = (runs[-1][0] * size, runs[-1][1])
            else:
                runs.append((size, stride))
        self.runs = tuple(runs)

    def starts(self, rank: int) -> bool:
        """Whether ``rank`` is the first rank of one of these groups."""
        local = rank - self.offset
        return all((local // stride) % size == 0 for stride, size in self.steps)


def _survives(
    owner: _Owners, name: str, group: tuple[int, ...], renumbering: Renumbering, shapes: dict[int, _Shape], mine: _Shape
) -> bool:
    """Whether the processes of new ``group`` are exactly an old group of grid name ``name`` (``shapes``: the
    old shards' shapes of ``name``, ``mine``: the new shard's)."""
    first, last = renumbering.old_of(group[0]), renumbering.old_of(group[-1])
    if first is None or last is None:
        return False
    plan = owner(first)
    if plan is None or last >= plan.ranks.stop:
        return False
    shape = shapes[plan.index]
    if last - first == group[-1] - group[0] and not renumbering.replaces_within(first, last):  # the group shifted
        return shape.runs == mine.runs and shape.starts(first)
    return tuple(renumbering.old_of(rank) for rank in group) == plan.groups_of(first, (name,))[name]


def _count(plan: ShardPlan, name: str) -> int:
    """How many groups of ``name`` a shard has."""
    if name in GRID_GROUP_NAMES:
        return plan.size // plan.group_span(plan.rank_offset, name)[0]
    return plan.size // plan.spec.pp


def _singletons(
    new: ShardPlan, olds: list[int | None], owner: _Owners, shapes: dict[int, _Shape]
) -> tuple[int, int, int, tuple[int, ...] | None]:
    """``_walk`` for a name whose groups are single ranks: one kept for each rank that was alone in its
    old group of that name too. ``olds``: the old rank of each rank of ``new``."""
    kept, example = 0, None
    for rank, before in zip(new.ranks, olds):
        plan = None if before is None else owner(before)
        if plan is not None and not shapes[plan.index].steps:
            kept += 1
        elif example is None:
            example = (rank,)
    return new.size, kept, 0, example


def _embedding_kept(name: str, first: int, last: int | None, pp: _Shape) -> bool:
    """Whether a new embd / pos_embd group whose pp group maps to old ranks first..last is an old one."""
    starts = pp.starts(first)
    return starts if name == "pos_embd" else starts and last is not None and last - first == pp.span


def _embedding(
    old: Layout, new: ShardPlan, name: str, renumbering: Renumbering
) -> tuple[int, int, int, tuple[int, ...] | None]:
    """``_walk`` for embd and pos_embd, from the pp groups they come from: a new group survives when its
    first rank's old rank starts an old pp group and (embd) its last rank's old rank ends that group."""
    shapes = {plan.index: _Shape(plan, "pp") for plan in old.shards}
    owner = _Owners(old)
    total = kept = 0
    example = None
    for group in new.iter_groups("pp"):
        total += 1
        first, last = renumbering.old_of(group[0]), renumbering.old_of(group[-1])
        plan = None if first is None else owner(first)
        if plan is not None and _embedding_kept(name, first, last, shapes[plan.index]):  # type: ignore[arg-type]
            kept += 1
        elif example is None:
            example = (group[0],) if name == "pos_embd" or len(group) == 1 else (group[0], group[-1])
    return total, kept, 0, example


def _walk(
    old: Layout, new: ShardPlan, name: str, renumbering: Renumbering, node: int | None, olds: list[int | None]
) -> tuple[int, int, int, tuple[int, ...] | None]:
    """(groups, surviving, crossing physical nodes of ``node`` ranks, the first rebuilt) of one name."""
    if name not in GRID_GROUP_NAMES:
        return _embedding(old, new, name, renumbering)
    shapes = {plan.index: _Shape(plan, name) for plan in old.shards}
    mine, owner = _Shape(new, name), _Owners(old)
    if not mine.steps:
        return _singletons(new, olds, owner, shapes)
    total = kept = crossing = 0
    example = None
    for group in new.iter_groups(name):
        total += 1
        if _survives(owner, name, group, renumbering, shapes, mine):
            kept += 1
        elif example is None:
            example = group
        if node is not None and renumbering.physical(group[0]) // node != renumbering.physical(group[-1]) // node:
            crossing += 1
    return total, kept, crossing, example


def group_fates(
    old: Layout, new: ShardPlan, renumbering: Renumbering, ranks_per_node: int | None = None
) -> tuple[GroupFate, ...]:
    """One GroupFate per group name (all 15) of new shard ``new``."""
    same = unchanged(old, new, renumbering)
    olds = renumbering.old_ranks(new.ranks) if same is None else []
    fates = []
    for name in GROUP_NAMES:
        node = ranks_per_node if name in BANDWIDTH_GROUPS else None
        if same is not None:
            crossing = node_crossings(*same.grid_of(name), node)[0] if node is not None else 0
            total = _count(same, name)
            fates.append(GroupFate(new.index, name, total, total, crossing))
        else:
            fates.append(GroupFate(new.index, name, *_walk(old, new, name, renumbering, node, olds)))
    return tuple(fates)


__all__ = ["GroupFate", "HoldingsKey", "RankMove", "group_fates", "holdings_key", "rank_moves", "unchanged"]
