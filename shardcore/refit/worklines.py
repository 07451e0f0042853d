"""Work lines: how the tiles of one route are shared among its holders (the refit's algorithm: ``plan.py``).

A *route* is every tile with the same holders and needers. Its tiles, laid end to end (``TileRun``), are served by
one work line per group of needers: each needer's copy of the run, cut into at most |H| segments (``line_cuts``),
segment k sent by the holder ``sources[(k + seed) % |H|]`` (``WorkLine.sender``); with fan-out, a node's relay of a
tile is its needer at the tile's seed (``relay``). This module owns that arithmetic: the plan's pieces and the
stats' sums (``cost.py``) both read it from here.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from .boxes import Box
from .placement import HolderSet, Slice


class Tile(NamedTuple):
    """The overlap of a source slice and a destination slice of one tensor, toward one destination."""

    position: int  # the tensor's position in the manifest
    shard: int  # position of the destination in the plan's destinations
    box: Box
    src_offset: tuple[int, ...]
    dst_offset: tuple[int, ...]
    sources: HolderSet
    needers: HolderSet
    seed: int
    rows: int  # extent of the box along dim 0, the dim pieces are cut along
    row_bytes: int  # bytes of one row of the box
    group: tuple[tuple[int, Slice], ...] = ()
    """With fan-out: (destination, slice) of every destination slice with this tile's box, this one included."""
    target: str = ""  # the destination's local tensor, when a weight map puts the box in another one (Slice.target)


Line = tuple[tuple[int, ...], tuple[int, ...], int]
"""One work line: its needers, its sources and the offset of its seed."""


class Routes(NamedTuple):
    """How one (holders, needers) pair is served, shared by every tile with that pair."""

    local: tuple[int, ...]  # needers that hold the tile already
    lines: tuple[Line, ...]
    far: tuple[tuple[int, ...], ...] = ()  # fan-out: the needers of each node without holders, by node


Piece = tuple[int, int, int, int, int]
"""(src, dst, first row, end row, hop) of a tile, rows along dim 0 relative to the tile's box."""


