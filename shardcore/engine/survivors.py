"""The survivors' world: after ranks are gone, the ones still running form a smaller world to go on in.

Two ways, chosen alike on every survivor from what it can see:

* **Shrink**, where the default group's backend says ``supports_shrinking`` (NCCL's communicator shrink
  on torch 2.13) and the store's host survives: ``dist.shrink_group(gone, shrink_flags=SHRINK_ABORT)``.
  The default group's communicator is kept, shrunk in place (pending work on it aborted), and becomes
  the new default group. torch destroys every other group when the default one shrinks (their ranks
  are renumbered), so the new layout's groups are created afresh from the shrunk communicator. The new
  default group keeps the old store, which is why its host must survive; and since torch 2.13 resets
  its group counter there (the shrink destroys the old default group through the whole-world branch of
  ``destroy_process_group``), new groups would take the old groups' names and read the connection keys
  those left in the store (measured: gloo then dials a dead address), so the counter is set back.
* **A new world** otherwise (gloo says ``supports_shrinking`` False): the default group is destroyed and
  the survivors initialise a new one on the same backend and device. Its store is the old store under
  a prefix of its own when the old store's host survives (rank 0, or torchrun's agent when it hosts
  the store); when rank 0 hosted it and is gone, the lowest survivor (the new rank 0) hosts a new
  TCPStore at ``rendezvous=(host, port)``, an address of that survivor's machine that every survivor
  was told before the loss (the store cannot be found afterwards: it was the only meeting place).

Either way survivors keep their order (new rank = old rank minus the gone ranks below it, as
``shardcore.replan.Renumbering`` numbers them), the old build's groups are destroyed first
(``destroy_shards``), and the survivors then meet in the new world (``engine.agreement``) to check that
they all formed the same one. Every step is bounded by ``timeout`` except NCCL's own shrink.
"""

from __future__ import annotations

import hashlib
import time
from bisect import bisect_left
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..errors import GroupCreationError, LayoutError
from ..plan.arguments import as_timedelta, check_count, shown, shown_ranks
from .agreement import Party, Purpose, Terms, convene
from .backends.shards import Shard, destroy_shards
from .torch_state import (
    abandon_store,
    agent_hosts_store,
    bound_device,
    c10d,
    default_group_can_shrink,
    default_store,
    dist,
    group_counter,
    import_torch,
    is_fake_world,
    set_group_counter,
)

SHRINK = "shrink"
NEW_WORLD = "new world"
FORMED = Purpose("re-formed world", "form_survivor_world", GroupCreationError)


@dataclass(frozen=True)
class SurvivorWorld:
    """The world this rank now belongs to, and how it was formed.

    Attributes:
        how: ``shrink`` (torch's ``shrink_group``) or ``new world`` (destroyed and initialised anew).
        old_rank / rank: This process's rank before and after.
        old_world_size / world_size: Ranks before and after.
        gone: The old ranks left out, sorted.
        store: Where the new world's store lives, for people.
        seconds: Wall time of the whole call (the agreement included).
    """

    how: str
    old_rank: int
    rank: int
    old_world_size: int
    world_size: int
    gone: tuple[int, ...]
    store: str
    seconds: float


@dataclass(frozen=True)
class FormedTerms(Terms):
    """What every survivor must have formed alike."""

    KIND = "survivors"

    old_world_size: int
    gone: tuple[int, ...]
    how: str


