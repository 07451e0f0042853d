"""Which messages a rank sends and receives, and in which ``batch_isend_irecv`` call each one goes.

Pure index math over one rank's part of a plan (``RankRefit``): no torch, no store. Sender and
receiver derive every decision here from the transfers between them alone, so both ends of a
message cut it alike, give it the same key and put it in the same batch.

**Messages.** The transfers between two ranks, in the part's order, are cut along their first dim to at most
``cap`` bytes. A piece of ``SOLO_BYTES`` or more travels alone (then it can go straight from the
source tensor and into the destination tensor where its slice is contiguous); smaller pieces are
packed, in order, into messages of at most ``cap`` bytes. Each direction of a pair ends with a
*ledger*: one small message that states every message's size (and, with ``verify="checksum"``, its
checksum), so the receiver checks what arrived against what the sender sent.

**Batches: rounds that both ends post alike.** NCCL can hang on a ``batch_isend_irecv`` with many
ops (pytorch #174288: hangs at ~1,000 ops, none at 256) or when one end posts a message in another
batch than the other (NVIDIA/nccl #2130). So ranks are paired by a round-robin tournament (the
circle method, as pytorch PR #174942 proposed): in round r each rank has at most one partner, and
ranks i and j meet in exactly one round, which both compute alike. ``fan(world, max_ops)`` consecutive rounds
form a *super-round* (all of them in a world of up to 17 ranks); each pair's messages (both
directions, in key order) are cut into chunks of at most ``max_ops // fan`` messages and
``bucket_bytes // fan`` staged bytes, and batch (s, c) holds chunk c of every pair of super-round s.
So a batch has at most ``max_ops`` ops and stages at most ``bucket_bytes``, and both ends of every
message post it in the same batch, whatever the plan.

*Staged bytes* are counted alike at both ends: a message may be staged (at either end) when it packs
several pieces or its one piece does not span the tensor's trailing dims, which every rank knows from
the box and the global shape alone; a single piece that spans them is a contiguous slice of both
ends' (contiguous) local tensors and travels in place, costing no staging memory. A converting
refit's message of a tensor cast on the way (``converting``, from the manifest) may be staged too.

**Hops (fan-out).** A relay forwards bytes it received (``Transfer.hop == 1``: read from its
destination tensor). Every message has the hop of its transfers (a pair's transfers are cut into
messages, with a ledger, per hop), and batch keys are (hop, s, c): every rank runs all its hop-0
batches, each waited for and unpacked, before its first hop-1 batch. So a relay's forward reads its
destination only after every hop-0 receive it has landed there, and the forwarded box is one the
relay receives in full at hop 0 (the planner forwards a tile only from a needer of the same tile).

**Two batches in flight.** A rank may post batch k+1 before it waits for batch k, never further
ahead (``staging_layout``: when both are of one hop and their staged bytes fit in ``bucket_bytes``
together); it lands k (waits, unpacks, checks) while k+1 is on the wire. Whether it posts ahead is
its own choice, from its own staging, and both ends still post every batch, and every op in it, in
the same order.

**Why no plan can deadlock.** Every rank posts its batches in increasing (hop, s, c) and waits for
them in that order; a batch needs only its partners' same batch, which contains the matching ops
(both ends derive the key from the message alone: its hop, and the pair's round). Take the
smallest batch any unfinished rank is waiting in: each of its partners has posted that batch too
(it posts in order, and it is waiting in that batch or a later one, by minimality, or still runs
and will post it; it cannot be past it, since completing it needs this rank's ops), so every op in
it is matched and it completes. Induction on the batch order does the rest; the hop is just the
most significant part of the order, so the argument holds for any number of hops. Posting ahead
only makes a batch posted earlier, so the argument holds with one or two batches in flight, and
for ranks that choose differently. On each backend "posted and matched" means "completes":

* gloo moves every posted op on its own I/O threads, whatever else is posted (each op is posted
  alone, as torch posts a gloo batch anyway), and two in-flight messages of one pair and tag match
  in the order both ends posted them, which is the same.
* NCCL and HCCL run each ``batch_isend_irecv`` as one group, launched on the communicator's stream:
  the device runs a rank's batches in posting order, whatever the host queued ahead, so the
  induction above holds on the device (the first unfinished batch of the world has every partner's
  same group at the head of its stream). Posting ahead only queues the next group: the host does
  not block in it. Each batch still holds at most ``max_ops`` ops and is symmetric, the two hazards
  of pytorch #174288 and NVIDIA/nccl #2130; at most two groups are ever outstanding.

Staging: two batches in flight never share a byte of the buffer (``staging_layout`` puts them at
its two ends), and batch k+2 reuses batch k's bytes only after k landed: on the host, and on NCCL
in stream order too (k's unpack is queued before k+2's pack, and k+2's ops wait for the current
stream; k+2's pack comes after k's wait, which orders it after k's sends read the bytes).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter
from typing import Any, NamedTuple, cast

from .boxes import from_fields, moved
from .made_when_read import MadeWhenRead
from .part import Received, Row, Rows

ALIGN = 16
"""Byte offset of each piece in a packed message: any dtype's view of it is aligned."""
SOLO_BYTES = 256 << 10
"""A piece this big travels alone, from and into the tensors themselves where its slice is contiguous."""
MAX_FAN = 16
"""Most tournament rounds per super-round: how many partners a rank talks to in one batch, at most."""
LEDGER_ENTRY_BYTES = 16
"""One ledger entry: the message's bytes and its checksum, two int64."""


