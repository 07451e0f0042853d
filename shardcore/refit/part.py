"""A rank's part of a refit plan, and the one order of its transfers.

A part (``RankRefit``) is what one rank sends, receives and copies, as ``Transfer``s in one order
(``transfer_order``): both ends of a pair list the transfers between them alike, so each end cuts the same
messages from them (``schedule.py``). The plan (``plan.py``) finds a rank's transfers tile by tile, in no order
that helps; ``PartBuilder`` puts them in the part's order once they are all found.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, count, islice
from operator import attrgetter, eq
from typing import Any, NamedTuple

from .boxes import Box, fitted, from_fields
from .collector import gc_paused
from .made_when_read import MadeWhenRead
from .manifest import Manifest, TensorSpec
from .worklines import Tile


class Transfer(NamedTuple):
    """One dense box of one tensor, moved (or copied, when src == dst) from a source rank to a destination rank.

    The box lies inside one packed block, so it is one dense box in both ranks' local tensors. A named tuple,
    ordered field by field: a rank's part holds tens of thousands, and a tuple is made in a fraction of the time a
    frozen dataclass takes (``boxes.from_fields`` makes them without even the keyword handling).

    Attributes:
        tensor: The tensor's name in the manifest.
        src: Source rank (holds the box in the source layout).
        dst: Destination rank (must hold the box in the destination layout).
        box: Global [start, stop) per dim.
        src_offset: Where the box starts in the source rank's local tensor, per dim.
        dst_offset: Where the box starts in the destination rank's local tensor, per dim.
        bytes: Size of the box in bytes on the wire: in the narrower of the tensor's source and destination
            dtypes (``TensorSpec.wire_dtype``).
        hop: 0 when the bytes come from the sender's source tensor; 1 when a relay forwards them (fan-out):
            they come from the relay's destination tensor (``src_offset`` is there), once its hop-0
            receives have landed.
        target: The destination's local tensor when a weight map puts the box in another tensor than
            ``tensor`` (an engine's ``qkv_proj``); empty: ``tensor`` itself. ``dst_offset`` (and a forward's
            ``src_offset``) are in that tensor's coordinates: its dims align with the box's from the right.
    """

    tensor: str
    src: int
    dst: int
    box: Box
    src_offset: tuple[int, ...]
    dst_offset: tuple[int, ...]
    bytes: int
    hop: int = 0
    target: str = ""

    @property
    def destination(self) -> str:
        """The name of the destination's local tensor the box lands in."""
        return self.target or self.tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """Extent of the box per dim."""
        return tuple(stop - start for start, stop in self.box)

    @property
    def is_local(self) -> bool:
        """A copy inside one rank: nothing crosses the wire."""
        return self.src == self.dst

    @property
    def dst_box(self) -> Box:
        """The box in the destination's own coordinates: [start, stop) per dim of the destination rank's local
        tensor (``destination``: an engine's own ``qkv_proj`` through a weight map), where ``box`` is global."""
        extents = fitted(self.shape, len(self.dst_offset))
        return tuple((start, start + extent) for start, extent in zip(self.dst_offset, extents))

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
            "hop": self.hop,
            **({"target": self.target} if self.target else {}),
        }


Row = tuple[Box, tuple[int, ...], tuple[int, ...], tuple[int, ...], int]
"""One box a rank receives whole (``Received``): the box, its shape, where it starts in the source's and in the
destination's local tensor, and its bytes."""


class KindBoxes(NamedTuple):
    """The boxes a rank receives whole of each tensor of a kind (``PartBuilder.receive``), found once per kind."""

    rows: tuple[Row, ...]
    """In box order."""
    of_slice: tuple[int, ...]
    """Per row, the number of the source slice it comes from."""
    slices: tuple[int, ...]
    """Those numbers, each once."""


class Received(NamedTuple):
    """Boxes of one tensor that a rank receives whole from one holder, in box order: what a part holds for the
    receives of a tensor of a kind (``PartBuilder.receive``), found once per kind, instead of a ``Transfer`` each.

    Attributes:
        tensor: The tensor's name in the manifest.
        src: The holder that sends them.
        rows: The boxes (``Row``), in box order.
        target: The destination's local tensor, as ``Transfer.target``.
    """

    tensor: str
    src: int
    rows: tuple[Row, ...]
    target: str

    @property
    def hop(self) -> int:
        """Sent from the holder's source tensor, as a ``Transfer`` of hop 0."""
        return 0

    def transfers(self, dst: int) -> list[Transfer]:
        """The boxes as ``Transfer``s to ``dst``."""
        tensor, src, target = self.tensor, self.src, self.target
        return [
            from_fields(Transfer, (tensor, src, dst, box, src_offset, dst_offset, nbytes, 0, target))
            for box, _, src_offset, dst_offset, nbytes in self.rows
        ]


