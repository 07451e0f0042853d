"""The one agreement protocol: the ranks of a party agree on what they are about to do before any of them acts.

Builds (``build_shards``), window-local group creation, refits and the live checks all use it. It
runs on any backend (the default group's store is all it needs), so it can check, before a single
group is created or a single byte is sent, that every rank planned the same thing, and it names the
ranks that are missing, failed or differ instead of hanging.

**Parties and sessions.** A *party* is the whole world or one window of it, or a group of its own with a store
of its own (a refit group between two jobs' worlds: ``Party.store``, where each process has a rank in the group's
numbering); its keys live under ``shardcore/<scope>/``. A *session* (one build, one refit, one
window-local creation) is a series of meetings of one party. Its first meeting, ``convene``, reads the
party's *epoch* from the store; the session's later meetings (``meet``) use the epoch its ranks met at.
Every first meeting has the same name, whatever the session, so a rank in a build and a rank in a refit at
the same epoch meet, and see that they disagree, instead of waiting at different keys.

**Numbered by the store, never by a process.** Whoever decides a session's first meeting (the last to
arrive, or the first to give up waiting) moves the epoch on, once, with a compare-and-set, before it
writes the outcome. A rank that failed before touching the store, skipped a session, or was replaced by
a new process therefore reads the same epoch as every other rank at its next session: no counter in any
process can drift.

**Cheap.** A refit meets twice, so its meetings cost what a refit's fixed cost is: a first meeting
takes five store round trips per rank (epoch, reference, value, count, outcome; a refit's one more, its
tally) and a later one three (a later meeting compares nothing, so it has no reference), all in one call
on shardcore's store thread. The last to arrive, on whom everyone waits, makes no more: the count tells
it whether values differ (a differing rank counts for more), and it learns the outcome from its own write
instead of reading it back. Deleting old keys, and counting a rank off at a lingering meeting (the store's host
waits for it), are queued behind the call, off the caller's path.

**Failures reach everyone at once.** A rank that fails on its own still arrives, with its error
instead of a value (``arrive_failed``): the others stop at once and name it. During a session, a rank
can also publish a failure (``publish_failure``) that the others poll (``published_failures``), and
declare a peer it lost (``declare_absent``) so that the next meeting does not wait for it.

**Bounded.** Every store call runs through ``torch_state.store_call``, on a connection of its own,
bounded by the caller's timeout: a frozen store host is named, not waited on.

**Admissions.** A party whose members are not known in advance (the processes of two jobs forming a group of
their own: ``transfer.group``) forms at an *admission* (``admit``), a first meeting where each arrival claims its
rank, naming itself, and brings terms that include the party's size. Values that differ end it at once for
every rank in it (the arrivals disagree on how many meet, so no count could complete), and that outcome stands
for the timeout, so the latecomers of the same attempt hear it too; a rank claimed twice (a job started twice)
is refused at once, told who holds it. Its members are recorded as they arrive, and the next completed
admission deletes the keys of those before it, whoever wrote them (a restarted job's processes are new ones).

**Clean.** A meeting ends with one outcome, written once (compare-and-set) by its decider:
``complete`` or ``timeout``. Each rank deletes what it wrote in a meeting (the decider the shared keys
too) once a later meeting of the same party completes, when no rank can still read it: the store holds
about one session's keys per party at a time. ``linger`` keeps the store's host (rank 0) at a final
meeting until every rank has read its outcome, so a job that ends right after it loses no one's answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

from ..errors import ShardcoreError
from ..plan.arguments import shortened, shown_ranks
from .torch_state import dist, store_call, store_in_background, world_token

if TYPE_CHECKING:
    from torch.distributed import Store

    from .torch_state import OwnStore

log = logging.getLogger("shardcore.agreement")

GRACE = 2.0
"""Seconds allowed past the deadline for the store to answer before its host is called unresponsive."""
OPEN = "open"
"""The name of every session's first meeting."""
COMPLETE = "complete"
_SAME = "="
"""What a rank stores when it brought the reference value (never empty: compare-and-set treats "" as unset)."""
_FAILED = "!"
"""A value starting with it is a rank's error, not what it agreed to."""
_ABSENT = "gone: "
"""After ``_FAILED``: another rank declared this one lost (``declare_absent``); it is the one at fault."""
_ARRIVED = "arrived"
"""What a rank brings to a later meeting, where nothing is compared: also its reference, never stored."""
_DIFFER, _ALIKE = "~", "="
"""After ``complete`` in a meeting's result: whether some rank brought another value than the reference."""
_DIFFERING = 1 << 32
"""What a rank that brings another value than the reference adds to a meeting's arrival count (one more than
any party's size), so that the last to arrive learns from the count alone whether values differ."""
_CONFLICT = "conflict:"
"""An admission's outcome when arrivals brought different values; then the time (``time.time``) until which it
stands, and the two (claimant, value) pairs as JSON."""
_HELD = "held:"
"""What an admission tells an arrival whose rank someone else claimed; then the holder (never stored)."""
_POLL = 0.5
"""Seconds one wait for an admission's outcome lasts before it looks again (see ``_wait``)."""
_SHOWN_ERROR = 500
"""Characters of one rank's error kept for the others (``shortened``: whole items, and how many were left out)."""
_SHOWN_FAILURES = 4
"""Distinct errors of failed ranks shown in one message; the other failed ranks are counted."""

