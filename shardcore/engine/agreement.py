"""Store-based rendezvous: every rank of the world meets at a named phase of a build, bringing what it agreed to.

It runs on any backend (the default group's store is all it needs), so it can check, before
a single group is created, that the ranks planned the same layout, and it names the ranks
that are missing or differ instead of hanging.

Builds are numbered by an epoch kept in the store, not by a count each process keeps, so
ranks stay in step however differently a build failed on each:

* A rank joins its build's first meeting (``agree``) at the epoch it reads from the store
  at that moment. Whoever decides that meeting (the last to arrive, or the first to give
  up waiting) moves the epoch on, once, with a compare-and-set; the build's later meetings
  use the epoch its ranks met at.
* A rank that fails on its own (a bad spec, a backend that does not import, a failed group)
  still arrives, with its error instead of a value (``report_failure``): the others stop at
  once and name it, instead of waiting out the timeout.
* A meeting ends with one outcome, written once (compare-and-set) by its decider:
  ``complete`` or ``timeout``. A rank that arrives after a timeout sees it and fails at
  once; a rank that never arrives reads the next epoch when it next builds.

So a rank that failed before touching the store, a mismatch, a timeout or a failed group
all leave every rank's next build at the same epoch. Each rank deletes what it wrote in a
meeting (the decider the shared keys too) once a later meeting completes, when no rank
can still read it: the store holds about one build's keys at a time.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..errors import GroupCreationError, LayoutMismatchError, ShardcoreError
from .torch_state import store_call

if TYPE_CHECKING:
    from torch.distributed import Store

log = logging.getLogger("shardcore")

_MAX_LISTED = 16
_SHOWN_CHARS = 120
"""Longer specs are shown by their first differing shard."""
GRACE = 2.0
"""Seconds allowed past the deadline for the store to answer before its host is called unresponsive."""
EPOCH_KEY = "shardcore/epoch"
COMPLETE = "complete"
_ARRIVED = "arrived"
"""What a rank brings to a meeting with nothing to compare; never empty: compare-and-set treats "" as unset."""
_FAILED = "!"
"""A value starting with it is a rank's error, not what it agreed to."""


