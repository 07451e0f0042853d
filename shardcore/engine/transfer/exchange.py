"""Moving one rank's messages: post each batch, land the one before while it is on the wire, check every message.

Two batches are in flight at a time: a rank posts batch k+1, then waits for batch k and unpacks what
it staged, while k+1 is on the wire (``transfer.schedule`` argues why this cannot deadlock). It does so
when k and k+1 are of the same hop and their staged bytes fit in ``bucket_bytes`` together; else it
lands k first. The staging buffer holds both: k at its low end, k+1 at its high end, so staging stays
within ``bucket_bytes`` (or the one batch's own bytes, where a message bigger than the bucket travels
alone).

A rank never leaves its batches half posted while its peers live: a peer whose op is never posted
waits until its deadline, and a gloo wait that times out closes the connection for good (measured
on torch 2.13), which would break every later refit. So when something goes wrong on this rank (a
local exception) or another rank publishes a failure, this rank *drains*: it keeps posting every
batch it has left, in order, so that its peers complete theirs, but does no more work for the
result (on gloo a drained send is one byte, which gloo accepts for a longer receive; on other
backends it is the whole buffer, unpacked). The refit then fails at its end meeting on every rank,
naming the rank at fault, and every connection is as clean as before: the next refit works. Only a
peer that died or hung is dropped: its connection is gone anyway, and this rank declares it absent
so that the end meeting does not wait for it. On gloo each op is posted alone (torch posts a gloo
batch op by op anyway), so that a connection that closed while the batch before was in flight fails
its own ops only, and the batch's other ops are still posted.

Every received message is checked against its sender's ledger: its size always, and with
``verify="checksum"`` a checksum the sender computed over the bytes it sent.

A relay's forwards (hop 1, fan-out) are sent from its destination tensors, which its hop-0 batches,
all landed before its first hop-1 batch is posted, have filled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

from ...plan.arguments import shown_ranks
from ...refit.placement import fitted
from ...refit.schedule import Batch, Message, Piece, Slot, StagingLayout, aligned, staging_layout
from ..agreement import Party, publish_failure, published_failures

if TYPE_CHECKING:
    import torch

log = logging.getLogger("shardcore.refit")

POLL_SECONDS = 0.05
"""Between batches, how often a rank looks for failures other ranks published."""
_CHECKSUM_WIDTH = 251
"""The checksum weighs each word by its position modulo this prime, so swapped or shifted words show."""


def checksum(data: torch.Tensor) -> int:
    """A position-weighted sum of a contiguous byte tensor's words (not cryptographic: it catches truncation,
    corruption and words out of place, the faults of a wrong or short message).

    Words are int64 where the bytes allow (their sums wrap alike at both ends: addition modulo 2**64 does not
    depend on the order a reduction takes), else int32, else single bytes; the result folds the plain sum,
    the position-weighted sum and the length into one int64. Summing int64 words in their own dtype is about
    ten times faster than widening int32 ones, and reads each byte once.
    """
    import torch

    words = data
    for dtype, size in ((torch.int64, 8), (torch.int32, 4)):
        if data.numel() % size == 0 and data.storage_offset() % size == 0:
            words = data.view(dtype)
            break
    n = words.numel()
    whole = n - n % _CHECKSUM_WIDTH
    columns = [0] * _CHECKSUM_WIDTH
    if whole:
        columns = words[:whole].view(-1, _CHECKSUM_WIDTH).sum(0, dtype=torch.int64).tolist()
    for index, value in enumerate(words[whole:].tolist()):
        columns[index] += int(value)
    plain = sum(columns)
    weighted = sum((k + 1) * column for k, column in enumerate(columns))
    return (plain * 1_000_003 + weighted * 31 + n) % (1 << 63)


def view_of(tensor: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The box of ``shape`` at ``offset`` in ``tensor``; through a weight map the tensor may have unit dims more
    or fewer than the box on the left (``placement.fitted``), and the view has the tensor's."""
    return tensor[tuple(slice(o, o + n) for o, n in zip(offset, fitted(shape, len(offset))))]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


@dataclass
class Integrity:
    """What this rank found wrong with what it received: (sender, message, what) per fault."""

    faults: list[tuple[int, Message, str]] = field(default_factory=list)

    def describe(self, rank: int) -> str:
        sender, message, what = self.faults[0]
        tensors = sorted({piece.tensor for piece, _ in message.pieces})
        shown = ", ".join(tensors[:3]) + (f" and {len(tensors) - 3} more" if len(tensors) > 3 else "")
        more = f" ({len(self.faults)} faulty messages in all)" if len(self.faults) > 1 else ""
        return f"rank {rank} received from rank {sender} a message of {shown} that {what}{more}"