ErrorType = Callable[[str, Sequence[int]], ShardcoreError]
"""How a caller's error is made: (message, the ranks at fault)."""


@dataclass(frozen=True)
class Party:
    """The ranks that meet, and where their meetings live in the store.

    Attributes:
        scope: The store namespace: ``world``, ``window/<build>/<first>+<size>``, or a refit group's.
        ranks: The ranks taking part (the default group's, or a group's own numbering with ``store``).
        host: The rank that hosts the store and lingers at final meetings (None: none of them).
        store: A group's own store, where it meets and where this process has a rank of its own (a refit
            group between two jobs); None: the default group's store and rank.
        title: How messages name the party (default: the world or the window).
    """

    scope: str
    ranks: range
    host: int | None = 0
    store: OwnStore | None = field(default=None, compare=False, repr=False)
    title: str = field(default="", compare=False)

    @classmethod
    def world(cls) -> Party:
        """Every rank of the default group (rank 0 hosts the store, unless torchrun's agent does)."""
        from .torch_state import agent_hosts_store

        return cls("world", range(dist().get_world_size()), None if agent_hosts_store() else 0)

    @classmethod
    def window(cls, build: int, ranks: range) -> Party:
        """The ranks of one shard's window, in the build ``build`` (so a rebuilt window meets afresh)."""
        return cls(f"window/{build}/{ranks.start}+{len(ranks)}", ranks, None)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def me(self) -> int:
        """This process's rank in the party's numbering."""
        return self.store.rank if self.store is not None else int(dist().get_rank())

    @property
    def token(self) -> Any:
        """Tells the store this party meets in from another (a later world's, another group's)."""
        return self.store.token if self.store is not None else world_token()

    def describe(self) -> str:
        if self.title:
            return self.title
        return "of the world" if self.scope == "world" else f"of the window {shown_ranks(self.ranks)}"


@dataclass(frozen=True)
class Purpose:
    """What a session is for, so that its errors say what every rank must do and carry the caller's type."""

    noun: str
    """``build``, ``refit``, ``window-local creation``, ``check``."""
    call: str
    """What every rank of the party must call: ``build_shards``, ``execute_refit``, ..."""
    error: ErrorType
    """The error of a meeting some rank did not reach."""
    failed: ErrorType | None = None
    """The error of a meeting some rank reached with an error of its own (default: ``error``)."""


@dataclass(frozen=True)
class Meeting:
    """One meeting of one session, as this rank took part in it."""

    party: Party
    epoch: int
    phase: str
    decided: bool = False
    """This rank wrote the outcome: it deletes the shared keys."""

    @property
    def session(self) -> str:
        return f"shardcore/{self.party.scope}/{self.epoch}/"

    @property
    def prefix(self) -> str:
        return f"{self.session}{self.phase}/"


class Outcome(NamedTuple):
    """What a completed meeting says: its epoch, and the ranks grouped by value when the values differ."""

    epoch: int
    groups: list[tuple[list[int], str]] | None
    """(ranks, value) groups, the largest first; None when every rank brought the same value."""
    payload: str
    """What the meeting's decider attached (``convene(..., decide=...)``); "" otherwise."""


class Admission(NamedTuple):
    """How an admission (``admit``) ended: the caller words the error of one that did not complete."""

    epoch: int
    """The admission's epoch (once complete, the party's generation: the first is 0)."""
    complete: bool
    conflict: tuple[tuple[str, str], tuple[str, str]] | None = None
    """Arrivals brought different values: (claimant, value) of the one that differed, then of the first."""
    holder: str | None = None
    """Another arrival holds this rank already (the claimant it named): this one was refused."""
    missing: tuple[int, ...] = ()
    """At the timeout: the ranks that never arrived."""


class _Claim(NamedTuple):
    """An admission's arrival: who claims the rank (shown to a second claimant), and how long a conflict stands."""

    claimant: str
    lasts: float


_pending: dict[tuple[Any, str], list[Meeting]] = {}
"""Per world and party: meetings this rank took part in whose keys it has not deleted yet."""


