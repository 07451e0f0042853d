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

The exchange posts, waits and checks; what a message's bytes are and where a received one lands is its codec's
(``Codec``: plain, converting, landing or delta transfers), the one interface it calls.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol, TypeVar, cast

from ...plan.arguments import shown_ranks
from ...refit.schedule import Batch, Message, Slot, StagingLayout, aligned, staging_layout
from ..agreement import Party, publish_failure, published_failures

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch.distributed import ProcessGroup, Work

    from ...refit.part import Transfer

log = logging.getLogger("shardcore.refit")

Result = TypeVar("Result")
"""What a step ``Exchange._guarded`` runs returns."""

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


Place = tuple[bool, str, int, int]
"""Where a message that travels in place lies: (in the sources, else the destinations; tensor; first byte; end
byte)."""


class Codec(Protocol):
    """What the bytes of this rank's messages are and where received ones land: the one interface the exchange
    calls, which plain (``transfer.pieces.Plain``), converting (``transfer.convert.Conversion``), landing
    (``transfer.landing.Landing``) and delta (``transfer.delta.DeltaSession``) transfers implement."""

    encodes: ClassVar[bool]
    """Whether a data message's bytes are an encoding (a delta refit's): then every one is staged, never in place."""

    @property
    def sources(self) -> Mapping[str, torch.Tensor]: ...
    @property
    def destinations(self) -> Mapping[str, torch.Tensor]: ...
    @property
    def device(self) -> torch.device | str: ...
    def learn(self, exchange: Exchange, messages: list[Message]) -> None: ...
    def declare(
        self, exchange: Exchange, messages: list[Message], wires: list[tuple[torch.Tensor, bool]]
    ) -> list[tuple[torch.Tensor, bool]]: ...
    def pack(self, exchange: Exchange, message: Message, wire: torch.Tensor, staged: bool) -> torch.Tensor: ...
    def unsent(self, message: Message) -> None: ...
    def unpack(self, message: Message, wire: torch.Tensor, staged: bool) -> list[str]: ...
    def expected_bytes(self, message: Message) -> int | None: ...
    def copy(self, transfer: Transfer) -> None: ...
    def place(self, message: Message) -> Place | None: ...
    def finish(self) -> None: ...


class _InFlight(NamedTuple):
    """A posted batch not yet landed: its messages as posted, their wires (bytes, staged), and their works (None:
    an op that could not be posted)."""

    messages: list[Message]
    wires: list[tuple[torch.Tensor, bool]]
    works: list[Work | None]