@dataclass(frozen=True)
class Agreement:
    """What every rank must bring to a build: the same layout, backend, groups and strategy."""

    layout: str
    """The layout's fingerprint: equal layouts, equal fingerprints."""
    spec: str
    """The layout's shards as a spec string, to show a person what differs."""
    order: str
    rank_offset: int
    backend: str
    group_names: tuple[str, ...]
    strategy: str
    group_counter: int
    """torch's default-mode group counter: ranks start the build from the highest one brought."""

    def encode(self) -> str:
        """The one text form stored for other ranks to compare."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> Agreement:
        """Inverse of ``encode``."""
        data = json.loads(text)
        return cls(**{**data, "group_names": tuple(data["group_names"])})

    def same_plan(self, other: Agreement) -> bool:
        """True when only the strategy or counter differ (not a layout mismatch)."""
        return (self.layout, self.backend, self.group_names) == (other.layout, other.backend, other.group_names)

    def same_build(self, other: Agreement) -> bool:
        """True when only the group counter differs: the ranks can build, from the highest counter."""
        return self.same_plan(other) and self.strategy == other.strategy

    def shown_fields(self, others: Sequence[Agreement]) -> list[str]:
        """The fields to show for a disagreement: those that differ, the fingerprint only if nothing else does."""
        names = [f.name for f in fields(self) if f.name not in ("layout", "group_counter")]
        differing = [name for name in names if any(getattr(o, name) != getattr(self, name) for o in others)]
        if not differing and any(o.layout != self.layout for o in others):
            differing = ["layout"]
        return differing

    def show(self, names: Sequence[str], against: Agreement | None = None) -> str:
        """``names`` of this agreement for a message; a long spec as its first difference from ``against``."""
        parts = []
        for name in names:
            value = getattr(self, name)
            if name == "spec" and against is not None and len(value) > _SHOWN_CHARS:
                value = _first_difference(value, against.spec)
            elif name == "group_names":
                value = ",".join(value)
            parts.append(f"{name} {value!r}" if isinstance(value, str) else f"{name} {value}")
        return ", ".join(parts)


def _first_difference(theirs: str, ours: str) -> str:
    """A long spec shown by its first shard that differs from ``ours``."""
    mine, other = theirs.split("+"), ours.split("+")
    index = next((i for i, (a, b) in enumerate(zip(mine, other, strict=False)) if a != b), min(len(mine), len(other)))
    shard = mine[index] if index < len(mine) else "nothing"
    return f"{len(mine)} shards, shard {index}: {shard} (where the others have {len(other)} shards)"


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def listed(ranks: Sequence[int]) -> str:
    """Ranks for a message: the first few, then the count."""
    shown = ", ".join(map(str, ranks[:_MAX_LISTED]))
    return f"[{shown}{', ...' if len(ranks) > _MAX_LISTED else ''}] ({len(ranks)} ranks)"


@dataclass(frozen=True)
class _Meeting:
    epoch: int
    phase: str
    decided: bool
    """This rank wrote the outcome: it deletes the shared keys."""

    @property
    def prefix(self) -> str:
        return f"shardcore/{self.epoch}/{self.phase}/"

    @property
    def where(self) -> str:
        return f"at '{self.phase}' of build {self.epoch}"


_pending: list[_Meeting] = []
"""Meetings this rank took part in whose keys it has not deleted yet."""


def agree(agreement: Agreement, timeout: timedelta) -> tuple[int, int]:
    """The first meeting of a build: every rank of the world must bring the same ``agreement``.

    Args:
        agreement: what this rank planned.
        timeout: how long to wait for the last rank.

    Returns:
        (the build's epoch, for its later meetings; the group counter to build from, the
        highest any rank brought).

    Raises:
        GroupCreationError: a rank did not arrive in time, failed (naming it and why), the
            store's host died or stopped answering, or ranks agree on the layout but not on
            the strategy.
        LayoutMismatchError: ranks planned different layouts, backends or groups; every
            group of ranks outside the majority is named with what it planned.
    """
    meeting, groups = _meet(None, "agree", agreement.encode(), timeout)
    if groups is None:
        return meeting.epoch, agreement.group_counter
    values = [Agreement.decode(value) for _, value in groups]
    if all(values[0].same_build(value) for value in values):
        return meeting.epoch, max(value.group_counter for value in values)
    raise _mismatch(meeting, groups, values)


def meet(epoch: int, phase: str, timeout: timedelta) -> None:
    """A later meeting of the build at ``epoch``: wait until every rank reaches ``phase``.

    Raises:
        GroupCreationError: a rank did not arrive in time or failed on the way (naming it
            and why), or the store's host died or stopped answering.
    """
    _meet(epoch, phase, _ARRIVED, timeout)


def report_failure(epoch: int | None, phase: str, error: BaseException, timeout: timedelta) -> None:
    """Arrive at ``phase`` with ``error`` instead of a value: the others stop at once and name it.

    ``epoch`` None is a failure before the build's first meeting (``agree``): then it waits,
    like every rank, for the meeting's outcome, so that this rank's next build cannot read
    the epoch before it has moved on. At a later meeting the build's epoch is already past,
    so it leaves at once. Best effort: whatever the meeting says, or a store that cannot be
    reached, the caller raises its own error.
    """
    text = f"{_FAILED}{type(error).__name__}: {error}"[:500]
    try:
        if epoch is None:
            _meet(epoch, phase, text, timeout)
        else:
            dist = _dist()
            rank, world = dist.get_rank(), dist.get_world_size()
            where = f"at '{phase}' of build {epoch}"
            _pending.append(store_call(lambda store: _join(store, epoch, phase, text, rank, world), GRACE, where))
    except ShardcoreError:
        log.debug("shardcore: reported a failure at %r", phase, exc_info=True)


def _join(store: Store, epoch: int | None, phase: str, value: str, rank: int, world: int) -> _Meeting:
    """Arrive: read the epoch if needed, leave the value, count in; the last to arrive decides ``complete``."""
    if epoch is None:
        epoch = store.add(EPOCH_KEY, 0)
        while store.check([f"shardcore/{epoch}/{phase}/result"]):  # decided, but its decider has not moved on yet
            store.compare_set(EPOCH_KEY, str(epoch), str(epoch + 1))
            epoch += 1
    meeting = _Meeting(epoch, phase, decided=False)
    prefix = meeting.prefix
    reference = store.compare_set(f"{prefix}reference", "", value).decode()
    store.set(f"{prefix}value/{rank}", "" if reference == value else value)  # its presence says "arrived"
    if reference != value:
        store.append(f"{prefix}differ", f"{rank}:{_digest(value)},")  # type: ignore[attr-defined]  # not in stubs
    if store.add(f"{prefix}arrived", 1) == world:
        return _Meeting(epoch, phase, _decide(store, meeting, COMPLETE) == COMPLETE)
    return meeting


def _decide(store: Store, meeting: _Meeting, outcome: str) -> str:
    """Write the meeting's outcome unless someone did; the one who writes it moves the epoch on."""
    written = store.compare_set(f"{meeting.prefix}result", "", outcome).decode()
    if written == outcome:
        store.compare_set(EPOCH_KEY, str(meeting.epoch), str(meeting.epoch + 1))
    return written


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:12]