def form_survivor_world(
    gone: Collection[int],
    *,
    shards: Sequence[Shard] = (),
    rendezvous: tuple[str, int] | None = None,
    timeout: float | timedelta | None = None,
    abort: bool = True,
) -> SurvivorWorld:
    """Leave the ranks ``gone`` behind: make the default group that of the survivors, renumbered in order.

    Every survivor calls it, with the same arguments; the gone ranks must not (their processes have ended,
    or are about to). Afterwards build the new layout (``build_shards``) and restore the weights
    (``shardcore.replan.restore_plan`` and ``execute_refit``).

    Args:
        gone: Old ranks not in the new world: the lost ones, and any a replan option releases
            (``ReplanOption.renumbering.gone``).
        shards: This rank's shards of the old build, destroyed first (every other group of the process is
            destroyed too: torch's rule when the default group shrinks, or is destroyed).
        rendezvous: (host, port) where the lowest survivor hosts the new world's store, needed when the old
            store's host (rank 0) is gone; give it on every survivor. Unused otherwise.
        timeout: seconds (or a timedelta) for forming the world and agreeing on it; default 5 minutes.
        abort: shrink with ``SHRINK_ABORT`` (abort the old communicator's pending work: a peer died mid-way),
            else ``SHRINK_DEFAULT``.

    Returns:
        This rank's SurvivorWorld.

    Raises:
        LayoutError: a bad ``gone``, ``rendezvous`` or ``timeout``, or this rank among the gone ones; checked
            before anything is destroyed.
        GroupCreationError: torch.distributed not initialised (or the fake backend); the store's host is gone
            and no ``rendezvous`` was given (before anything is destroyed); the new world did not form within
            ``timeout``; or the survivors formed different worlds (naming them).
    """
    started = time.monotonic()
    wait = as_timedelta(timeout)
    rank, world = _require_world()
    left = _check_gone(gone, rank, world)
    address = _check_rendezvous(rendezvous)
    store_survives = agent_hosts_store() or 0 not in left
    if not store_survives and address is None:
        raise GroupCreationError(
            f"rank {rank}: the store's host, rank 0, is gone: give rendezvous=(host, port), an address where the "
            f"lowest survivor, old rank {_lowest_survivor(left)}, hosts the new world's store (every survivor the same)"
        )
    how = SHRINK if store_survives and default_group_can_shrink() else NEW_WORLD
    new_rank, size = rank - bisect_left(left, rank), world - len(left)
    if not store_survives:
        abandon_store()
    destroy_shards(shards)
    if how == SHRINK:
        _shrink(rank, left, abort)
        store = "the old store"
    else:
        store = _new_world(rank, new_rank, size, left, None if store_survives else address, wait)
    _agree(FormedTerms(world, left, how), wait)
    return SurvivorWorld(how, rank, new_rank, world, size, left, store, time.monotonic() - started)


def _require_world() -> tuple[int, int]:
    """This rank and the world's size; a world must exist (and be a real one) to leave ranks behind."""
    import_torch()
    torch_dist = dist()
    if not torch_dist.is_available() or not torch_dist.is_initialized():
        raise GroupCreationError("torch.distributed is not initialized: there is no world to leave ranks behind in")
    if is_fake_world():
        raise GroupCreationError("the fake backend has no peers to lose: form a survivor world on a real backend")
    return int(torch_dist.get_rank()), int(torch_dist.get_world_size())


def _check_gone(gone: object, rank: int, world: int) -> tuple[int, ...]:
    """The gone ranks, sorted; each a rank of the world, this one not among them, at least one.

    Raises:
        LayoutError: naming the bad value.
    """
    if isinstance(gone, (str, bytes)) or not isinstance(gone, Collection):
        raise LayoutError(f"gone={shown(gone)}: expected a collection of old ranks, e.g. option.renumbering.gone")
    for value in gone:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < world:
            raise LayoutError(
                f"gone rank {shown(value)} is outside the world [0, {world}): name ranks of the old world"
            )
    left = tuple(sorted(set(gone)))
    if not left:
        raise LayoutError("gone=(): no rank is gone, so the world stays as it is")
    if rank in left:
        raise LayoutError(
            f"rank {rank} is among the gone ranks {shown_ranks(left)}: a gone rank takes no part; end its process"
        )
    return left


