"""plan_refit: which rank sends which global box of every tensor to which rank, from the layouts alone.

The unit of planning is a *tile*: for one tensor, one destination shard and one packed block, the
overlap of a source tp slice ``v`` with a destination tp slice ``u``. Its holders H are the source
ranks with slice v (replicas over dp/cp, or expt_dp), its needers D the destination ranks with
slice u. Every piece's source is a pure function of the tile alone:

1. a needer that is also a holder copies the tile locally (collocated ranks send nothing);
2. with ``ranks_per_node``, the needers on a node that has holders are served by those holders;
3. the rest form a *work line*: their copies of the tile laid end to end (in rows of dim 0),
   cut into K equal segments, segment k sent by holder ``(k + seed) % |H|``. K is |H| unless that
   would make pieces smaller than ``min_piece_bytes``; ``seed`` (from the tile's identity)
   rotates which holders take small tiles, so whole small tensors also spread over replicas.

A piece is therefore split across replicas when that balances the load, and every rank that
evaluates a tile derives the same pieces. ``RefitPlan.for_rank(r)`` evaluates only the tiles of
the tensors r holds (as a destination: its slices; as a source: its slices' tiles in each
destination shard): its cost is its own tiles and their replica sets, never the whole schedule.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..errors import RefitError
from ..plan.layout import Layout, ShardPlan
from .manifest import Manifest, TensorSpec
from .placement import (
    Box,
    check_fits,
    expert_range,
    holders,
    local_shape_on,
    stages_of,
    tp_rank_of,
    tp_size,
    tp_slices,
)

DEFAULT_MIN_PIECE_BYTES = 1 << 20
"""Pieces are not split across replicas below this size: a message costs more than it balances."""


@dataclass(frozen=True, order=True)
class Transfer:
    """One dense box of one tensor, moved (or copied, when src == dst) from a source rank to a destination rank.

    The box lies inside one packed block, so it is one dense box in both ranks' local tensors.

    Attributes:
        tensor: The tensor's name in the manifest.
        src: Source rank (holds the box in the source layout).
        dst: Destination rank (must hold the box in the destination layout).
        box: Global [start, stop) per dim.
        src_offset: Where the box starts in the source rank's local tensor, per dim.
        dst_offset: Where the box starts in the destination rank's local tensor, per dim.
        bytes: Size of the box in bytes.
    """

    tensor: str
    src: int
    dst: int
    box: Box
    src_offset: tuple[int, ...]
    dst_offset: tuple[int, ...]
    bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Extent of the box per dim."""
        return tuple(stop - start for start, stop in self.box)

    @property
    def is_local(self) -> bool:
        """A copy inside one rank: nothing crosses the wire."""
        return self.src == self.dst

    def to_dict(self) -> dict[str, Any]:
        """JSON form: tensor, src, dst, box ([start, stop] per dim), offsets and bytes."""
        return {
            "tensor": self.tensor,
            "src": self.src,
            "dst": self.dst,
            "box": [list(pair) for pair in self.box],
            "src_offset": list(self.src_offset),
            "dst_offset": list(self.dst_offset),
            "bytes": self.bytes,
        }


@dataclass(frozen=True)
class RankRefit:
    """One rank's part of a refit plan.

    ``sends`` and ``recvs`` are sorted by (src, dst, tensor position in the manifest, box), so a
    sender's sends to a peer and that peer's receives from it come in the same order.

    Attributes:
        rank: The global rank.
        sends: Transfers with src == rank and dst != rank.
        recvs: Transfers with dst == rank and src != rank.
        copies: Transfers with src == dst == rank.
        source_shapes: Local shape of every tensor the rank holds in the source layout.
        destination_shapes: Local shape of every tensor the rank must hold in a destination layout.
    """

    rank: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    copies: tuple[Transfer, ...]
    source_shapes: dict[str, tuple[int, ...]]
    destination_shapes: dict[str, tuple[int, ...]]

    @property
    def bytes_sent(self) -> int:
        return sum(t.bytes for t in self.sends)

    @property
    def bytes_received(self) -> int:
        return sum(t.bytes for t in self.recvs)


class HolderSet(NamedTuple):
    """The ranks of one shard holding one tp slice of a tensor (cached: many tensors share one)."""

    key: tuple[Any, ...]
    ranks: tuple[int, ...]
    members: frozenset[int]