def convene(
    party: Party,
    purpose: Purpose,
    value: str,
    timeout: timedelta,
    *,
    decide: Callable[[Store], str] | None = None,
    tally: int | None = None,
) -> Outcome:
    """The first meeting of a session: every rank of ``party`` brings ``value``; the epoch comes from the store.

    Args:
        party: who meets.
        purpose: what the session is for (its errors' wording and type).
        value: what this rank is about to do, as text (compared as is; ``Terms.encode`` makes one).
        timeout: how long to wait for the last rank.
        decide: run once, by the meeting's decider, when every rank has arrived; what it returns
            reaches every rank as ``Outcome.payload`` (a window draws its group names so).
        tally: this rank's number; the decider sums every rank's (one more store ``add`` per rank), and the sum
            reaches every rank as ``Outcome.payload``, in decimal (a refit checks that both ends of each
            message agree so: ``refit.pairing``). A meeting has ``decide`` or ``tally``, not both.

    Returns:
        The session's epoch, for its later meetings, and the ranks grouped by value if values differ.

    Raises:
        The purpose's error: a rank did not arrive in time or arrived with an error (naming it and
        why), or the store's host died or stopped answering.
    """
    return _meet(party, purpose, None, OPEN, value, timeout, decide=decide, tally=tally)


def admit(party: Party, purpose: Purpose, value: str, claimant: str, timeout: timedelta) -> Admission:
    """The first meeting of a party whose members are not known in advance (see **Admissions** above): this
    process claims its rank (``party.me``) as ``claimant``. Its waits look again every half second.

    Args:
        party: who meets: its ranks as this process counts them, and its store.
        purpose: whose error a store that stops answering raises.
        value: the terms every process must bring alike (``Terms.encode``), the party's size among them.
        claimant: this process, as the others see it when they conflict with it or claim its rank.
        timeout: how long to wait for every rank; also how long a conflict stands.

    Returns:
        How it ended: complete (its epoch is the party's generation), or why not, for the caller to word.

    Raises:
        The purpose's error: the store's host died or stopped answering.
    """
    rank, seconds = party.me, timeout.total_seconds()
    deadline = time.monotonic() + seconds
    claim = _Claim(claimant, seconds)

    def attend(store: Store) -> tuple[Meeting, str, list[int]]:
        meeting, known = _join(store, party, None, OPEN, value, rank, None, claim=claim)
        outcome = _outcome(store, meeting, rank, deadline, False, known, poll=_POLL)[0]
        missing = _missing(store, meeting) if outcome.startswith("timeout:") else []
        return meeting, outcome, missing

    meeting, outcome, missing = store_call(
        attend,
        seconds + GRACE,
        f"at the admission {party.describe()}",
        lambda message: purpose.error(message, []),
        on=party.store,
    )
    if outcome == COMPLETE:
        if meeting.decided:  # off the caller's path: the next store call runs after it
            store_in_background(lambda store: _forget_admissions(store, meeting), on=party.store)
        return Admission(meeting.epoch, True)
    if outcome.startswith(_CONFLICT):
        (who, differed), (first, reference) = json.loads(outcome[len(_CONFLICT) :].partition(":")[2])
        return Admission(meeting.epoch, False, conflict=((who, differed), (first, reference)))
    if outcome.startswith(_HELD):
        return Admission(meeting.epoch, False, holder=outcome[len(_HELD) :])
    return Admission(meeting.epoch, False, missing=tuple(missing))


def barrier(party: Party, purpose: Purpose, timeout: timedelta, *, linger: bool = False) -> int:
    """A session of one meeting with nothing to agree on but being there: every rank arrives, or arrives with its
    error (``arrive_failed(party, purpose, None, OPEN, ...)``); returns the session's epoch.

    Raises:
        The purpose's error: a rank missing, failed, or in another kind of session.
    """
    outcome = _meet(party, purpose, None, OPEN, f"{purpose.noun}:", timeout, linger=linger)
    if outcome.groups is not None:
        described = "; ".join(
            f"ranks {shown_ranks(ranks)} are in a {value.partition(':')[0]!r} session"
            for ranks, value in outcome.groups
        )
        raise purpose.error(f"rank {party.me}: the ranks are not all at {purpose.noun}: {described}", [])
    return outcome.epoch


def meet(
    party: Party,
    purpose: Purpose,
    epoch: int,
    phase: str,
    timeout: timedelta,
    *,
    linger: bool = False,
) -> Outcome:
    """A later meeting of the session at ``epoch``: wait until every rank of the party reaches ``phase``.

    Nothing is compared there (the first meeting did that): a rank brings only that it arrived, or its error.

    Args:
        linger: the session's final meeting before the job may end: the store's host stays until every
            rank has read the outcome (at most ``GRACE`` seconds once they have).

    Raises:
        The purpose's error: a rank did not arrive in time, arrived with an error or was declared
        absent (naming it and why), or the store's host died or stopped answering.
    """
    return _meet(party, purpose, epoch, phase, _ARRIVED, timeout, linger=linger)


