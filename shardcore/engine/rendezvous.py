"""Store-based rendezvous: every rank of the world meets at a named phase, bringing what it agreed to.

It runs on any backend (the default group's store is all it needs), so it can check, before
a single group is created, that the ranks planned the same layout, and it names the ranks
that are missing or differ instead of hanging.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..errors import GroupCreationError, LayoutMismatchError
from .torch_state import default_store

if TYPE_CHECKING:
    from torch.distributed import Store

log = logging.getLogger("shardcore")

_MAX_LISTED = 16
_sequence = 0
_previous_phase: str | None = None


@dataclass(frozen=True)
class Agreement:
    """What every rank must bring to a build: the same layout, backend, groups, strategy and group counter."""

    layout: str
    """The layout's fingerprint."""
    backend: str
    group_names: tuple[str, ...]
    strategy: str
    group_counter: int
    """torch's default-mode group counter: ranks holding different values would name groups differently."""

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

    def differences(self, other: Agreement) -> str:
        """The fields that differ, as ``name: theirs vs ours``."""
        return "; ".join(
            f"{f.name}: {getattr(other, f.name)!r} vs {getattr(self, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        )


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def listed(ranks: Sequence[int]) -> str:
    """Ranks for a message: the first few, then the count."""
    shown = ", ".join(map(str, ranks[:_MAX_LISTED]))
    return f"[{shown}{', ...' if len(ranks) > _MAX_LISTED else ''}] ({len(ranks)} ranks)"


def next_phase(name: str) -> str:
    """A store key unique to this build; every rank computes the same one."""
    global _sequence
    _sequence += 1
    return f"{_sequence}/{name}"


def rendezvous(phase: str, agreement: Agreement | None, timeout: timedelta) -> None:
    """Wait until every rank of the world reaches ``phase``; all must bring the same ``agreement``.

    Args:
        phase: a name every rank computes alike (``next_phase``).
        agreement: what the ranks must agree on, or None to only meet.
        timeout: how long to wait for the last rank.

    Raises:
        GroupCreationError: a rank did not arrive in time (naming it, and why when it left a
            reason with ``report_failure``), the store's host died, or ranks agree on the
            layout but not on the strategy or group counter.
        LayoutMismatchError: ranks planned different layouts, backends or groups.

    Once a phase completes, no rank reads the previous one again, so its keys are deleted
    (each rank its own value, rank 0 the shared ones): the store holds one phase at a time.
    """
    dist = _dist()
    value = "" if agreement is None else agreement.encode()
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
    store, prefix = default_store(), f"shardcore/{phase}"
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
        why = f"; ranks {listed(failed)} failed before it" if failed else ""
        if failed:
            why += f" (rank {failed[0]}: {store.get(f'{prefix}/failed/{failed[0]}').decode()})"
        raise GroupCreationError(
            f"rank {rank}: ranks {listed(missing)} did not reach '{phase}' within {timeout.total_seconds():g}s{why}; "
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
        ours, other = Agreement.decode(reference), Agreement.decode(theirs)
        error_type = GroupCreationError if ours.same_plan(other) else LayoutMismatchError
        raise error_type(
            f"rank {rank}: ranks {listed(differ)} disagree with the other {world - len(differ)} ranks at "
            f"'{phase}' ({ours.differences(other)}, theirs vs the others')"
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
        default_store().set(f"shardcore/{phase}/failed/{_dist().get_rank()}", f"{type(error).__name__}: {error}"[:500])
    except Exception:  # best effort: the store's host may be gone
        log.debug("shardcore: could not report the failure to the store", exc_info=True)


__all__ = ["Agreement", "listed", "next_phase", "rendezvous", "report_failure"]
