"""The one place that creates and destroys torch.distributed process groups.

Each distinct rank set is created once per process, in one global order (name slot,
then first rank), so no two ranks wait on each other in a cycle. Two strategies:

* ``local``: only members call ``new_group``; a rank's cost is its own groups.
* ``world``: every rank calls ``new_group`` for every group of every shard, Megatron's
  pattern: O(world) calls per rank.

Which one a build uses is ``strategy``'s choice.

Why ``local`` does not use ``use_local_synchronization=True``: torch names such a group
``sha1(ranks, number of live groups)``, and destroying groups lowers that number, so a
rebuilt layout reuses the old names and gloo reads the old incarnation's addresses from
the store (measured: the second build/destroy cycle of ``tp=2,pp=2`` on 4 ranks fails
in connectFullMesh). Default-mode groups are named by torch's world-wide counter
``group_count``, which never goes down. ``local`` sets that counter, before each group,
to ``start + slot * world_size + first rank``: a number every member computes alike,
unique among all groups of the build, and above every earlier name. Afterwards every
rank, member or not, leaves the counter at ``start + slots * world_size``, so later
world-collective group creation (Megatron, ``init_device_mesh``) still agrees on names.
Ranks check before starting that they hold the same counter (``agreement``); torch's
private state is touched only through ``torch_state``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ...errors import GroupCreationError
from ...plan.arguments import shown_ranks
from ...plan.layout import GROUP_NAMES, Layout, RankGroups, ShardPlan, distinct_groups
from ...plan.protocols import NamedGrids
from ..torch_state import (
    dist,
    group_counter,
    group_keys,
    is_fake_world,
    set_group_counter,
    store_abandoned,
    store_call,
)
from .strategy import Strategy

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


KEY_DELETION_TIMEOUT = 10.0
"""Seconds destroy_groups waits for the store to delete a destroyed group's keys."""
log = logging.getLogger("shardcore")


def requested_groups(plan: ShardPlan, rank: int, extra: NamedGrids, names: Collection[str] = GROUP_NAMES) -> RankGroups:
    """A member rank's standard groups among ``names``, plus the backend's extra ones."""
    groups = plan.groups_of(rank, names)
    groups.update({name: grid.group_ranks(rank, dims) for name, (grid, dims) in sorted(extra.items())})
    return groups


def _all_groups(plan: ShardPlan, extra: NamedGrids, names: Collection[str]) -> Iterator[tuple[int, ...]]:
    """Every distinct group of a shard among ``names`` and the extras, in the global creation order."""
    seen: set[tuple[int, ...]] = set()
    slots = [plan.iter_groups(name) for name in GROUP_NAMES if name in names]
    slots += [grid.iter_groups(dims) for _, (grid, dims) in sorted(extra.items())]
    for slot in slots:
        for ranks in slot:
            if ranks not in seen:
                seen.add(ranks)
                yield ranks


def _new_group(
    ranks: tuple[int, ...],
    names: Sequence[str],
    plan: ShardPlan,
    timeout: timedelta,
    abandoned: Callable[[], bool] | None = None,
) -> Any:
    """Create one group. ``abandoned``: asked first, True when the other ranks have given up on the build; a rank
    that comes after that fails at once, where gloo would wait out its own 30 s connect timeout for peers that left.

    Raises:
        GroupCreationError: naming the group, its ranks and why.
    """
    started = time.monotonic()
    if abandoned is not None and abandoned():
        raise GroupCreationError(
            f"rank {dist().get_rank()}: came to create group {'/'.join(names) or '?'} of shard {plan.index} with "
            f"ranks {shown_ranks(ranks)} after the other ranks had given up on the build: this rank was slower than "
            "the timeout (a busy machine, a debugger, a slow import?); give build_shards a longer timeout"
        )
    try:
        return dist().new_group(list(ranks), timeout=timeout)
    except Exception as error:
        raise GroupCreationError(
            f"rank {dist().get_rank()}: creating group {'/'.join(names) or '?'} of shard {plan.index} with ranks "
            f"{shown_ranks(ranks)} failed after {time.monotonic() - started:.1f}s: {error}. {_likely_cause()}"
        ) from error