def _meet(
    epoch: int | None, phase: str, value: str, timeout: timedelta
) -> tuple[_Meeting, list[tuple[list[int], str]] | None]:
    """Meet every rank at ``phase``; return the meeting and, where values differ, the groups of ranks by value."""
    dist = _dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    seconds = timeout.total_seconds()
    where = f"at '{phase}'" if epoch is None else f"at '{phase}' of build {epoch}"
    meeting = store_call(lambda store: _join(store, epoch, phase, value, rank, world), seconds, where)
    _pending.append(meeting)
    outcome, groups = store_call(
        lambda store: _outcome(store, meeting, rank, world, seconds), seconds + GRACE, meeting.where
    )
    if outcome == f"timeout:{rank}":  # this rank decided it: it deletes the shared keys
        _pending[_pending.index(meeting)] = replace(meeting, decided=True)
    if outcome != COMPLETE:
        missing, groups = store_call(lambda store: _arrivals(store, meeting, world), GRACE, meeting.where)
        failures = _failures(groups or [])
        raise GroupCreationError(
            f"rank {rank}: ranks {listed(missing)} did not reach '{phase}' within {seconds:g}s"
            f"{f'; {failures}' if failures else ''}; every rank of the world must call build_shards "
            f"(is one dead, slow, or running other code?)"
        )
    if groups is not None and any(value.startswith(_FAILED) for _, value in groups):
        raise GroupCreationError(f"rank {rank}: {_failures(groups)} {meeting.where}, so no rank can build")
    return meeting, groups


def _outcome(
    store: Store, meeting: _Meeting, rank: int, world: int, seconds: float
) -> tuple[str, list[tuple[list[int], str]] | None]:
    """Wait for the meeting's outcome (deciding ``timeout`` if none came in time); on ``complete``,
    delete the keys of earlier meetings and read the groups of ranks by value if they differ."""
    dist = _dist()
    prefix = meeting.prefix
    try:
        store.wait([f"{prefix}result"], timedelta(seconds=seconds))
        outcome = store.get(f"{prefix}result").decode()
    except dist.DistStoreError:  # a wait timeout: the store answers, a rank did not
        outcome = _decide(store, meeting, f"timeout:{rank}")
        if outcome != COMPLETE:
            return outcome, None
    for earlier in [m for m in _pending if m != meeting]:
        _forget(store, earlier, rank)
        _pending.remove(earlier)
    return outcome, _groups(store, meeting, range(world)) if store.check([f"{prefix}differ"]) else None


def _forget(store: Store, meeting: _Meeting, rank: int) -> None:
    """Delete what this rank wrote in a finished meeting; its decider deletes the shared keys."""
    prefix = meeting.prefix
    store.delete_key(f"{prefix}value/{rank}")
    if meeting.decided:
        for key in ("reference", "differ", "arrived", "result"):
            store.delete_key(f"{prefix}{key}")


def _groups(store: Store, meeting: _Meeting, arrived: Sequence[int]) -> list[tuple[list[int], str]]:
    """The arrived ranks grouped by the value they brought, the largest group first."""
    prefix = meeting.prefix
    entries = store.get(f"{prefix}differ").decode() if store.check([f"{prefix}differ"]) else ""
    digest_of = {int(rank): digest for rank, digest in (entry.split(":") for entry in entries.split(",") if entry)}
    by_digest: dict[str, list[int]] = {}
    for rank in arrived:
        by_digest.setdefault(digest_of.get(rank, ""), []).append(rank)
    groups = []
    for digest, ranks in by_digest.items():
        key = f"{prefix}value/{ranks[0]}" if digest else f"{prefix}reference"
        groups.append((ranks, store.get(key).decode()))
    return sorted(groups, key=lambda group: (-len(group[0]), group[0][0]))


def _arrivals(store: Store, meeting: _Meeting, world: int) -> tuple[list[int], list[tuple[list[int], str]] | None]:
    """After a timeout: the ranks that never arrived, and the others grouped by value."""
    arrived = [rank for rank in range(world) if store.check([f"{meeting.prefix}value/{rank}"])]
    missing = sorted(set(range(world)) - set(arrived))
    return missing, _groups(store, meeting, arrived) if arrived else None


def _failures(groups: Sequence[tuple[Sequence[int], str]]) -> str:
    """The ranks that arrived with an error, and each distinct error."""
    failed = [(ranks, value[len(_FAILED) :]) for ranks, value in groups if value.startswith(_FAILED)]
    return "; ".join(f"ranks {listed(ranks)} failed (rank {ranks[0]}: {error})" for ranks, error in failed)


def _mismatch(meeting: _Meeting, groups: Sequence[tuple[list[int], str]], values: Sequence[Agreement]) -> Exception:
    """Every group of ranks outside the majority, with what it planned, against what the majority planned."""
    rank, world = _dist().get_rank(), _dist().get_world_size()
    majority, others = values[0], values[1:]
    names = majority.shown_fields(others)
    described = [
        f"ranks {listed(ranks)} have {value.show(names, majority)}"
        for (ranks, _), value in zip(groups[1:], others, strict=True)
    ]
    outside = sum(len(ranks) for ranks, _ in groups[1:])
    error_type = GroupCreationError if all(majority.same_plan(value) for value in others) else LayoutMismatchError
    return error_type(
        f"rank {rank}: {outside} of {world} ranks disagree with the majority {meeting.where}: "
        f"{'; '.join(described)}; the majority, ranks {listed(groups[0][0])}, have {majority.show(names)}. "
        f"Every rank must call build_shards with the same spec, order, backend, groups and strategy"
    )


__all__ = ["COMPLETE", "EPOCH_KEY", "GRACE", "Agreement", "agree", "listed", "meet", "report_failure"]