class Rows(MadeWhenRead[Transfer]):
    """One direction of a rank's part (``RankRefit``) in the one order, as ``Transfer``s: its ``items`` hold the
    receives of tensors of a kind as ``Received`` boxes, made into Transfers only when the rows are read one by one
    (a user, the CLI). The executor's schedule reads ``items`` as they are (``schedule.pair_messages``). Compares
    equal to any sequence of the same transfers.

    Args:
        items: ``Transfer``s and ``Received`` boxes, in order.
        dst: The rank receiving the ``Received`` boxes.
    """

    __slots__ = ("_count", "dst", "items")

    def __init__(self, items: Sequence[Transfer | Received], dst: int) -> None:
        super().__init__()
        self.items, self.dst = tuple(items), dst
        self._count: int | None = None

    def _make(self) -> tuple[Transfer, ...]:
        made: list[Transfer] = []
        with gc_paused():  # tens of thousands of tuples, no cycle among them
            for item in self.items:
                if isinstance(item, Received):
                    made += item.transfers(self.dst)
                else:
                    made.append(item)
        return tuple(made)

    def tensors(self) -> set[str]:
        """The names of the tensors moved, without making the transfers."""
        return {item.tensor for item in self.items}

    @property
    def nbytes(self) -> int:
        """The transfers' bytes, without making them."""
        return sum(
            sum(row[4] for row in item.rows) if isinstance(item, Received) else item.bytes for item in self.items
        )

    def __len__(self) -> int:
        if self._count is None:
            self._count = sum(len(item.rows) if isinstance(item, Received) else 1 for item in self.items)
        return self._count

    def __add__(self, other: Sequence[Transfer]) -> tuple[Transfer, ...]:
        return (*self._items(), *other)

    def __radd__(self, other: Sequence[Transfer]) -> tuple[Transfer, ...]:
        return (*other, *self._items())

    def __reduce__(self) -> tuple[Any, ...]:
        return Rows, (self._items(), self.dst)


@dataclass(frozen=True)
class RankRefit:
    """One rank's part of a refit plan.

    Each of ``sends``, ``recvs`` and ``copies`` is in the one order of a part (``transfer_order``: src, dst, tensor
    position in the manifest, box, hop, target), so a sender's sends to a peer and that peer's receives from it come
    in the same order. Each is a ``Rows``: a sequence of transfers (a tuple given is made one), which holds the
    receives of tensors of a kind without a ``Transfer`` each until they are read one by one.

    Attributes:
        rank: The global rank.
        sends: Transfers with src == rank and dst != rank (with fan-out, a relay's forwards too: hop 1).
        recvs: Transfers with dst == rank and src != rank.
        copies: Transfers with src == dst == rank.
        source_shapes: Local shape of every tensor the rank holds in the source layout, as the caller passes
            them; the fp8 scale tensors it sends are not among them (the executor computes those).
        destination_shapes: Local shape of every tensor the rank must hold in a destination layout.
        source_dtypes: The dtype (torch's name, e.g. "bfloat16") of every tensor of ``source_shapes``: what
            ``execute_refit`` checks a source tensor against.
        destination_dtypes: The dtype of every tensor of ``destination_shapes`` (a converting refit's target
            dtype; an engine's own through a weight map; float32 for the scale tensors it quantizes with).
    """

    rank: int
    sends: Rows
    recvs: Rows
    copies: Rows
    source_shapes: dict[str, tuple[int, ...]]
    destination_shapes: dict[str, tuple[int, ...]]
    source_dtypes: dict[str, str] = field(default_factory=dict)
    destination_dtypes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for direction in ("sends", "recvs", "copies"):
            given = getattr(self, direction)
            if not isinstance(given, Rows):
                object.__setattr__(self, direction, Rows(given, self.rank))

    @property
    def bytes_sent(self) -> int:
        return self.sends.nbytes

    @property
    def bytes_received(self) -> int:
        return self.recvs.nbytes

    @property
    def sources_read(self) -> set[str]:
        """The tensors this rank reads from its source tensors: those it sends or copies at hop 0 (a relay's
        forwards, hop 1, read its destinations)."""
        return {t.tensor for t in (*self.sends, *self.copies) if not t.hop}


def transfer_order(manifest: Manifest) -> Callable[[Transfer], tuple[Any, ...]]:
    """The order of a rank's transfers (``RankRefit``), as a sort key over ``manifest``'s tensors: (src, dst, the
    tensor's position in the manifest, box, hop, target), which no two transfers of a plan share. It is the one
    order of a part: both ends of a pair list the messages between them in it, and whatever else lists a rank's
    transfers (the partial amaxes of per-tensor scales, ``scales.py``) sorts by this key. ``PartBuilder`` evaluates it
    faster, as one number and ties, and gives the same order."""
    index = manifest.index
    return lambda t: (t.src, t.dst, index(t.tensor), *_after_peers(t))