class _InFlight(NamedTuple):
    """A posted batch not yet landed: its messages as posted, their wires (bytes, staged), and their works."""

    messages: list[Message]
    wires: list[tuple[torch.Tensor, bool]]
    works: list[Any]


@dataclass
class Exchange:
    """One rank's exchange in one refit: its batches, its tensors, and what it saw."""

    rank: int
    batches: list[Batch]
    copies: Sequence[Any]
    """This rank's local copies (transfers with src == dst == rank)."""
    sources: Mapping[str, torch.Tensor]
    destinations: Mapping[str, torch.Tensor]
    tag: int
    verify: str
    party: Party
    epoch: int
    deadline: float
    gloo: bool
    bucket_bytes: int
    """Staging bytes one batch may hold, and two batches in flight together (``schedule.staging_layout``)."""
    conversion: Any = None
    """The refit's conversions on this rank (``transfer.convert.Conversion``), or None when nothing converts."""
    delta: Any = None
    """A delta refit's part on this rank (``transfer.delta.DeltaSession``), or None for a dense refit: then every
    data message is staged (encoded ones cannot travel in place), and each batch's two header rounds come first."""
    group: Any = None
    """The process group the messages go on, peers numbered in it (a refit group's); None: the default group."""
    places: dict[tuple[int, ...], tuple[bool, str, int, int]] | None = None
    """Where each message that travels in place lies: (in the sources, else the destinations; tensor; first byte;
    end byte), by key. Found from the tensors when None; a refit of the schedule's plan part passes what an
    earlier one found (``execute._schedule``): its tensors have the shapes and dtypes checked against the plan,
    so the same messages lie at the same bytes, and finding them (a view per message) is not paid again."""
    landing: Any = None
    """The destination tensors this rank quantizes on landing (``transfer.landing.Landing``: fp8 through a layout),
    whose pieces land in staging copies (``written``), never in place; None when there are none."""
    staging: torch.Tensor | None = None
    draining: str | None = None
    """Why this rank no longer works for the result (its own error, or a failure another rank published)."""
    error: BaseException | None = None
    """This rank's own failure, if any."""
    lost: dict[int, str] = field(default_factory=dict)
    """Peers whose connection failed (died, or hung past the deadline), with why."""
    integrity: Integrity = field(default_factory=Integrity)
    posted: dict[tuple[int, ...], int] = field(default_factory=dict)
    """Bytes this rank actually posted for each of its sends: what its ledgers state."""
    sent_sums: dict[tuple[int, ...], int] = field(default_factory=dict)
    received_sums: dict[tuple[int, ...], int] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0
    wrote: bool = False
    """Whether any destination byte may have been written (a receive posted or a local copy made)."""
    _polled: float = field(default_factory=time.monotonic)
    """When this rank last looked for published failures: not before the first batch (the start meeting has just
    shown that every rank was well), so a short refit costs no poll."""
    _directions: dict[tuple[int, bool], dict[tuple[int, ...], Message]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for batch in self.batches:
            for message in batch.messages:
                if not message.ledger:
                    self._directions.setdefault((message.peer, message.send), {})[message.key] = message

    @cached_property
    def layout(self) -> StagingLayout:
        """Where each batch stages, whether it goes on the wire while the batch before it is in flight, and the
        staging buffer's size (see ``schedule.staging_layout``)."""
        return staging_layout(
            self.batches, [self._staged_bytes(batch.messages) for batch in self.batches], self.bucket_bytes
        )

    def staging_bytes(self) -> int:
        """The staging memory the batches need: the most that two batches in flight stage together, or one alone
        (in-place messages take none): within ``bucket_bytes`` unless one message is bigger on its own."""
        return self.layout.nbytes

    def run(self) -> None:
        """Post every batch in order, each while the one before is still in flight where the layout allows,
        copying locally while the first is on the wire; never raises for a fault it can record (its own, a
        peer's, a faulty message)."""
        flight: _InFlight | None = None
        for number, (batch, slot) in enumerate(zip(self.batches, self.layout.slots)):
            if flight is not None and not slot.overlaps:
                self._land(flight)
                flight = None
            if number:  # the first batch follows the start meeting at once; a failure since shows at the next poll
                self._poll()
            posted = self._post(batch, slot)
            if number == 0:
                self._guarded(self._copy_locally)
            if flight is not None:
                self._land(flight)
            flight = posted
        if flight is not None:
            self._land(flight)
        if not self.batches:
            self._guarded(self._copy_locally)
        if self.landing is not None:
            self._guarded(self.landing.finish)

    def _copy_locally(self) -> None:
        """The pieces this rank holds on both sides, copied from its source tensors into its destinations."""
        self.wrote = self.wrote or bool(self.copies)
        for transfer in sorted(self.copies):
            shape = tuple(stop - start for start, stop in transfer.box)
            offset = tuple(transfer.src_offset)
            source = view_of(self.sources[transfer.tensor], offset, shape)
            if self.conversion is not None:  # quantized with its scales, or cast by the copy
                source = self.conversion.outgoing(transfer.tensor, source, offset)
            target = view_of(self.written(transfer.destination), tuple(transfer.dst_offset), shape)
            target.copy_(source.reshape(target.shape))
            self.bytes_copied += int(transfer.bytes)
            self._landed(transfer.destination, target.numel())

    def remaining(self) -> timedelta:
        return timedelta(seconds=max(0.001, self.deadline - time.monotonic()))

    def fail(self, error: BaseException) -> None:
        """Record this rank's own failure, publish it, and drain from now on."""
        if self.error is None:
            self.error = error
            publish_failure(self.party, self.epoch, error)
            log.warning(
                "shardcore refit: rank %d failed (%s: %s); draining its remaining batches",
                self.rank,
                type(error).__name__,
                error,
            )
        self.draining = self.draining or "its own error"

    def _guarded(self, step: Any) -> None:
        if step is None or self.draining:
            return
        try:
            step()
        except Exception as error:  # any local failure is published and drained, never left half done
            self.fail(error)

    def others_failed(self) -> bool:
        """Whether another rank published a failure (then its drained sends explain short messages here)."""
        return any(r != self.rank for r in published_failures(self.party, self.epoch))

    def _poll(self) -> None:
        """Look for failures other ranks published (at most every POLL_SECONDS); drain if there is one."""
        now = time.monotonic()
        if self.draining or now - self._polled < POLL_SECONDS:
            return
        self._polled = now
        others = {r: text for r, text in published_failures(self.party, self.epoch).items() if r != self.rank}
        if others:
            first = min(others)
            self.draining = f"rank {first} failed: {others[first]}"

    # -- one batch -------------------------------------------------------------------------------

    def _post(self, batch: Batch, slot: Slot) -> _InFlight:
        """Bind the batch's messages (peers already lost left out) to their bytes in ``slot``, and post them."""
        live = [m for m in batch.messages if m.peer not in self.lost]
        region = None if self.staging is None else self.staging[slot.offset : slot.offset + slot.nbytes]
        if self.delta is not None:  # the receivers' versions, before the senders encode
            self.delta.learn_bases(self, live)
        wires = self._bind(live, region)
        if self.delta is not None:  # the sizes, before the receivers post
            wires = self.delta.declare_sizes(self, live, wires)
        self.wrote = self.wrote or any(not m.send and not m.ledger for m in live)
        return _InFlight(live, wires, self._issue(live, wires))

    def _issue(self, messages: Sequence[Message], wires: Sequence[tuple[torch.Tensor, bool]]) -> list[Any]:
        """Post the ops: one coalesced batch where the backend coalesces one (NCCL, HCCL); on gloo, which does
        not (torch posts a gloo batch op by op anyway), each op straight on the group, so that a connection
        that closed fails its own peer's ops only and the batch's other ops are still posted, without torch's
        per-call checks. Returns a work per op (None where it could not be posted), or the backend's works
        for the whole batch."""
        import torch.distributed as dist

        if not self.gloo:
            try:
                return self._coalesced(messages, wires) if messages else []
            except Exception as error:  # a connection already gone: which peer is unknown, so blame the batch's
                for peer in {m.peer for m in messages}:
                    self.lost.setdefault(peer, f"its connection failed ({_first_line(error)})")
                return []
        world: Any = dist.group.WORLD if self.group is None else self.group
        works: list[Any] = []
        for message, (wire, _) in zip(messages, wires):
            work = None
            if message.peer not in self.lost:
                try:
                    work = (world.send if message.send else world.recv)([wire], message.peer, self.tag)
                except Exception as error:  # gloo: the connection closed (the peer died) while a batch was out
                    self.lost.setdefault(message.peer, f"its connection failed ({_first_line(error)})")
            works.append(work)
        return works

    def land_quietly(self, messages: Sequence[Message], wires: Sequence[tuple[torch.Tensor, bool]]) -> None:
        """Post ``messages`` (small headers, not the plan's) as a batch and wait for them, losing peers as a batch
        does; nothing is unpacked or counted."""
        messages = list(messages)
        self._land(_InFlight(messages, list(wires), self._issue(messages, wires)), lambda *landed: None)

    def _coalesced(self, messages: Sequence[Message], wires: Sequence[tuple[torch.Tensor, bool]]) -> list[Any]:
        """One batch on NCCL or HCCL: ``batch_isend_irecv`` on the default group; on a refit group, which torch's
        group registry does not know (so ``batch_isend_irecv`` cannot take it), the same coalescing on the group
        itself (``_start_coalescing`` / ``_end_coalescing``, what ``batch_isend_irecv`` runs)."""
        import torch.distributed as dist

        if self.group is None:
            ops = [
                dist.P2POp(dist.isend if m.send else dist.irecv, wire, m.peer, tag=self.tag)
                for m, (wire, _) in zip(messages, wires)
            ]
            return list(dist.batch_isend_irecv(ops))
        device = wires[0][0].device
        self.group._start_coalescing(device)
        for message, (wire, _) in zip(messages, wires):
            (self.group.send if message.send else self.group.recv)([wire], message.peer, self.tag)
        return [self.group._end_coalescing(device)]

    def _land(self, flight: _InFlight, complete: Any = None) -> None:
        """Wait for a posted batch, then complete each message (unpack, record, check its ledger)."""
        complete = complete or self._completed
        messages, wires, works = flight
        per_op = len(works) == len(messages)
        for index, work in enumerate(works):
            if work is None:
                continue
            done = range(index, index + 1) if per_op else range(len(messages))
            try:
                work.wait(self.remaining())
            except Exception as error:  # gloo: a closed connection (a dead peer) or a timeout (a hung one)
                timed_out = time.monotonic() >= self.deadline - 0.01 or "Timed out" in str(error)
                why = (
                    "did not answer before the deadline"
                    if timed_out
                    else "closed the connection (it has probably died)"
                )
                for i in done:
                    self.lost.setdefault(messages[i].peer, f"{why}: {_first_line(error)}")
                continue
            if per_op or index == len(works) - 1:
                for i in done:
                    complete(messages[i], *wires[i])

    def _staged_bytes(self, messages: Sequence[Message]) -> int:
        """The staging bytes ``messages`` take on this rank (in-place ones and ledgers take none)."""
        used = 0
        for message in messages:
            if not message.ledger and (self.delta is not None or message.key not in self._in_place):
                used = aligned(used + message.nbytes)
        return used

    def _bind(self, messages: Sequence[Message], region: torch.Tensor | None) -> list[tuple[torch.Tensor, bool]]:
        """The bytes each message goes from or into, and whether they are staged: its tensor slice, a slot of
        the batch's staging ``region``, or a ledger. Sends are packed (and summed) first, then ledgers filled.
        Without a region (the staging buffer could not be allocated: this rank drains) a staged message gets
        a buffer of its own, which a receive needs whole."""
        import torch

        wires: list[tuple[Any, bool]] = []
        slot = 0
        for message in messages:
            if message.ledger:
                wires.append((self._ledger_wire(message), False))
                continue
            wire = None if self.delta is not None else self._in_place.get(message.key)
            staged = wire is None
            if wire is None:
                if region is None:
                    wire = torch.empty(message.nbytes, dtype=torch.uint8, device=self.device)
                else:
                    wire = region[slot : slot + message.nbytes]
                    slot = aligned(slot + message.nbytes)
            if self.delta is not None and message.send:
                wire = self._encoded(message, wire)
            elif message.send and not self.draining:
                self._guarded(lambda m=message, w=wire, packed=staged: self._pack(m, w, packed))
            wires.append((wire, staged))
        if self.draining and self.gloo:  # gloo takes a shorter message for a longer receive
            wires = [
                (wire[:1] if m.send and not m.ledger else wire, staged) for m, (wire, staged) in zip(messages, wires)
            ]
        for message, (wire, _) in zip(messages, wires):
            if message.send and not message.ledger:
                self.posted[message.key] = wire.numel()
        for message, (wire, _) in zip(messages, wires):
            if message.ledger and message.send:
                self._fill_ledger(message, wire)
        return wires

    def _encoded(self, message: Message, slot: torch.Tensor) -> torch.Tensor:
        """A delta refit's send: its wire as ``delta`` encodes it into ``slot`` (the dense message when this rank
        drains or fails here, which its peers then never read), summed when verifying."""
        wire = slot
        if self.draining:
            self.delta.dense(message)
        else:
            try:
                wire = self.delta.encode(self, message, slot)
            except Exception as error:  # published and drained, like any failure to pack
                self.fail(error)
                self.delta.dense(message)
        if self.verify == "checksum":
            self.sent_sums[message.key] = checksum(wire)
        return wire

    def in_place_wire(self, message: Message) -> torch.Tensor | None:
        """The bytes, in its own tensor, of a message that can travel in place (None: it is staged)."""
        return self._in_place.get(message.key)

    def wire_dtype(self, message: Message, piece: Piece) -> torch.dtype:
        """The dtype a piece of ``message`` travels in (its tensor's, or a converting refit's wire dtype)."""
        name = self._name(message, piece)
        tensor = self.sources[name] if message.send and not message.hop else self.written(name)
        return tensor.dtype if self.conversion is None else self.conversion.wire_dtype(piece.tensor, tensor.dtype)

    def target_of(self, piece: Piece) -> torch.Tensor:
        """The box of this rank's destination tensor a received piece lands in."""
        return view_of(self.written(piece.destination), piece.dst_offset, piece.shape)

    def written(self, name: str) -> torch.Tensor:
        """The tensor the pieces of destination ``name`` land in (and a relay forwards from): the destination
        itself, or its staging copy when it is quantized on landing."""
        if self.landing is not None and name in self.landing:
            return self.landing.tensor(name)
        return self.destinations[name]

    def _landed(self, name: str, elements: int) -> None:
        """``elements`` of destination ``name`` landed (or were packed for a forward): a landing counts them."""
        if self.landing is not None and name in self.landing:
            self.landing.landed(name, elements)

    @staticmethod
    def _name(message: Message, piece: Piece) -> str:
        """The local tensor ``message`` reads or writes ``piece`` in: its source tensor for a send from the
        sources, else the destination's (another one through a weight map)."""
        return piece.tensor if message.send and not message.hop else piece.destination

    def _sent_from(self, message: Message, name: str) -> torch.Tensor:
        """The tensor a send reads ``name`` from: its source, or for a relay's forward (hop 1) its destination."""
        return self.written(name) if message.hop else self.sources[name]

    @cached_property
    def _in_place(self) -> dict[tuple[int, ...], torch.Tensor]:
        """The bytes, in its own tensor, of every message that travels in place, by key (bound once, for the
        layout and the posts); the others are staged."""
        if self.places is None:
            self.places = self._find_places()
        tensors: dict[tuple[bool, str], torch.Tensor] = {}
        wires: dict[tuple[int, ...], torch.Tensor] = {}
        for key, (in_sources, name, start, end) in self.places.items():
            whole = tensors.get((in_sources, name))
            if whole is None:
                whole = tensors[in_sources, name] = as_bytes((self.sources if in_sources else self.destinations)[name])
            wires[key] = whole[start:end]
        return wires

    def _find_places(self) -> dict[tuple[int, ...], tuple[bool, str, int, int]]:
        """Where each message that can travel in place lies in its tensor (see ``places``)."""
        places: dict[tuple[int, ...], tuple[bool, str, int, int]] = {}
        for batch in self.batches:
            for message in batch.messages:
                place = None if message.ledger else self._contiguous_slice(message)
                if place is not None:
                    places[message.key] = place
        return places

    def _contiguous_slice(self, message: Message) -> tuple[bool, str, int, int] | None:
        """Where a one-piece message's slice of its tensor lies, if contiguous and not cast on the way."""
        if len(message.pieces) != 1:
            return None
        piece = message.pieces[0][0]
        reads_source = message.send and not message.hop  # a relay's forward reads its destination
        if self.conversion is not None and not self.conversion.in_place(piece.tensor, reads_source):
            return None  # cast on the way: through the staging buffer
        name = self._name(message, piece)
        if not reads_source and self.landing is not None and name in self.landing:
            return None  # lands in a staging copy allocated when its first piece does
        tensor = (self.sources if reads_source else self.destinations).get(name)
        if tensor is None:  # a scale this rank never computed: it drains, and the message is never read
            return None
        view = view_of(tensor, piece.src_offset if message.send else piece.dst_offset, piece.shape)
        if not view.is_contiguous():
            return None
        start = view.data_ptr() - tensor.data_ptr()
        return reads_source, name, start, start + view.numel() * view.element_size()

    def _pack(self, message: Message, wire: torch.Tensor, staged: bool) -> None:
        """Copy a staged send's pieces into its slot; sum the message when verifying."""
        if staged:
            self.pack_pieces(message, wire)
        if self.verify == "checksum":
            self.sent_sums[message.key] = checksum(wire)

    def pack_pieces(self, message: Message, wire: torch.Tensor) -> None:
        """Copy a send's pieces, in the wire's dtype, to their offsets in ``wire``."""
        for piece, offset in message.pieces:
            name = self._name(message, piece)
            view = view_of(self._sent_from(message, name), piece.src_offset, piece.shape)
            dtype = view.dtype
            if self.conversion is not None:  # cast (by the copy) or quantized into the wire's dtype
                dtype = self.conversion.wire_dtype(piece.tensor, dtype)
                if not message.hop:  # a relay forwards its destination's bytes, already converted
                    view = self.conversion.outgoing(piece.tensor, view, piece.src_offset)
            wire[offset : offset + piece.nbytes].view(dtype).view(view.shape).copy_(view)
            if message.hop:  # a forward of a staging copy has read it
                self._landed(name, view.numel())

    def _ledger_wire(self, message: Message) -> torch.Tensor:
        import torch

        return torch.zeros(message.nbytes // 8, dtype=torch.int64, device=self.device)

    def _fill_ledger(self, ledger: Message, wire: torch.Tensor) -> None:
        """Every message of this direction of the pair: (bytes sent, checksum); all are bound by now."""
        import torch

        keys = [(index, *ledger.key[1:]) for index in range(wire.numel() // 2)]
        entries = [value for key in keys for value in (self.posted.get(key, -1), self.sent_sums.get(key, 0))]
        wire.copy_(torch.tensor(entries, dtype=torch.int64))

    def _completed(self, message: Message, wire: torch.Tensor, staged: bool) -> None:
        if message.send:
            self.bytes_sent += message.payload
            return
        self.bytes_received += message.payload
        if self.draining:
            return
        if message.ledger:
            self._guarded(lambda: self._check_ledger(message, wire))
            return
        if self.verify == "checksum":
            self.received_sums[message.key] = checksum(wire)
        if self.delta is not None:
            self._guarded(lambda: self.delta.land(self, message, wire, staged))
        elif staged:
            self._guarded(lambda: self._unpack(message, wire))

    def _unpack(self, message: Message, wire: torch.Tensor) -> None:
        """Copy a staged dense message's pieces from ``wire`` into the destinations (cast where they widen)."""
        for piece, offset in message.pieces:
            target = self.target_of(piece)
            dtype = target.dtype if self.conversion is None else self.conversion.wire_dtype(piece.tensor, target.dtype)
            target.copy_(wire[offset : offset + piece.nbytes].view(dtype).view(target.shape))
            self._landed(piece.destination, target.numel())

    def _check_ledger(self, ledger: Message, wire: torch.Tensor) -> None:
        """Compare what the sender says it sent with what this rank expected and received."""
        expected = self._directions.get((ledger.peer, False), {})
        for index, (size, summed) in enumerate(wire.view(-1, 2).tolist()):
            message = expected[(index, *ledger.key[1:])]
            nbytes = message.nbytes if self.delta is None else self.delta.expected_bytes(message)
            if size != nbytes:
                said = "nothing" if size < 0 else f"{size} bytes"
                here = "of no declared size" if nbytes is None else f"{nbytes} bytes"
                self.integrity.faults.append((ledger.peer, message, f"is {here} here but {said} as sent"))
            elif self.verify == "checksum" and self.received_sums.get(message.key) != summed:
                self.integrity.faults.append((ledger.peer, message, "does not match the checksum its sender computed"))

    @property
    def device(self) -> Any:
        tensors = [*self.sources.values(), *self.destinations.values()]
        return tensors[0].device if tensors else "cpu"

    def lost_text(self) -> str:
        ranks = sorted(self.lost)
        return f"lost ranks {shown_ranks(ranks)} (rank {ranks[0]} {self.lost[ranks[0]]})"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:200]


__all__ = ["POLL_SECONDS", "Exchange", "Integrity", "as_bytes", "checksum", "view_of"]
