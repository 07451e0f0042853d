"""Delta refits: each piece travels as its changed elements since the version its destination holds.

**What a sender keeps.** For every piece it sends (to each peer, at each hop), the bytes it last put on the
wire for it, in the wire dtype (after a converting refit's cast or fp8 quantization), with the version of the
refit that delivered them: a *snapshot*. So a rank's extra memory is one copy of the bytes it sends in a dense
refit (``RankRefit.bytes_sent``: a relay's forwards included), kept between refits; a receiver keeps nothing
more than its staging buffer. A snapshot's version is set only when its refit completed on every rank
(``DeltaSession.commit``); one written by a refit that failed has none, so its next send is dense. When a
tensor's pieces change (another plan, another shape), its snapshots from the old cut are dropped at the next
completed refit that sends it.

**Versions decide.** Before a batch's data moves, each receiver tells each of its senders in the batch, piece
by piece, the version its destination tensor holds (``held_version``; none when it was never written, when a
failed refit wrote part of it, or when the process is new): a sender sends a piece as a delta only when that
is the version of its snapshot, else dense. A destination tensor whose in-place counter moved since a delta
refit last completed into it (written by something else, or a new tensor at a freed one's address) holds no
base either. So no rank ever applies a delta to a base it does not hold: a new or restarted engine, a failed
refit, or a subset that skipped a tensor all get dense pieces (``delta_checksum`` catches a base changed where
no counter sees it, through ``.data``). With
``anchor_every=K`` every version divisible by K is dense throughout (a full refit).

**Encoding.** A changed piece is its changed elements (compared in the wire dtype's width: bitwise) as int32
indices and values, or a bitmap of them and values, whichever is smaller, or the dense piece when that is
smaller still. A message whose pieces all travel dense is the dense message itself (in place where the dense
refit's is); any other is a header (kind and count per piece) and the pieces' encodings. The receiver writes
the changed elements into its destination in place (cast on the way where the refit widens): by index, or
through the unpacked bitmap as a mask. The sender refreshes its snapshot of a piece sent by index at the
changed elements only; any other piece's snapshot is copied whole (on a CPU a copy beats a masked write).

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
from typing import TYPE_CHECKING, Any, NamedTuple

from ...refit.schedule import Message, Piece, aligned
from .exchange import checksum

if TYPE_CHECKING:
    import torch

    from .exchange import Exchange

DENSE, INDICES, BITMAP = 0, 1, 2
"""How one piece travels in an encoded message: whole, as int32 indices and values, or as a bitmap and values."""
DENSE_MESSAGE, DELTA_MESSAGE = 0, 1
"""A message's kind: the dense message itself, or a header and its pieces' encodings."""
UNKNOWN = -2
"""A header entry that never arrived (its sender drained): never a version, a size or a kind."""
PIECE_HEADER_BYTES = 16
"""Per piece of an encoded message: its kind and its count of changed elements, two int64."""
SAMPLE = 4096
"""Elements of a piece sampled (strided) first: when as many changed as make the dense piece the smallest, it is
sent dense without a full compare."""
_INDEX_LIMIT = 1 << 31
"""Pieces with more elements than int32 indices reach travel as a bitmap or dense."""


class Snapshot:
    """The bytes a sender last put on the wire for one piece toward one peer, and the version that delivered
    them (None until the refit that sent them completed everywhere)."""

    __slots__ = ("data", "version")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.version: int | None = None


SnapshotKey = tuple[int, int, Piece, str]
"""(peer, hop, piece, wire dtype): what a snapshot is of; another cut, shape or dtype is another key."""

_snapshots: dict[SnapshotKey, Snapshot] = {}
"""This process's snapshots: lost with the process, so a restarted sender sends dense."""


_counters: dict[tuple[str, int, tuple[int, ...]], int] = {}
"""A receiver's destination tensors (device, address, shape) -> their in-place version counter when a delta
refit last completed into them. A tensor whose counter moved since (written by anything else), or a new tensor
that took a freed one's address, holds no base a delta can build on, whatever ``held_version`` recorded."""


def _identity(tensor: torch.Tensor) -> tuple[str, int, tuple[int, ...]]:
    return str(tensor.device), tensor.data_ptr(), tuple(tensor.shape)