def line_cuts(starts: Sequence[int], steps: Sequence[int], copies: int, holders: int, floor: int) -> tuple[int, ...]:
    """Where a work line is cut into segments, one per sending holder at most.

    The line is ``copies`` copies of a run of tiles laid end to end: tile j takes bytes
    [starts[j], starts[j + 1]) of each copy and may be cut every ``steps[j]`` bytes (its row). The line
    is cut into min(holders, rows of the line) equal segments, each cut moved back onto a step of the
    tile it falls in. With a floor, a cut nearer than a floor to an edge of its tile's copy moves onto
    that edge, and one nearer than a floor to the cut before it in the same copy moves onto the nearer
    of the two; then every piece (a segment's part inside one tile's copy) has at least ``floor`` bytes,
    or is the whole tile. Cuts on a tile's edge cost no piece, so a run of small tiles is still cut
    evenly. Cuts never decrease, so a segment may be empty.

    Returns:
        The count + 1 cut positions, in bytes from the start of the line: 0 first, the line's end last.
    """
    size = starts[-1]
    width = copies * size
    rows = sum((starts[j + 1] - starts[j]) // step for j, step in enumerate(steps))
    count = max(1, min(holders, copies * rows))
    cuts = [0]
    for k in range(1, count):
        copy, at = divmod(k * width // count, size)
        j = bisect_right(starts, at) - 1
        edge = copy * size + starts[j]  # where the tile's copy starts on the line
        inside = at - starts[j]
        inside -= inside % steps[j]
        rest = starts[j + 1] - starts[j] - inside
        if inside and (inside < floor or rest < floor):  # too near an edge of its tile: onto the nearer edge
            inside = 0 if inside <= rest else inside + rest
        elif inside and cuts[-1] > edge and inside - (cuts[-1] - edge) < floor:  # too near the cut before
            inside = cuts[-1] - edge if inside - (cuts[-1] - edge) <= rest else inside + rest
        cuts.append(edge + inside)
    cuts.append(width)
    return tuple(cuts)


class WorkLine(NamedTuple):
    """One line of a route, over every tile of the route: segment k of ``cuts`` is sent by
    ``sources[(k + seed) % len(sources)]``, copy i goes to ``needers[i]`` (the relays' line of fan-out has
    no fixed needers: copy i goes to each tile's relay on the i-th node without holders)."""

    needers: tuple[int, ...]
    copies: int
    sources: tuple[int, ...]
    seed: int
    cuts: tuple[int, ...]

    def sender(self, k: int) -> int:
        """The source that sends segment ``k``: the segments are dealt round the sources from the seed's place, so
        a route's longer segments (of a small route) fall on other holders than another route's."""
        return self.sources[(k + self.seed) % len(self.sources)]

    def segment(self, place: int) -> int:
        """The segment the source at ``place`` (its index in ``sources``) sends: ``sender``'s inverse."""
        return (place - self.seed) % len(self.sources)


def relay(group: Sequence[int], seed: int) -> int:
    """Fan-out: the needer of a tile that relays it into its node (``group``, the tile's needers there), rotated by
    the tile's seed so that a node's relays share the forwarding."""
    return group[seed % len(group)]


@dataclass(frozen=True)
class Run:
    """One route's run: its tiles laid end to end in a fixed order (tensor, box), and the route's work lines cut over
    them. What the stats add up (``cost.py``); the planner's runs keep their tiles too (``TileRun``).

    Attributes:
        routes: The route's local copies and lines.
        starts: Where each tile starts in one copy of the run, in bytes; the run's bytes last.
        lines: One per line of ``routes``, then the relays' line (fan-out).
        sources: The route's holders.
        shard: The destination of the run's first tile (a route's needers are one destination's, but with fan-out).
        group: With fan-out, the first tile's group (``Tile.group``), whose members name each needer's destination.
        scaled: Bytes of one copy of the run that are fp8 scale tensors.
    """

    routes: Routes
    starts: tuple[int, ...]
    lines: tuple[WorkLine, ...]
    sources: HolderSet
    shard: int
    group: tuple[tuple[int, Slice], ...]
    scaled: int

    def shares(self, line: WorkLine) -> Iterator[tuple[int, int, int]]:
        """(sender, copy, bytes) of every segment's part in each copy of ``line``: what each pair moves."""
        width, cuts = self.starts[-1], line.cuts
        for k in range(len(cuts) - 1):
            start, stop = cuts[k], cuts[k + 1]
            while start < stop:
                copy = start // width
                end = min(stop, (copy + 1) * width)
                yield line.sender(k), copy, end - start
                start = end

    def piece_count(self, line: WorkLine) -> int:
        """How many pieces ``line`` sends: one per tile's copy, and one more per cut inside a tile's copy."""
        width, edges = self.starts[-1], set(self.starts)
        return line.copies * (len(self.starts) - 1) + sum(cut % width not in edges for cut in set(line.cuts[1:-1]))


@dataclass(frozen=True)
class TileRun(Run):
    """A route's run with its tiles (``Run``'s order): what a rank's part reads its pieces off.

    Attributes:
        tiles: The run's tiles (with fan-out, each box once, whichever destination of its group found it).
    """

    tiles: tuple[Tile, ...]
    _at: dict[int, dict[int, int]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def at(self, ranks: tuple[int, ...], rank: int) -> int:
        """Where ``rank`` is in ``ranks`` (a line's sources or needers, which may be a thousand ranks long),
        indexed once per line."""
        return self.members(ranks)[rank]

    def members(self, ranks: tuple[int, ...]) -> dict[int, int]:
        """``ranks`` (a line's sources or needers) as a rank -> place index, made once per line: a set to test."""
        index = self._at.get(id(ranks))
        if index is None:
            index = self._at[id(ranks)] = {member: i for i, member in enumerate(ranks)}
        return index

    @cached_property
    def index(self) -> dict[tuple[int, Box], int]:
        """Where each tile (by tensor and box) lies in the run."""
        return {(tile.position, tile.box): j for j, tile in enumerate(self.tiles)}


__all__ = ["Line", "Piece", "Routes", "Run", "Tile", "TileRun", "WorkLine", "line_cuts", "relay"]
