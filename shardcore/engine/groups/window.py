"""Groups that one shard's window creates by itself after the build, named so they can never collide.

torch names a default-mode group after its world-wide counter ``group_count`` and finds the
group's peers under that name in the store. When two windows each create a group of their
own (a DeviceMesh ``_flatten``, a ``dist.new_group`` of their ranks), both advance the
counter in step, both groups get the same name, and gloo's rendezvous mixes the windows'
addresses: every rank hangs, or, worse, a group silently spans both windows.

A window-local group's name must therefore be

(a) computed alike by every member,
(b) unlike any name another window, a later window-local creation, or any world-collective
    creation (a later ``build_shards``, Megatron, ``init_device_mesh``) ever uses, and
(c) taken without moving the world counter, which every rank of the world must still hold
    alike so that later world-collective creation agrees.

So every creation is a session of the window's own party in the one agreement protocol
(``engine.agreement``): every rank of the window brings what it asks for (which rows, which
backend), and the meeting's decider draws a block of numbers from one store-wide counter
(``shardcore/window/names``), so no two creations, in any window or build, ever draw the same
number. Each member then sets torch's counter to ``RESERVED + number + row``, far above anything
world-collective creation reaches (it adds at most a few times the world size per build), creates
its group, and puts the counter back (c); a last meeting confirms every member created it.

Sessions are numbered by the window's epoch in the store, so a rank that failed, or asked for
something else, at one creation (and arrived with its error, or was named) is in step with the
others at the next: every rank of the window raises GroupCreationError naming the rank at fault
within the timeout, never a hang and never a wrong group, and the next good creation succeeds.
The window's party is keyed by its build's epoch, so a rebuilt window never meets an earlier one.
"""

from __future__ import annotations

import atexit
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ...errors import GroupCreationError
from ...plan.arguments import as_timedelta, shown_ranks
from ..agreement import Party, Purpose, Terms, arrive_failed, convene, meet
from ..torch_state import dist, group_counter, is_fake_world, set_group_counter
from .strategy import world_collective_reason

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

RESERVED = 1 << 48
"""Window-local group names start here: world-collective creation never counts this high."""
NAMES_KEY = "shardcore/window/names"
"""The store-wide counter window-local creations draw their names from."""
WINDOW = Purpose("window-local creation", "the same window-local creation (in the same order)", GroupCreationError)

_name_block = 0
"""Fake worlds only: no store is shared, so numbers are drawn from this process's count."""
_open: dict[range, Window] = {}
atexit.register(_open.clear)  # while the interpreter lives: a window's groups must not outlive it (see world_token)


@dataclass(frozen=True)
class WindowRequest(Terms):
    """What every rank of the window must ask for alike at one creation."""

    KIND = "window-group"
    HIDDEN = ("digest",)

    what: str
    """The request as a person reads it: description and rows (the first few)."""
    digest: str
    """Every row and option, hashed: equal requests, equal digests."""