class Slot(NamedTuple):
    """Where one batch stages in a rank's staging buffer, and whether it is posted while the batch before it is
    still in flight."""

    offset: int
    nbytes: int
    overlaps: bool


class StagingLayout(NamedTuple):
    """A rank's slots, one per batch in order, and the staging buffer they need."""

    slots: list[Slot]
    nbytes: int


class Piece(NamedTuple):
    """A dense box of one tensor: its shape, and where it starts in the sender's and the receiver's local tensor.

    Through a weight map the receiver's tensor is another one, ``target`` (``Transfer.target``), whose dims
    align with the box's from the right (``boxes.fitted``)."""

    tensor: str
    shape: tuple[int, ...]
    src_offset: tuple[int, ...]
    dst_offset: tuple[int, ...]
    nbytes: int
    target: str = ""

    @property
    def destination(self) -> str:
        """The name of the receiver's local tensor."""
        return self.target or self.tensor


class Layout(NamedTuple):
    """How the boxes of a kind's ``Rows`` pack into a message one after another: found once per kind, and the same
    wherever they start (at an aligned byte)."""

    offsets: tuple[int, ...]
    """Each box's byte offset from the first's."""
    end: int
    """Bytes from the first box's start to the last one's end."""
    most: int
    """The biggest box's bytes."""
    total: int
    """All the boxes' bytes."""


def layout(rows: Sequence[Row]) -> Layout:
    """``rows`` packed as ``pair_messages`` packs pieces, from an aligned byte: each box at the next aligned one."""
    offsets, size = [], 0
    for row in rows:
        offset = aligned(size)
        offsets.append(offset)
        size = offset + row[4]
    return Layout(tuple(offsets), size, max(row[4] for row in rows), sum(row[4] for row in rows))


def box_pieces(boxes: Received) -> list[Piece]:
    """A ``Received``'s boxes as pieces, one each, made from their rows as ``pieces_of`` makes a piece from its
    transfer."""
    tensor, target = boxes.tensor, boxes.target
    return [
        from_fields(Piece, (tensor, shape, src_offset, dst_offset, nbytes, target))
        for _, shape, src_offset, dst_offset, nbytes in boxes.rows
    ]


def packed_pieces(boxes: Received, base: int, layout: Layout) -> list[tuple[Piece, int]]:
    """A ``Received``'s boxes packed whole from byte ``base`` of a message (at ``base`` plus their ``layout``'s
    offsets), as pieces with their byte offsets."""
    return [(piece, base + offset) for piece, offset in zip(box_pieces(boxes), layout.offsets)]


