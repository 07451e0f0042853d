"""The one place that creates and destroys torch.distributed process groups.

Each distinct rank set is created once per process, in one global order (name slot,
then first rank), so no two ranks wait on each other in a cycle. Two strategies:

* ``local`` (default): only members call ``new_group``; a rank's cost is its own groups.
* ``world``: every rank calls ``new_group`` for every group of every shard, Megatron's
  pattern: O(world) calls per rank.

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
Ranks check before starting that they hold the same counter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .errors import GroupCreationError, LayoutMismatchError
from .layout import DECODER_GROUPS, EXPERT_GROUPS, GROUP_NAMES, Groups, Layout, ShardPlan, distinct_groups
from .protocols import NamedGrids

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

log = logging.getLogger("shardcore")

STRATEGIES = ("local", "world")
DEFAULT_TIMEOUT = timedelta(minutes=5)
_MAX_LISTED = 16
_sequence = 0
_previous_phase: str | None = None


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _c10d() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d


def live_group_count() -> int:
    """Process groups this process holds, the default group included."""
    return len(_c10d()._world.pg_names)


def group_counter() -> int:
    """torch's counter that names default-mode groups; every rank must hold the same value."""
    return int(_c10d()._world.group_count)


def _set_group_counter(value: int) -> None:
    _c10d()._world.group_count = value


def check_local_strategy() -> None:
    """Members-only creation deadlocks where torch makes every rank take part; refuse it upfront."""
    import os

    if os.environ.get("TORCH_DIST_INIT_BARRIER") == "1":
        raise GroupCreationError(
            "TORCH_DIST_INIT_BARRIER=1 makes every group creation a world barrier, so members-only creation "
            "would hang: unset it or use strategy='world'"
        )
    if _c10d()._get_default_group().bound_device_id is not None:
        raise GroupCreationError(
            "the default group is bound to a device (init_process_group(device_id=...)), so torch splits "
            "communicators with every rank taking part and members-only creation would hang: "
            "init without device_id or use strategy='world'"
        )


def as_timedelta(timeout: float | timedelta | None) -> timedelta:
    """Seconds or a timedelta; None means DEFAULT_TIMEOUT."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    value = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if value.total_seconds() <= 0:
        raise GroupCreationError(f"timeout={timeout!r}: expected a positive number of seconds")
    return value


def _listed(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:_MAX_LISTED]))
    return f"[{shown}{', ...' if len(ranks) > _MAX_LISTED else ''}] ({len(ranks)} ranks)"


def is_fake_world() -> bool:
    """True under torch's fake backend, where no rank can see another."""
    return str(_dist().get_backend()) == "fake"


def _store() -> Store:
    return _c10d()._get_default_store()


def rendezvous(phase: str, value: str, timeout: timedelta) -> None:
    """Wait until every rank of the world reaches ``phase``; all must bring the same ``value``.

    Store-based, so it works on any backend and names the ranks that are missing or
    differ: a GroupCreationError on timeout, a LayoutMismatchError when values differ.
    Once a phase completes, no rank reads the previous one again, so its keys are deleted
    (each rank its own value, rank 0 the shared ones): the store holds one phase at a time.
    A store that goes away (its host died) is a GroupCreationError too.
    """
    dist = _dist()
    try:
        _rendezvous(phase, value, timeout)
    except dist.DistError as error:
        raise GroupCreationError(
            f"rank {dist.get_rank()}: lost the store at '{phase}' ({error}); its host (rank 0 under torchrun) "
            f"has probably died"
        ) from None


def _rendezvous(phase: str, value: str, timeout: timedelta) -> None:
    global _previous_phase
    dist = _dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    store, prefix = _store(), f"shardcore/{phase}"
    store.set(f"{prefix}/value/{rank}", value)
    reference = store.compare_set(f"{prefix}/reference", "", value).decode()
    if reference != value:
        store.append(f"{prefix}/differ", f"{rank},")  # type: ignore[attr-defined]  # missing from torch's stubs
    if store.add(f"{prefix}/arrived", 1) == world:
        store.set(f"{prefix}/done", "1")
    try:
        store.wait([f"{prefix}/done"], timeout)
    except dist.DistError as error:
        try:
            missing = [r for r in range(world) if not store.check([f"{prefix}/value/{r}"])]
            failed = [r for r in missing if store.check([f"{prefix}/failed/{r}"])]
        except dist.DistError:
            raise error from None  # the store itself is gone: rendezvous() names it
        why = f"; ranks {_listed(failed)} failed before it" if failed else ""
        if failed:
            why += f" (rank {failed[0]}: {store.get(f'{prefix}/failed/{failed[0]}').decode()})"
        raise GroupCreationError(
            f"rank {rank}: ranks {_listed(missing)} did not reach '{phase}' within {timeout.total_seconds():g}s{why}; "
            f"every rank of the world must call build_shards (is one dead, slow, or running other code?)"
        ) from None
    previous, _previous_phase = _previous_phase, prefix
    if previous is not None:
        _delete_phase(store, previous, rank)
    if store.check([f"{prefix}/differ"]):
        differ = sorted(int(r) for r in store.get(f"{prefix}/differ").decode().split(",") if r)
        theirs = store.get(f"{prefix}/value/{differ[0]}").decode()
        if 2 * len(differ) > world:  # the first to arrive is the odd one out: name the minority
            differ_set = set(differ)
            differ, theirs, reference = [r for r in range(world) if r not in differ_set], reference, theirs
        error_type = GroupCreationError if reference.split("|")[0] == theirs.split("|")[0] else LayoutMismatchError
        raise error_type(
            f"rank {rank}: ranks {_listed(differ)} disagree with the other {world - len(differ)} ranks at "
            f"'{phase}': they have {theirs!r}, the others {reference!r} "
            f"(layout:backend:groups | strategy | torch group counter)"
        )