def arrive_failed(
    party: Party,
    purpose: Purpose,
    epoch: int | None,
    phase: str,
    error: BaseException,
    timeout: timedelta,
    *,
    stay: bool = False,
) -> None:
    """Arrive at ``phase`` with ``error`` instead of a value: the others stop at once and name it.

    ``epoch`` None is a failure before the session's first meeting: then it waits, like every rank,
    for the meeting's outcome, so that this rank's next session cannot read the epoch before it has
    moved on. At a later meeting the session's epoch is already past, so it leaves at once, unless
    ``stay``: then it too waits for the outcome (every rank arrived, or the timeout), for a rank that
    must not clean up while the others may still use what it left (a build's group connect keys). Best
    effort: whatever the meeting says, or a store that cannot be reached, the caller raises its own error.
    """
    text = _FAILED + shortened(f"{type(error).__name__}: {error}", _SHOWN_ERROR)
    try:
        if epoch is None:
            _meet(party, purpose, None, OPEN, text, timeout)
        elif stay:
            _meet(party, purpose, epoch, phase, text, timeout)
        else:
            rank = party.me
            meeting = store_call(
                lambda store: _join(store, party, epoch, phase, text, rank, None)[0],
                GRACE,
                _where(party, epoch, phase),
                on=party.store,
            )
            _remember(meeting)
    except ShardcoreError:
        pass


def publish_failure(party: Party, epoch: int, error: BaseException | str) -> None:
    """Leave this rank's failure where the session's ranks look (``published_failures``); best effort."""
    record = _record(party.me, error if isinstance(error, str) else f"{type(error).__name__}: {error}")
    key = f"shardcore/{party.scope}/{epoch}/failed"

    def append(store: Store) -> None:
        store.append(key, record)  # type: ignore[attr-defined]  # not in torch's stubs

    with contextlib.suppress(ShardcoreError):
        store_call(append, GRACE, "publishing a failure", on=party.store)


def published_failures(party: Party, epoch: int) -> dict[int, str]:
    """The failures ranks published during the session at ``epoch``, by rank ({} if none or unreadable)."""
    key = f"shardcore/{party.scope}/{epoch}/failed"

    def read(store: Store) -> str:
        return store.get(key).decode(errors="replace") if store.check([key]) else ""

    try:
        return _by_rank(store_call(read, GRACE, "reading published failures", on=party.store))
    except ShardcoreError:
        return {}


def _record(rank: int, text: str) -> str:
    """One rank's line of text in a key many ranks append to (``_by_rank`` reads them)."""
    return json.dumps([rank, shortened(text, _SHOWN_ERROR)]) + "\n"


def _by_rank(text: str) -> dict[int, str]:
    """The lines ``_record`` made, by rank (a rank's first line if it wrote several)."""
    found: dict[int, str] = {}
    for line in filter(None, text.split("\n")):
        rank, said = json.loads(line)
        found.setdefault(int(rank), str(said))
    return found


def declare_absent(party: Party, epoch: int, phase: str, ranks: Sequence[int], reason: str) -> None:
    """Arrive at ``phase`` for ``ranks`` that this rank lost (a closed connection): the meeting does not wait
    for them, and every rank names them with ``reason``. The first declaration of a rank counts; best effort."""
    text = _FAILED + _ABSENT + shortened(reason, _SHOWN_ERROR)

    def declare(store: Store) -> None:
        for lost in ranks:
            _join(store, party, epoch, phase, text, lost, None)

    with contextlib.suppress(ShardcoreError):
        store_call(declare, GRACE, _where(party, epoch, phase), on=party.store)


def decided_without_me(party: Party, epoch: int, phase: str) -> bool:
    """Whether the meeting at ``phase`` of the session at ``epoch`` is decided while this rank has not reached it:
    the others gave up waiting (a rank past its own deadline asks before it waits on them again). One store
    ``check``; False when the store does not answer in time.
    """
    key = f"{Meeting(party, epoch, phase).prefix}result"
    try:
        return bool(store_call(lambda store: store.check([key]), GRACE, _where(party, epoch, phase), on=party.store))
    except ShardcoreError:
        return False


def exchange_notes(
    party: Party,
    purpose: Purpose,
    epoch: int,
    note: str,
    wanted: Sequence[int],
    conclude: Callable[[dict[int, str]], str],
    timeout: timedelta,
) -> dict[int, str]:
    """Every rank of the session at ``epoch`` leaves ``note``, reads the notes of the ranks ``wanted`` and draws its
    conclusion from them (``conclude``: "" for none); returns every rank's conclusion that is not empty, by rank.

    For what is too big to compare at a meeting and needed only on a rare path: a refit naming the pairs of ranks
    whose parts disagree, each pair found by its own ends and told to every rank. Three later meetings (every note
    is written before any is read, every conclusion before any is read, and read before any is deleted), one
    ``multi_get`` per rank; each rank deletes its note, the party's first rank the conclusions.

    Raises:
        The purpose's error: a rank did not come in time, or the store's host died or stopped answering.
    """
    rank = party.me
    base = f"shardcore/{party.scope}/{epoch}/note/"
    said_key = f"{base}said"
    where = f"notes of {purpose.noun} {epoch}"
    seconds = timeout.total_seconds() + GRACE

    def call(job: Callable[[Store], Any]) -> Any:
        return store_call(job, seconds, where, lambda message: purpose.error(message, []), on=party.store)

    call(lambda store: store.set(f"{base}{rank}", note))
    meet(party, purpose, epoch, "notes-written", timeout)
    keys = [f"{base}{peer}" for peer in wanted]
    values = call(lambda store: store.multi_get(keys) if keys else [])
    mine = conclude({peer: value.decode() for peer, value in zip(wanted, values)})
    if mine:
        record = _record(rank, mine)
        call(lambda store: store.append(said_key, record))  # type: ignore[attr-defined]  # not in torch's stubs
    meet(party, purpose, epoch, "notes-concluded", timeout)
    text = call(lambda store: store.get(said_key).decode() if store.check([said_key]) else "")
    meet(party, purpose, epoch, "notes-done", timeout)
    call(lambda store: store.delete_key(f"{base}{rank}"))
    if rank == party.ranks[0]:
        call(lambda store: store.delete_key(said_key))
    return _by_rank(text)