class PartBuilder:
    """One rank's transfers as they are found, put in the order of ``RankRefit`` at the end (``transfer_order``).
    (src, dst, position) is one number, sorted as such (an int sort in C); the few transfers sharing it (boxes of one
    tensor between one pair) are ordered among themselves by the rest of the key."""

    def __init__(self, world_size: int, tensors: Sequence[TensorSpec]) -> None:
        self.transfers: list[Transfer] = []
        self.pairs: list[int] = []  # (src, dst, position) of each transfer, as one number
        self.received: list[Received] = []
        """Boxes received whole of one tensor from one holder."""
        self.received_pairs: list[int] = []
        """Each one's (src, dst, position) as one number (``number``)."""
        self.world_size, self.specs, self.tensors = world_size, tensors, len(tensors)

    def add(self, tile: Tile, src: int, dst: int) -> None:
        """The whole of ``tile``, from ``src``'s source tensor (hop 0) to a needer of it (``dst``, of its slice)."""
        position = tile.position
        self.pairs.append((src * self.world_size + dst) * self.tensors + position)
        self.transfers.append(
            from_fields(
                Transfer,
                (
                    self.specs[position].name,
                    src,
                    dst,
                    tile.box,
                    tile.src_offset,
                    tile.dst_offset,
                    tile.rows * tile.row_bytes,
                    0,
                    tile.target,
                ),
            )
        )

    def number(self, src: int, dst: int, position: int) -> int:
        """(src, dst, position) as one number, ordered as the part orders them (``transfer_order``)."""
        return (src * self.world_size + dst) * self.tensors + position

    def receive_apart(self, rank: int, target: str, position: int, holders: Sequence[int], boxes: KindBoxes) -> None:
        """The boxes of tensor ``position`` (a kind's ``boxes``) that ``rank`` receives whole into its local tensor
        ``target`` (empty: the tensor itself), each from its source slice's one holder (``holders``, by slice), when
        they come from several: a ``Transfer`` each. (From one holder, as most do, they are one ``Received`` in
        ``received``.)"""
        name = self.specs[position].name
        for (box, _, src_offset, dst_offset, nbytes), i in zip(boxes.rows, boxes.of_slice):
            src = holders[i]
            self.pairs.append(self.number(src, rank, position))
            self.transfers.append(
                from_fields(Transfer, (name, src, rank, box, src_offset, dst_offset, nbytes, 0, target))
            )

    def extend(self, position: int, transfers: Iterable[Transfer]) -> None:
        """Transfers of tensor ``position``."""
        for t in transfers:
            self.pairs.append((t.src * self.world_size + t.dst) * self.tensors + position)
            self.transfers.append(t)

    def split(self, rank: int) -> tuple[Rows, Rows, Rows]:
        """The part's sends, receives and local copies, each in order. Every transfer of a rank's part has the rank
        at one end, so those from it (sends and copies) lie together in the order, its copies together among them,
        and every other one is a receive. A ``Received`` shares its (src, dst, position) with nothing else (else its
        boxes are made transfers, and ordered with the others), so it is ordered by that number alone."""
        received, numbers = self.received, self.received_pairs
        if received:
            unique = set(numbers)
            clash = unique.intersection(self.pairs)
            if len(unique) < len(numbers):
                clash |= {pair for pair, times in Counter(numbers).items() if times > 1}
            if clash:
                for pair, boxes in zip(numbers, received):
                    if pair in clash:
                        made = boxes.transfers(rank)
                        self.pairs += [pair] * len(made)
                        self.transfers += made
                kept = [i for i, pair in enumerate(numbers) if pair not in clash]
                received, numbers = [received[i] for i in kept], [numbers[i] for i in kept]
        keys, items = self.pairs + numbers, self.transfers + received
        order = sorted(range(len(keys)), key=keys.__getitem__)  # ints, compared in C (one digit, most worlds)
        ranked = list(map(keys.__getitem__, order))
        ordered = list(map(items.__getitem__, order))
        ties = list(compress(count(1), map(eq, ranked, islice(ranked, 1, None))))  # n: ranked[n - 1] == ranked[n]
        n = 0
        while n < len(ties):  # each stretch of transfers sharing their number, by (box, hop, target)
            start, stop = ties[n] - 1, ties[n] + 1
            n += 1
            while n < len(ties) and ties[n] == stop:
                stop, n = stop + 1, n + 1
            ordered[start:stop] = sorted(ordered[start:stop], key=_after_peers)  # transfers only: see the doc
        span, pair = self.world_size * self.tensors, (rank * self.world_size + rank) * self.tensors
        first, last = bisect_left(ranked, rank * span), bisect_left(ranked, (rank + 1) * span)
        low, high = bisect_left(ranked, pair), bisect_left(ranked, pair + self.tensors)
        return (
            Rows((*ordered[first:low], *ordered[high:last]), rank),
            Rows((*ordered[:first], *ordered[last:]), rank),
            Rows(ordered[low:high], rank),
        )


_after_peers = attrgetter("box", "hop", "target")
"""The order of one tensor's transfers between one pair of ranks (the end of ``transfer_order``'s key)."""


__all__ = ["KindBoxes", "PartBuilder", "RankRefit", "Received", "Row", "Rows", "Transfer", "transfer_order"]
