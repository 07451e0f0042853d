"""Box arithmetic: a tensor's global boxes ([start, stop) per dim), where they meet, what they share, where a box
starts in a local tensor, and the fast maker of the named tuples that carry them. Pure index math; every side of
a refit (placements, weight maps, the plan, the schedule, the executor's checks) reads its boxes through it.
"""

from __future__ import annotations

from math import prod

Box = tuple[tuple[int, int], ...]
"""A global box: [start, stop) per dim."""

Holding = tuple[Box, tuple[int, ...]]
"""A global box a rank holds, and where it starts in the rank's local tensor."""

from_fields = tuple.__new__
"""Makes a named tuple (``Slice``, ``HeldTensor``, the planner's ``Tile`` and ``Transfer``) from a tuple of its
fields, skipping the keyword handling of its class's constructor: a rank's part of a large MoE refit makes tens of
thousands of each."""


def meets(first: Box, second: Box) -> bool:
    """Whether two boxes of one tensor share an element."""
    for (a, b), (c, d) in zip(first, second):  # noqa: SIM110 (a loop: all() over a generator costs twice as much)
        if d <= a or b <= c:
            return False
    return True


def overlap(first: Box, second: Box) -> Box:
    """The box two boxes that meet share."""
    return tuple([(max(a, c), min(b, d)) for (a, b), (c, d) in zip(first, second)])


def moved(offset: tuple[int, ...], box: Box, inner: Box) -> tuple[int, ...]:
    """Where ``inner``, a box inside ``box``, starts in a local tensor in which ``box`` starts at ``offset``.

    The dims of ``offset`` align with the boxes' from the right: a weight map may put a box in a tensor
    with unit dims more or fewer on the left (one expert's slot of a stacked tensor), which never move."""
    n = min(len(offset), len(box))
    lead, skip = len(offset) - n, len(box) - n
    tail = (o + lo - a for o, (lo, _), (a, _) in zip(offset[lead:], inner[skip:], box[skip:]))
    return (*offset[:lead], *tail)


def fitted(shape: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """A box's extents in a tensor of ``ndim`` dims, dims aligned from the right: unit dims added or dropped
    on the left (see ``moved``)."""
    return (1,) * (ndim - len(shape)) + shape[max(0, len(shape) - ndim) :]


def volume(box: Box) -> int:
    """Elements in a box."""
    return prod(stop - start for start, stop in box)


def subtract(box: Box, cut: Box) -> list[Box]:
    """``box`` minus ``cut``: at most two disjoint boxes per dim (``[box]`` when they do not meet)."""
    if not meets(box, cut):
        return [box]
    pieces, rest = [], list(box)
    for dim, ((start, stop), (low, high)) in enumerate(zip(box, cut)):
        if start < low:
            pieces.append((*rest[:dim], (start, low), *rest[dim + 1 :]))
        if high < stop:
            pieces.append((*rest[:dim], (high, stop), *rest[dim + 1 :]))
        rest[dim] = (max(start, low), min(stop, high))
    return pieces


__all__ = ["Box", "Holding", "fitted", "from_fields", "meets", "moved", "overlap", "subtract", "volume"]
