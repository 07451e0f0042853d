"""Delta refits: each piece travels as its changed elements since the version its destination holds.

**What a sender keeps.** For every piece it sends (to each peer, at each hop), the bytes it last put on the
wire for it, in the wire dtype (after a converting refit's cast or fp8 quantization), with the version of the
refit that delivered them: a *snapshot*. So a rank's extra memory is one copy of the bytes it sends in a dense
refit (``RankRefit.bytes_sent``: a relay's forwards included), kept between refits in its refit session
(``transfer.session``); a receiver keeps nothing more than its staging buffer. A snapshot's version is set only
when its refit completed on every rank (``DeltaSession.commit``); one written by a refit that failed has none,
so its next send is dense. When a tensor's pieces change (another plan, another shape), its snapshots from the
old cut are dropped at the next completed refit that sends it.

**Versions decide.** Before a batch's data moves, each receiver tells each of its senders in the batch, piece
by piece, the version its destination tensor holds (``held_version``; none when it was never written, when a
failed refit wrote part of it, or when the process or the session is new): a sender sends a piece as a delta
only when that is the version of its snapshot, else dense. A destination tensor whose in-place counter moved
since a delta refit last completed into it (written by something else, or a new tensor at a freed one's
address) holds no base either. So no rank ever applies a delta to a base it does not hold: a new or restarted
engine, a failed refit, or a subset that skipped a tensor all get dense pieces (``delta_checksum`` catches a
base changed where no counter sees it, through ``.data``). With ``anchor_every=K`` every version divisible by K
is dense throughout (a full refit).

**Encoding.** Each piece is encoded on its own (``delta_codec.py``: its changed elements by index or by bitmap,
or dense when that is smaller). A message whose pieces all travel dense is the dense message itself (in place
where the dense refit's is); any other is a header (kind and count per piece) and the pieces' encodings.

**Sizes without a collective.** Message sizes change every refit, so each batch starts with small rounds on
its own pairs, before its data: the receivers' held versions (to the senders; once per pair and refit, in the
first batch the pair meets in, for all its messages), then each message's size and kind (to the receivers),
optionally with each piece's checksum. Both ends post them in the batch's order, so the schedule's argument
(no deadlock, ``max_ops``) holds: a header round has at most two ops per partner. Every data message may be
staged (the schedule counts it so at both ends), and an encoded message is never bigger than its dense one,
so staging stays within ``bucket_bytes``.

**Relays** (fan-out) are senders too: a forward is encoded against the relay's own snapshot of what it last
forwarded, so the second hop carries a delta as well.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from ...refit.schedule import Message, Piece, aligned
from .delta_codec import BITMAP, DENSE, INDICES, apply_piece, encode_piece, itemsize_of, piece_bytes, write_encoding
from .exchange import Exchange, Place, checksum
from .pieces import Plain
from .session import RefitSession, Snapshot, SnapshotKey, tensor_key

if TYPE_CHECKING:
    import torch

    from ...refit.part import Transfer

DENSE_MESSAGE, DELTA_MESSAGE = 0, 1
"""A message's kind: the dense message itself, or a header and its pieces' encodings."""
UNKNOWN = -2
"""A header entry that never arrived (its sender drained): never a version, a size or a kind."""
PIECE_HEADER_BYTES = 16
"""Per piece of an encoded message: its kind and its count of changed elements, two int64."""


# ----------------------------------------------------------------------------- one rank's delta refit


class _Header(NamedTuple):
    """What a receiver learned of one message in the sizes round: its bytes and kind, and (with the check on)
    its pieces' checksums as its sender computed them."""

    nbytes: int
    kind: int
    sums: tuple[int, ...]