# ----------------------------------------------------------------------------- the meeting


def _where(party: Party, epoch: int | None, phase: str) -> str:
    session = "" if epoch is None else f" {epoch}"
    return f"at '{phase}' of {party.scope} session{session}"


def _remember(meeting: Meeting) -> None:
    _pending.setdefault((meeting.party.token, meeting.party.scope), []).append(meeting)


def _meet(
    party: Party,
    purpose: Purpose,
    epoch: int | None,
    phase: str,
    value: str,
    timeout: timedelta,
    *,
    decide: Callable[[Store], str] | None = None,
    tally: int | None = None,
    linger: bool = False,
) -> Outcome:
    """Meet every rank of ``party`` at ``phase``; raise the purpose's error unless the meeting completed cleanly."""
    rank = party.me
    seconds = timeout.total_seconds()

    def lost(message: str) -> ShardcoreError:
        return purpose.error(message, [])

    deadline = time.monotonic() + seconds

    def attend(store: Store) -> tuple[Meeting, tuple[str, list[tuple[list[int], str]] | None, str]]:
        meeting, known = _join(store, party, epoch, phase, value, rank, decide, tally)
        _remember(meeting)
        return meeting, _outcome(store, meeting, rank, deadline, linger, known)

    meeting, (outcome, groups, payload) = store_call(
        attend, seconds + GRACE, _where(party, epoch, phase), lost, on=party.store
    )
    where = f"at '{phase}' of {purpose.noun} {meeting.epoch}"
    if outcome == f"timeout:{rank}":  # this rank decided it: it deletes the shared keys
        pending = _pending[(party.token, party.scope)]
        pending[pending.index(meeting)] = replace(meeting, decided=True)
    if outcome != COMPLETE:
        missing, arrived = store_call(lambda store: _arrivals(store, meeting), GRACE, where, lost, on=party.store)
        failures = _failures(arrived or [])
        raise purpose.error(
            f"rank {rank}: ranks {shown_ranks(missing)} did not reach '{phase}' of {purpose.noun} {meeting.epoch} "
            f"within {seconds:g}s{f'; {failures}' if failures else ''}; every rank {party.describe()} must call "
            f"{purpose.call} (is one dead, slow, or running other code?)",
            missing,
        )
    failed = [ranks for ranks, value in groups or [] if value.startswith(_FAILED)]
    if failed:
        gone = [ranks for ranks, value in groups or [] if value.startswith(_FAILED + _ABSENT)]
        raise (purpose.failed or purpose.error)(
            f"rank {rank}: {_failures(groups or [])} ({where}: no rank can go on)",
            sorted(r for ranks in (gone or failed) for r in ranks),
        )
    return Outcome(meeting.epoch, groups, payload)