class MessagePieces(MadeWhenRead[tuple[Piece, int]]):
    """A message's pieces with their byte offsets, as ``pair_messages`` cuts them, held as three columns of one item
    per entry: ``entries`` (a loose ``(Piece, offset)``, or a ``Received`` whose boxes are packed whole),
    ``bases`` (the byte a Received's boxes start at) and ``layouts`` (its kind's ``Layout``; None for a loose
    piece). A tensor's boxes thus cost a list item, not a ``Piece`` each nor an object the collector walks; the
    pieces are made only when read one by one, and the runs (``transfer.runs``) read the columns as they are.
    Compares equal to any sequence of the same pieces.

    Args:
        entries: Loose ``(Piece, offset)`` items and packed ``Received`` boxes, in the message's order.
        bases: Per entry, the byte a Received's boxes start at (0 for a loose piece).
        layouts: Per entry, a Received's ``Layout``, or None.
        length: How many pieces they are.
        payload: Their bytes.
    """

    __slots__ = ("_length", "bases", "entries", "layouts", "payload")

    def __init__(
        self,
        entries: list[tuple[Piece, int] | Received],
        bases: array[int],
        layouts: list[Layout | None],
        length: int,
        payload: int,
    ) -> None:
        super().__init__()
        self.entries, self.bases, self.layouts, self._length, self.payload = entries, bases, layouts, length, payload

    @classmethod
    def alone(cls, piece: Piece) -> MessagePieces:
        """A message of one piece, at byte 0."""
        return cls([(piece, 0)], array("q", (0,)), [None], 1, piece.nbytes)

    def _make(self) -> tuple[tuple[Piece, int], ...]:
        made: list[tuple[Piece, int]] = []
        for entry, base, found in zip(self.entries, self.bases, self.layouts):
            if found is None:
                made.append(entry)  # type: ignore[arg-type]  # a loose piece
            else:
                made += packed_pieces(entry, base, found)  # type: ignore[arg-type]  # a Received
        return tuple(made)

    def __len__(self) -> int:
        return self._length


@dataclass
class Message:
    """One message between this rank and ``peer``: its key (the order both ends agree on), its pieces with
    their byte offsets in the message, and its size. A ledger carries no pieces."""

    key: tuple[int, int, int, int]
    """(index within its direction and hop of the pair, src, dst, hop)."""
    peer: int
    send: bool
    pieces: Sequence[tuple[Piece, int]]
    """A tuple, or a ``MessagePieces`` as ``pair_messages`` cuts them."""
    nbytes: int
    ledger: bool = False

    @cached_property
    def payload(self) -> int:
        """Bytes of tensor data the message carries (counted once: every refit of a kept schedule reads it)."""
        pieces = self.pieces
        return pieces.payload if isinstance(pieces, MessagePieces) else sum(piece.nbytes for piece, _ in pieces)

    @property
    def hop(self) -> int:
        """0: sent from the sender's source tensors; 1: forwarded from its destination tensors (a relay)."""
        return self.key[3]