def _likely_cause() -> str:
    """Why a group creation failed: a lost store (its host died) explains a member's abrupt error."""
    try:
        store_call(lambda store: store.check(["shardcore/alive"]), KEY_DELETION_TIMEOUT, "after a failed group")
    except GroupCreationError as error:
        return f"The store is unreachable: {error}"
    return "Its members must all reach this group within the timeout"


def create_groups(
    layout: Layout,
    rank: int,
    extras: Mapping[int, NamedGrids],
    strategy: Strategy,
    timeout: timedelta,
    names: Collection[str] = GROUP_NAMES,
    *,
    created: list[ProcessGroup],
    abandoned: Callable[[], bool] | None = None,
) -> tuple[RankGroups, dict[str, ProcessGroup | None]]:
    """Create this rank's groups among ``names`` plus the backend's extras, appending each to ``created``.
    ``abandoned``: asked before each group, True when the other ranks have given up on the build.

    Returns (planned ranks by name, process group by name); build_shards checks ``strategy``
    before any rank communicates. Both dicts are empty on an idle rank.

    On failure the groups created so far stay in ``created``, not destroyed: destroying one
    deletes this rank's connect keys, which a member still inside its ``new_group`` may not
    have read yet (gloo's connecting side finishes before its peer reads its address), and
    that member would then wait out its whole timeout. The caller destroys them once every
    rank is past creating (``build_shards``: after the build's last meeting).
    """
    mine = layout.shard_of(rank)
    ranks_by_name = requested_groups(mine, rank, extras.get(mine.index, {}), names) if mine is not None else {}
    process_groups: dict[str, ProcessGroup | None] = dict.fromkeys(ranks_by_name)
    shared = {group.ranks: group.names for group in distinct_groups(ranks_by_name)}

    def create(ranks: tuple[int, ...], plan: ShardPlan) -> None:
        pg = _new_group(ranks, shared.get(ranks, ()), plan, timeout, abandoned)
        if ranks in shared:
            created.append(pg)
            process_groups.update(dict.fromkeys(shared[ranks], pg))

    if strategy == Strategy.WORLD:
        for plan in layout.shards:
            for ranks in _all_groups(plan, extras.get(plan.index, {}), names):
                create(ranks, plan)
    else:
        slots = [*GROUP_NAMES, *sorted({name for extra in extras.values() for name in extra})]
        start, slot_of = group_counter(), {name: i for i, name in enumerate(slots)}
        for ranks, group_names in shared.items():
            set_group_counter(start + slot_of[group_names[0]] * layout.world_size + ranks[0])
            create(ranks, mine)  # type: ignore[arg-type]  # shared is empty on an idle rank
        set_group_counter(start + len(slots) * layout.world_size)
    return ranks_by_name, process_groups


def destroy_groups(groups: Sequence[ProcessGroup]) -> None:
    """Destroy each group once (shared names hold the same object) and delete the store keys it left.

    Each member deletes the keys it wrote to connect the group (``torch_state.group_keys``):
    a default-mode group's name is never used again, so no later group reads them. Call it
    only once every member of these groups is past creating them (after a meeting all of them
    reached, or gave up on): a member still connecting reads them. Deleting is best effort: a
    store that does not answer within ``KEY_DELETION_TIMEOUT`` leaves them (logged); a store given
    up because its host is gone (``torch_state.abandon_store``) is not asked.
    """
    seen: set[int] = set()
    keys: list[str] = []
    for pg in groups:
        if pg is not None and id(pg) not in seen:
            seen.add(id(pg))
            keys += group_keys(pg)
            dist().destroy_process_group(pg)
    if keys and not is_fake_world() and not store_abandoned():
        try:
            store_call(lambda store: [store.delete_key(key) for key in keys], KEY_DELETION_TIMEOUT, "deleting keys")
        except GroupCreationError as error:
            log.warning("shardcore: the destroyed groups' store keys stay: %s", error)


__all__ = ["KEY_DELETION_TIMEOUT", "create_groups", "destroy_groups", "requested_groups"]