def _join(
    store: Store,
    party: Party,
    epoch: int | None,
    phase: str,
    value: str,
    rank: int,
    decide: Callable[[Store], str] | None,
    tally: int | None = None,
    *,
    claim: _Claim | None = None,
) -> tuple[Meeting, str | None]:
    """Arrive (for ``rank``): read the epoch if needed, leave the value, count in; the last to arrive decides.
    With ``claim``, an admission's arrival: a standing conflict is heard, values that differ decide at once, a
    rank held by another claimant refuses this one, and the members are recorded.

    Returns:
        The meeting, and its outcome when this call decided it (or found it decided; an admission's refusal):
        the decider learns it from its own write and need not read it back.
    """
    base = f"shardcore/{party.scope}/"
    if epoch is None:  # a first meeting's outcome is written after the epoch moves on: none is decided at it
        epoch = store.add(f"{base}epoch", 0)
        while claim is not None and store.check([result := f"{Meeting(party, epoch, phase).prefix}result"]):
            outcome = store.get(result).decode()  # an admission's conflict (or one decided as this rank read)
            if outcome.startswith(_CONFLICT) and time.time() < float(outcome[len(_CONFLICT) :].partition(":")[0]):
                return Meeting(party, epoch, phase), outcome  # a latecomer of the attempt that conflicted
            store.compare_set(f"{base}epoch", str(epoch), str(epoch + 1))  # it no longer stands: meet afresh
            epoch = store.add(f"{base}epoch", 0)
    meeting = Meeting(party, epoch, phase)
    prefix = meeting.prefix
    if claim is None:
        reference = store.compare_set(f"{prefix}reference", "", value).decode() if phase == OPEN else _ARRIVED
    else:  # the reference names who brought it, for a conflict's message
        first, reference = json.loads(store.compare_set(f"{prefix}reference", "", json.dumps([claim.claimant, value])))
        if reference != value:  # the arrivals disagree on who meets, so no count can complete: decided now
            pairs = json.dumps([[claim.claimant, value], [first, reference]])
            return meeting, _decide(store, meeting, f"{_CONFLICT}{time.time() + claim.lasts}:{pairs}", stands=True)
    stored = _SAME if reference == value else value
    if claim is not None:
        stored += claim.claimant
    held = store.compare_set(f"{prefix}value/{rank}", "", stored).decode()
    if held != stored:  # already there: declared absent before it came (it reads the outcome and fails)
        return meeting, None if claim is None else _HELD + held[len(_SAME) :]  # or claimed by another process
    if claim is not None:  # whoever deletes this admission's keys may never have met this process
        store.append(f"{prefix}members", f"{rank},")  # type: ignore[attr-defined]  # not in torch's stubs
    if reference != value:
        store.append(f"{prefix}differ", f"{rank}:{_digest(value)},")  # type: ignore[attr-defined]  # not in stubs
    if tally is not None:  # before counting in: the last to count in reads every rank's
        store.add(f"{prefix}tally", tally)
    # one count for both: arrivals in the low digits, ranks that brought another value in the high ones
    count = store.add(f"{prefix}arrived", 1 if reference == value else 1 + _DIFFERING)
    if count % _DIFFERING == party.size:
        differ = count >= _DIFFERING
        payload = ""
        if tally is not None:
            payload = str(store.add(f"{prefix}tally", 0))
        elif decide is not None and not differ:
            payload = decide(store)
        result = COMPLETE + (_DIFFER if differ else _ALIKE) + payload
        outcome = _decide(store, meeting, result)
        return replace(meeting, decided=outcome == result), outcome
    return meeting, None


def _decide(store: Store, meeting: Meeting, outcome: str, *, stands: bool = False) -> str:
    """Write the meeting's outcome unless someone did. A first meeting's decider moves the epoch on before, so
    that a rank that has read the outcome (and starts its next session) can never read this epoch again, while
    a rank that read it before, late, still joins this meeting and reads its outcome; unless the outcome
    ``stands`` (an admission's conflict), for every rank that reads this epoch until it expires."""
    if meeting.phase == OPEN and not stands:
        store.compare_set(f"shardcore/{meeting.party.scope}/epoch", str(meeting.epoch), str(meeting.epoch + 1))
    return store.compare_set(f"{meeting.prefix}result", "", outcome).decode()


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def _outcome(
    store: Store,
    meeting: Meeting,
    rank: int,
    deadline: float,
    linger: bool,
    known: str | None = None,
    *,
    poll: float | None = None,
) -> tuple[str, list[tuple[list[int], str]] | None, str]:
    """Wait until ``deadline`` (``time.monotonic``) for the meeting's outcome (deciding ``timeout`` if none came in
    time; ``poll``: see ``_wait``), unless it is ``known`` (this rank decided it); on ``complete``, delete the keys
    of the party's earlier meetings and read the groups of ranks by value if they differ."""
    outcome = known
    if outcome is None:  # none in time: the store answers, a rank did not
        outcome = _wait(store, f"{meeting.prefix}result", deadline, poll) or _decide(store, meeting, f"timeout:{rank}")
    if not outcome.startswith(COMPLETE):
        return outcome, None, ""
    pending = _pending.get((meeting.party.token, meeting.party.scope), [])
    earlier = [m for m in pending if m.epoch != meeting.epoch or m.phase != meeting.phase]
    for done in earlier:
        pending.remove(done)
    if earlier:  # off the caller's path: the next store call runs after it

        def forget(later: Store) -> None:
            for done in earlier:
                _forget(later, done, rank)

        store_in_background(forget, on=meeting.party.store)
    differ, payload = outcome[len(COMPLETE)] == _DIFFER, outcome[len(COMPLETE) + 1 :]
    groups = _groups(store, meeting, meeting.party.ranks) if differ else None
    if linger:
        _linger(store, meeting, rank)
    return COMPLETE, groups, payload


def _wait(store: Store, key: str, deadline: float, poll: float | None) -> str | None:
    """The key's value once set, or None at ``deadline`` (``time.monotonic``; one look even past it). This client
    is shardcore's own: its timeout bounds the get's wait. ``poll``: wait in slices of that many seconds, each
    followed by a plain look (an admission: a reconnecting job once saw one long wait outlast a key set
    meanwhile, 2 runs in about 10 on this machine, not explained; a slice bounds that to ``poll``)."""
    while True:
        left = deadline - time.monotonic()
        piece = left if poll is None else min(poll, left)
        try:
            store.set_timeout(timedelta(seconds=max(0.001, piece)))
            return store.get(key).decode()
        except dist().DistStoreError:  # a wait timeout
            if poll is not None and store.check([key]):
                return store.get(key).decode()
            if piece >= left:
                return None


