"""The one place that creates and destroys torch.distributed process groups.

Each distinct rank set is created once per process, in one global order (name slot,
then first rank), so no two ranks wait on each other in a cycle. Two strategies:

* ``local``: only members call ``new_group``; a rank's cost is its own groups.
* ``world``: every rank calls ``new_group`` for every group of every shard, Megatron's
  pattern: O(world) calls per rank.

``auto`` (the default) picks one for the world it finds (``choose_strategy``): ``world``
where torch makes every group creation world-collective (a device-bound default group,
``TORCH_DIST_INIT_BARRIER=1``, TorchComms), else ``local``.

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
Ranks check before starting that they hold the same counter (``rendezvous``); torch's
private state is touched only through ``torch_state``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from datetime import timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from ..errors import GroupCreationError
from ..plan.layout import GROUP_NAMES, Layout, RankGroups, ShardPlan, distinct_groups
from .backend import NamedGrids
from .rendezvous import listed
from .torch_state import (
    bound_device,
    group_counter,
    group_keys,
    set_group_counter,
    store_call,
    torchcomms_enabled,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class Strategy(StrEnum):
    """Who calls ``new_group`` for a group: its members only, or every rank of the world."""

    AUTO = "auto"
    """Choose for the world found: ``world`` where torch creates groups with every rank, else ``local``."""
    LOCAL = "local"
    WORLD = "world"


KEY_DELETION_TIMEOUT = 10.0
"""Seconds destroy_groups waits for the store to delete a destroyed group's keys."""
log = logging.getLogger("shardcore")


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def init_barrier_enabled() -> bool:
    """Whether torch adds a world barrier to every group creation: ``int($TORCH_DIST_INIT_BARRIER) == 1``.

    torch 2.13 reads the variable as ``int(os.getenv("TORCH_DIST_INIT_BARRIER", "0")) == 1``,
    so ``" 1"`` and ``"01"`` turn the barrier on and ``"true"`` or ``"2"`` do not.

    Raises:
        GroupCreationError: the value is not an integer (torch's own ``new_group`` would fail on it).
    """
    value = os.environ.get("TORCH_DIST_INIT_BARRIER", "0")
    try:
        return int(value) == 1
    except ValueError:
        raise GroupCreationError(
            f"TORCH_DIST_INIT_BARRIER={value!r}: torch reads it as an integer (1 turns on a barrier after every "
            "group creation, 0 or unset turns it off): set it to 0 or 1"
        ) from None


def _environment_reason() -> str | None:
    """Why torch's settings (not its default group) make every rank take part in each group creation."""
    if torchcomms_enabled():
        return "TorchComms is enabled (TORCH_DISTRIBUTED_USE_TORCHCOMMS=1): new_group splits the whole world"
    if init_barrier_enabled():
        return "TORCH_DIST_INIT_BARRIER=1 makes every group creation a world barrier"
    return None


def world_collective_reason() -> str | None:
    """Why torch makes every rank take part in each group creation here, or None when it does not."""
    reason = _environment_reason()
    if reason is not None:
        return reason
    device = bound_device()
    if device is not None:
        return (
            f"the default group is bound to {device} (init_process_group(device_id=...)), so torch splits "
            "communicators with every rank taking part"
        )
    return None


def _parse(requested: str | Strategy) -> Strategy:
    try:
        return Strategy(requested)
    except ValueError:
        raise GroupCreationError(f"strategy={requested!r}: expected one of {', '.join(Strategy)}") from None


def _refuse_local(reason: str) -> GroupCreationError:
    return GroupCreationError(
        f"strategy='local' cannot work here: {reason}, so members-only creation would hang; "
        "use strategy='world' or 'auto' (the default), which picks 'world' here"
    )


def check_strategy_early(requested: str | Strategy) -> None:
    """What can be decided before any process joins a world: the name, ``TORCH_DIST_INIT_BARRIER``'s
    value, and an explicit ``local`` where torch's settings make it hang (``shardcore check`` calls
    it before starting workers).

    Raises:
        GroupCreationError: as ``choose_strategy`` would on every rank.
    """
    if _parse(requested) == Strategy.LOCAL:
        reason = _environment_reason()
        if reason is not None:
            raise _refuse_local(reason)
    else:
        init_barrier_enabled()