class Tile(NamedTuple):
    """The overlap of source slice v and destination slice u of one block of one tensor in one destination shard."""

    position: int  # the tensor's position in the manifest
    shard: int  # position of the destination shard in the plan's destinations
    box: Box
    src_offset: tuple[int, ...]
    dst_offset: tuple[int, ...]
    sources: HolderSet
    needers: HolderSet
    seed: int
    rows: int  # extent of the box along dim 0, the dim pieces are cut along
    row_bytes: int  # bytes of one row of the box


class Routes(NamedTuple):
    """How one (holders, needers) pair is served, shared by every tile with that pair."""

    local: tuple[int, ...]  # needers that hold the tile already
    lines: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]  # (needers, sources, seed offset) per work line


Piece = tuple[int, int, int, int]
"""(src, dst, first row, end row) of a tile, rows along dim 0 relative to the tile's box."""


def _resolve(layout: Layout, shard: int | ShardPlan, what: str) -> ShardPlan:
    if isinstance(shard, ShardPlan):
        if shard.ranks.stop > layout.world_size:
            raise RefitError(
                f"{what} shard ('{shard.spec}') has ranks [{shard.rank_offset}, {shard.ranks.stop}) outside the "
                f"world of {layout.world_size}: a shard of another layout must lie in the same world"
            )
        return shard
    if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < len(layout.shards):
        raise RefitError(f"{what} shard {shard!r}: expected a shard index in [0, {len(layout.shards)}) or a ShardPlan")
    return layout.shards[shard]


