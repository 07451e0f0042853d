"""A sequence whose items are made only when read one by one: what a rank's part and a message hold instead of
tens of thousands of small tuples that most readers never look at one by one."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar, overload

Item = TypeVar("Item")


class MadeWhenRead(Sequence[Item]):
    """A sequence that makes its items (``_make``) the first time one is read, and keeps them; a subclass counts
    them without making them (``__len__``). Compares equal to any sequence of the same items, and shows as the
    tuple of them."""

    __slots__ = ("_made",)

    def __init__(self) -> None:
        self._made: tuple[Item, ...] | None = None

    def _make(self) -> tuple[Item, ...]:
        """The items, in order (made once)."""
        raise NotImplementedError

    def _items(self) -> tuple[Item, ...]:
        if self._made is None:
            self._made = self._make()
        return self._made

    @overload
    def __getitem__(self, index: int) -> Item: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Item, ...]: ...

    def __getitem__(self, index: int | slice) -> Item | tuple[Item, ...]:
        return self._items()[index]

    def __iter__(self) -> Iterator[Item]:
        return iter(self._items())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MadeWhenRead):
            return self._items() == other._items()
        if isinstance(other, Sequence) and not isinstance(other, str):
            return self._items() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a tuple of the same items, which hashes otherwise

    def __repr__(self) -> str:
        return repr(self._items())


__all__ = ["MadeWhenRead"]