def bases_held(held: Mapping[str, int | None], destinations: Mapping[str, torch.Tensor]) -> dict[str, int | None]:
    """The version each destination tensor holds as a delta's base: ``held`` (its intact ``held_version``),
    unless the tensor was written since a delta refit last completed into it, or is not the tensor it was."""
    return {
        name: version if _counters.get(_identity(tensor)) == tensor._version else None
        for name, version in held.items()
        if (tensor := destinations.get(name)) is not None
    }


def snapshot_bytes() -> int:
    """The memory this rank's snapshots hold: about the bytes it sent in its last refits of each tensor."""
    return sum(snapshot.data.numel() for snapshot in _snapshots.values())


def forget_snapshots() -> None:
    """Drop every snapshot of this process (its next refit sends dense): what a restarted sender has."""
    _snapshots.clear()


# ----------------------------------------------------------------------------- one piece


_WORDS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _words(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    import torch

    return data.view(getattr(torch, _WORDS[itemsize]))


class Changes:
    """The changed elements of a piece, in the form finding them gave: ascending int64 indices (few changed:
    found from the changed 64-bit words) or a mask over the elements (many changed: one element-wise compare).
    The other form is derived only where the chosen encoding needs it, so neither path pays for both."""

    __slots__ = ("_listed", "count", "elements", "found", "is_mask")

    def __init__(self, count: int, elements: int, found: torch.Tensor, is_mask: bool) -> None:
        self.count, self.elements, self.found, self.is_mask = count, elements, found, is_mask
        self._listed: torch.Tensor | None = None

    def indices(self) -> torch.Tensor:
        """The changed elements' indices, ascending (int64); listed from the mask once, when first asked."""
        if self._listed is None:
            self._listed = self.found.nonzero().view(-1) if self.is_mask else self.found
        return self._listed

    def mask(self) -> torch.Tensor:
        """The changed elements as bools, padded with False to a whole number of 64-bit words (to pack)."""
        import torch

        padded = torch.zeros(-(-self.elements // 64) * 64, dtype=torch.bool, device=self.found.device)
        if self.is_mask:
            padded[: self.elements] = self.found
        else:
            padded[self.found] = True
        return padded


def changed_elements(now: torch.Tensor, before: torch.Tensor, itemsize: int) -> Changes | None:
    """The elements of width ``itemsize`` whose bytes differ between two contiguous byte tensors of one size;
    None when so many differ that the dense piece is the smallest encoding.

    A strided sample of ``SAMPLE`` elements settles a piece that mostly changed without reading all of it. Else
    64-bit words are compared first (one compare per 8 bytes: the cheapest pass over the bytes) and, when few
    changed, only their elements are, giving indices; when many words changed, every element is compared,
    giving a mask (which the bitmap encoding packs as it is, without listing the elements).
    """
    import torch

    elements = now.numel() // itemsize
    now_items, before_items = _words(now, itemsize), _words(before, itemsize)
    if elements >= 4 * SAMPLE:
        stride = elements // SAMPLE
        seen = int(torch.count_nonzero(torch.ne(now_items[::stride][:SAMPLE], before_items[::stride][:SAMPLE])))
        if cheapest(seen * elements // SAMPLE, elements, itemsize) == DENSE:
            return None
    aligned_words = now.numel() % 8 == 0 and now.storage_offset() % 8 == 0 and before.storage_offset() % 8 == 0
    if itemsize < 8 and aligned_words:
        now_words, before_words = now.view(torch.int64), before.view(torch.int64)
        differs = torch.ne(now_words, before_words)
        changed_words = int(torch.count_nonzero(differs))
        if changed_words * 4 <= differs.numel():  # few: the elements of the changed words only
            if cheapest(changed_words, elements, itemsize) == DENSE:
                return None
            words = differs.nonzero().view(-1)
            shift = (8 // itemsize).bit_length() - 1  # log2 of the elements per word (shifts: no int64 division)
            inner = torch.ne(
                _words(torch.index_select(now_words, 0, words), itemsize),
                _words(torch.index_select(before_words, 0, words), itemsize),
            )
            found = inner.view(-1).nonzero().view(-1)
            indices = torch.index_select(words, 0, found >> shift).bitwise_left_shift_(shift)
            indices.bitwise_or_(found.bitwise_and_((1 << shift) - 1))
            return Changes(indices.numel(), elements, indices, is_mask=False)
    differs = torch.ne(now_items, before_items)
    count = int(torch.count_nonzero(differs))
    if cheapest(count, elements, itemsize) == DENSE:
        return None
    return Changes(count, elements, differs, is_mask=True)


def piece_bytes(kind: int, count: int, elements: int, itemsize: int) -> int:
    """The bytes a piece's encoding takes (aligned, as it lies in a message)."""
    if kind == DENSE:
        return aligned(elements * itemsize)
    if kind == INDICES:
        return aligned(4 * count) + aligned(count * itemsize)
    return aligned(-(-elements // 8)) + aligned(count * itemsize)


def cheapest(count: int, elements: int, itemsize: int) -> int:
    """The smallest encoding of a piece with ``count`` of its ``elements`` changed (dense on a tie)."""
    options = [(piece_bytes(DENSE, count, elements, itemsize), DENSE)]
    if elements < _INDEX_LIMIT:
        options.append((piece_bytes(INDICES, count, elements, itemsize), INDICES))
    options.append((piece_bytes(BITMAP, count, elements, itemsize), BITMAP))
    return min(options)[1]


_PACK = 0x0102040810204080
"""Times a word of eight 0/1 bytes, this gathers byte j's bit into bit 56 + j: eight flags packed in one step."""


def _bit_weights(device: Any) -> torch.Tensor:
    import torch

    return torch.tensor([1 << bit for bit in range(8)], dtype=torch.uint8, device=device)


def itemsize_of(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``: the width changes are found in."""
    return int(dtype.itemsize)


def encoding(kind: int, changes: Changes, data: torch.Tensor, itemsize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A changed piece's encoding as two byte tensors, its head and its values: int32 indices, or the bitmap
    (element j of each 8 -> bit j, packed eight flags at a time from the mask), and the changed elements' bytes
    in ascending order, gathered by index (on a CPU ``nonzero`` and ``index_select`` beat ``masked_select``,
    measured: 2.8 against 5 ns per byte at 30 % changed)."""
    import torch

    values = torch.index_select(_words(data, itemsize), 0, changes.indices()).view(torch.uint8)
    if kind == INDICES:
        return changes.indices().to(torch.int32).view(torch.uint8), values
    bits = ((changes.mask().view(torch.uint8).view(torch.int64) * _PACK) >> 56).to(torch.uint8)
    return bits[: -(-changes.elements // 8)], values


def encode_piece(
    now: torch.Tensor, snapshot: torch.Tensor, itemsize: int
) -> tuple[int, int, tuple[torch.Tensor, torch.Tensor] | None]:
    """A piece's encoding against ``snapshot`` (its bytes as last sent, a delta's base), which is then refreshed
    to ``now``: (kind, changed elements, the encoding's head and values; None when dense). The encoding is
    built beside ``now``, never over it. A piece sent by index refreshes the snapshot at its changed elements
    only, from the values it sends; any other is copied whole (cheaper than a masked write on a CPU)."""
    changes = changed_elements(now, snapshot, itemsize)
    if changes is None or (kind := cheapest(changes.count, changes.elements, itemsize)) == DENSE:
        snapshot.copy_(now)
        return DENSE, 0, None
    head, values = encoding(kind, changes, now, itemsize)
    if kind == INDICES:
        _words(snapshot, itemsize).index_copy_(0, changes.indices(), _words(values, itemsize))
    else:
        snapshot.copy_(now)
    return kind, changes.count, (head, values)


def write_encoding(out: torch.Tensor, head: torch.Tensor, values: torch.Tensor) -> int:
    """Lay an encoding's head and values into ``out`` (bytes, at an aligned offset), each at an aligned offset
    so the receiver views them as int32 indices and wire-dtype values without copying; returns the bytes
    written (``piece_bytes``)."""
    start = aligned(head.numel())
    out[: head.numel()].copy_(head)
    out[start : start + values.numel()].copy_(values)
    return start + aligned(values.numel())


def apply_piece(
    target: torch.Tensor, payload: torch.Tensor, kind: int, count: int, wire_dtype: torch.dtype
) -> str | None:
    """Write an encoded piece into ``target`` (the destination's box, any strides) in place: the dense bytes,
    or its changed elements (bitwise where the dtypes agree, cast where the refit widens): scattered by index,
    or by the unpacked bitmap as a mask (``masked_scatter_``, no list of indices built). Returns why it cannot
    (a bitmap that marks another number of elements than its count; nothing written then), else None."""
    import torch

    itemsize = itemsize_of(wire_dtype)
    elements = target.numel()
    if kind == DENSE:
        target.copy_(payload[: elements * itemsize].view(wire_dtype).view(target.shape))
        return None
    start = aligned(4 * count) if kind == INDICES else aligned(-(-elements // 8))
    values = payload[start : start + count * itemsize].view(wire_dtype)
    if target.dtype == wire_dtype:  # bitwise, whatever the floats hold (NaN payloads included)
        target, values = _words(target, itemsize), _words(values, itemsize)
    else:
        values = values.to(target.dtype)
    if kind == BITMAP:
        bits = payload[: -(-elements // 8)]
        mask = (bits.view(-1, 1) & _bit_weights(bits.device)).ne(0).view(-1)[:elements]
        marked = int(torch.count_nonzero(mask))
        if marked != count:
            return f"holds a bitmap of {marked} changes for {count} values"
        target.masked_scatter_(mask.view(target.shape), values)
        return None
    indices = payload[: 4 * count].view(torch.int32).long()
    if target.is_contiguous():
        target.view(-1).index_copy_(0, indices, values)
    else:
        target.index_put_(torch.unravel_index(indices, target.shape), values)
    return None


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
    of each batch told it.

    Attributes:
        held: Destination tensor name -> the version it holds intact (None: none it can build on).
        anchor: This refit sends every piece dense (``anchor_every`` divides its version).
        check: Checksum every destination piece after it is written, against its sender's.
    """

    held: dict[str, int | None]
    destinations: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """This rank's destination tensors, whose counters ``commit`` records."""
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
    """Peers whose bases this rank exchanged already in this refit (``learn_bases``)."""

    # -- the two header rounds -----------------------------------------------------------------------

    def learn_bases(self, exchange: Exchange, messages: Sequence[Message]) -> None:
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
        got = _swap(exchange, messages, outgoing, expected)
        for peer, mine in _by_peer(pairs, send=True).items():
            values = got.get(peer, [])
            for message in mine:
                self._bases[message.key], values = values[: len(message.pieces)], values[len(message.pieces) :]

    def declare_sizes(
        self, exchange: Exchange, messages: Sequence[Message], wires: list[tuple[torch.Tensor, bool]]
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
        got = _swap(exchange, messages, outgoing, expected)
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

    def encode(self, exchange: Exchange, message: Message, slot: torch.Tensor) -> torch.Tensor:
        """The wire of a send: the dense message (in place where it can be) or its encoding, written into
        ``slot``; every piece's snapshot is refreshed to what the message carries: a piece sent by index only
        at its changed elements (scattered from the values it sends), any other piece whole."""
        in_place = exchange.in_place_wire(message)
        if in_place is not None:
            nows = [in_place]
        else:
            exchange.pack_pieces(message, slot)
            nows = [slot[offset : offset + piece.nbytes] for piece, offset in message.pieces]
        bases = self._bases.get(message.key) or []
        found: list[_Encoded] = []
        for index, ((piece, _), now) in enumerate(zip(message.pieces, nows)):
            dtype = exchange.wire_dtype(message, piece)
            itemsize = itemsize_of(dtype)
            key = (message.peer, message.hop, piece, str(dtype))
            snapshot = _snapshots.get(key)
            base = bases[index] if index < len(bases) else UNKNOWN
            if snapshot is not None and snapshot.data.numel() != now.numel():  # never for one key: start afresh
                snapshot = None
            kind, count, parts = DENSE, 0, None
            if snapshot is None:
                snapshot = _snapshots[key] = Snapshot(now.clone())
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

    def dense(self, message: Message) -> None:
        """Declare a send dense without encoding it (this rank drains: its bytes are never read)."""
        self._declared[message.key] = (message.nbytes, DENSE_MESSAGE, [0] * len(message.pieces))

    # -- a receiver's message ------------------------------------------------------------------------

    def land(self, exchange: Exchange, message: Message, wire: torch.Tensor, staged: bool) -> None:
        """Write a received message into the destinations: unpack a dense one, apply an encoded one; then,
        with the check on, compare every piece's checksum with its sender's."""
        header = self._headers.get(message.key)
        self.wire_received += wire.numel()
        if header is None or header.kind == UNKNOWN:
            exchange.integrity.faults.append((message.peer, message, "came without its size header"))
            return
        if header.kind == DENSE_MESSAGE:
            if staged:
                exchange._unpack(message, wire)
        else:
            problem = self._apply(exchange, message, wire)
            if problem is not None:
                exchange.integrity.faults.append((message.peer, message, problem))
                return
        if self.check:
            for (piece, _), summed in zip(message.pieces, header.sums):
                target = exchange.target_of(piece)
                dtype = exchange.wire_dtype(message, piece)
                if checksum(_as_wire_bytes(target, dtype)) != summed:
                    exchange.integrity.faults.append(
                        (
                            message.peer,
                            message,
                            f"left tensor {piece.destination} unlike its sender's bytes once applied (the checksum "
                            "after the delta differs)",
                        )
                    )

    def _apply(self, exchange: Exchange, message: Message, wire: torch.Tensor) -> str | None:
        """Apply an encoded message piece by piece; the reason it cannot be, if it cannot (nothing written then
        for that piece and those after it)."""
        count = len(message.pieces)
        start = aligned(PIECE_HEADER_BYTES * count)
        if wire.numel() < start:
            return f"is {wire.numel()} bytes, shorter than its header"
        header = wire[: PIECE_HEADER_BYTES * count].view(_int64()).view(-1, 2).tolist()
        position = start
        for (piece, _), (kind, changed) in zip(message.pieces, header):
            target = exchange.target_of(piece)
            dtype = exchange.wire_dtype(message, piece)
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
        for tensor in self.destinations.values():
            _counters[_identity(tensor)] = tensor._version
        touched = set(self._touched)
        for key in touched:
            _snapshots[key].version = version
        cut = {(peer, hop, piece.tensor) for peer, hop, piece, _ in touched}
        for key in [key for key in _snapshots if (key[0], key[1], key[2].tensor) in cut and key not in touched]:
            del _snapshots[key]


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


def _swap(
    exchange: Exchange, messages: Sequence[Message], outgoing: dict[int, list[int]], expected: dict[int, int]
) -> dict[int, list[int]]:
    """One header round of a batch: a vector of int64 to each peer in ``outgoing``, one of ``expected[peer]``
    entries from each peer there, posted and waited for like a batch (a lost peer's never comes)."""
    import torch

    hop = messages[0].hop if messages else 0
    headers: list[Message] = []
    wires: list[tuple[torch.Tensor, bool]] = []
    for peer in sorted(set(outgoing) | set(expected)):
        if peer in exchange.lost:
            continue
        if peer in outgoing:
            values = torch.tensor(outgoing[peer], dtype=torch.int64, device=exchange.device)
            wire = values.view(torch.uint8)
            if exchange.draining and exchange.gloo:  # as a drained data send: one byte, taken by a longer receive
                wire = wire[:1]
            headers.append(Message((0, exchange.rank, peer, hop), peer, True, (), values.numel() * 8))
            wires.append((wire, False))
        if peer in expected:
            values = torch.full((expected[peer],), UNKNOWN, dtype=torch.int64, device=exchange.device)
            headers.append(Message((0, peer, exchange.rank, hop), peer, False, (), values.numel() * 8))
            wires.append((values.view(torch.uint8), False))
    if not headers:
        return {}
    exchange.land_quietly(headers, wires)
    return {
        message.peer: wire.view(torch.int64).tolist()
        for message, (wire, _) in zip(headers, wires)
        if not message.send and message.peer not in exchange.lost
    }


__all__ = [
    "BITMAP",
    "DENSE",
    "INDICES",
    "Changes",
    "DeltaSession",
    "Snapshot",
    "apply_piece",
    "changed_elements",
    "cheapest",
    "encode_piece",
    "forget_snapshots",
    "piece_bytes",
    "snapshot_bytes",
    "write_encoding",
]
