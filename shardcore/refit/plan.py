"""A refit plan: which rank sends which global box of every tensor to which rank, from two placements.

A *placement* (``placement.py``) says what one side of a refit holds: each tensor's slices (dense
global boxes with the ranks holding them) and each rank's tensors. The unit of planning is a
*tile*: for one tensor and one destination, the overlap of a source slice with a destination
slice. Its holders H are the source slice's ranks, its needers D the destination slice's ranks.
Every piece's source is a pure function of the tile and the other tiles of its route (below):

1. a needer that is also a holder copies the tile locally (collocated ranks send nothing);
2. with ``ranks_per_node``, the needers on a node that has holders are served by those holders;
3. the rest form a *work line*. Every tile with the same holders and needers (the same *route*: most
   tensors of a layout share a few) is served by one line: each needer's copy of all those tiles
   laid end to end (tensor by tensor, in rows of dim 0), cut into at most |H| equal segments,
   segment k sent by holder ``(k + seed) % |H|``; ``seed`` (from the route's first tile) rotates
   which holders take the longer segments of small routes.

So every holder of a route sends an equal share of all its bytes, a needer's copy spans a few
consecutive segments (it hears from about |H| / needers holders of each route, not from all), and a
tile is cut only where a segment ends inside it: most travel whole, from one replica.

**The floor on piece size** (``min_piece_bytes``, default 1 MiB; 0 turns it off): cuts fall on whole
rows, and a cut nearer than a floor to the edge of a tile's copy (or to the cut before it in the same
copy) moves onto that edge (or that cut). So no piece is smaller than the floor unless the tile itself
is. A cut on a tile's edge costs no piece, so a line of small tiles is still cut evenly: each cut
moves by at most a floor and a row, each segment stays within two of them of its even share.

**Fan-out** (``fan_out=True``, with ``ranks_per_node``): the needers of a tile are those of every
destination slice with the same box (replicas of one destination shard, and ranks of other
destination shards sliced alike). On a node that holds no source of the tile, one needer is the
*relay* (rotated by the seed): only the relays join the work line, so the tile crosses the slow
link once per node, and each relay forwards the whole tile to the node's other needers in a
second hop (``Transfer.hop == 1``: from the relay's destination tensor, after its first-hop
receives). Sender, relay and forwardee still derive the same pieces from the tile's route.

Every rank that evaluates a tile derives the same pieces: a route's line is a pure function of the
route's tiles, and a rank that sends or receives on a route evaluates all of them (it holds every
slice of the route on its side). ``RefitPlan.for_rank(r)`` evaluates only the tiles of the slices r
holds (as a destination: its slices against the source's; as a source: its slices against each
destination's): its cost is its own tiles and their replica sets, never the whole
schedule. ``plan_refit`` plans between shards (``ShardPlacement``, by index math);
``plan_refit_from`` between any placements (``ExplicitPlacement``, ``Placement.restrict``);
``plan.subset(...)`` keeps some tensors only (a partial refit).
"""

from __future__ import annotations

import fnmatch
import hashlib
import warnings
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import accumulate, pairwise, repeat
from operator import add, attrgetter, itemgetter, sub
from typing import Any, NamedTuple, Self, cast

from ..errors import LayoutError, ManifestError, RefitError
from ..plan.arguments import shown
from ..plan.layout import Layout, ShardPlan
from .boxes import Box, from_fields, moved, overlap
from .collector import gc_paused
from .manifest import Manifest, TensorSpec, scale_shape
from .part import KindBoxes, PartBuilder, RankRefit, Received, Row, Transfer
from .placement import HolderSet, Member, Placement, ShardPlacement, Slice, destination_kind, source_kind
from .weightmap import MappedPlacement
from .worklines import Line, Piece, Routes, Run, Tile, TileRun, WorkLine, line_cuts, relay

DEFAULT_MIN_PIECE_BYTES = 1 << 20
"""The floor on piece size: below it a message costs more than the balance it buys."""


_place = attrgetter("position", "box")
"""Where a tile lies: its tensor and box (a run's order)."""


_POSITION, _KIND = itemgetter(0), itemgetter(2)
"""A member's (``placement.Member``) position and kind."""


def _named(targets: tuple[Slice, ...], name: str) -> tuple[Slice, ...]:
    """A kind's slices, which alike tensors share under no local tensor's name (``HeldAlike``), as the slices of local
    tensor ``name`` (empty: the tensor itself, as named already): what a tile and a fan-out group read."""
    return tuple([piece._replace(target=name) for piece in targets]) if name else targets


class _RouteRows(NamedTuple):
    """One tensor's rows on one route (``RefitPlan._kind_runs``), in the order of their boxes."""

    route: tuple[Any, ...]
    sources: HolderSet
    needers: HolderSet
    shard: int
    seed: int  # the first row's seed, less its tensor's position
    sizes: list[int]
    steps: list[int]


