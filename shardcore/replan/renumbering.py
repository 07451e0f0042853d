"""Old ranks to new ranks after a world loses, releases or gains ranks.

Survivors keep their order: a survivor's new rank is its old rank minus the ranks gone below it (what
torch's ``shrink_group`` and a re-formed world both do). Ranks are gone when they were lost, or when
an option releases them (survivors the new layout does not use, which leave with the lost ones, so
that every shard's window stays contiguous). Added ranks come after every survivor, except those that
**replace** lost ranks: each takes a lost rank's place (its slot, and so its number and node), so that no
survivor's number changes; a replacement holds no weights, like any added rank.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field


def ranges(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted ranks as [first, last] runs: [0, 1, 2, 5] -> [(0, 2), (5, 5)]."""
    runs: list[tuple[int, int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], rank)
        else:
            runs.append((rank, rank))
    return runs


def format_ranks(ranks: Iterable[int], limit: int = 8) -> str:
    """Ranks as compact runs, e.g. '8-15, 40'; after ``limit`` runs, how many more."""
    runs = ranges(ranks)
    shown = [f"{a}-{b}" if b > a else str(a) for a, b in runs[:limit]]
    more = f" and {len(runs) - limit} more runs" if len(runs) > limit else ""
    return ", ".join(shown) + more if shown else "none"


def named_ranks(ranks: Collection[int], noun: str = "rank") -> str:
    """``rank 1``, ``ranks 1-2, 5``, ``node 3``: ``format_ranks`` after the noun, singular for one."""
    return f"{noun if len(set(ranks)) == 1 else noun + 's'} {format_ranks(ranks)}"


@dataclass(frozen=True)
class Renumbering:
    """How the old world's ranks map into the new world.

    Attributes:
        old_world: Ranks in the old world.
        lost: Old ranks that are gone (failed), sorted.
        released: Survivors the new layout lets go (they leave with the lost ranks), sorted.
        added: Ranks the new world gains: the first ``len(replaced)`` take the places of ``replaced``, the rest
            come after every survivor.
        replaced: Lost ranks whose places added ranks take, sorted (at most ``added`` of them).
    """

    old_world: int
    lost: tuple[int, ...]
    released: tuple[int, ...] = ()
    added: int = 0
    replaced: tuple[int, ...] = ()
    _gone: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _gaps: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """Old ranks whose places close up: the gone ones but those a replacement takes, sorted."""
    _below: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """Per gap, the places below it (non-decreasing): what finds an old rank in O(log gone)."""
    survivors: int = field(init=False, compare=False)
    """Old ranks that stay."""
    _places: int = field(init=False, repr=False, compare=False)
    """New ranks on old places: the survivors and the replacements."""

    def __post_init__(self) -> None:
        gone = tuple(sorted({*self.lost, *self.released}))
        gaps = tuple(sorted(set(gone) - set(self.replaced)))
        object.__setattr__(self, "_gone", gone)
        object.__setattr__(self, "_gaps", gaps)
        object.__setattr__(self, "_below", tuple(rank - index for index, rank in enumerate(gaps)))
        object.__setattr__(self, "survivors", self.old_world - len(gone))
        object.__setattr__(self, "_places", self.old_world - len(gaps))

    @property
    def gone(self) -> tuple[int, ...]:
        """Old ranks not in the new world: lost and released, sorted."""
        return self._gone

    @property
    def new_world(self) -> int:
        """Ranks in the new world: the survivors that stay, then the added ranks."""
        return self.survivors + self.added

    def is_gone(self, old: int) -> bool:
        """Whether old rank ``old`` is lost or released. On an old place (a survivor's or a replacement's), it is
        gone only when a replacement took that place: what ``old_of`` tells a replacement by."""
        position = bisect_left(self._gone, old)
        return position < len(self._gone) and self._gone[position] == old

    def new_of(self, old: int) -> int | None:
        """The new rank of old rank ``old``, or None when it is gone (a replaced rank's place is a new process's)."""
        if self.is_gone(old):
            return None
        return old - bisect_right(self._gaps, old)

    def _place(self, new: int) -> int:
        """The old place of new rank ``new`` (below ``_places``)."""
        return new + bisect_right(self._below, new)  # every gap with at most ``new`` places below it

    def old_of(self, new: int) -> int | None:
        """The old rank now at new rank ``new``, or None for an added rank (a replacement too)."""
        if new >= self._places:
            return None
        old = self._place(new)
        return None if self.replaced and self.is_gone(old) else old

    def old_ranks(self, window: range) -> list[int | None]:
        """``old_of`` for every new rank of ``window`` (ascending), in O(len(window) + gone)."""
        out: list[int | None] = []
        gaps, old, position = self._gaps, -1, 0
        for new in window:
            if new >= self._places:
                out.append(None)
                continue
            if old < 0:
                old = self._place(new)
                position = bisect_right(gaps, old)
            else:
                old += 1
                while position < len(gaps) and gaps[position] == old:
                    old, position = old + 1, position + 1
            out.append(None if self.replaced and self.is_gone(old) else old)
        return out

    def lost_within(self, window: range) -> tuple[int, ...]:
        """The lost ranks in the old ranks ``window`` (a shard's), ascending, by bisection over ``lost``."""
        lost = self.lost
        return lost[bisect_left(lost, window.start) : bisect_left(lost, window.stop)]

    def replaces_within(self, first: int, last: int) -> bool:
        """Whether a replacement took the place of an old rank in [first, last]: a new process among old ones."""
        replaced = self.replaced
        return bool(replaced) and bisect_right(replaced, last) > bisect_left(replaced, first)

    def survivors_below(self, old: int) -> int:
        """New ranks on old places below ``old``: the survivors there, and the replacements of lost ranks there."""
        return old - bisect_left(self._gaps, old)

    def physical(self, new: int) -> int:
        """Where new rank ``new`` sits among the old world's slots (a replacement on its lost rank's, other added
        ranks after the old world): what nodes are counted on, since a node's ranks do not move when another
        node fails."""
        return self.old_world + new - self._places if new >= self._places else self._place(new)

    def with_released(self, released: Collection[int]) -> Renumbering:
        """The same loss, releasing ``released`` too."""
        return Renumbering(self.old_world, self.lost, tuple(sorted(released)), self.added, self.replaced)

    def with_replaced(self, replaced: Collection[int]) -> Renumbering:
        """The same loss, added ranks taking the places of the lost ranks ``replaced`` (at most ``added``)."""
        return Renumbering(self.old_world, self.lost, self.released, self.added, tuple(sorted(replaced)))


__all__ = ["Renumbering", "format_ranks", "named_ranks", "ranges"]