@dataclass
class DeltaSession:
    """One rank's part of one delta refit: the versions its destinations hold, and what the two header rounds
    of each batch told it; the codec of its messages (``exchange.Codec``), their pieces packed and unpacked by
    ``dense`` (a plain or converting codec, in the wire dtype).

    Attributes:
        held: Destination tensor name -> the version it holds intact (None: none it can build on).
        dense: How this rank's pieces are moved when dense (its tensors, and what converts).
        session: The refit session (``transfer.session``).
        anchor: This refit sends every piece dense (``anchor_every`` divides its version).
        check: Checksum every destination piece after it is written, against its sender's.
    """

    held: dict[str, int | None]
    dense: Plain
    session: RefitSession
    """Where this rank's snapshots and counters are kept between refits."""
    anchor: bool = False
    check: bool = False
    wire_sent: int = 0
    """Data bytes this rank put on the wire (encoded messages as encoded)."""
    wire_received: int = 0
    pieces_sent_as_delta: int = 0
    pieces_sent_dense: int = 0
    _bases: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    """Per message this rank sends: its receiver's version of each piece's destination (-1: none)."""
    _declared: dict[tuple[int, ...], tuple[int, int, list[int]]] = field(default_factory=dict)
    """Per message this rank sends: its size, kind and pieces' checksums, for the sizes round."""
    _headers: dict[tuple[int, ...], _Header] = field(default_factory=dict)
    """Per message this rank receives: what its sender declared."""
    _touched: list[SnapshotKey] = field(default_factory=list)
    _met: set[int] = field(default_factory=set)
    """Peers whose bases this rank exchanged already in this refit (``learn``)."""

    encodes: ClassVar[bool] = True
    """Every data message is staged (an encoded one cannot travel in place), and each batch's two header rounds
    come first."""

    @property
    def sources(self) -> Mapping[str, torch.Tensor]:
        return self.dense.sources

    @property
    def destinations(self) -> Mapping[str, torch.Tensor]:
        """This rank's destination tensors, whose counters ``commit`` records."""
        return self.dense.destinations

    @property
    def device(self) -> torch.device | str:
        return self.dense.device

    def copy(self, transfer: Transfer) -> None:
        """A local copy: dense."""
        self.dense.copy(transfer)

    def place(self, message: Message) -> Place | None:
        """Where a message lies when it travels dense, in place (``declare`` and ``pack`` use it then)."""
        return self.dense.place(message)

    def finish(self) -> None:
        self.dense.finish()

    # -- the two header rounds -----------------------------------------------------------------------

    def learn(self, exchange: Exchange, messages: list[Message]) -> None:
        """Round one, once per pair and refit: in the first batch of the refit that holds data between two
        ranks (the same batch at both ends: both derive it from the schedule), each receiver tells each sender
        the version its destination holds, piece by piece of every message between them in the whole refit
        (each hop): held versions do not change while a refit runs. A batch where no pair meets for the first
        time has no round one."""
        first = {m.peer for m in messages if not m.ledger} - self._met
        if not first:
            return
        self._met |= first
        pairs = [m for batch in exchange.batches for m in batch.messages if m.peer in first]
        outgoing = {
            peer: [self._base(piece) for m in mine for piece, _ in m.pieces]
            for peer, mine in _by_peer(pairs, send=False).items()
        }
        expected = {peer: sum(len(m.pieces) for m in mine) for peer, mine in _by_peer(pairs, send=True).items()}
        got = exchange.swap(messages, outgoing, expected, UNKNOWN)
        for peer, mine in _by_peer(pairs, send=True).items():
            values = got.get(peer, [])
            for message in mine:
                self._bases[message.key], values = values[: len(message.pieces)], values[len(message.pieces) :]

    def declare(
        self, exchange: Exchange, messages: list[Message], wires: list[tuple[torch.Tensor, bool]]
    ) -> list[tuple[torch.Tensor, bool]]:
        """Round two: each sender tells each receiver every message's size and kind (and pieces' checksums);
        returns the batch's wires with every receive cut to what it will carry (or in place, when dense)."""
        outgoing = {
            peer: [value for m in mine for value in self._entries(m)]
            for peer, mine in _by_peer(messages, send=True).items()
        }
        expected = {
            peer: sum(self._entry_count(m) for m in mine) for peer, mine in _by_peer(messages, send=False).items()
        }
        got = exchange.swap(messages, outgoing, expected, UNKNOWN)
        for peer, mine in _by_peer(messages, send=False).items():
            values = got.get(peer, [])
            for message in mine:
                count = self._entry_count(message)
                entry, values = values[:count], values[count:]
                self._headers[message.key] = _header(message, entry)
        out = []
        for message, (wire, staged) in zip(messages, wires):
            if not message.send and not message.ledger:
                wire, staged = self._receive_wire(exchange, message, wire)
            out.append((wire, staged))
        return out

    def _entry_count(self, message: Message) -> int:
        return 2 + (len(message.pieces) if self.check else 0)

    def _entries(self, message: Message) -> list[int]:
        nbytes, kind, sums = self._declared.get(message.key, (message.nbytes, DENSE_MESSAGE, []))
        if not self.check:
            return [nbytes, kind]
        return [nbytes, kind, *sums, *[0] * (len(message.pieces) - len(sums))]

    def _base(self, piece: Piece) -> int:
        held = self.held.get(piece.destination)
        return -1 if held is None else held

    def _receive_wire(self, exchange: Exchange, message: Message, slot: torch.Tensor) -> tuple[torch.Tensor, bool]:
        header = self._headers[message.key]
        if header.kind == DENSE_MESSAGE:
            in_place = exchange.in_place_wire(message)
            return (in_place, False) if in_place is not None else (slot, True)
        if header.kind == DELTA_MESSAGE:
            return slot[: header.nbytes], True
        return slot, True  # unknown (its sender drained): the whole slot takes whatever comes, and is not read

    def expected_bytes(self, message: Message) -> int | None:
        """The size a received message's sender declared for it (None: its header never came)."""
        header = self._headers.get(message.key)
        return None if header is None or header.kind == UNKNOWN else header.nbytes

    # -- a sender's message --------------------------------------------------------------------------

    def pack(self, exchange: Exchange, message: Message, slot: torch.Tensor, staged: bool) -> torch.Tensor:
        """The wire of a send: the dense message (in place where it can be) or its encoding, written into
        ``slot`` (always staged); every piece's snapshot is refreshed to what the message carries: a piece sent by
        index only at its changed elements (scattered from the values it sends), any other piece whole."""
        in_place = exchange.in_place_wire(message)
        if in_place is not None:
            nows = [in_place]
        else:
            self.dense.pack_pieces(message, slot)
            nows = [slot[offset : offset + piece.nbytes] for piece, offset in message.pieces]
        bases = self._bases.get(message.key) or []
        found: list[_Encoded] = []
        for index, ((piece, _), now) in enumerate(zip(message.pieces, nows)):
            dtype = self.dense.piece_dtype(message, piece)
            itemsize = itemsize_of(dtype)
            key = (message.peer, message.hop, piece, str(dtype))
            snapshot = self.session.snapshots.get(key)
            base = bases[index] if index < len(bases) else UNKNOWN
            if snapshot is not None and snapshot.data.numel() != now.numel():  # never for one key: start afresh
                snapshot = None
            kind, count, parts = DENSE, 0, None
            if snapshot is None:
                snapshot = self.session.snapshots[key] = Snapshot(now.clone())
            elif not self.anchor and base >= 0 and snapshot.version == base:
                kind, count, parts = encode_piece(now, snapshot.data, itemsize)
            else:
                snapshot.data.copy_(now)
            snapshot.version = None  # pending: set when this refit completes everywhere
            self._touched.append(key)
            found.append(_Encoded(kind, count, itemsize, snapshot, parts))
        sums = [checksum(encoded.snapshot.data) for encoded in found] if self.check else []
        size = aligned(PIECE_HEADER_BYTES * len(found)) + sum(
            piece_bytes(e.kind, e.changed, e.snapshot.data.numel() // e.itemsize, e.itemsize) for e in found
        )
        delta = sum(encoded.kind != DENSE for encoded in found)
        self.pieces_sent_as_delta += delta
        self.pieces_sent_dense += len(found) - delta
        if not delta or size >= message.nbytes:
            self._declared[message.key] = (message.nbytes, DENSE_MESSAGE, sums)
            self.wire_sent += message.nbytes
            return in_place if in_place is not None else slot[: message.nbytes]  # encodings were built beside it
        self._declared[message.key] = (size, DELTA_MESSAGE, sums)
        self.wire_sent += size
        return _written(slot, found, size)

    def unsent(self, message: Message) -> None:
        """Declare a send dense without encoding it (this rank drains: its bytes are never read)."""
        self._declared[message.key] = (message.nbytes, DENSE_MESSAGE, [0] * len(message.pieces))

    # -- a receiver's message ------------------------------------------------------------------------

    def unpack(self, message: Message, wire: torch.Tensor, staged: bool) -> list[str]:
        """Write a received message into the destinations: unpack a dense one, apply an encoded one; then,
        with the check on, compare every piece's checksum with its sender's. Returns what is wrong with it."""
        header = self._headers.get(message.key)
        self.wire_received += wire.numel()
        if header is None or header.kind == UNKNOWN:
            return ["came without its size header"]
        if header.kind == DENSE_MESSAGE:
            self.dense.unpack(message, wire, staged)
        else:
            problem = self._apply(message, wire)
            if problem is not None:
                return [problem]
        if not self.check:
            return []
        return [
            f"left tensor {piece.destination} unlike its sender's bytes once applied (the checksum after the delta "
            "differs)"
            for (piece, _), summed in zip(message.pieces, header.sums)
            if checksum(_as_wire_bytes(self.dense.target_of(piece), self.dense.piece_dtype(message, piece))) != summed
        ]

    def _apply(self, message: Message, wire: torch.Tensor) -> str | None:
        """Apply an encoded message piece by piece; the reason it cannot be, if it cannot (nothing written then
        for that piece and those after it)."""
        count = len(message.pieces)
        start = aligned(PIECE_HEADER_BYTES * count)
        if wire.numel() < start:
            return f"is {wire.numel()} bytes, shorter than its header"
        header = wire[: PIECE_HEADER_BYTES * count].view(_int64()).view(-1, 2).tolist()
        position = start
        for (piece, _), (kind, changed) in zip(message.pieces, header):
            target = self.dense.target_of(piece)
            dtype = self.dense.piece_dtype(message, piece)
            elements = target.numel()
            if kind not in (DENSE, INDICES, BITMAP) or not 0 <= changed <= elements:
                return f"holds a piece of {piece.tensor} with kind {kind} and {changed} changes: not an encoding"
            nbytes = piece_bytes(kind, changed, elements, itemsize_of(dtype))
            if position + nbytes > wire.numel():
                return f"is {wire.numel()} bytes, shorter than its pieces' encodings"
            problem = apply_piece(target, wire[position : position + nbytes], kind, changed, dtype)
            if problem is not None:
                return f"{problem} in a piece of {piece.tensor}"
            position += nbytes
        return None

    # -- the end ---------------------------------------------------------------------------------------

    def commit(self, version: int | None) -> None:
        """The refit completed on every rank: what this rank sent is what its receivers hold at ``version``.
        Snapshots of the same tensors toward the same peers from another cut (another plan, another shape) are
        dropped; those toward peers this refit did not send to are kept (a destination that skipped it)."""
        snapshots = self.session.snapshots
        for tensor in self.destinations.values():
            self.session.counters[tensor_key(tensor)] = tensor._version
        touched = set(self._touched)
        for key in touched:
            snapshots[key].version = version
        cut = {(peer, hop, piece.tensor) for peer, hop, piece, _ in touched}
        for key in [key for key in snapshots if (key[0], key[1], key[2].tensor) in cut and key not in touched]:
            del snapshots[key]


def _int64() -> torch.dtype:
    import torch

    return torch.int64


def _as_wire_bytes(target: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A destination box's bytes as its sender put them on the wire (in the wire dtype, contiguous)."""
    import torch

    values = target if target.dtype == dtype else target.to(dtype)
    return values.contiguous().reshape(-1).view(torch.uint8)


class _Encoded(NamedTuple):
    """One piece of a message being encoded: its kind, its number of changed elements, its refreshed snapshot
    (what the receiver will hold) and, for a changed piece, its encoding's head and values."""

    kind: int
    changed: int
    itemsize: int
    snapshot: Snapshot
    parts: tuple[torch.Tensor, torch.Tensor] | None


def _written(slot: torch.Tensor, found: Sequence[_Encoded], size: int) -> Any:
    """Write an encoded message into ``slot``: a dense piece from its refreshed snapshot (the slot's own bytes
    may lie under the header), a changed one from its encoding; returns its bytes."""
    import torch

    header = torch.tensor([[encoded.kind, encoded.changed] for encoded in found], dtype=torch.int64)
    slot[: header.numel() * 8].view(torch.int64).copy_(header.view(-1))
    position = aligned(PIECE_HEADER_BYTES * len(found))
    for encoded in found:
        if encoded.parts is None:
            data = encoded.snapshot.data
            slot[position : position + data.numel()].copy_(data)
            position += aligned(data.numel())
        else:
            position += write_encoding(slot[position:], *encoded.parts)
    return slot[:size]


def _header(message: Message, entry: list[int]) -> _Header:
    """What a sizes-round entry says of ``message``; UNKNOWN where it is not a size and kind the message can
    have (a drained sender's bytes)."""
    if len(entry) < 2:
        return _Header(UNKNOWN, UNKNOWN, ())
    nbytes, kind, *sums = entry
    if kind == DENSE_MESSAGE and nbytes == message.nbytes:
        return _Header(nbytes, kind, tuple(sums))
    if kind == DELTA_MESSAGE and 0 < nbytes < message.nbytes:
        return _Header(nbytes, kind, tuple(sums))
    return _Header(UNKNOWN, UNKNOWN, ())


def _by_peer(messages: Sequence[Message], send: bool) -> dict[int, list[Message]]:
    """The batch's data messages of one direction, by peer, in the batch's order."""
    peers: dict[int, list[Message]] = {}
    for message in messages:
        if message.send == send and not message.ledger:
            peers.setdefault(message.peer, []).append(message)
    return peers


__all__ = ["DeltaSession"]