@dataclass(frozen=True)
class RefitPlan:
    """A refit from one placement to one or more others; evaluated lazily.

    Build it with ``plan_refit`` (between shards) or ``plan_refit_from`` (between any placements).
    ``for_rank`` computes one rank's part alone; ``transfers`` enumerates the whole schedule;
    ``RefitStats.of(plan)`` (``cost.py``) adds up what it costs.

    Attributes:
        source_placement: What the source side holds.
        destination_placements: What each destination must hold; no rank is in two.
        world_size: Ranks of the world the plan runs in (every placement's ranks lie in it).
        ranks_per_node: Ranks per node (node = rank // K), or None: same-node sources come first.
        min_piece_bytes: The floor on piece size (0: none): see the module doc.
        fan_out: Relay each tile once into every node that holds no source of it (needs ranks_per_node).
        tensors: Positions of the tensors this plan moves (``subset``); None: every tensor.
    """

    source_placement: Placement
    destination_placements: tuple[Placement, ...]
    world_size: int
    ranks_per_node: int | None = None
    min_piece_bytes: int = DEFAULT_MIN_PIECE_BYTES
    fan_out: bool = False
    tensors: frozenset[int] | None = None
    _routes: dict[tuple[Any, ...], Routes] = field(default_factory=dict, init=False, repr=False, compare=False)
    _runs: dict[tuple[Any, ...], TileRun] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Each route's run of tiles, cut once every tile of the route has been seen (``_cut_runs``)."""
    _last_rank: dict[int, RankRefit] = field(default_factory=dict, init=False, repr=False, compare=False)
    """The rank part ``for_rank`` computed last: a rank asks for its own part to allocate its tensors, then
    ``execute_refit`` asks again, and an RL loop refits with the same plan every step."""
    _fingerprint: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    """``fingerprint()``, made once: it digests the whole manifest, and every refit asks for it."""

    @property
    def manifest(self) -> Manifest:
        """The model every placement of the plan describes."""
        return self.source_placement.manifest

    def destination_placement_of(self, rank: int) -> Placement | None:
        """The destination placement rank ``rank`` is in (no rank is in two), or None for a rank that receives
        nothing: what the executor, the checks and a plugin ask of a rank to find its local tensors and what it
        lands, zeroes or is checked against.

        Args:
            rank: A rank of the plan's world.
        """
        return next((placement for placement in self.destination_placements if rank in placement.ranks), None)

    def destination_tensor(self, name: str) -> TensorSpec:
        """The tensor a destination rank holds locally as ``name``: the manifest's, or through a weight map an
        engine's (its names, shapes and dtypes), for the executor's checks of the tensors it is given.

        Raises:
            ManifestError: no destination holds a tensor of that name.
        """
        for placement in self.destination_placements:
            local = placement.local_tensors()
            if local is not self.manifest and _position(local, name) is not None:
                return local.tensor(name)
        return self.manifest.tensor(name)

    # -- tiles -------------------------------------------------------------------------------

    def _tile(self, position: int, shard: int, source: Slice, target: Slice, group: tuple[Any, ...] = ()) -> Tile:
        """The tile where ``source`` and ``target`` (two slices that meet) overlap; with fan-out, ``group`` is
        the target's fan-out group (``_groups``), whose first member seeds the tile."""
        if source.box == target.box:  # the common case: the same split on both sides
            box, src_offset, dst_offset = source.box, source.offset, target.offset
        else:
            box = overlap(source.box, target.box)
            src_offset = moved(source.offset, source.box, box)
            dst_offset = moved(target.offset, target.box, box)
        row_bytes = self.manifest.tensors[position].wire_itemsize
        for start, stop in box[1:]:
            row_bytes *= stop - start
        first, seeding = group[0] if group else (shard, target)
        seed = position + first * 7919 + (seeding.block + 1) * 31 + seeding.part * 131 + source.part * 1031
        rows = box[0][1] - box[0][0]
        return Tile(
            position,
            shard,
            box,
            src_offset,
            dst_offset,
            source.holders,
            target.holders,
            seed,
            rows,
            row_bytes,
            group,
            target.target,
        )

    def _groups(self, position: int, shard: int, targets: Sequence[Slice]) -> list[tuple[tuple[int, Slice], ...]]:
        """Each target's fan-out group: with fan-out, every destination slice with its box, by destination (the
        target itself among them, as the object given: ``_alike`` keys on it); without, nothing. One destination may
        hold a box in two slices (an engine's kv head replicated over two tp ranks): both are members."""
        if not self.fan_out:
            return [()] * len(targets)
        return [
            tuple(
                (index, target if index == shard and piece == target else piece)
                for index, placement in enumerate(self.destination_placements)
                for piece in placement.overlapping(position, target.box)
                if piece.box == target.box and piece.target == target.target
            )
            for target in targets
        ]

    def _tiles_into(
        self,
        position: int,
        shard: int,
        targets: Sequence[Slice],
        sources: Sequence[Slice],
        groups: Sequence[tuple[tuple[int, Slice], ...]],
    ) -> list[tuple[int, int, Tile]]:
        """Every tile into ``targets`` (destination ``shard``'s slices of tensor ``position``, each with its fan-out
        group in ``groups``): where the source's slices (``sources``, all of them) meet them; each with the numbers
        of its two slices."""
        at = {source.box: i for i, source in enumerate(sources)}  # one side's slices of a tensor: boxes apart
        return [
            (j, at[source.box], self._tile(position, shard, source, target, group))
            for j, (target, group) in enumerate(zip(targets, groups))
            for source in self.source_placement.overlapping(position, target.box)
        ]

    def _tiles_from(
        self,
        position: int,
        shard: int,
        source: Slice,
        targets: Sequence[Slice],
        groups: Sequence[tuple[tuple[int, Slice], ...]],
    ) -> list[tuple[int, int, Tile]]:
        """Every tile of source slice ``source`` toward ``targets`` (destination ``shard``'s slices of the tensor that
        meet it, each with its fan-out group in ``groups``), each with the numbers of its two slices."""
        return [
            (j, 0, self._tile(position, shard, source, target, group))
            for j, (target, group) in enumerate(zip(targets, groups))
        ]

    def _positions(self) -> Iterable[int]:
        """The tensors this plan moves, by position."""
        every = range(len(self.manifest))
        return every if self.tensors is None else (p for p in every if p in self.tensors)

    def _all_tiles(self) -> Iterator[Tile]:
        """Every tile, in the global order: destination, tensor, destination slice, source slice."""
        held = [(position, self.source_placement.slices(position)) for position in self._positions()]
        for shard, placement in enumerate(self.destination_placements):
            found: dict[tuple[int, ...], Any] = {}
            for position, sources in held:
                for _, tile in self._tiles_alike(found, position, shard, placement.slices(position), sources):
                    yield tile

    def _tiles_alike(
        self,
        found: dict[tuple[Any, ...], Any],
        position: int,
        shard: int,
        targets: Sequence[Slice],
        sources: Sequence[Slice],
    ) -> list[tuple[int, Tile]]:
        """The tiles into ``targets`` (slices of tensor ``position`` in destination ``shard``; ``sources`` are
        the tensor's source slices), each with the number of its source slice. A tensor whose slices have the boxes
        of an earlier one's (a shard placement's, for the same weight of every layer; an engine's, for every expert
        of a layer) has that tensor's tiles, moved to it (``_alike``); so most tiles are not found again. With
        fan-out each target's group (``_groups``) is found first: the tiles are made with it."""
        groups = self._groups(position, shard, targets)
        return self._alike(
            found,
            (shard, -1),
            targets,
            sources,
            groups,
            position,
            lambda: self._tiles_into(position, shard, targets, sources, groups),
        )

    def _tiles_out(self, found: dict[tuple[Any, ...], Any], position: int, shard: int, source: Slice) -> list[Tile]:
        """The tiles of source slice ``source`` toward destination ``shard`` (``_tiles_from``), found once per
        distinct (source slice, destination's slices) as ``_tiles_alike`` finds them. The destination's slices are
        only those meeting ``source``: a rank's sends cost its own tiles, not every slice of an engine's image. With
        fan-out the tiles' groups are made of the destinations' slices with those slices' boxes."""
        targets = tuple(self.destination_placements[shard].overlapping(position, source.box))
        groups = self._groups(position, shard, targets)
        made = self._alike(
            found,
            (shard, -2),
            targets,
            (source,),
            groups,
            position,
            lambda: self._tiles_from(position, shard, source, targets, groups),
        )
        return [tile for _, tile in made]

    def _alike(
        self,
        found: dict[tuple[Any, ...], Any],
        key: tuple[Any, ...],
        targets: Sequence[Slice],
        sources: Sequence[Slice],
        groups: Sequence[tuple[tuple[int, Slice], ...]],
        position: int,
        make: Callable[[], list[tuple[int, int, Tile]]],
    ) -> list[tuple[int, Tile]]:
        """``make()``'s tiles for tensor ``position`` (each with the numbers of its slices in ``targets`` and
        ``sources``), or those found before for another tensor whose slices have the same boxes, moved to it; each
        with the number of its source slice.

        A tile depends on its two slices' boxes, the source's offset, and the numbers that seed it (``_tile``):
        those make the key. The destination's offset, both holder sets and the local tensor's name are read off
        the slices of the tensor at hand, so slices alike in shape share tiles (a MoE layer's experts do, each
        at another slot of an engine's stacked tensor). With fan-out a tile's group (``groups``, each target's) is
        read off the tensor at hand too, and its first member seeds the tile in the target's place: the key holds
        each group's first destination, block and part (every layer's weight has the same, so its tiles are found
        once, where keying by the slices' identity found them tensor by tensor)."""
        key = (key, destination_kind(targets), source_kind(sources))
        if self.fan_out:  # what of a group seeds its tiles (``_tile``): its first member's destination and slice
            key = (*key, tuple([(group[0][0], group[0][1].block, group[0][1].part) for group in groups]))
        itemsize = self.manifest.tensors[position].wire_itemsize
        known = found.get(key)
        if known is None:
            made = make()
            kept = [
                (
                    j,
                    i,
                    tile.shard,
                    tile.box,
                    tile.src_offset,
                    tile.seed - tile.position,
                    tile.rows,
                    tile.row_bytes // itemsize,
                )
                for j, i, tile in made
            ]
            found[key] = kept
            return [(i, tile) for _, i, tile in made]
        # another tensor's tiles, moved here: the same boxes; the seed (which starts from the position, ``_tile``),
        # the bytes of a row, the destination's offset, the holders and the local tensor are this tensor's
        return [
            (
                i,
                from_fields(
                    Tile,
                    (
                        position,
                        shard,
                        box,
                        src_offset,
                        target.offset if target.box == box else moved(target.offset, target.box, box),
                        sources[i].holders,
                        target.holders,
                        seed + position,
                        rows,
                        per_row * itemsize,
                        group,
                        target.target,
                    ),
                ),
            )
            for j, i, shard, box, src_offset, seed, rows, per_row in known
            for target, group in ((targets[j], groups[j]),)
        ]

    # -- pieces ------------------------------------------------------------------------------

    @staticmethod
    def _route_key(tile: Tile) -> tuple[Any, ...]:
        """What names a tile's route: its holders and its needers (with fan-out, its whole group's)."""
        if tile.group:
            return (tile.sources.key, -1, tuple((shard, piece.holders.key) for shard, piece in tile.group))
        return (tile.sources.key, tile.shard, tile.needers.key)

    def _routes_of(self, tile: Tile) -> Routes:
        """Local copies and work lines of a tile's (holders, needers) pair: with ``ranks_per_node``, needers
        on a node that has holders form a line served by those holders; the rest one line over all holders.
        With fan-out the needers are the whole group's, and a node without holders sends one relay to that line."""
        key = self._route_key(tile)
        found = self._routes.get(key)
        if found is not None:
            return found
        if tile.group:
            return self._routes_for(
                key, tile.sources, sorted(r for _, piece in tile.group for r in piece.holders.ranks)
            )
        return self._routes_for(key, tile.sources, tile.needers.ranks)

    def _routes_for(self, key: tuple[Any, ...], sources: HolderSet, needers: Sequence[int]) -> Routes:
        """``_routes_of``'s routes of route ``key``: its holders ``sources`` and its needers, made once per route."""
        found = self._routes.get(key)
        if found is not None:
            return found
        members = sources.members
        local = tuple(d for d in needers if d in members)
        remote = tuple(d for d in needers if d not in members)
        lines: list[Line] = []
        far_nodes: tuple[tuple[int, ...], ...] = ()
        per_node = self.ranks_per_node
        if per_node is None:
            lines.append((remote, sources.ranks, 0))
        else:
            near: dict[int, list[int]] = {}
            for s in sources.ranks:
                near.setdefault(s // per_node, []).append(s)
            by_node: dict[int, list[int]] = {}
            far: dict[int, list[int]] = {}
            for d in remote:
                (by_node if d // per_node in near else far).setdefault(d // per_node, []).append(d)
            lines += [(tuple(group), tuple(near[node]), node) for node, group in by_node.items()]
            if self.fan_out:  # the far line's needers are the relays, one per node, chosen per tile
                far_nodes = tuple(tuple(group) for group in far.values())
            else:
                lines.append((tuple(d for group in far.values() for d in group), sources.ranks, 0))
        found = self._routes[key] = Routes(local, tuple(line for line in lines if line[0]), far_nodes)
        return found

    def _cut_runs(self, tiles: Iterable[Tile], keys: Iterable[tuple[Any, ...]] | None = None) -> list[TileRun]:
        """The runs of the routes of ``tiles``, in the order they first appear; a route not cut yet is cut from
        its tiles among ``tiles``, which must be all of them (a rank's own tiles hold every tile of its routes).
        ``keys``: the tiles' route keys (``_route_key``), when the caller has them."""
        found: dict[tuple[Any, ...], list[Tile]] = {}
        tiles = list(tiles)
        for tile, key in zip(tiles, keys if keys is not None else map(self._route_key, tiles)):
            found.setdefault(key, []).append(tile)
        for key, pending in found.items():
            if key not in self._runs:
                # a box's tile once: a rank that both sends and receives on a route finds each of its tiles twice,
                # and with fan-out a box has a tile per destination of its group
                pending.sort(key=_place)  # stable: a box's first tile stays first
                kept = pending[:1]
                kept += [
                    tile
                    for before, tile in pairwise(pending)
                    if tile.box != before.box or tile.position != before.position
                ]
                self._runs[key] = self._run(kept)
        return [self._runs[key] for key in found]

    def _run(self, tiles: Sequence[Tile]) -> TileRun:
        """One route's run of ``tiles`` (in order) and its lines, cut (``line_cuts``)."""
        first, scales = tiles[0], self.manifest.scale_positions
        routes = self._routes_of(first)
        steps = [tile.row_bytes for tile in tiles]
        starts = [0, *accumulate([tile.rows * step for tile, step in zip(tiles, steps)])]
        scaled = (
            sum(starts[j + 1] - starts[j] for j, tile in enumerate(tiles) if tile.position in scales) if scales else 0
        )
        lines = self._lines(routes, starts, steps, first.seed, first.sources.ranks)
        return TileRun(routes, tuple(starts), lines, first.sources, first.shard, first.group, scaled, tuple(tiles))

    def _lines(
        self, routes: Routes, starts: Sequence[int], steps: Sequence[int], seed: int, holders: tuple[int, ...]
    ) -> tuple[WorkLine, ...]:
        """A route's work lines over its run: tile j takes bytes [starts[j], starts[j + 1]) of each copy and may be
        cut every ``steps[j]``; ``seed`` is the run's first tile's, ``holders`` the route's (``line_cuts``)."""
        floor = self.min_piece_bytes
        lines = [
            WorkLine(
                needers,
                len(needers),
                sources,
                seed + offset,
                line_cuts(starts, steps, len(needers), len(sources), floor),
            )
            for needers, sources, offset in routes.lines
        ]
        if routes.far:
            nodes = len(routes.far)
            lines.append(WorkLine((), nodes, holders, seed, line_cuts(starts, steps, nodes, len(holders), floor)))
        return tuple(lines)

    def _kind_runs(self) -> list[Run]:
        """Every route's run, without fan-out, made without the tiles: a tensor's tiles are found once per kind of
        slices on both sides (``Placement.kind_of``), split by route once per kind and holders, and each tensor adds
        its rows' sizes to its routes'. The runs are ``_cut_runs``' of every tile (``_all_tiles``), in the same
        order: a route's tensors come in the order of their positions, a tensor's rows in the order of their boxes."""
        parts: dict[tuple[Any, ...], list[tuple[int, _RouteRows]]] = {}
        tensors, scales = self.manifest.tensors, self.manifest.scale_positions
        held = [(position, self.source_placement.slices(position)) for position in self._positions()]
        for shard, placement in enumerate(self.destination_placements):
            rows_of: dict[tuple[Any, ...], list[tuple[int, int, Tile]]] = {}
            split_of: dict[tuple[Any, ...], list[_RouteRows]] = {}
            for position, sources in held:
                kind, needers = placement.kind_of(position)
                key = (kind, source_kind(sources))
                made = rows_of.get(key)
                if made is None:
                    targets = placement.slices(position)
                    made = rows_of[key] = self._tiles_into(position, shard, targets, sources, [()] * len(targets))
                itemsize = tensors[position].wire_itemsize
                alike = (id(made), tuple([h.key for h in needers]), tuple([s.holders.key for s in sources]), itemsize)
                split = split_of.get(alike)
                if split is None:
                    split = split_of[alike] = self._route_rows(shard, made, sources, needers, itemsize)
                for rows in split:
                    found = parts.get(rows.route)
                    if found is None:
                        parts[rows.route] = [(position, rows)]
                    else:
                        found.append((position, rows))
        runs = []
        for route, found in parts.items():
            position, first = found[0]
            sizes = [size for _, rows in found for size in rows.sizes]
            steps = [step for _, rows in found for step in rows.steps]
            starts = [0, *accumulate(sizes)]
            scaled = sum(sum(rows.sizes) for at, rows in found if at in scales)
            routes = self._routes_for(route, first.sources, first.needers.ranks)
            lines = self._lines(routes, starts, steps, position + first.seed, first.sources.ranks)
            runs.append(Run(routes, tuple(starts), lines, first.sources, first.shard, (), scaled))
        return runs

    def _route_rows(
        self,
        shard: int,
        made: list[tuple[int, int, Tile]],
        sources: Sequence[Slice],
        needers: Sequence[HolderSet],
        itemsize: int,
    ) -> list[_RouteRows]:
        """The tiles ``made`` for a tensor of one kind (``_kind_runs``), as the rows of another tensor of the kind on
        each of its routes (with its holders ``sources`` and ``needers`` and its ``itemsize``): per route, the rows'
        sizes and steps in the order of their boxes, each box once (as ``_cut_runs`` keeps them), and the first row's
        seed less its tensor's position."""
        by_route: dict[tuple[Any, ...], list[tuple[Box, int, int, int, int, int]]] = {}
        kind_itemsize = self.manifest.tensors[made[0][2].position].wire_itemsize if made else itemsize
        for j, i, tile in made:
            row_bytes = tile.row_bytes // kind_itemsize * itemsize
            route = (sources[i].holders.key, shard, needers[j].key)
            row = (tile.box, j, i, tile.seed - tile.position, tile.rows * row_bytes, row_bytes)
            by_route.setdefault(route, []).append(row)
        found = []
        for route, rows in by_route.items():
            rows.sort(key=itemgetter(0))  # stable: a box's first tile stays first
            kept = rows[:1] + [row for before, row in pairwise(rows) if row[0] != before[0]]
            _, j, i, seed, _, _ = kept[0]
            sizes, steps = [row[4] for row in kept], [row[5] for row in kept]
            found.append(_RouteRows(route, sources[i].holders, needers[j], shard, seed, sizes, steps))
        return found

    def _spread(self, tile: Tile, run: TileRun, line: WorkLine, needers: Sequence[int], dst: int | None) -> list[Piece]:
        """The tile's pieces on one work line: each of its copies (one per needer) cut where the line's segments end.

        With ``dst`` given, only the pieces that rank receives are cut: one rank's cost is its own pieces.
        """
        j = run.index[tile.position, tile.box]
        first, width, row_bytes = run.starts[j], run.starts[-1], tile.row_bytes
        size = tile.rows * row_bytes
        cuts = line.cuts
        copies: Iterable[int] = range(len(needers))
        if dst is not None:
            copies = (run.at(needers, dst) if needers is line.needers else needers.index(dst),)
        pieces: list[Piece] = []
        for i in copies:
            start = i * width + first
            end = start + size
            for k in range(bisect_right(cuts, start) - 1, bisect_left(cuts, end)):
                low, high = max(start, cuts[k]), min(end, cuts[k + 1])
                if low < high:
                    first_row = (low - start) // row_bytes
                    pieces.append((line.sender(k), needers[i], first_row, (high - start) // row_bytes, 0))
        return pieces

    @staticmethod
    def _sends(run: TileRun, rank: int) -> Iterator[tuple[Tile, Piece]]:
        """What ``rank`` sends on ``run`` from its source tensors (hop 0), with the tile of each piece: on each line
        it serves, its one segment, walked copy by copy and tile by tile (its cost is its own pieces, not the
        route's tiles). With fan-out, a copy of the relays' line goes to each tile's relay on its node."""
        starts, tiles, width = run.starts, run.tiles, run.starts[-1]
        for n, line in enumerate(run.lines):
            sources = line.sources
            if rank not in run.members(sources):
                continue
            k = line.segment(run.at(sources, rank))
            if k >= len(line.cuts) - 1:
                continue
            at, high = line.cuts[k], line.cuts[k + 1]
            far = run.routes.far if n == len(run.routes.lines) else None
            while at < high:
                copy, inside = divmod(at, width)
                j = bisect_right(starts, inside) - 1
                tile, edge = tiles[j], copy * width + starts[j]
                end = min(high, edge + starts[j + 1] - starts[j])
                dst = line.needers[copy] if far is None else relay(far[copy], tile.seed)
                yield tile, (rank, dst, (at - edge) // tile.row_bytes, (end - edge) // tile.row_bytes, 0)
                at = end

    def _pieces(self, tile: Tile, dst: int | None = None) -> list[Piece]:
        """Who sends which rows of the tile to the tile's needers: a pure function of the tile's route's tiles
        (its run, cut by ``_cut_runs`` first).

        ``dst`` restricts the answer to the pieces that rank receives (its local copy included), computing only
        those (what a rank sends: ``_sends``).
        """
        if dst is not None and dst in tile.sources.members:
            return [(dst, dst, 0, tile.rows, 0)]
        run = self._runs[self._route_key(tile)]
        routes, rows = run.routes, tile.rows
        pieces: list[Piece] = [] if dst is not None else [(d, d, 0, rows, 0) for d in routes.local]
        for line in run.lines[: len(routes.lines)]:
            if dst is None or dst in run.members(line.needers):
                pieces += self._spread(tile, run, line, line.needers, dst)
        if routes.far:  # fan-out: the relays' line, then each relay's forwards
            relays = [relay(group, tile.seed) for group in routes.far]
            if dst is None or dst in relays:
                pieces += self._spread(tile, run, run.lines[-1], relays, dst)
            pieces += [
                (relay, d, 0, rows, 1)
                for relay, group in zip(relays, routes.far)
                for d in group
                if d != relay and (dst is None or d == dst)
            ]
        if tile.group:
            own = tile.needers.members
            pieces = [piece for piece in pieces if piece[1] in own]
        return pieces

    def _forwards(self, tile: Tile, rank: int) -> list[Piece]:
        """With fan-out: the whole tile that ``rank``, when it is a relay, forwards to the other needers of its node
        (any destination)."""
        if not tile.group:
            return []
        for group in self._routes_of(tile).far:
            if len(group) > 1 and relay(group, tile.seed) == rank:
                return [(rank, d, 0, tile.rows, 1) for d in group if d != rank]
        return []

    def _offset_in(self, tile: Tile, rank: int) -> tuple[int, ...]:
        """Where the tile starts in destination rank ``rank``'s local tensor (``rank`` needs it: in its group)."""
        if rank in tile.needers.members or not tile.group:
            return tile.dst_offset
        target = next(target for _, target in tile.group if rank in target.holders.members)
        return moved(target.offset, target.box, tile.box)

    def _transfers(self, tile: Tile, pieces: Sequence[Piece]) -> Iterator[Transfer]:
        name = self.manifest.tensors[tile.position].name
        (first, _), rest = tile.box[0], tile.box[1:]
        row_bytes = tile.row_bytes
        for src, dst, lo, hi, hop in pieces:
            origin = self._offset_in(tile, src) if hop else tile.src_offset
            target = tile.dst_offset if dst in tile.needers.members else self._offset_in(tile, dst)
            if lo == 0 and hi == tile.rows:  # the whole tile, as most travel
                yield from_fields(
                    Transfer, (name, src, dst, tile.box, origin, target, hi * row_bytes, hop, tile.target)
                )
                continue
            box = ((first + lo, first + hi), *rest)
            yield from_fields(
                Transfer,
                (
                    name,
                    src,
                    dst,
                    box,
                    moved(origin, tile.box, box),
                    moved(target, tile.box, box),
                    (hi - lo) * row_bytes,
                    hop,
                    tile.target,
                ),
            )

    # -- public ------------------------------------------------------------------------------

    def transfers(self) -> Iterator[Transfer]:
        """Every transfer of the plan (local copies included) in the global deterministic order:
        destination, tensor, destination slice, source slice, then the tile's pieces."""
        for tile, pieces in self.tiles():
            yield from self._transfers(tile, pieces)

    def tiles(self) -> Iterator[tuple[Tile, list[Piece]]]:
        """Every tile with its pieces, in the global order (for cost accounting)."""
        with gc_paused():
            every = list(self._all_tiles())
            self._cut_runs(every)
        for tile in every:
            yield tile, self._pieces(tile)

    def runs(self) -> list[Run]:
        """Every route's run, cut (for cost accounting: a run's lines give its pieces by arithmetic); with fan-out
        with its tiles (each tile's relay is its own), else made without them (``_kind_runs``)."""
        with gc_paused():
            if self.fan_out:
                return list(self._cut_runs(self._all_tiles()))
            return self._kind_runs()

    @property
    def scale_positions(self) -> frozenset[int]:
        """Deprecated, goes in the next release: the manifest's (``Manifest.scale_positions``)."""
        warnings.warn(
            "RefitPlan.scale_positions is deprecated and goes in the next release: use plan.manifest.scale_positions",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.manifest.scale_positions

    def fingerprint(self) -> dict[str, str]:
        """What every rank executing this plan must agree on, part by part, as short readable texts:
        equal plans give equal parts (the executor compares them before a byte moves)."""
        if not self._fingerprint:
            with gc_paused():  # the manifest's and the maps' digests make a text per tensor, and nothing lasts
                self._fingerprint.update(self._fingerprint_parts())
        return dict(self._fingerprint)

    def _fingerprint_parts(self) -> dict[str, str]:
        manifest = self.manifest
        return {
            "layout": self._world(),
            "source": self.source_placement.describe(),
            "destinations": " + ".join(placement.describe() for placement in self.destination_placements),
            "manifest": f"{manifest.name}: {len(manifest)} tensors, {manifest.nbytes} B, digest {manifest.digest()}"
            + self._subset_text(),
            "options": f"ranks_per_node={self.ranks_per_node}, min_piece_bytes={self.min_piece_bytes}"
            + (", fan_out=True" if self.fan_out else ""),
        }

    def _subset_text(self) -> str:
        """The subset in the fingerprint: its size and a digest of its tensors' names (empty for every tensor)."""
        if self.tensors is None:
            return ""
        names = "\n".join(self.manifest.tensors[p].name for p in sorted(self.tensors))
        return f"; a subset of {len(self.tensors)} tensors, digest {hashlib.sha256(names.encode()).hexdigest()[:16]}"

    def subset(self, selection: str | Iterable[str] | Callable[[TensorSpec], bool]) -> Self:
        """This plan for some of its tensors only (a partial refit): LoRA adapters, the tensors that changed,
        some experts. The result is a plan like any other (``for_rank``, ``transfers``, ``RefitStats``); its
        fingerprint names the subset, so ranks that execute different subsets are stopped before a byte moves.

        Args:
            selection: Tensor names (or one name), or a predicate on each ``TensorSpec`` of this plan,
                e.g. ``lambda t: t.expert in (0, 1)``.

        Returns:
            A plan of the same kind over the selected tensors (each tensor a rank holds outside them is
            absent from its ``source_shapes`` and ``destination_shapes``: it is neither read nor written).

        Raises:
            RefitError: a selection that is neither names nor a predicate, a name outside this plan's
                tensors, or a selection of no tensor.
        """
        manifest = self.manifest
        kept = set(self._positions())
        if callable(selection):
            chosen = {p for p in kept if selection(manifest.tensors[p])}
        else:
            names = [selection] if isinstance(selection, str) else selection
            if not isinstance(names, Iterable) or isinstance(names, (bytes, Mapping)):
                raise RefitError(f"subset({shown(selection)}): expected tensor names or a predicate on a TensorSpec")
            chosen = set()
            for name in names:
                position = _position(manifest, name)
                if position is None or position not in kept:
                    where = "the manifest" if position is None else "this plan's tensors"
                    raise RefitError(
                        f"subset: tensor {shown(name)} is not in {where}: name tensors of {manifest.name!r} "
                        f"(shardcore.refit.tensors_matching finds them by pattern)"
                    )
                chosen.add(position)
        if not chosen:
            dense = "" if any(manifest.tensors[p].expert is not None for p in kept) else ", none an expert's"
            raise RefitError(
                f"subset({shown(selection)}) selects none of the {len(kept)} tensors of {manifest.name!r}{dense}: "
                "select at least one (shardcore.refit.tensors_matching finds them by pattern)"
            )
        partners = _scale_partners(manifest, kept, chosen) | self._landing_partners(chosen)
        return replace(self, tensors=frozenset(chosen | partners))

    def _landing_partners(self, chosen: set[int]) -> set[int]:
        """Every source tensor that feeds a destination tensor quantized on landing that a chosen one feeds: such a
        tensor is quantized whole, once all of it has landed, so its sources are refitted together."""
        found: set[int] = set()
        for placement in self.destination_placements:
            if not isinstance(placement, MappedPlacement) or placement.landing is None:
                continue
            weights, landing = placement.weights, placement.landing
            for position in chosen:
                for target in weights.fed_by(self.manifest.tensors[position].name):
                    if landing.tensor(target).scale is not None:
                        found.update(weights.feeds(target))
        return found

    def _world(self) -> str:
        return f"a world of {self.world_size} ranks"

    def for_rank(self, rank: int) -> RankRefit:
        """Rank ``rank``'s sends, receives, local copies and local shapes, computed from its own tiles only
        (the last rank's part is kept, so asking again for it costs nothing; treat it as read-only).

        Raises:
            LayoutError: the rank is outside the world.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {shown(rank)} is outside the world [0, {self.world_size})")
        if rank not in self._last_rank:
            with gc_paused():
                mine = self._rank_part(rank)
            self._last_rank.clear()
            self._last_rank[rank] = mine
        return self._last_rank[rank]

    def _rank_part(self, rank: int) -> RankRefit:
        tensors = self.manifest.tensors
        receiving: list[Tile] = []  # the tiles the rank receives (or copies) on
        sending: list[Tile] = []  # and those it sends from its source slices
        destination_shapes: dict[str, tuple[int, ...]] = {}
        destination_dtypes: dict[str, str] = {}
        chosen = self.tensors
        found: dict[tuple[int, ...], Any] = {}  # tiles of tensors with the same slices (``_alike``): received,
        sent: dict[tuple[int, ...], Any] = {}  # and sent
        part = PartBuilder(self.world_size, tensors)
        direct = _Direct(self, rank, part)
        source_slices = self.source_placement.slices
        for shard, placement in enumerate(self.destination_placements):
            landing = placement.landing if isinstance(placement, MappedPlacement) else None
            local = placement.local_tensors()
            for local_tensor in placement.held_alike(rank):
                members = local_tensor.members
                if chosen is not None:
                    members = [member for member in members if member[0] in chosen]
                    if not members:
                        continue
                name = local_tensor.name or tensors[members[0][0]].name
                if name not in destination_shapes:  # without a kind, an engine's tensor comes once per source
                    destination_shapes[name] = local_tensor.shape
                    spec = local.tensor(name) if local_tensor.name else tensors[members[0][0]]
                    destination_dtypes[name] = spec.destination_dtype
                    if landing is not None and spec.scale is not None:  # quantized on landing
                        scales = f"{name}_scale_inv"
                        destination_shapes[scales] = scale_shape(local_tensor.shape)
                        destination_dtypes[scales] = local.tensor(scales).destination_dtype
                for position, targets, kind in direct.receive(shard, local_tensor.name, members):
                    if kind is not None:
                        targets = _named(targets, local_tensor.name)
                    made = self._tiles_alike(found, position, shard, targets, source_slices(position))
                    receiving += [tile for _, tile in made]
        source_shapes: dict[str, tuple[int, ...]] = {}
        source_dtypes: dict[str, str] = {}
        shards = range(len(self.destination_placements))
        for held in self.source_placement.held(rank):
            position = held.position
            if chosen is not None and position not in chosen:
                continue
            if tensors[position].scale_of is None:  # scale tensors are derived where the weight is
                source_shapes[tensors[position].name] = held.shape
                source_dtypes[tensors[position].name] = tensors[position].dtype
            for source in held.slices:
                for shard in shards:
                    sending += self._tiles_out(sent, position, shard, source)
        keys = [self._route_key(tile) for tile in receiving]
        self._cut_runs(receiving + sending, keys + [self._route_key(tile) for tile in sending])
        whole: dict[tuple[Any, ...], tuple[int, ...]] = {}  # each run's ``_whole`` senders for this rank
        for tile, key in zip(receiving, keys):
            if tile.group:  # fan-out: the pieces of the tile's group
                senders: tuple[int, ...] = ()
            elif rank in tile.sources.members:  # held already: a local copy
                senders = (rank,)
            else:
                senders = whole.get(key, ())
                if key not in whole:
                    senders = whole[key] = self._whole(self._runs[key], rank)
            if senders:  # the tile comes whole from each sender, as most do
                for src in senders:
                    part.add(tile, src, rank)
            else:
                part.extend(
                    tile.position, self._transfers(tile, self._pieces(tile, dst=rank) + self._forwards(tile, rank))
                )
        for run in self._cut_runs(sending):
            for tile, piece in self._sends(run, rank):
                if piece[2] == 0 and piece[3] == tile.rows and not tile.group:  # the whole tile, as most are sent
                    part.add(tile, piece[0], piece[1])
                else:
                    part.extend(tile.position, self._transfers(tile, (piece,)))
        sends, recvs, copies = part.split(rank)
        return RankRefit(
            rank=rank,
            sends=sends,
            recvs=recvs,
            copies=copies,
            source_shapes=source_shapes,
            destination_shapes=destination_shapes,
            source_dtypes=source_dtypes,
            destination_dtypes=destination_dtypes,
        )

    @staticmethod
    def _whole(run: TileRun, rank: int) -> tuple[int, ...]:
        """The sender of ``rank``'s copy on each line of ``run`` it is a needer on, when no segment ends inside that
        copy: then each tile of the run comes whole from those senders (``_spread``'s pieces, found once per run).
        Empty when a copy is cut (or with fan-out's relays' line): the tile's pieces are cut one by one."""
        if run.routes.far:
            return ()
        width, senders = run.starts[-1], []
        for line in run.lines:
            if rank in run.members(line.needers):
                start = run.at(line.needers, rank) * width
                k = bisect_right(line.cuts, start) - 1
                if line.cuts[k + 1] < start + width:
                    return ()
                senders.append(line.sender(k))
        return tuple(senders)


class _Way(NamedTuple):
    """How a rank receives a tensor of a kind from its source slices (``_Direct``), found once per local tensor's
    members for the same weight of every layer (``_Ways``)."""

    number: int
    """The number of the pair (holder, rank) in the part's order (``PartBuilder.number``), when every box comes
    from one holder; -1 when not."""
    src: int
    """That holder (-1: none)."""
    holders: tuple[int, ...] | None
    """Each source slice's one holder; None when a slice has several, or the rank holds one: the plan's general
    way receives the tensor."""
    boxes: KindBoxes | None
    """The boxes received, when ``holders`` is set."""


class _Ways(NamedTuple):
    """How a rank receives each member of a local tensor (``_Direct.receive``), found once for the members' sequence
    of kinds, source slices and dtypes: the same weight of every layer has the same."""

    sources: list[Sequence[Slice]]
    alike: list[int]
    """The members' ``Manifest.alike_numbers``: their dtypes among the rest (a layer of another dtype has other
    bytes)."""
    ways: list[_Way]
    numbers: list[int] | None
    """When every member comes whole from one holder, as most do: each way's ``number``, ``src`` and its boxes' rows,
    as columns; None when not."""
    srcs: list[int]
    rows: list[tuple[Row, ...]]

    @classmethod
    def of(cls, sources: list[Sequence[Slice]], alike: list[int], ways: list[_Way]) -> _Ways:
        """The members' ways, with their columns when every member comes whole from one holder."""
        rows = [way.boxes.rows for way in ways if way.boxes is not None and way.number >= 0]
        if len(rows) < len(ways):
            return cls(sources, alike, ways, None, [], [])
        return cls(sources, alike, ways, [way.number for way in ways], [way.src for way in ways], rows)


class _Direct:
    """One rank's receives of tensors of a kind (``HeldAlike``) whose every source slice has one holder, not the
    rank: each tile then comes whole from its holder (a work line of one holder is one segment), so no run is cut
    for it, and the receives of a kind against a kind of source slices are found once and given each such tensor.

    With fan-out a tile comes whole from its holder too when the rank is its only needer on its node (no relay
    there: the tile's group has no other holder on the node). Whether it is depends on the rank's own destination
    alone when no other destination has a rank on its node, and then it is the same for every tensor of the same
    kinds; otherwise every tensor goes the plan's general way."""

    def __init__(self, plan: RefitPlan, rank: int, part: PartBuilder) -> None:
        self.plan, self.rank, self.part = plan, rank, part
        self.node: range | None = None
        """With fan-out, the ranks of this rank's node (None: no fan-out, or no direct receive with it)."""
        if plan.fan_out and plan.ranks_per_node is not None:
            start = rank - rank % plan.ranks_per_node
            node = range(start, start + plan.ranks_per_node)
            sides = [placement.ranks for placement in plan.destination_placements]
            shared = any(r in ranks for ranks in sides if rank not in ranks for r in node)  # another destination's
            if any(rank in ranks for ranks in sides) and not shared:
                self.node = node
        self.direct = not plan.fan_out or self.node is not None
        """Whether a tensor may be received directly at all."""
        self.sources: dict[int, tuple[Sequence[Slice], int, tuple[int, ...] | None]] = {}
        """By the id of a tensor's source slices: them (kept, so no other takes the id), the number of their kind
        (``source_kind``, numbered in ``kinds``), and each slice's one holder (None when a slice has more)."""
        self.kinds: dict[tuple[Any, ...], int] = {}
        self.rows: dict[tuple[Any, ...], KindBoxes] = {}
        """By (destination, kind, source kind, dtypes): the boxes received (``_rows``)."""
        self.relative: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
        """By (destination, boxes of its slices, source kind, bytes of an element): the tiles of ``_rows``, each
        with its destination offset less its slice's."""
        self.layouts: dict[tuple[int, tuple[Hashable, ...]], _Ways] = {}
        """By (destination, the kinds of a local tensor's members): how each member is received."""

    def receive(self, shard: int, name: str, members: Sequence[Member]) -> list[Member]:
        """Adds to the part the receives of ``members`` (of destination ``shard``, in local tensor ``name``) whose
        kind is known and whose every source slice has one holder, not this rank; returns the others, for the plan's
        general way (a local copy or a send cuts runs). A tensor's boxes from one holder, as most are, are one
        ``Received``. How each member is received (``_Way``) is found once per sequence of kinds, source slices and
        dtypes (``_Ways``): the same weight of every layer has the same, so each other one costs a few passes in C
        over its members and a ``Received`` each."""
        if not self.direct:
            return list(members)
        kinds = tuple(map(_KIND, members))
        if None in kinds:
            return self._receive_alone(shard, name, members)
        manifest = self.plan.manifest
        positions = list(map(_POSITION, members))
        sources = self.plan.source_placement.slices_each(positions)
        alike = list(map(manifest.alike_numbers.__getitem__, positions))
        key = (shard, kinds)
        known = self.layouts.get(key)
        if known is None or known.sources != sources or known.alike != alike:
            ways = [
                self._way(shard, name, position, targets, kind, slices)
                for (position, targets, kind), slices in zip(members, sources)
            ]
            known = self.layouts[key] = _Ways.of(sources, alike, ways)
        if known.numbers is None:
            return self._receive_ways(name, members, known.ways)
        self.part.received_pairs += map(add, known.numbers, positions)
        self.part.received += map(
            from_fields,
            repeat(Received),
            zip(map(manifest.ordered_names.__getitem__, positions), known.srcs, known.rows, repeat(name)),
        )
        return []

    def _receive_alone(self, shard: int, name: str, members: Sequence[Member]) -> list[Member]:
        """``receive`` for members of which some are of no kind (left to the general way): each found alone."""
        slices_of = self.plan.source_placement.slices
        ways = [
            None if kind is None else self._way(shard, name, position, targets, kind, slices_of(position))
            for position, targets, kind in members
        ]
        return self._receive_ways(name, members, ways)

    def _receive_ways(self, name: str, members: Sequence[Member], ways: Sequence[_Way | None]) -> list[Member]:
        """Adds to the part the receives of ``members`` as their ``ways`` say; returns those the plan's general way
        receives (of no way, or of a way without boxes)."""
        part, rank, left, names = self.part, self.rank, [], self.plan.manifest.ordered_names
        for member, way in zip(members, ways):
            if way is None or way.boxes is None:
                left.append(member)
            elif way.number >= 0:
                part.received_pairs.append(way.number + member[0])
                part.received.append(from_fields(Received, (names[member[0]], way.src, way.boxes.rows, name)))
            else:  # from several holders: a transfer per box
                part.receive_apart(rank, name, member[0], way.holders, way.boxes)  # type: ignore[arg-type]
        return left

    def _way(
        self,
        shard: int,
        name: str,
        position: int,
        targets: tuple[Slice, ...],
        kind: Hashable,
        sources: Sequence[Slice],
    ) -> _Way:
        """How ``receive`` receives tensor ``position`` (of ``kind``, with source slices ``sources``, in local tensor
        ``name``)."""
        known = self.sources.get(id(sources))
        if known is None or known[0] is not sources:
            known = self._source(sources)
        holders, rank, spec = known[2], self.rank, self.plan.manifest.tensors[position]
        if holders is None or rank in holders:
            return _Way(-1, -1, None, None)
        if self.node is not None and not self._alone(self.node, shard, name, position, targets):
            return _Way(-1, -1, None, None)
        key = (shard, kind, known[1], spec.dtype, spec.to_dtype)
        boxes = self.rows.get(key)
        if boxes is None:
            boxes = self.rows[key] = self._rows(shard, position, targets, sources)
        src = holders[boxes.slices[0]]
        if any(holders[i] != src for i in boxes.slices):
            return _Way(-1, -1, holders, boxes)
        return _Way(self.part.number(src, rank, 0), src, holders, boxes)

    def _alone(self, node: range, shard: int, name: str, position: int, targets: tuple[Slice, ...]) -> bool:
        """With fan-out: whether this rank is the only needer on its ``node`` of every tile of ``targets`` (its slices
        of tensor ``position``, in local tensor ``name``): no other holder of a slice of the same box there
        (``_groups``), so no relay forwards to it or through it."""
        rank = self.rank
        return all(
            r == rank or r not in node
            for group in self.plan._groups(position, shard, _named(targets, name))
            for _, piece in group
            for r in piece.holders.ranks
        )

    def _source(self, sources: Sequence[Slice]) -> tuple[Sequence[Slice], int, tuple[int, ...] | None]:
        """``sources``' entry in ``self.sources``, made."""
        ones = None
        if all(len(piece.holders.ranks) == 1 for piece in sources):
            ones = tuple([piece.holders.ranks[0] for piece in sources])
        number = self.kinds.setdefault(source_kind(sources), len(self.kinds))
        found = self.sources[id(sources)] = (sources, number, ones)
        return found

    def _rows(self, shard: int, position: int, targets: tuple[Slice, ...], sources: Sequence[Slice]) -> KindBoxes:
        """``receive``'s boxes of a kind: the plan's tiles of tensor ``position`` (``RefitPlan._tiles_into``), found
        once per (destination, boxes of its slices, kind of source slices, bytes of an element) with the
        destination's offsets apart: slices alike at other offsets (every expert's slot of a stacked tensor) take
        those tiles moved there. No tile's seed is read: each comes whole from its one holder."""
        spec = self.plan.manifest.tensors[position]
        key = (
            shard,
            tuple([(piece.box, len(piece.offset)) for piece in targets]),
            self.sources[id(sources)][1],
            spec.wire_itemsize,
        )
        relative = self.relative.get(key)
        if relative is None:
            relative = self.relative[key] = [
                (
                    tile.box,
                    tuple([stop - start for start, stop in tile.box]),
                    tile.src_offset,
                    j,
                    tuple(map(sub, tile.dst_offset, targets[j].offset)),
                    tile.rows * tile.row_bytes,
                    i,
                )
                for j, i, tile in self.plan._tiles_into(position, shard, targets, sources, [()] * len(targets))
            ]
        rows = sorted(
            ((box, shape, src_offset, tuple(map(add, moved_by, targets[j].offset)), nbytes), i)
            for box, shape, src_offset, j, moved_by, nbytes, i in relative
        )
        of_slice = tuple([i for _, i in rows])
        return KindBoxes(tuple([row for row, _ in rows]), of_slice, tuple(sorted(set(of_slice))))


def _scale_partners(manifest: Manifest, kept: set[int], chosen: set[int]) -> set[int]:
    """The fp8 scale tensors of the chosen weights, and the weights of the chosen scales: a weight and its
    scales are refitted together, or the destination holds bytes quantized with another scale."""
    names = {manifest.tensors[p].name for p in chosen}
    weights = {manifest.tensors[p].scale_of for p in chosen} - {None}
    return {p for p in kept if manifest.tensors[p].scale_of in names or manifest.tensors[p].name in weights}


@dataclass(frozen=True)
class ShardRefitPlan(RefitPlan):
    """A refit between shards of layouts (``plan_refit``): a RefitPlan over ``ShardPlacement``s.

    Attributes:
        layout: The layout whose world the shards live in.
        source: The source shard.
        destinations: The destination shards.
        shards: The source shard, then the destinations, where a side holds another layout than Megatron's
            (``layouts``: its placement is then not a ``ShardPlacement``); empty: read off the placements.
    """

    layout: Layout = field(kw_only=True)
    shards: tuple[ShardPlan, ...] = field(kw_only=True, default=())

    @cached_property
    def source(self) -> ShardPlan:
        return self.shards[0] if self.shards else cast(ShardPlacement, self.source_placement).plan

    @cached_property
    def destinations(self) -> tuple[ShardPlan, ...]:
        if self.shards:
            return self.shards[1:]
        return tuple(cast(ShardPlacement, placement).plan for placement in self.destination_placements)

    def _world(self) -> str:
        return self.layout.fingerprint()


def _position(manifest: Manifest, name: object) -> int | None:
    """The position of tensor ``name``, None when the manifest has no such tensor."""
    try:
        return manifest.index(name) if isinstance(name, str) else None
    except ManifestError:
        return None


def tensors_matching(manifest: Manifest, patterns: str | Iterable[str]) -> tuple[str, ...]:
    """The names of ``manifest``'s tensors that match any of the shell-style ``patterns`` (``fnmatch``: ``*``,
    ``?``, ``[...]``), in manifest order; for ``plan.subset`` and the CLI's ``--tensors``.

    Raises:
        RefitError: a pattern that is not text, or one that matches no tensor (naming it).
    """
    given = [patterns] if isinstance(patterns, str) else list(patterns)
    names = [tensor.name for tensor in manifest]
    found: set[str] = set()
    for pattern in given:
        if not isinstance(pattern, str):
            raise RefitError(f"tensor pattern {shown(pattern)}: expected text such as 'decoder.layers.*.mlp.*'")
        matched = fnmatch.filter(names, pattern)
        if not matched:
            raise RefitError(
                f"tensor pattern {shown(pattern)} matches no tensor of {manifest.name!r}: names look like "
                f"{shown(names[0])}; * matches any text"
            )
        found.update(matched)
    return tuple(name for name in names if name in found)


__all__ = ["DEFAULT_MIN_PIECE_BYTES", "RefitPlan", "ShardRefitPlan", "tensors_matching"]