@dataclass
class Exchange:
    """One rank's exchange in one refit: its batches, its codec, and what it saw."""

    rank: int
    batches: list[Batch]
    copies: Sequence[Transfer]
    """This rank's local copies (transfers with src == dst == rank)."""
    codec: Codec
    """What its messages' bytes are, and where received ones land."""
    tag: int
    verify: str
    party: Party
    epoch: int
    deadline: float
    gloo: bool
    bucket_bytes: int
    """Staging bytes one batch may hold, and two batches in flight together (``schedule.staging_layout``)."""
    group: ProcessGroup | None = None
    """The process group the messages go on, peers numbered in it (a refit group's); None: the default group."""
    places: dict[tuple[int, ...], Place] | None = None
    """Where each message that travels in place lies (``Place``), by key. Found from the tensors when None; a
    refit of the schedule's plan part passes what an earlier one found (``execute._schedule``): its tensors have the
    shapes and dtypes checked against the plan, so the same messages lie at the same bytes, and finding them (a
    view per message) is not paid again."""
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
        self._guarded(self.codec.finish)

    def run_first(self, batches: list[Batch], codec: Codec, what: str) -> None:
        """Run ``batches``, moving ``codec``'s tensors, before this exchange's own (``what``: a converting refit's
        partial-amax exchange): on the same tag, party, deadline and checks, its faults and lost peers this
        exchange's. A peer lost there makes this rank drain, published: nothing it would send next is known."""
        if batches:
            import torch

            phase = replace(
                self,
                batches=batches,
                copies=(),
                codec=codec,
                places=None,
                staging=None,
                posted={},
                sent_sums={},
                received_sums={},
                _directions={},
            )  # sharing this exchange's lost peers and faults
            phase.staging = torch.empty(phase.staging_bytes(), dtype=torch.uint8, device=phase.device)
            phase.run()
            self.error, self.draining = phase.error, phase.draining
        if self.lost:
            why = f"it {self.lost_text()} in {what}"
            if not self.draining:  # published: a rank it then sends nothing may have no link to the lost one
                publish_failure(self.party, self.epoch, why)
            self.draining = self.draining or why

    def _copy_locally(self) -> None:
        """The pieces this rank holds on both sides, copied from its source tensors into its destinations."""
        self.wrote = self.wrote or bool(self.copies)
        for transfer in self.copies:  # in the part's order (``refit.part.transfer_order``)
            self.codec.copy(transfer)
            self.bytes_copied += int(transfer.bytes)

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

    def _guarded(self, step: Callable[[], Result]) -> Result | None:
        """Run a local step unless this rank drains (``fail`` takes any failure in it); returns what the step
        returned, or None when it did not run or failed."""
        if self.draining:
            return None
        try:
            return step()
        except Exception as error:  # any local failure is published and drained, never left half done
            self.fail(error)
            return None

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
        self.codec.learn(self, live)  # a delta refit's receivers' versions, before the senders encode
        wires = self.codec.declare(self, live, self._bind(live, region))  # a delta refit's sizes
        self.wrote = self.wrote or any(not m.send and not m.ledger for m in live)
        return _InFlight(live, wires, self._issue(live, wires))

    def _issue(self, messages: Sequence[Message], wires: Sequence[tuple[torch.Tensor, bool]]) -> list[Work | None]:
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
        world = cast("ProcessGroup", dist.group.WORLD) if self.group is None else self.group
        works: list[Work | None] = []
        for message, (wire, _) in zip(messages, wires):
            work = None
            if message.peer not in self.lost:
                try:
                    work = (world.send if message.send else world.recv)([wire], message.peer, self.tag)
                except Exception as error:  # gloo: the connection closed (the peer died) while a batch was out
                    self.lost.setdefault(message.peer, f"its connection failed ({_first_line(error)})")
            works.append(work)
        return works

    def swap(
        self, messages: Sequence[Message], outgoing: dict[int, list[int]], expected: dict[int, int], unheard: int
    ) -> dict[int, list[int]]:
        """A header round of a batch of ``messages`` (a delta refit's, ``transfer.delta``): a vector of int64 to each
        peer in ``outgoing``, one of ``expected[peer]`` entries from each peer there, posted and waited for like a
        batch, losing peers as a batch does (a lost peer's never comes, and a drained one's entries stay ``unheard``);
        nothing is unpacked or counted."""
        import torch

        hop = messages[0].hop if messages else 0
        headers: list[Message] = []
        wires: list[tuple[torch.Tensor, bool]] = []
        for peer in sorted(set(outgoing) | set(expected)):
            if peer in self.lost:
                continue
            if peer in outgoing:
                values = torch.tensor(outgoing[peer], dtype=torch.int64, device=self.device)
                wire = values.view(torch.uint8)
                if self.draining and self.gloo:  # as a drained data send: one byte, taken by a longer receive
                    wire = wire[:1]
                headers.append(Message((0, self.rank, peer, hop), peer, True, (), values.numel() * 8))
                wires.append((wire, False))
            if peer in expected:
                values = torch.full((expected[peer],), unheard, dtype=torch.int64, device=self.device)
                headers.append(Message((0, peer, self.rank, hop), peer, False, (), values.numel() * 8))
                wires.append((values.view(torch.uint8), False))
        if not headers:
            return {}
        self._land(_InFlight(headers, wires, self._issue(headers, wires)), lambda *landed: None)
        return {
            message.peer: wire.view(torch.int64).tolist()
            for message, (wire, _) in zip(headers, wires)
            if not message.send and message.peer not in self.lost
        }

    def _coalesced(self, messages: Sequence[Message], wires: Sequence[tuple[torch.Tensor, bool]]) -> list[Work | None]:
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

    def _land(self, flight: _InFlight, complete: Callable[[Message, torch.Tensor, bool], None] | None = None) -> None:
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
            if not message.ledger and (self.codec.encodes or message.key not in self._in_place):
                used = aligned(used + message.nbytes)
        return used

    def _bind(self, messages: Sequence[Message], region: torch.Tensor | None) -> list[tuple[torch.Tensor, bool]]:
        """The bytes each message goes from or into, and whether they are staged: its tensor slice, a slot of
        the batch's staging ``region``, or a ledger. Sends are packed (and summed) first, then ledgers filled.
        Without a region (the staging buffer could not be allocated: this rank drains) a staged message gets
        a buffer of its own, which a receive needs whole."""
        import torch

        wires: list[tuple[torch.Tensor, bool]] = []
        slot = 0
        for message in messages:
            if message.ledger:
                wires.append((self._ledger_wire(message), False))
                continue
            wire = None if self.codec.encodes else self._in_place.get(message.key)
            staged = wire is None
            if wire is None:
                if region is None:
                    wire = torch.empty(message.nbytes, dtype=torch.uint8, device=self.device)
                else:
                    wire = region[slot : slot + message.nbytes]
                    slot = aligned(slot + message.nbytes)
            if message.send:
                wire = self._sent(message, wire, staged)
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

    def in_place_wire(self, message: Message) -> torch.Tensor | None:
        """The bytes, in its own tensor, of a message that can travel in place (None: it is staged)."""
        return self._in_place.get(message.key)

    @cached_property
    def _in_place(self) -> dict[tuple[int, ...], torch.Tensor]:
        """The bytes, in its own tensor, of every message that travels in place, by key (bound once, for the
        layout and the posts); the others are staged."""
        if self.places is None:
            self.places = {
                message.key: place
                for batch in self.batches
                for message in batch.messages
                if not message.ledger and (place := self.codec.place(message)) is not None
            }
        tensors: dict[tuple[bool, str], torch.Tensor] = {}
        wires: dict[tuple[int, ...], torch.Tensor] = {}
        for key, (in_sources, name, start, end) in self.places.items():
            whole = tensors.get((in_sources, name))
            if whole is None:
                side = self.codec.sources if in_sources else self.codec.destinations
                whole = tensors[in_sources, name] = as_bytes(side[name])
            wires[key] = whole[start:end]
        return wires

    def _sent(self, message: Message, slot: torch.Tensor, staged: bool) -> torch.Tensor:
        """A send's bytes (``_pack``); when this rank drains, or fails here, the slot as it is, which its peers then
        never read."""
        packed = self._guarded(functools.partial(self._pack, message, slot, staged))
        if self.draining:
            self.codec.unsent(message)
        return slot if packed is None else packed

    def _pack(self, message: Message, wire: torch.Tensor, staged: bool) -> torch.Tensor:
        """A send's bytes as the codec makes them in its slot ``wire`` (or ``wire`` itself, its own tensor's bytes
        in place), summed when verifying."""
        wire = self.codec.pack(self, message, wire, staged)
        if self.verify == "checksum":
            self.sent_sums[message.key] = checksum(wire)
        return wire

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
        self._guarded(functools.partial(self._receive, message, wire, staged))

    def _receive(self, message: Message, wire: torch.Tensor, staged: bool) -> None:
        """Land a received data message through the codec; what it finds wrong with it is a fault of its sender's."""
        for what in self.codec.unpack(message, wire, staged):
            self.integrity.faults.append((message.peer, message, what))

    def _check_ledger(self, ledger: Message, wire: torch.Tensor) -> None:
        """Compare what the sender says it sent with what this rank expected and received."""
        expected = self._directions.get((ledger.peer, False), {})
        for index, (size, summed) in enumerate(wire.view(-1, 2).tolist()):
            message = expected[(index, *ledger.key[1:])]
            nbytes = self.codec.expected_bytes(message)
            if size != nbytes:
                said = "nothing" if size < 0 else f"{size} bytes"
                here = "of no declared size" if nbytes is None else f"{nbytes} bytes"
                self.integrity.faults.append((ledger.peer, message, f"is {here} here but {said} as sent"))
            elif self.verify == "checksum" and self.received_sums.get(message.key) != summed:
                self.integrity.faults.append((ledger.peer, message, "does not match the checksum its sender computed"))

    @property
    def device(self) -> torch.device | str:
        return self.codec.device

    def lost_text(self) -> str:
        ranks = sorted(self.lost)
        return f"lost ranks {shown_ranks(ranks)} (rank {ranks[0]} {self.lost[ranks[0]]})"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:200]


__all__ = ["POLL_SECONDS", "Codec", "Exchange", "Integrity", "Place", "as_bytes", "checksum"]
