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

So every creation is one round of agreement among the window's ranks, through the default
store, under its own keys ``shardcore/window/<build>/<first>+<size>/<sequence>``: every rank
of the window brings a digest of what it asks for (which rows, which backend) and the last
to arrive draws a block of numbers from one store-wide counter (``shardcore/window/names``),
so no two creations, in any window or build, ever draw the same number. Each member then
sets torch's counter to ``RESERVED + number + row``, far above anything world-collective
creation reaches (it adds at most a few times the world size per build), creates its
group, and puts the counter back (c). ``<sequence>`` counts the window's creations on each
rank, so ranks that call in the same order meet at the same keys; a rank that is absent
or asks for something else makes every rank raise GroupCreationError naming it within the
timeout, never a hang and never a wrong group.

The window's key includes ``<build>``, a count of ``build_shards`` calls that every rank
keeps alike, so a rebuilt window never reads an earlier build's keys. The keys are small
and left in the store (``O(window)`` per creation; creations after the build are rare).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ...errors import GroupCreationError
from ...plan.arguments import as_timedelta
from ..agreement import listed
from ..torch_state import default_store, group_counter, is_fake_world, set_group_counter
from .strategy import world_collective_reason

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

RESERVED = 1 << 48
"""Window-local group names start here: world-collective creation never counts this high."""

_name_block = 0
"""Fake worlds only: no store is shared, so numbers are drawn from this process's count."""
_open: dict[tuple[int, int], Window] = {}


def _dist() -> Any:
    import torch.distributed as dist

    return dist


@dataclass(eq=False)
class Window:
    """One shard's window on a member rank, with what it created after the build.

    Every rank of the window must make the same window-local creations in the same order.
    """

    first: int
    """The window's first global rank."""
    size: int
    """Ranks in the window."""
    build: int
    """Which ``build_shards`` call opened it (every rank counts alike)."""
    timeout: timedelta
    created: list[Any] = field(default_factory=list, repr=False)
    """Every group this rank holds from the build and after it; ``destroy_shards`` destroys them."""
    closed: bool = False
    _sequence: int = 0

    @property
    def ranks(self) -> range:
        """The window's global ranks."""
        return range(self.first, self.first + self.size)

    def new_group(self, ranks: Iterable[int], **options: Any) -> ProcessGroup | None:
        """One group of ranks inside the window; every rank of the window calls it alike.

        Args:
            ranks: global ranks, all inside the window.
            **options: ``timeout``, ``backend``, ``pg_options``, ``group_desc`` (as for ``dist.new_group``).

        Returns:
            The group on its members, None on the window's other ranks.

        Raises:
            GroupCreationError: a rank outside the window, a window rank absent or asking for
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
        groups = [tuple(sorted(row)) for row in rows]
        self._check(groups)
        wait = self.timeout if timeout is None else as_timedelta(timeout)
        reason = world_collective_reason()
        if reason is not None:
            raise GroupCreationError(
                f"a window cannot create groups by itself here: {reason}, so every rank of the world must take "
                f"part; declare the groups at build time instead (Backend.extra_groups, or the dtensor "
                f"backend's flatten= option)"
            )
        what = f"{group_desc or 'new_group'} {_rows_text(groups)}"
        request = json.dumps({"rows": groups, "backend": str(backend), "desc": group_desc})
        self._sequence += 1
        number = self._agree(what, request, len(groups), wait)
        rank = _dist().get_rank()
        for index, row in enumerate(groups):
            if rank in row:
                pg = _named_group(RESERVED + number + index, row, wait, backend, pg_options, group_desc)
                self.created.append(pg)
                return pg
        return None

    def close(self) -> None:
        """Refuse later creations and drop the destroyed groups (holding one keeps its sockets open)."""
        self.closed = True
        self.created.clear()
        if _open.get((self.first, self.size)) is self:
            del _open[(self.first, self.size)]

    def _check(self, rows: Sequence[tuple[int, ...]]) -> None:
        rank = _dist().get_rank()
        if self.closed:
            raise GroupCreationError(
                f"rank {rank}: the window of ranks {listed(self.ranks)} was destroyed (destroy_shards): "
                f"create groups on the shards of a new build_shards"
            )
        if rank not in self.ranks:
            raise GroupCreationError(
                f"rank {rank} is not in the window of ranks {listed(self.ranks)}: only the window's ranks create "
                f"its groups"
            )
        seen: set[int] = set()
        for row in rows:
            outside = [r for r in row if r not in self.ranks]
            if not row or outside:
                raise GroupCreationError(
                    f"group {list(row)}: ranks {outside or '(none)'} are not in the window of ranks "
                    f"{listed(self.ranks)}; a window-local group holds ranks of its window only"
                )
            if seen.intersection(row):
                raise GroupCreationError(
                    f"group {list(row)} overlaps an earlier group of the same call at ranks "
                    f"{sorted(seen.intersection(row))}: pass disjoint groups, or call new_group once per group"
                )
            seen.update(row)

    def _agree(self, what: str, request: str, count: int, timeout: timedelta) -> int:
        """Meet the window's other ranks; the first of ``count`` numbers no other creation ever draws."""
        global _name_block
        if is_fake_world():  # no rank sees another: nothing to agree on
            _name_block += count
            return _name_block - count
        dist = _dist()
        try:
            return _agree(default_store(), self, what, request, count, timeout)
        except dist.DistError as error:
            raise GroupCreationError(
                f"rank {dist.get_rank()}: lost the store while creating {what} ({error}); its host (rank 0 under "
                f"torchrun) has probably died"
            ) from None