@dataclass(frozen=True)
class RefitPlan:
    """A refit from one source shard to one or more destination shards; evaluated lazily.

    Build it with ``plan_refit``. ``for_rank`` computes one rank's part alone; ``transfers``
    enumerates the whole schedule; ``stats`` summarizes its cost (computed once).
    """

    layout: Layout
    source: ShardPlan
    destinations: tuple[ShardPlan, ...]
    manifest: Manifest
    ranks_per_node: int | None = None
    min_piece_bytes: int = DEFAULT_MIN_PIECE_BYTES
    _holders: dict[tuple[Any, ...], HolderSet] = field(default_factory=dict, init=False, repr=False, compare=False)
    _routes: dict[tuple[Any, ...], Routes] = field(default_factory=dict, init=False, repr=False, compare=False)

    # -- tiles -------------------------------------------------------------------------------

    def _holder_set(self, tensor: TensorSpec, side: int, tp_rank: int) -> HolderSet:
        """Holders of slice ``tp_rank`` on side ``side`` (-1: the source, i >= 0: destination i)."""
        plan = self.source if side < 0 else self.destinations[side]
        stages = stages_of(tensor, plan, self.manifest)
        owner = -1 if tensor.expert is None else tensor.expert // (self.manifest.experts // plan.spec.ep)
        key = (side, owner, stages, tensor.tp_dim is not None, tp_rank)
        found = self._holders.get(key)
        if found is None:
            ranks = holders(tensor, plan, self.manifest, tp_rank)
            found = self._holders[key] = HolderSet(key, ranks, frozenset(ranks))
        return found

    def _tile(self, position: int, tensor: TensorSpec, shard: int, block: int, u: int, v: int) -> Tile | None:
        """The tile of destination slice u and source slice v in ``block``, or None if they do not overlap."""
        full = tuple((0, size) for size in tensor.shape)
        zero = (0,) * len(full)
        seed = position + shard * 7919
        if tensor.tp_dim is None:
            return self._make_tile(position, tensor, shard, full, zero, zero, 0, 0, seed)
        dst_plan = self.destinations[shard]
        src_slice = tp_slices(tensor.blocks, tp_size(tensor, self.source), v)[block]
        dst_slice = tp_slices(tensor.blocks, tp_size(tensor, dst_plan), u)[block]
        start, stop = max(src_slice.start, dst_slice.start), min(src_slice.stop, dst_slice.stop)
        if start >= stop:
            return None
        dim = tensor.tp_dim
        box = (*full[:dim], (start, stop), *full[dim + 1 :])
        src_offset = (*zero[:dim], src_slice.local + start - src_slice.start, *zero[dim + 1 :])
        dst_offset = (*zero[:dim], dst_slice.local + start - dst_slice.start, *zero[dim + 1 :])
        seed += (block + 1) * 31 + u * 131 + v * 1031
        return self._make_tile(position, tensor, shard, box, src_offset, dst_offset, u, v, seed)

    def _make_tile(
        self,
        position: int,
        tensor: TensorSpec,
        shard: int,
        box: Box,
        src_offset: tuple[int, ...],
        dst_offset: tuple[int, ...],
        u: int,
        v: int,
        seed: int,
    ) -> Tile:
        row_bytes = tensor.itemsize
        for start, stop in box[1:]:
            row_bytes *= stop - start
        sources, needers = self._holder_set(tensor, -1, v), self._holder_set(tensor, shard, u)
        return Tile(
            position, shard, box, src_offset, dst_offset, sources, needers, seed, box[0][1] - box[0][0], row_bytes
        )

    def _tiles_of_slice(
        self, position: int, tensor: TensorSpec, shard: int, index: int, *, destination: bool
    ) -> Iterator[Tile]:
        """Every tile of one tp slice of ``tensor`` toward destination ``shard``: destination slice u
        (``destination``) or source slice v, cut where the other side's slices meet it."""
        if tensor.tp_dim is None:
            yield self._tile(position, tensor, shard, 0, 0, 0)  # type: ignore[misc]
            return
        src_tp, dst_tp = tp_size(tensor, self.source), tp_size(tensor, self.destinations[shard])
        ways, other = (dst_tp, src_tp) if destination else (src_tp, dst_tp)
        for piece in tp_slices(tensor.blocks, ways, index):
            part = (piece.stop - piece.start) * ways // other  # the other side's slice size in this block
            block_start = piece.start - index * (piece.stop - piece.start)
            for k in range((piece.start - block_start) // part, (piece.stop - 1 - block_start) // part + 1):
                u, v = (index, k) if destination else (k, index)
                tile = self._tile(position, tensor, shard, piece.block, u, v)
                if tile is not None:
                    yield tile

    def _all_tiles(self) -> Iterator[Tile]:
        """Every tile, in the global order: destination shard, tensor, destination slice, block, source slice."""
        for shard, plan in enumerate(self.destinations):
            for position, tensor in enumerate(self.manifest.tensors):
                for u in range(tp_size(tensor, plan)):
                    yield from self._tiles_of_slice(position, tensor, shard, u, destination=True)

    # -- pieces ------------------------------------------------------------------------------

    def _routes_of(self, sources: HolderSet, needers: HolderSet) -> Routes:
        """Local copies and work lines of a (holders, needers) pair: with ``ranks_per_node``, needers on a
        node that has holders form a line served by those holders; the rest one line over all holders."""
        key = (sources.key, needers.key)
        found = self._routes.get(key)
        if found is not None:
            return found
        members = sources.members
        local = tuple(d for d in needers.ranks if d in members)
        remote = tuple(d for d in needers.ranks if d not in members)
        lines: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
        per_node = self.ranks_per_node
        if per_node is None:
            lines.append((remote, sources.ranks, 0))
        else:
            near: dict[int, list[int]] = {}
            for s in sources.ranks:
                near.setdefault(s // per_node, []).append(s)
            by_node: dict[int, list[int]] = {}
            rest = []
            for d in remote:
                if d // per_node in near:
                    by_node.setdefault(d // per_node, []).append(d)
                else:
                    rest.append(d)
            lines += [(tuple(group), tuple(near[node]), node) for node, group in by_node.items()]
            lines.append((tuple(rest), sources.ranks, 0))
        found = self._routes[key] = Routes(local, tuple(line for line in lines if line[0]))
        return found

    def _spread(
        self, tile: Tile, needers: Sequence[int], sources: Sequence[int], seed: int, src: int | None, dst: int | None
    ) -> list[Piece]:
        """One work line: ``needers``' copies of the tile cut into equal segments, one per source (see module doc).

        With ``src`` (or ``dst``) given, only the segments that rank sends (or receives) are cut: one
        rank's cost is its own pieces.
        """
        rows = tile.rows
        width = len(needers) * rows
        by_size = -(-width * tile.row_bytes // self.min_piece_bytes) if self.min_piece_bytes else width
        count = max(1, min(len(sources), width, by_size))
        segments: Iterable[int] = range(count)
        if dst is not None:  # the segments overlapping copy i: those holding its first and last row, and between
            i = needers.index(dst)
            segments = range(((i * rows + 1) * count - 1) // width, ((i + 1) * rows * count - 1) // width + 1)
        elif src is not None:  # a source takes at most one segment
            k = (sources.index(src) - seed) % len(sources)
            segments = (k,) if k < count else ()
        pieces: list[Piece] = []
        for k in segments:
            start, stop = k * width // count, (k + 1) * width // count
            source = sources[(k + seed) % len(sources)]
            copy = start // rows
            while start < stop:
                end = min(stop, (copy + 1) * rows)
                if dst is None or needers[copy] == dst:
                    pieces.append((source, needers[copy], start - copy * rows, end - copy * rows))
                start, copy = end, copy + 1
        return pieces

    def _pieces(self, tile: Tile, src: int | None = None, dst: int | None = None) -> list[Piece]:
        """Who sends which rows of the tile to whom: a pure function of the tile.

        ``src`` / ``dst`` restrict the answer to the pieces that rank sends to others / receives
        (its local copy included), computing only those.
        """
        if dst is not None and dst in tile.sources.members:
            return [(dst, dst, 0, tile.rows)]
        if src is not None and src not in tile.sources.members:
            return []
        routes = self._routes_of(tile.sources, tile.needers)
        pieces: list[Piece] = [] if src is not None or dst is not None else [(d, d, 0, tile.rows) for d in routes.local]
        for needers, sources, offset in routes.lines:
            if (src is None or src in sources) and (dst is None or dst in needers):
                pieces += self._spread(tile, needers, sources, tile.seed + offset, src, dst)
        return pieces

    def _transfers(self, tile: Tile, pieces: Sequence[Piece]) -> Iterator[Transfer]:
        name = self.manifest.tensors[tile.position].name
        (first, _), rest = tile.box[0], tile.box[1:]
        row_bytes = tile.row_bytes
        src0, src_rest = tile.src_offset[0], tile.src_offset[1:]
        dst0, dst_rest = tile.dst_offset[0], tile.dst_offset[1:]
        for src, dst, lo, hi in pieces:
            yield Transfer(
                name,
                src,
                dst,
                ((first + lo, first + hi), *rest),
                (src0 + lo, *src_rest),
                (dst0 + lo, *dst_rest),
                (hi - lo) * row_bytes,
            )

    # -- public ------------------------------------------------------------------------------

    def transfers(self) -> Iterator[Transfer]:
        """Every transfer of the plan (local copies included) in the global deterministic order:
        destination shard, tensor, destination slice, block, source slice, then the tile's pieces."""
        for tile in self._all_tiles():
            yield from self._transfers(tile, self._pieces(tile))

    def tiles(self) -> Iterator[tuple[Tile, list[Piece]]]:
        """Every tile with its pieces, in the global order (for cost accounting)."""
        for tile in self._all_tiles():
            yield tile, self._pieces(tile)

    def _held(self, plan: ShardPlan, rank: int) -> Iterator[int]:
        """Positions of the tensors ``rank`` holds in ``plan``."""
        stage = plan.decoder_grid.coords(rank)["pp"]
        experts = expert_range(plan, self.manifest, plan.expert_grid.coords(rank)["ep"])
        return self.manifest.on_stage(stage, plan.spec.pp, experts)

    def fingerprint(self) -> dict[str, str]:
        """What every rank executing this plan must agree on, part by part, as short readable texts:
        equal plans give equal parts (the executor compares them before a byte moves)."""

        def shard(plan: ShardPlan) -> str:
            return f"shard {plan.index} '{plan.spec}' [{plan.rank_offset}, {plan.ranks.stop})"

        manifest = self.manifest
        return {
            "layout": self.layout.fingerprint(),
            "source": shard(self.source),
            "destinations": " + ".join(shard(plan) for plan in self.destinations),
            "manifest": f"{manifest.name}: {len(manifest)} tensors, {manifest.nbytes} B, digest {manifest.digest()}",
            "options": f"ranks_per_node={self.ranks_per_node}, min_piece_bytes={self.min_piece_bytes}",
        }

    def for_rank(self, rank: int) -> RankRefit:
        """Rank ``rank``'s sends, receives, local copies and local shapes, computed from its own tiles only.

        Raises:
            LayoutError: the rank is outside the world.
        """
        self.layout._check_rank(rank)
        tensors = self.manifest.tensors
        keyed: list[tuple[int, int, int, Box, Transfer]] = []
        destination_shapes: dict[str, tuple[int, ...]] = {}
        for shard, plan in enumerate(self.destinations):
            if rank not in plan:
                continue
            for position in self._held(plan, rank):
                tensor = tensors[position]
                destination_shapes[tensor.name] = local_shape_on(tensor, plan)
                u = tp_rank_of(tensor, plan, rank)
                for tile in self._tiles_of_slice(position, tensor, shard, u, destination=True):  # type: ignore[arg-type]
                    mine = self._pieces(tile, dst=rank)
                    keyed += ((t.src, t.dst, position, t.box, t) for t in self._transfers(tile, mine))
        source_shapes: dict[str, tuple[int, ...]] = {}
        if rank in self.source:
            for position in self._held(self.source, rank):
                tensor = tensors[position]
                source_shapes[tensor.name] = local_shape_on(tensor, self.source)
                v = tp_rank_of(tensor, self.source, rank)
                for shard in range(len(self.destinations)):
                    for tile in self._tiles_of_slice(position, tensor, shard, v, destination=False):  # type: ignore[arg-type]
                        mine = self._pieces(tile, src=rank)
                        keyed += ((t.src, t.dst, position, t.box, t) for t in self._transfers(tile, mine))
        keyed.sort(key=lambda item: item[:4])
        ordered = [item[4] for item in keyed]
        return RankRefit(
            rank=rank,
            sends=tuple(t for t in ordered if t.src == rank and t.dst != rank),
            recvs=tuple(t for t in ordered if t.dst == rank and t.src != rank),
            copies=tuple(t for t in ordered if t.src == rank == t.dst),
            source_shapes=source_shapes,
            destination_shapes=destination_shapes,
        )


def plan_refit(
    layout: Layout,
    src: int | ShardPlan,
    dst: int | ShardPlan | Sequence[int | ShardPlan],
    manifest: Manifest,
    ranks_per_node: int | None = None,
    *,
    min_piece_bytes: int = DEFAULT_MIN_PIECE_BYTES,
) -> RefitPlan:
    """Plan moving ``manifest``'s weights from shard ``src`` to shard(s) ``dst``; no model, no collective, no torch.

    Args:
        layout: The layout whose world the shards live in.
        src: The source shard: an index into ``layout.shards``, or a ShardPlan (for the collocated
            two-layout case, a shard of another layout over the same world).
        dst: One destination shard or a sequence of them, given the same way; they may not overlap.
        manifest: The model's tensors.
        ranks_per_node: Ranks per node (node = rank // K): same-node sources are chosen first and
            the stats split traffic into intra- and inter-node.
        min_piece_bytes: Do not split a piece across replicas below this size.

    Returns:
        A lazy RefitPlan; every check that can fail has been made.

    Raises:
        RefitError: bad shard indices, overlapping destinations, bad ranks_per_node.
        ManifestError: a tensor, the layers or the experts do not split over a shard.
    """
    source = _resolve(layout, src, "source")
    items = dst if isinstance(dst, Sequence) else [dst]
    if not items:
        raise RefitError("no destination shard given: name at least one, e.g. dst=1")
    destinations = tuple(_resolve(layout, item, "destination") for item in items)
    for i, first in enumerate(destinations):
        for second in destinations[i + 1 :]:
            if first.rank_offset < second.ranks.stop and second.rank_offset < first.ranks.stop:
                raise RefitError(
                    f"destination shards '{first.spec}' [{first.rank_offset}, {first.ranks.stop}) and "
                    f"'{second.spec}' [{second.rank_offset}, {second.ranks.stop}) overlap: each rank can hold one copy"
                )
    if ranks_per_node is not None and (
        isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1
    ):
        raise RefitError(f"ranks_per_node={ranks_per_node!r}: expected a positive integer")
    if isinstance(min_piece_bytes, bool) or not isinstance(min_piece_bytes, int) or min_piece_bytes < 0:
        raise RefitError(f"min_piece_bytes={min_piece_bytes!r}: expected a non-negative integer")
    if not isinstance(manifest, Manifest):
        raise RefitError(f"manifest must be a shardcore.refit.Manifest; got {type(manifest).__name__}")
    for plan in (source, *destinations):
        check_fits(manifest, plan)
    return RefitPlan(layout, source, destinations, manifest, ranks_per_node, min_piece_bytes)


__all__ = ["DEFAULT_MIN_PIECE_BYTES", "RankRefit", "RefitPlan", "Transfer", "plan_refit"]
