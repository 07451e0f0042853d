"""The one place that creates and destroys torch.distributed process groups.

Each distinct rank set is created once per process, in one global order (name slot,
then first rank), so no two ranks wait on each other in a cycle. Two strategies:

* ``local`` (default): only members call ``new_group(..., use_local_synchronization=True)``;
  a rank's cost is its own groups. torch names such a group by hashing its ranks with the
  number of groups the calling process holds, so ranks first agree on that count.
* ``world``: every rank calls ``new_group`` for every group of every shard, Megatron's
  pattern: O(world) calls per rank, safe with any history of earlier groups.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .errors import GroupCreationError, LayoutMismatchError
from .layout import DECODER_GROUPS, EXPERT_GROUPS, Groups, Layout, ShardPlan, distinct_groups
from .protocols import NamedGrids

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

log = logging.getLogger("shardcore")

STRATEGIES = ("local", "world")
DEFAULT_TIMEOUT = timedelta(minutes=5)
_MAX_LISTED = 16
_sequence = 0


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _c10d() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d


def live_group_count() -> int:
    """Process groups this process holds (the number torch mixes into local group names)."""
    return len(_c10d()._world.pg_names)


def _named_group_count() -> int:
    """Groups created in default mode so far (the number torch puts in their names)."""
    return int(_c10d()._world.group_count)


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
    """
    dist = _dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    store, prefix = _store(), f"shardcore/{phase}"
    store.set(f"{prefix}/value/{rank}", value)
    reference = store.compare_set(f"{prefix}/reference", "", value).decode()
    if reference != value:
        store.append(f"{prefix}/differ", f"{rank},")
    if store.add(f"{prefix}/arrived", 1) == world:
        store.set(f"{prefix}/done", "1")
    try:
        store.wait([f"{prefix}/done"], timeout)
    except dist.DistStoreError:
        missing = [r for r in range(world) if not store.check([f"{prefix}/value/{r}"])]
        raise GroupCreationError(
            f"rank {rank}: ranks {_listed(missing)} did not reach '{phase}' within {timeout.total_seconds():g}s; "
            f"every rank of the world must call build_shards (is one dead, slow, or running other code?)"
        ) from None
    if store.check([f"{prefix}/differ"]):
        differ = sorted(int(r) for r in store.get(f"{prefix}/differ").decode().split(",") if r)
        theirs = store.get(f"{prefix}/value/{differ[0]}").decode()
        error = GroupCreationError if reference.split("|")[0] == theirs.split("|")[0] else LayoutMismatchError
        raise error(
            f"rank {rank}: ranks {_listed(differ)} disagree with the first rank to arrive at '{phase}': "
            f"they have {theirs!r}, it has {reference!r} (layout fingerprint | strategy | group count)"
        )


def next_phase(name: str) -> str:
    """A store key unique to this build; every rank computes the same one."""
    global _sequence
    _sequence += 1
    return f"{_sequence}/{name}"


def requested_groups(plan: ShardPlan, rank: int, extra: NamedGrids) -> dict[str, tuple[int, ...] | None]:
    """A member rank's standard groups plus the backend's extra ones."""
    groups = plan.groups_of(rank)
    groups.update({name: grid.group_ranks(rank, dims) for name, (grid, dims) in sorted(extra.items())})
    return groups


def _all_groups(plan: ShardPlan, extra: NamedGrids) -> Iterator[tuple[int, ...]]:
    """Every distinct group of a shard, in the global creation order (slot, first rank)."""
    seen: set[tuple[int, ...]] = set()
    slots: list[Iterator[tuple[int, ...]]] = [plan.decoder_grid.iter_groups(d) for d in DECODER_GROUPS.values()]
    slots += [plan.expert_grid.iter_groups(d) for d in EXPERT_GROUPS.values()]
    pp_groups = list(plan.decoder_grid.iter_groups("pp"))
    slots.append(iter([(p[0], p[-1]) if len(p) > 1 else (p[0],) for p in pp_groups]))
    slots.append(iter([(p[0],) for p in pp_groups]))
    slots += [grid.iter_groups(dims) for _, (grid, dims) in sorted(extra.items())]
    for slot in slots:
        for ranks in slot:
            if ranks not in seen:
                seen.add(ranks)
                yield ranks


def _new_group(ranks: tuple[int, ...], names: Sequence[str], plan: ShardPlan, local: bool, timeout: timedelta) -> Any:
    dist = _dist()
    started = time.monotonic()
    try:
        return dist.new_group(list(ranks), timeout=timeout, use_local_synchronization=local)
    except Exception as error:
        raise GroupCreationError(
            f"rank {dist.get_rank()}: creating group {'/'.join(names) or '?'} of shard {plan.index} with ranks "
            f"{_listed(ranks)} failed after {time.monotonic() - started:.1f}s: {error}. "
            f"Its members must all reach this group within the timeout"
        ) from error


def create_groups(
    layout: Layout, rank: int, extras: Mapping[int, NamedGrids], strategy: str, timeout: timedelta
) -> tuple[Groups, dict[str, ProcessGroup | None], list[ProcessGroup]]:
    """Create this rank's groups: (planned ranks by name, group by name, groups created).

    Both dicts are empty on an idle rank. On failure every group created so far is
    destroyed before the error propagates.
    """
    if strategy not in STRATEGIES:
        raise GroupCreationError(f"strategy={strategy!r}: expected one of {', '.join(STRATEGIES)}")
    mine = layout.shard_of(rank)
    planned = requested_groups(mine, rank, extras.get(mine.index, {})) if mine is not None else {}
    groups: dict[str, ProcessGroup | None] = dict.fromkeys(planned)
    names = {group.ranks: group.names for group in distinct_groups(planned)}
    created: list[ProcessGroup] = []
    try:
        for plan in layout.shards:
            if strategy == "local" and plan is not mine:
                continue
            todo = iter(names) if strategy == "local" else _all_groups(plan, extras.get(plan.index, {}))
            for ranks in todo:
                pg = _new_group(ranks, names.get(ranks, ()), plan, strategy == "local", timeout)
                if ranks in names:
                    created.append(pg)
                    groups.update(dict.fromkeys(names[ranks], pg))
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
    "create_groups",
    "destroy_groups",
    "is_fake_world",
    "live_group_count",
    "next_phase",
    "rendezvous",
    "requested_groups",
]