def _linger(store: Store, meeting: Meeting, rank: int) -> None:
    """Count this rank as having read the outcome; the store's host waits (up to GRACE) for everyone to. Another
    rank counts itself off the caller's path, on the party's store (a refit group's own, not its job's), where its
    store thread does it next (at exit too: ``store_in_background``). A host that waits out the grace says so: a
    rank went away right after the meeting, or counted itself elsewhere, and every meeting now costs GRACE."""

    def count(later: Store) -> None:
        if later.add(f"{meeting.prefix}read", 1) == meeting.party.size:
            later.set(f"{meeting.prefix}all-read", "1")

    if rank != meeting.party.host:
        store_in_background(count, on=meeting.party.store)
        return
    count(store)
    try:
        store.wait([f"{meeting.prefix}all-read"], timedelta(seconds=GRACE))
    except dist().DistStoreError:  # a rank gone before it read: it will not
        read = store.add(f"{meeting.prefix}read", 0)
        log.warning(
            "rank %d, the store's host: %d of %d ranks %s said they read the outcome of '%s' of session %d "
            "within %gs; went on without the others",
            rank, read, meeting.party.size, meeting.party.describe(), meeting.phase, meeting.epoch, GRACE,
        )  # fmt: skip


def _forget(store: Store, meeting: Meeting, rank: int) -> None:
    """Delete what this rank wrote in a finished meeting; its decider deletes the shared keys (and the session's)."""
    prefix = meeting.prefix
    store.delete_key(f"{prefix}value/{rank}")
    if meeting.decided:
        shared = ("differ", "arrived", "tally", "result", "read", "all-read")
        for key in ("reference", *shared) if meeting.phase == OPEN else shared:
            store.delete_key(f"{prefix}{key}")
        if meeting.phase == OPEN:
            store.delete_key(f"{meeting.session}failed")


def _forget_admissions(store: Store, completed: Meeting) -> None:
    """Delete the keys of the party's admissions before ``completed``, back to the last one that completed (whose
    decider did those before it), their members' too: they may have gone (a restarted job's processes are new)."""
    for epoch in range(completed.epoch - 1, -1, -1):
        prefix = replace(completed, epoch=epoch).prefix
        outcome = store.get(f"{prefix}result").decode() if store.check([f"{prefix}result"]) else ""
        members = store.get(f"{prefix}members").decode() if store.check([f"{prefix}members"]) else ""
        for rank in filter(None, members.split(",")):
            store.delete_key(f"{prefix}value/{rank}")
        for key in ("reference", "members", "arrived", "result"):
            store.delete_key(f"{prefix}{key}")
        if outcome.startswith(COMPLETE):
            return


def _groups(store: Store, meeting: Meeting, arrived: Sequence[int]) -> list[tuple[list[int], str]]:
    """The arrived ranks grouped by the value they brought, the largest group first."""
    prefix = meeting.prefix
    entries = store.get(f"{prefix}differ").decode() if store.check([f"{prefix}differ"]) else ""
    digest_of = {int(r): digest for r, digest in (entry.split(":") for entry in entries.split(",") if entry)}
    by_digest: dict[str, list[int]] = {}
    for rank in arrived:
        by_digest.setdefault(digest_of.get(rank, ""), []).append(rank)
    groups = []
    for digest, ranks in by_digest.items():
        if digest or meeting.phase == OPEN:
            groups.append((ranks, store.get(f"{prefix}value/{ranks[0]}" if digest else f"{prefix}reference").decode()))
        else:
            groups.append((ranks, _ARRIVED))
    return sorted(groups, key=lambda group: (-len(group[0]), group[0][0]))


def _missing(store: Store, meeting: Meeting) -> list[int]:
    """After a timeout: the ranks that never arrived."""
    return [rank for rank in meeting.party.ranks if not store.check([f"{meeting.prefix}value/{rank}"])]


def _arrivals(store: Store, meeting: Meeting) -> tuple[list[int], list[tuple[list[int], str]] | None]:
    """After a timeout: the ranks that never arrived, and the others grouped by value."""
    missing = _missing(store, meeting)
    absent = set(missing)
    arrived = [rank for rank in meeting.party.ranks if rank not in absent]
    return missing, _groups(store, meeting, arrived) if arrived else None


def _failures(groups: Sequence[tuple[Sequence[int], str]]) -> str:
    """The ranks that arrived with an error, and each distinct error (the first few: the rest counted)."""
    parts = []
    failed = [(ranks, value) for ranks, value in groups if value.startswith(_FAILED)]
    for ranks, value in failed[:_SHOWN_FAILURES]:
        error = value[len(_FAILED) :]
        who = (
            f"rank {ranks[0]} failed: " if len(ranks) == 1 else f"ranks {shown_ranks(ranks)} failed (rank {ranks[0]}): "
        )
        parts.append(who + error)
    more = [rank for ranks, _ in failed[_SHOWN_FAILURES:] for rank in ranks]
    if more:
        parts.append(f"ranks {shown_ranks(more)} failed too")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- what ranks agree on