def _delete_phase(store: Store, prefix: str, rank: int) -> None:
    """Drop a completed phase's keys: this rank's value, and on rank 0 the shared keys."""
    keys = [f"{prefix}/value/{rank}"]
    if rank == 0:
        keys += [f"{prefix}/{key}" for key in ("reference", "differ", "arrived", "done")]
    for key in keys:
        store.delete_key(key)


def report_failure(phase: str, error: BaseException) -> None:
    """Leave why this rank will not reach ``phase``, for the ranks that time out waiting for it."""
    try:
        _store().set(f"shardcore/{phase}/failed/{_dist().get_rank()}", f"{type(error).__name__}: {error}"[:500])
    except Exception:  # best effort: the store's host may be gone
        log.debug("shardcore: could not report the failure to the store", exc_info=True)


def next_phase(name: str) -> str:
    """A store key unique to this build; every rank computes the same one."""
    global _sequence
    _sequence += 1
    return f"{_sequence}/{name}"


def requested_groups(
    plan: ShardPlan, rank: int, extra: NamedGrids, names: Collection[str] = GROUP_NAMES
) -> dict[str, tuple[int, ...] | None]:
    """A member rank's standard groups among ``names``, plus the backend's extra ones."""
    groups = plan.groups_of(rank, names)
    groups.update({name: grid.group_ranks(rank, dims) for name, (grid, dims) in sorted(extra.items())})
    return groups


def _all_groups(plan: ShardPlan, extra: NamedGrids, names: Collection[str]) -> Iterator[tuple[int, ...]]:
    """Every distinct group of a shard among ``names`` and the extras, in the global creation order."""
    seen: set[tuple[int, ...]] = set()
    pp_groups = list(plan.decoder_grid.iter_groups("pp"))
    slots: dict[str, Iterable[tuple[int, ...]]] = {
        **{name: plan.decoder_grid.iter_groups(dims) for name, dims in DECODER_GROUPS.items()},
        **{name: plan.expert_grid.iter_groups(dims) for name, dims in EXPERT_GROUPS.items()},
        "embd": [(p[0], p[-1]) if len(p) > 1 else (p[0],) for p in pp_groups],
        "pos_embd": [(p[0],) for p in pp_groups],
    }
    slots = {name: groups for name, groups in slots.items() if name in names}
    slots.update({name: grid.iter_groups(dims) for name, (grid, dims) in sorted(extra.items())})
    for slot in slots.values():
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
            f"{_listed(ranks)} failed after {time.monotonic() - started:.1f}s: {error}. {_likely_cause()}"
        ) from error


def _likely_cause() -> str:
    """Why a group creation failed: a lost store (its host died) explains a member's abrupt error."""
    try:
        _store().check(["shardcore/alive"])
    except Exception:  # any failure to reach the store means the same thing here
        return "The store is unreachable: its host (rank 0 under torchrun) has probably died"
    return "Its members must all reach this group within the timeout"


def create_groups(
    layout: Layout,
    rank: int,
    extras: Mapping[int, NamedGrids],
    strategy: str,
    timeout: timedelta,
    names: Collection[str] = GROUP_NAMES,
) -> tuple[Groups, dict[str, ProcessGroup | None], list[ProcessGroup]]:
    """Create this rank's groups among ``names`` plus the backend's extras.

    Returns (planned ranks by name, group by name, groups created). ``strategy`` is one of
    STRATEGIES; build_shards checks it before any rank communicates.

    Both dicts are empty on an idle rank. On failure every group created so far is
    destroyed before the error propagates.
    """
    mine = layout.shard_of(rank)
    planned = requested_groups(mine, rank, extras.get(mine.index, {}), names) if mine is not None else {}
    groups: dict[str, ProcessGroup | None] = dict.fromkeys(planned)
    shared = {group.ranks: group.names for group in distinct_groups(planned)}
    created: list[ProcessGroup] = []

    def create(ranks: tuple[int, ...], plan: ShardPlan) -> None:
        pg = _new_group(ranks, shared.get(ranks, ()), plan, timeout)
        if ranks in shared:
            created.append(pg)
            groups.update(dict.fromkeys(shared[ranks], pg))

    try:
        if strategy == "world":
            for plan in layout.shards:
                for ranks in _all_groups(plan, extras.get(plan.index, {}), names):
                    create(ranks, plan)
        else:
            slots = [*GROUP_NAMES, *sorted({name for extra in extras.values() for name in extra})]
            start, slot_of = group_counter(), {name: i for i, name in enumerate(slots)}
            for ranks, group_names in shared.items():
                _set_group_counter(start + slot_of[group_names[0]] * layout.world_size + ranks[0])
                create(ranks, mine)  # type: ignore[arg-type]
            _set_group_counter(start + len(slots) * layout.world_size)
    except BaseException:
        destroy_groups(created)
        raise
    return planned, groups, created


def destroy_groups(groups: Sequence[ProcessGroup]) -> None:
    """Destroy each group once (shared names hold the same object)."""
    dist = _dist()
    seen: set[int] = set()
    for pg in groups:
        if pg is not None and id(pg) not in seen:
            seen.add(id(pg))
            dist.destroy_process_group(pg)


__all__ = [
    "DEFAULT_TIMEOUT",
    "STRATEGIES",
    "as_timedelta",
    "check_local_strategy",
    "group_counter",
    "create_groups",
    "destroy_groups",
    "is_fake_world",
    "live_group_count",
    "next_phase",
    "rendezvous",
    "report_failure",
    "requested_groups",
]