def _check_rendezvous(rendezvous: object) -> tuple[str, int] | None:
    if rendezvous is None:
        return None
    if not isinstance(rendezvous, tuple) or len(rendezvous) != 2 or not isinstance(rendezvous[0], str):
        raise LayoutError(f"rendezvous={shown(rendezvous)}: expected (host, port), e.g. ('10.0.0.2', 29600)")
    host, port = rendezvous
    return host, check_count("rendezvous port", port, minimum=1, maximum=65535)


def _lowest_survivor(left: tuple[int, ...]) -> int:
    return next(rank for rank, gone in enumerate((*left, -1)) if rank != gone)


def _shrink(rank: int, left: tuple[int, ...], abort: bool) -> None:
    """torch's shrink_group of the default group; the shrunk group becomes the default one.

    Raises:
        GroupCreationError: the backend refused or failed the shrink.
    """
    flags = c10d().SHRINK_ABORT if abort else c10d().SHRINK_DEFAULT
    counter = group_counter()
    try:
        dist().shrink_group(list(left), shrink_flags=flags)
    except (TypeError, ValueError, RuntimeError) as error:
        raise GroupCreationError(f"rank {rank}: shrink_group({shown_ranks(left)}) failed: {error}", [rank]) from error
    set_group_counter(counter)  # torch reset it: new groups would take the old ones' names, and their store keys


def _new_world(
    rank: int, new_rank: int, size: int, left: tuple[int, ...], address: tuple[str, int] | None, wait: timedelta
) -> str:
    """Destroy the default group and initialise the survivors' one (same backend, same device); returns where
    its store lives. ``address``: where the new rank 0 hosts a new store (None: the old store, prefixed).

    Raises:
        GroupCreationError: the new store could not be hosted or reached, or the world did not form in time.
    """
    backend, device = str(dist().get_backend()), bound_device()
    old = default_store() if address is None else None
    digest = hashlib.sha256(repr(left).encode()).hexdigest()[:12]
    prefix = f"shardcore/survivors/{len(left) + size}-{digest}/"
    dist().destroy_process_group()
    where = f"the old store, under {prefix}"
    if address is None:
        store: Any = dist().PrefixStore(prefix, old)
    else:
        host, port = address
        where = f"new rank 0 (old rank {_lowest_survivor(left)}) at {host}:{port}"
        try:
            store = dist().PrefixStore(
                prefix,
                dist().TCPStore(host, port, size, is_master=new_rank == 0, timeout=wait, wait_for_workers=False),
            )
        except (RuntimeError, dist().DistError) as error:
            role = "host" if new_rank == 0 else "reach"
            raise GroupCreationError(
                f"rank {rank}: cannot {role} the survivors' store at {host}:{port}: {error}", [rank]
            ) from None
    try:
        dist().init_process_group(backend, store=store, rank=new_rank, world_size=size, timeout=wait, device_id=device)
    except (RuntimeError, dist().DistError) as error:
        raise GroupCreationError(
            f"rank {rank} (new rank {new_rank}): the world of {size} survivors did not form within "
            f"{wait.total_seconds():g}s ({str(error).strip()[:300]}): every survivor must call form_survivor_world "
            f"with the same gone ranks",
            [rank],
        ) from None
    return where


def _agree(terms: FormedTerms, wait: timedelta) -> None:
    """The survivors meet in their new world: every one must have formed the same one.

    Raises:
        GroupCreationError: a survivor missing, failed, or with other gone ranks (naming them).
    """
    outcome = convene(Party.world(), FORMED, terms.encode(), wait)
    if outcome.groups is not None:
        message = FormedTerms.disagreement(
            dist().get_rank(),
            outcome.groups,
            "after forming the survivors' world",
            "Every survivor must call form_survivor_world with the same gone ranks",
        )
        raise GroupCreationError(message, sorted(r for ranks, _ in outcome.groups[1:] for r in ranks))


__all__ = ["NEW_WORLD", "SHRINK", "SurvivorWorld", "form_survivor_world"]