@dataclass
class Batch:
    """One ``batch_isend_irecv`` of this rank: its place in the order every rank shares, and its messages."""

    key: tuple[int, int, int]
    """(hop, super-round, chunk)."""
    messages: list[Message] = field(default_factory=list)

    @property
    def peers(self) -> set[int]:
        return {message.peer for message in self.messages}


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pieces_of(transfer: Any, cap: int) -> list[Piece]:
    """A transfer cut along its first dim with extent > 1 into pieces of at most ``cap`` bytes (or one slab)."""
    shape = tuple([stop - start for start, stop in transfer.box])
    nbytes = int(transfer.bytes)
    target = getattr(transfer, "target", "")
    dim = None if nbytes <= cap else next((d for d, n in enumerate(shape) if n > 1), None)
    if dim is None:  # one piece, as most transfers are
        return [Piece(transfer.tensor, shape, tuple(transfer.src_offset), tuple(transfer.dst_offset), nbytes, target)]
    slab = nbytes // shape[dim]
    step = max(1, cap // slab)
    box = tuple((0, n) for n in shape)
    pieces = []
    for start in range(0, shape[dim], step):
        n = min(step, shape[dim] - start)
        cut = (*shape[:dim], n, *shape[dim + 1 :])
        part = (*box[:dim], (start, start + n), *box[dim + 1 :])
        src, dst = (moved(tuple(offset), box, part) for offset in (transfer.src_offset, transfer.dst_offset))
        pieces.append(Piece(transfer.tensor, cut, src, dst, slab * n, target))
    return pieces


def _pieces(boxes: Received, dst: int, cap: int, most: int) -> list[Piece]:
    """The pieces of a ``Received``'s boxes (to ``dst``; ``most``: its biggest box's bytes) as ``pieces_of`` cuts
    their transfers: a box within ``cap`` is one piece."""
    if most <= cap:
        return box_pieces(boxes)
    return [piece for transfer in boxes.transfers(dst) for piece in pieces_of(transfer, cap)]


def pair_messages(transfers: Sequence[Any], cap: int, dst: int = -1) -> list[tuple[MessagePieces, int]]:
    """The messages of one direction of one pair, as both ends derive them: (pieces with their byte offsets,
    message bytes). ``transfers`` come in the part's one order (``part.transfer_order``), which both ends share, so
    they are cut as they come, never re-sorted; ``Received`` boxes among them (a ``Rows``' items, received by
    ``dst``) are cut as their transfers would be, and those that fit whole in the message being filled are held
    as one entry (their ``layout`` found once per kind: ``MessagePieces``). The cut depends on sizes alone, never
    on either side's strides."""
    out: list[tuple[MessagePieces, int]] = []
    entries: list[tuple[Piece, int] | Received] = []  # the message being filled, as MessagePieces' columns
    bases, kinds = array("q"), cast(list[Layout | None], [])
    size = count = payload = 0  # its bytes, pieces and their bytes
    layouts: dict[int, Layout] = {}
    for transfer in transfers:
        if isinstance(transfer, Received):
            rows = transfer.rows
            found = layouts.get(id(rows))
            if found is None:
                found = layouts[id(rows)] = layout(rows)
            base = aligned(size)
            if base + found.end <= cap and found.most < SOLO_BYTES:  # whole in this message: as its pieces would be
                entries.append(transfer)
                bases.append(base)
                kinds.append(found)
                size, count, payload = base + found.end, count + len(rows), payload + found.total
                continue
            pieces = _pieces(transfer, dst, cap, found.most)
        else:
            pieces = pieces_of(transfer, cap)
        for piece in pieces:
            nbytes = piece.nbytes
            if nbytes >= SOLO_BYTES:
                out.append((MessagePieces.alone(piece), nbytes))
                continue
            offset = aligned(size)
            if entries and offset + nbytes > cap:
                out.append((MessagePieces(entries, bases, kinds, count, payload), size))
                entries, bases, kinds, offset, count, payload = [], array("q"), [], 0, 0, 0
            entries.append((piece, offset))
            bases.append(0)
            kinds.append(None)
            size, count, payload = offset + nbytes, count + 1, payload + nbytes
    if entries:
        out.append((MessagePieces(entries, bases, kinds, count, payload), size))
    return out


def tournament_round(i: int, j: int, world: int) -> int:
    """The round in which ranks i and j meet in a round-robin tournament of ``world`` ranks (the circle method).

    With n players (``world`` rounded up to even; an odd world's last player is a bye), round r pairs
    player n-1 with r and, for the others, every i, j with i + j = 2r (mod n-1); 2 is invertible mod
    the odd n-1, so the round of a pair is ``(i + j) * n/2 mod (n-1)``. Each rank meets each other in
    exactly one of the n-1 rounds, and has one partner per round.
    """
    n = world + world % 2
    last = n - 1
    if j == last:
        return i
    if i == last:
        return j
    return (i + j) * (n // 2) % last


def _by_peer(transfers: Sequence[Any], attr: str) -> dict[tuple[int, int], list[Any]]:
    """Transfers by (peer, hop): each direction of a pair has its messages and its ledger per hop."""
    peers: dict[tuple[int, int], list[Any]] = {}
    for key, transfer in zip(map(attrgetter(attr, "hop"), transfers), transfers):
        peers.setdefault(key, []).append(transfer)
    return peers


def fan(world: int, max_ops: int) -> int:
    """Tournament rounds per super-round in a world of ``world`` ranks: every round when they are few, and
    few enough that each partner's chunk gets two ops (a send and a receive) of the batch's ``max_ops``."""
    return max(1, min(MAX_FAN, world - 1 + world % 2, max_ops // 2))


def may_stage(
    message: Message, shapes: Mapping[str, tuple[int, ...]], converting: frozenset[str] = frozenset()
) -> bool:
    """Whether either end of ``message`` may stage it (see the module doc): both ends answer alike."""
    if message.ledger:
        return False
    if len(message.pieces) != 1:
        return True
    piece = message.pieces[0][0]
    if piece.target:  # its destination tensor is another one, of its own shape
        return True
    return piece.tensor in converting or piece.shape[1:] != tuple(shapes[piece.tensor][1:])


def rank_batches(
    mine: Any,
    rank: int,
    world: int,
    bucket_bytes: int,
    max_ops: int,
    shapes: Mapping[str, tuple[int, ...]],
    converting: frozenset[str] = frozenset(),
) -> list[Batch]:
    """This rank's batches in the order every rank shares, each holding its messages in key order.

    Args:
        mine: this rank's part of the plan (``sends``, ``recvs``).
        rank: this rank.
        world: ranks in the world (the tournament's players).
        bucket_bytes: bytes one batch may hold (staged or not, so that both ends count alike).
        max_ops: operations one batch may hold.
        shapes: every tensor's global shape (the manifest's), for what may be staged.
        converting: the tensors cast on the way (a converting refit's), staged wherever they are.
    """
    rounds = fan(world, max_ops)
    pair_bytes = max(ALIGN, bucket_bytes // rounds)
    pair_ops = max(2, max_ops // rounds)
    lists: dict[tuple[int, int], list[Message]] = {}
    for send, transfers in ((True, mine.sends), (False, mine.recvs)):
        items = transfers.items if isinstance(transfers, Rows) else transfers
        for (peer, hop), pair in _by_peer(items, "dst" if send else "src").items():
            src, dst = (rank, peer) if send else (peer, rank)
            found = pair_messages(pair, pair_bytes, dst)
            messages = lists.setdefault((peer, hop), [])
            messages += [
                Message((index, src, dst, hop), peer, send, pieces, size) for index, (pieces, size) in enumerate(found)
            ]
            messages.append(
                Message((len(found), src, dst, hop), peer, send, (), LEDGER_ENTRY_BYTES * len(found), ledger=True)
            )
    batches: dict[tuple[int, int, int], Batch] = {}
    for (peer, hop), messages in lists.items():
        messages.sort(key=lambda message: message.key)
        superround = tournament_round(rank, peer, world) // rounds
        for chunk, part in enumerate(_chunks(messages, pair_ops, pair_bytes, shapes, converting)):
            key = (hop, superround, chunk)
            batches.setdefault(key, Batch(key)).messages += part
    ordered = [batches[key] for key in sorted(batches)]
    for batch in ordered:
        batch.messages.sort(key=lambda message: (message.peer, message.key))
    return ordered


def staging_layout(batches: Sequence[Batch], staged: Sequence[int], bucket_bytes: int) -> StagingLayout:
    """Which batches go on the wire while the one before is in flight, and where each stages.

    Batch k overlaps batch k-1 when both are of one hop (a relay forwards only what its hop-0 batches, all
    landed before, brought it) and their staged bytes fit in ``bucket_bytes`` together. A chain of
    overlapping batches alternates between the buffer's low and high ends, so the two in flight never share
    a byte; the buffer is the most any batch stages alone or with the one before it. So staging stays within
    ``bucket_bytes``, unless one batch alone holds more (a message bigger than its pair's budget travels
    alone), and never needs more than that batch.

    Args:
        batches: this rank's batches, in order.
        staged: the bytes each batch stages on this rank (aligned; in-place messages take none).
        bucket_bytes: the staging bytes two batches in flight may hold together.
    """
    overlaps = [
        k > 0 and batches[k].key[0] == batches[k - 1].key[0] and staged[k - 1] + staged[k] <= bucket_bytes
        for k in range(len(batches))
    ]
    nbytes = max((staged[k] + (staged[k - 1] if overlaps[k] else 0) for k in range(len(batches))), default=0)
    slots: list[Slot] = []
    high = False
    for overlapping, size in zip(overlaps, staged):
        high = overlapping and not high
        slots.append(Slot(nbytes - size if high else 0, size, overlapping))
    return StagingLayout(slots, nbytes)


def _chunks(
    messages: Sequence[Message],
    ops: int,
    nbytes: int,
    shapes: Mapping[str, tuple[int, ...]],
    converting: frozenset[str],
) -> Iterator[list[Message]]:
    """A pair's messages cut in order into chunks of at most ``ops`` messages and ``nbytes`` bytes that may be
    staged (a bigger message alone); both ends cut alike because both count alike (``may_stage``)."""
    chunk: list[Message] = []
    size = 0
    for message in messages:
        staged = aligned(message.nbytes) if may_stage(message, shapes, converting) else 0
        if chunk and (len(chunk) == ops or (staged and size + staged > nbytes)):
            yield chunk
            chunk, size = [], 0
        chunk.append(message)
        size += staged
    if chunk:
        yield chunk


__all__ = [
    "ALIGN",
    "LEDGER_ENTRY_BYTES",
    "MAX_FAN",
    "SOLO_BYTES",
    "Batch",
    "Layout",
    "Message",
    "MessagePieces",
    "Piece",
    "Slot",
    "StagingLayout",
    "aligned",
    "box_pieces",
    "fan",
    "layout",
    "may_stage",
    "packed_pieces",
    "pair_messages",
    "pieces_of",
    "rank_batches",
    "staging_layout",
    "tournament_round",
]