@dataclass(eq=False)
class Window:
    """One shard's window on a member rank, with what it created after the build.

    Every rank of the window must make the same window-local creations in the same order.
    """

    ranks: range
    """The window's global ranks."""
    build: int
    """The epoch of the ``build_shards`` call that opened it (every rank has the same)."""
    timeout: timedelta
    created: list[Any] = field(default_factory=list, repr=False)
    """Every group this rank holds from the build and after it; ``destroy_shards`` destroys them."""
    closed: bool = False

    @property
    def party(self) -> Party:
        return Party.window(self.build, self.ranks)

    def new_group(self, ranks: Iterable[int], **options: Any) -> ProcessGroup | None:
        """One group of ranks inside the window; every rank of the window calls it alike.

        Args:
            ranks: global ranks, all inside the window.
            **options: ``timeout``, ``backend``, ``pg_options``, ``group_desc`` (as for ``dist.new_group``).

        Returns:
            The group on its members, None on the window's other ranks.

        Raises:
            GroupCreationError: a rank outside the window, a window rank absent, failed or asking for
                something else within the timeout, or the window already destroyed.
        """
        return self.new_groups([ranks], **options)

    def new_groups(
        self,
        rows: Iterable[Iterable[int]],
        *,
        timeout: float | timedelta | None = None,
        backend: str | None = None,
        pg_options: Any = None,
        group_desc: str | None = None,
    ) -> ProcessGroup | None:
        """Disjoint groups of the window's ranks in one agreement; returns this rank's group (None if in none).

        Every rank of the window calls it with the same rows, the pattern of DeviceMesh and
        Megatron (each rank enumerates every group, keeps its own), but only the window takes part.

        Raises:
            GroupCreationError: as ``new_group``; also overlapping or empty rows.
        """
        rank = dist().get_rank()
        self._check_member(rank)
        wait = self.timeout if timeout is None else as_timedelta(timeout)
        try:  # a window rank that fails here still arrives, so the others name it instead of waiting
            groups = [tuple(sorted(row)) for row in rows]
            request = self._request(groups, backend, group_desc)
        except BaseException as error:
            if not is_fake_world():
                arrive_failed(self.party, WINDOW, None, "open", error, wait)
            raise
        number, epoch = self._agree(request, len(groups), wait)
        mine = None
        try:
            for index, row in enumerate(groups):
                if rank in row:
                    mine = _named_group(RESERVED + number + index, row, wait, backend, pg_options, group_desc)
                    self.created.append(mine)
        except BaseException as error:
            if epoch is not None:
                arrive_failed(self.party, WINDOW, epoch, "created", error, wait)
            raise
        if epoch is not None:
            meet(self.party, WINDOW, epoch, "created", wait)
        return mine

    def close(self) -> None:
        """Refuse later creations and drop the destroyed groups (holding one keeps its sockets open)."""
        self.closed = True
        self.created.clear()
        if _open.get(self.ranks) is self:
            del _open[self.ranks]

    def _check_member(self, rank: int) -> None:
        if self.closed:
            raise GroupCreationError(
                f"rank {rank}: the window of ranks {shown_ranks(self.ranks)} was destroyed (destroy_shards): "
                f"create groups on the shards of a new build_shards"
            )
        if rank not in self.ranks:
            raise GroupCreationError(
                f"rank {rank} is not in the window of ranks {shown_ranks(self.ranks)}: only the window's ranks "
                f"create its groups"
            )

    def _request(self, rows: Sequence[tuple[int, ...]], backend: str | None, desc: str | None) -> WindowRequest:
        """The request's terms, once the rows are checked and the world lets a window create alone.

        Raises:
            GroupCreationError: rows outside the window, empty or overlapping; or a world where every
                rank must take part in each group creation.
        """
        reason = world_collective_reason()
        if reason is not None:
            raise GroupCreationError(
                f"a window cannot create groups by itself here: {reason}, so every rank of the world must take "
                f"part; declare the groups at build time instead (Backend.extra_groups, or the dtensor "
                f"backend's flatten= option)"
            )
        seen: set[int] = set()
        for row in rows:
            outside = [r for r in row if r not in self.ranks]
            if not row or outside:
                raise GroupCreationError(
                    f"group {shown_ranks(row)}: ranks {shown_ranks(outside) if outside else '(none)'} are not in the "
                    f"window of ranks {shown_ranks(self.ranks)}; a window-local group holds ranks of its window only"
                )
            if seen.intersection(row):
                raise GroupCreationError(
                    f"group {shown_ranks(row)} overlaps an earlier group of the same call at ranks "
                    f"{shown_ranks(seen.intersection(row))}: pass disjoint groups, or call new_group once per group"
                )
            seen.update(row)
        what = (
            f"{desc or 'new_group'} {'; '.join(shown_ranks(row) for row in rows[:4])}{'; ...' if len(rows) > 4 else ''}"
        )
        digest = hashlib.sha256(json.dumps([rows, str(backend), desc]).encode()).hexdigest()[:16]
        return WindowRequest(what[:300], digest)

    def _agree(self, request: WindowRequest, count: int, timeout: timedelta) -> tuple[int, int | None]:
        """Meet the window's other ranks: (the first of ``count`` names no other creation draws, the session's
        epoch; None in a fake world, where no rank sees another).

        Raises:
            GroupCreationError: a window rank absent, failed, or asking for something else.
        """
        global _name_block
        if is_fake_world():
            _name_block += count
            return _name_block - count, None

        def draw(store: Store) -> str:
            return str(store.add(NAMES_KEY, count) - count)

        outcome = convene(self.party, WINDOW, request.encode(), timeout, decide=draw)
        if outcome.groups is not None:
            raise GroupCreationError(
                WindowRequest.disagreement(
                    dist().get_rank(),
                    outcome.groups,
                    f"at window-local creation {outcome.epoch} of the window {shown_ranks(self.ranks)}",
                    "Every rank of the window must create the same window-local groups in the same order",
                ),
                sorted(r for ranks, _ in outcome.groups[1:] for r in ranks),
            )
        return int(outcome.payload), outcome.epoch


def _named_group(
    name: int, ranks: tuple[int, ...], timeout: timedelta, backend: str | None, pg_options: Any, desc: str | None
) -> ProcessGroup:
    """``dist.new_group`` under the torch name ``str(name)``, leaving torch's world counter as it was."""
    saved = group_counter()
    set_group_counter(name)
    try:
        return dist().new_group(list(ranks), timeout=timeout, backend=backend, pg_options=pg_options, group_desc=desc)
    except Exception as error:
        raise GroupCreationError(
            f"rank {dist().get_rank()}: creating window-local group {shown_ranks(ranks)} failed: {error}. Its "
            f"members must all reach it within the timeout"
        ) from error
    finally:
        set_group_counter(saved)


def open_window(ranks: range, build: int, timeout: timedelta, created: list[Any]) -> Window:
    """The member rank's window for a build; ``created`` is the list of the build's groups, shared."""
    window = Window(ranks, build, timeout, created)
    _open[ranks] = window
    return window


def window_of(first: int, size: int) -> Window | None:
    """This rank's open window over ranks ``first .. first+size-1`` from its latest build, if any."""
    return _open.get(range(first, first + size))


__all__ = ["NAMES_KEY", "RESERVED", "Window", "WindowRequest", "open_window", "window_of"]