def _agree(store: Store, window: Window, what: str, request: str, count: int, timeout: timedelta) -> int:
    dist = _dist()
    rank = dist.get_rank()
    prefix = f"shardcore/window/{window.build}/{window.first}+{window.size}/{window._sequence}"
    value = f"{hashlib.sha1(request.encode()).hexdigest()} {what[:300]}"
    store.set(f"{prefix}/value/{rank}", value)
    if store.compare_set(f"{prefix}/reference", "", value).decode() != value:
        store.append(f"{prefix}/differ", f"{rank},")  # type: ignore[attr-defined]  # missing from torch's stubs
    if store.add(f"{prefix}/arrived", 1) == window.size:
        store.set(f"{prefix}/number", str(store.add("shardcore/window/names", count) - count))
        store.set(f"{prefix}/done", "1")
    started = time.monotonic()
    try:
        store.wait([f"{prefix}/done"], timeout)
    except dist.DistError:
        missing = [r for r in window.ranks if not store.check([f"{prefix}/value/{r}"])]
        raise GroupCreationError(
            f"rank {rank}: ranks {listed(missing)} of the window {listed(window.ranks)} did not reach window-local "
            f"creation #{window._sequence} ({what}) within {time.monotonic() - started:.0f}s; every rank of the "
            f"window must create the same window-local groups in the same order"
        ) from None
    if store.check([f"{prefix}/differ"]):
        differ = sorted(int(r) for r in store.get(f"{prefix}/differ").decode().split(",") if r)
        reference = store.get(f"{prefix}/reference").decode()
        theirs = store.get(f"{prefix}/value/{differ[0]}").decode()
        if 2 * len(differ) > window.size:  # the first to arrive is the odd one out: name the minority
            differ, theirs, reference = [r for r in window.ranks if r not in set(differ)], reference, theirs
        raise GroupCreationError(
            f"rank {rank}: ranks {listed(differ)} of the window {listed(window.ranks)} asked for something else at "
            f"window-local creation #{window._sequence}: '{theirs.split(' ', 1)[1]}' vs "
            f"'{reference.split(' ', 1)[1]}'; every rank of the window must create the same groups in the same order"
        )
    return int(store.get(f"{prefix}/number").decode())


def _named_group(
    name: int, ranks: tuple[int, ...], timeout: timedelta, backend: str | None, pg_options: Any, desc: str | None
) -> ProcessGroup:
    """``dist.new_group`` under the torch name ``str(name)``, leaving torch's world counter as it was."""
    dist = _dist()
    saved = group_counter()
    set_group_counter(name)
    try:
        return dist.new_group(list(ranks), timeout=timeout, backend=backend, pg_options=pg_options, group_desc=desc)
    except Exception as error:
        raise GroupCreationError(
            f"rank {dist.get_rank()}: creating window-local group {list(ranks)} failed: {error}. Its members must "
            f"all reach it within the timeout"
        ) from error
    finally:
        set_group_counter(saved)


def _rows_text(rows: Sequence[tuple[int, ...]]) -> str:
    shown = "; ".join(str(list(row)) for row in rows[:4])
    return f"[{shown}{'; ...' if len(rows) > 4 else ''}]"


def open_window(first: int, size: int, build: int, timeout: timedelta, created: list[Any]) -> Window:
    """The member rank's window for a build; ``created`` is the list of the build's groups, shared."""
    window = Window(first, size, build, timeout, created)
    _open[(first, size)] = window
    return window


def window_of(first: int, size: int) -> Window | None:
    """This rank's open window over ranks ``first .. first+size-1`` from its latest build, if any."""
    return _open.get((first, size))


__all__ = ["RESERVED", "Window", "open_window", "window_of"]