def choose_strategy(requested: str | Strategy) -> tuple[Strategy, str]:
    """The strategy to build with and why; ``auto`` resolves to ``world`` or ``local`` here.

    Args:
        requested: ``auto``, ``local`` or ``world``.

    Returns:
        (``local`` or ``world``, a sentence saying why).

    Raises:
        GroupCreationError: an unknown strategy, or ``local`` asked for explicitly in a world where
            members-only creation would hang (naming the reason and ``strategy='world'`` or ``'auto'``).
    """
    strategy = _parse(requested)
    if strategy == Strategy.WORLD:
        return strategy, "asked for: every rank creates every group"
    reason = world_collective_reason()
    if strategy == Strategy.LOCAL:
        if reason is not None:
            raise _refuse_local(reason)
        return strategy, "asked for: members create their own groups"
    if reason is not None:
        return Strategy.WORLD, f"{reason}: every rank creates every group (Megatron's pattern)"
    return Strategy.LOCAL, "groups are created lazily here: members create only their own groups"


def is_fake_world() -> bool:
    """True under torch's fake backend, where no rank can see another."""
    return str(_dist().get_backend()) == "fake"


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


def _new_group(ranks: tuple[int, ...], names: Sequence[str], plan: ShardPlan, timeout: timedelta) -> Any:
    dist = _dist()
    started = time.monotonic()
    try:
        return dist.new_group(list(ranks), timeout=timeout)
    except Exception as error:
        raise GroupCreationError(
            f"rank {dist.get_rank()}: creating group {'/'.join(names) or '?'} of shard {plan.index} with ranks "
            f"{listed(ranks)} failed after {time.monotonic() - started:.1f}s: {error}. {_likely_cause()}"
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
) -> tuple[RankGroups, dict[str, ProcessGroup | None], list[ProcessGroup]]:
    """Create this rank's groups among ``names`` plus the backend's extras.

    Returns (planned ranks by name, process group by name, groups created); build_shards
    checks ``strategy`` before any rank communicates.

    Both dicts are empty on an idle rank. On failure every group created so far is
    destroyed before the error propagates.
    """
    mine = layout.shard_of(rank)
    ranks_by_name = requested_groups(mine, rank, extras.get(mine.index, {}), names) if mine is not None else {}
    process_groups: dict[str, ProcessGroup | None] = dict.fromkeys(ranks_by_name)
    shared = {group.ranks: group.names for group in distinct_groups(ranks_by_name)}
    created: list[ProcessGroup] = []

    def create(ranks: tuple[int, ...], plan: ShardPlan) -> None:
        pg = _new_group(ranks, shared.get(ranks, ()), plan, timeout)
        if ranks in shared:
            created.append(pg)
            process_groups.update(dict.fromkeys(shared[ranks], pg))

    try:
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
    except BaseException:
        destroy_groups(created)
        raise
    return ranks_by_name, process_groups, created


def destroy_groups(groups: Sequence[ProcessGroup]) -> None:
    """Destroy each group once (shared names hold the same object) and delete the store keys it left.

    Each member deletes the keys it wrote to connect the group (``torch_state.group_keys``):
    a default-mode group's name is never used again, and by the time a group is destroyed
    its members have connected, so no later group reads them. Deleting is best effort: a
    store that does not answer within ``KEY_DELETION_TIMEOUT`` leaves them (logged).
    """
    dist = _dist()
    seen: set[int] = set()
    keys: list[str] = []
    for pg in groups:
        if pg is not None and id(pg) not in seen:
            seen.add(id(pg))
            keys += group_keys(pg)
            dist.destroy_process_group(pg)
    if keys and not is_fake_world():
        try:
            store_call(lambda store: [store.delete_key(key) for key in keys], KEY_DELETION_TIMEOUT, "deleting keys")
        except GroupCreationError as error:
            log.warning("shardcore: the destroyed groups' store keys stay: %s", error)


__all__ = [
    "Strategy",
    "check_strategy_early",
    "choose_strategy",
    "create_groups",
    "destroy_groups",
    "init_barrier_enabled",
    "is_fake_world",
    "requested_groups",
    "world_collective_reason",
]