T = TypeVar("T", bound="Terms")

_SHOWN_CHARS = 120
"""Longer texts are shown by their first difference."""


@dataclass(frozen=True)
class Terms:
    """What every rank of a session must bring alike: a frozen dataclass of text and numbers.

    Subclasses name their kind (``KIND``); ``encode`` is the text compared at ``convene``, and
    ``disagreement`` turns the groups of a meeting whose values differ into one message that names
    every group of ranks outside the majority with the fields in which it differs.
    """

    KIND: ClassVar[str] = "terms"
    HIDDEN: ClassVar[tuple[str, ...]] = ()
    """Fields compared but not shown (fingerprints: shown only when nothing else differs)."""

    def encode(self) -> str:
        """The one text form stored for other ranks to compare: the kind, then the fields as JSON."""
        return f"{self.KIND}:{json.dumps(asdict(self), sort_keys=True)}"

    @classmethod
    def decode(cls: type[T], text: str) -> T | None:
        """Inverse of ``encode``; None for another kind (a rank in another kind of session)."""
        kind, _, body = text.partition(":")
        if kind != cls.KIND:
            return None
        data = json.loads(body)
        types = {f.name: f.type for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in types})

    def differing(self, others: Sequence[Terms]) -> list[str]:
        """The fields to show: those that differ, a hidden one only if nothing else does."""
        names = [f.name for f in fields(self)]
        differ = [n for n in names if any(getattr(o, n) != getattr(self, n) for o in others)]
        shown = [n for n in differ if n not in self.HIDDEN]
        return shown or differ

    def show(self, names: Sequence[str], against: Terms | None = None) -> str:
        """``names`` of these terms for a message; a long text as its first difference from ``against``."""
        parts = []
        for name in names:
            value = getattr(self, name)
            if isinstance(value, str) and len(value) > _SHOWN_CHARS:
                value = (
                    first_difference(value, str(getattr(against, name)))
                    if against is not None
                    else f"{value[:_SHOWN_CHARS]}... ({len(value)} characters)"
                )
            elif isinstance(value, tuple):
                value = ",".join(map(str, value))
            parts.append(f"{name} {value!r}" if isinstance(value, str) else f"{name} {value}")
        return ", ".join(parts)

    @classmethod
    def disagreement(cls, rank: int, groups: Sequence[tuple[list[int], str]], where: str, fix: str) -> str:
        """One message for a meeting whose values differ: every group outside the majority, and the majority."""
        decoded = [cls.decode(value) for _, value in groups]
        majority_ranks, majority = groups[0][0], decoded[0]
        others = [(ranks, terms, value) for (ranks, value), terms in zip(groups[1:], decoded[1:])]
        known = [terms for _, terms, _ in others if terms is not None]
        names = majority.differing(known) if majority is not None else []
        described = []
        for ranks, terms, value in others:
            if terms is None or majority is None:
                kind = value.partition(":")[0] if terms is None else cls.KIND
                described.append(f"ranks {shown_ranks(ranks)} are in a {kind!r} session")
            else:
                described.append(f"ranks {shown_ranks(ranks)} have {terms.show(names, majority)}")
        outside = sum(len(ranks) for ranks, _, _ in others)
        total = outside + len(majority_ranks)
        mine = (
            f"have {majority.show(names)}"
            if majority is not None
            else f"are in a {groups[0][1].partition(':')[0]!r} session"
        )
        return (
            f"rank {rank}: {outside} of {total} ranks disagree with the majority {where}: {'; '.join(described)}; "
            f"the majority, ranks {shown_ranks(majority_ranks)}, {mine}. {fix}"
        )


def first_difference(theirs: str, ours: str) -> str:
    """A long ``+``-joined text (a spec) shown by its first part that differs from ``ours``."""
    mine, other = theirs.split("+"), ours.split("+")
    index = next((i for i, (a, b) in enumerate(zip(mine, other, strict=False)) if a != b), min(len(mine), len(other)))
    part = mine[index][:_SHOWN_CHARS] if index < len(mine) else "nothing"
    if len(mine) == 1 and len(other) == 1:
        return f"{theirs[:_SHOWN_CHARS]}... ({len(theirs)} characters)"
    return f"{len(mine)} shards, shard {index}: {part} (where the others have {len(other)} shards)"


__all__ = [
    "COMPLETE",
    "GRACE",
    "OPEN",
    "Admission",
    "Meeting",
    "Outcome",
    "Party",
    "Purpose",
    "Terms",
    "admit",
    "arrive_failed",
    "barrier",
    "convene",
    "declare_absent",
    "first_difference",
    "meet",
    "publish_failure",
    "published_failures",
]
