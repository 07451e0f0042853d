"""Plain transfers: a rank's pieces copied from its tensors into a message's bytes, and from a message into its
tensors, as they are.

The exchange (``transfer.exchange``) posts bytes; what the bytes of a message are, and where a received one
lands, is its codec's (``exchange.Codec``). This plain one is what the others build on: a converting refit's
(``transfer.convert.Conversion``: cast or quantized on the way), fp8 through a layout
(``transfer.landing.Landing``: quantized once landed) and a delta refit's (``transfer.delta.DeltaSession``: each
piece as its changes since the version its receiver holds, dense pieces through a plain or converting codec).
A subclass changes a piece's wire dtype and what is sent of it (``wire_dtype``, ``outgoing``), or the tensor a
piece lands in and what happens once it has (``written``, ``landed``, ``finish``); the copies stay here.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from ...refit.boxes import fitted
from ...refit.schedule import Message, Piece
from .exchange import Exchange, Place
from .runs import Run, Where, run_views, runs

if TYPE_CHECKING:
    import torch

    from ...refit.part import Transfer


def view_of(tensor: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The box of ``shape`` at ``offset`` in ``tensor``; through a weight map the tensor may have unit dims more
    or fewer than the box on the left (``boxes.fitted``), and the view has the tensor's."""
    return tensor[tuple(slice(o, o + n) for o, n in zip(offset, fitted(shape, len(offset))))]


def _packed(stretches: list[torch.Tensor], wire: torch.Tensor) -> None:
    """Copy ``stretches`` (1-d, of one dtype) back to back into the bytes ``wire``, in one call."""
    import torch

    out = wire.view(stretches[0].dtype)
    if len(stretches) == 1:
        out.copy_(stretches[0])
    else:
        torch.cat(stretches, out=out)


@dataclass(kw_only=True)
class Plain:
    """One rank's pieces in one refit, moved as they are: its source tensors (a converting refit adds the scale
    tensors it computes) and its destination tensors, written in place.

    Attributes:
        sources: Tensor name -> this rank's local source tensor.
        destinations: Tensor name -> this rank's local destination tensor.
    """

    sources: dict[str, torch.Tensor] = field(default_factory=dict)
    destinations: Mapping[str, torch.Tensor] = field(default_factory=dict)
    kept_runs: dict[tuple[int, ...], tuple[list[Run], list[tuple[Piece, int]]]] | None = None
    """The runs of each received message (``transfer.runs``) by key, found by an earlier refit of the same schedule
    (``Schedule.runs``): they depend on the plan's part alone. None: found for each message, kept nowhere."""

    encodes: ClassVar[bool] = False
    """Whether a data message's bytes are an encoding (a delta refit's), never its pieces in place."""

    @property
    def device(self) -> torch.device | str:
        """The device of this rank's tensors (what staging and headers are allocated on)."""
        tensors = [*self.sources.values(), *self.destinations.values()]
        return tensors[0].device if tensors else "cpu"

    # -- what a subclass changes ---------------------------------------------------------------------

    def wire_dtype(self, name: str, default: torch.dtype) -> torch.dtype:
        """The dtype tensor ``name``'s pieces travel in, ``default`` being its tensor's."""
        return default

    def casts(self) -> Container[str]:
        """The tensors whose pieces ``wire_dtype`` may change: none, they travel as their tensors hold them."""
        return ()

    def quantizes(self, name: str) -> bool:
        """Whether ``outgoing`` changes source ``name``'s pieces beyond a cast (then each is copied alone)."""
        return False

    def outgoing(self, name: str, view: torch.Tensor, offset: tuple[int, ...]) -> torch.Tensor:
        """What to copy into the wire (or a local destination) for ``view``, the box at ``offset`` of the local
        source tensor ``name``: the view itself (the copy into the wire's dtype casts it)."""
        return view

    def in_place(self, piece: Piece, send: bool) -> bool:
        """Whether ``piece`` can go from the source tensor (``send``) or into the destination as it is there."""
        return True

    def written(self, name: str) -> torch.Tensor:
        """The tensor the pieces of destination ``name`` land in (and a relay forwards from)."""
        return self.destinations[name]

    def written_dtype(self, name: str) -> torch.dtype:
        """The dtype of ``written(name)``, without making it (a staging copy is made when its first piece lands)."""
        return self.destinations[name].dtype

    def landed(self, name: str, elements: int) -> None:
        """``elements`` of destination ``name`` landed (or were packed for a forward)."""

    def finish(self) -> None:
        """Every message has landed."""

    # -- what the exchange calls ---------------------------------------------------------------------

    def learn(self, exchange: Exchange, messages: list[Message]) -> None:
        """Before a batch is bound: what this rank must hear from its peers first (nothing, when plain)."""

    def declare(
        self, exchange: Exchange, messages: list[Message], wires: list[tuple[torch.Tensor, bool]]
    ) -> list[tuple[torch.Tensor, bool]]:
        """Once a batch is bound: what this rank must tell its peers before the data (nothing, when plain); returns
        the batch's wires."""
        return wires

    def pack(self, exchange: Exchange, message: Message, wire: torch.Tensor, staged: bool) -> torch.Tensor:
        """A send's bytes: its pieces copied into its slot ``wire`` when ``staged`` (else ``wire`` is the pieces'
        own bytes, travelling in place)."""
        if staged:
            self.pack_pieces(message, wire)
        return wire

    def unsent(self, message: Message) -> None:
        """A send this rank does not pack (it drains: its peers never read it)."""

    def unpack(self, message: Message, wire: torch.Tensor, staged: bool) -> list[str]:
        """Write a received message into the destinations (a staged one; one in place is there already), its pieces
        in strided runs where they form them (``transfer.runs``); returns what is wrong with it (nothing, when
        plain: its size and checksum are the exchange's to check)."""
        if staged:
            together, single = self.runs_of(message)
            for run in together:
                target, source = run_views(run, self.written(run.name), wire)
                target.copy_(source)
                self.landed(run.name, run.segments * run.numel)
            for piece, offset in single:
                target = self.target_of(piece)
                dtype = self.piece_dtype(message, piece)
                target.copy_(wire[offset : offset + piece.nbytes].view(dtype).view(target.shape))
                self.landed(piece.destination, target.numel())
        return []

    def expected_bytes(self, message: Message) -> int | None:
        """The size a received message must have (None: unknown, so wrong)."""
        return message.nbytes

    def copy(self, transfer: Transfer) -> None:
        """A piece this rank holds on both sides, copied from its source tensor into its destination."""
        shape = tuple(stop - start for start, stop in transfer.box)
        offset = tuple(transfer.src_offset)
        source = self.outgoing(transfer.tensor, view_of(self.sources[transfer.tensor], offset, shape), offset)
        target = view_of(self.written(transfer.destination), tuple(transfer.dst_offset), shape)
        target.copy_(source.reshape(target.shape))
        self.landed(transfer.destination, target.numel())

    def place(self, message: Message) -> Place | None:
        """Where a one-piece message's slice of its tensor lies, if contiguous and moved as it is (None: staged)."""
        if len(message.pieces) != 1:
            return None
        piece = message.pieces[0][0]
        reads_source = self.reads_source(message)
        if not self.in_place(piece, reads_source):  # cast on the way, or landing in a staging copy
            return None
        name = self.name_of(message, piece)
        tensor = (self.sources if reads_source else self.destinations).get(name)
        if tensor is None:  # a scale this rank never computed: it drains, and the message is never read
            return None
        view = view_of(tensor, piece.src_offset if message.send else piece.dst_offset, piece.shape)
        if not view.is_contiguous():
            return None
        start = view.data_ptr() - tensor.data_ptr()
        return reads_source, name, start, start + view.numel() * view.element_size()

    # -- pieces --------------------------------------------------------------------------------------

    def pack_pieces(self, message: Message, wire: torch.Tensor) -> None:
        """Copy a send's pieces, in the wire's dtype, to their offsets in ``wire``: in strided runs where they form
        them (``transfer.runs``), the rest (and what ``outgoing`` quantizes) one by one."""
        together, single = self.runs_of(message)
        if message.hop:
            for run in together:
                source, target = run_views(run, self._read(message, run.name), wire)
                target.copy_(source)
                self.landed(run.name, run.segments * run.numel)  # a forward of a staging copy has read it
        else:
            self._pack_runs(message, together, wire)
        for piece, offset in single:
            name = self.name_of(message, piece)
            view = view_of(self._read(message, name), piece.src_offset, piece.shape)
            dtype = self.piece_dtype(message, piece)
            if not message.hop:  # a relay forwards its destination's bytes, already converted
                view = self.outgoing(piece.tensor, view, piece.src_offset)
            wire[offset : offset + piece.nbytes].view(dtype).view(view.shape).copy_(view)
            if message.hop:
                self.landed(name, view.numel())

    def _pack_runs(self, message: Message, together: list[Run], wire: torch.Tensor) -> None:
        """Copy a hop-0 send's runs from the source tensors into ``wire``. A sender holding each expert in its own
        tensor has a run per tensor, thousands per message, so the runs of one stretch each, in their tensor's own
        dtype and back to back in the wire, are copied by one ``torch.cat`` (a fraction of a copy's dispatch per
        run); the others, one strided copy each (``run_views``: a copy casts into the wire's dtype)."""
        group: list[torch.Tensor] = []
        start = end = 0
        for run in together:
            source = self._read(message, run.name)
            if run.segments != 1 or run.dtype != source.dtype:
                read, target = run_views(run, source, wire)
                target.copy_(read)
                continue
            flat = source.view(-1)
            stretch = flat if run.start == 0 and run.numel == flat.numel() else flat[run.start : run.start + run.numel]
            if group and (run.wire != end or stretch.dtype != group[0].dtype):
                _packed(group, wire[start:end])
                group = []
            if not group:
                start = end = run.wire
            group.append(stretch)
            end += run.numel * run.dtype.itemsize
        if group:
            _packed(group, wire[start:end])

    def _read(self, message: Message, name: str) -> torch.Tensor:
        """The local tensor a send of ``message`` reads ``name`` from: a relay forwards what landed in its destination,
        any other send reads its source."""
        return self.written(name) if message.hop else self.sources[name]

    def runs_of(self, message: Message) -> tuple[list[Run], list[tuple[Piece, int]]]:
        """``message``'s pieces as strided runs on this rank, and the pieces copied alone (``transfer.runs``): kept in
        ``kept_runs`` when given."""
        found = None if self.kept_runs is None else self.kept_runs.get(message.key)
        if found is None:
            found = runs(message.pieces, self._where(message), message.send, self.casts())
            if self.kept_runs is not None:
                self.kept_runs[message.key] = found
        return found

    def _where(self, message: Message) -> Where:
        """Where ``message``'s pieces' tensors lie on this rank (``runs.Where``): a send's in its source tensors (a
        relay's forward in its destinations), a receive's in its destinations; a piece ``outgoing`` changes goes
        alone. Asked once per tensor of the message, tens of thousands in an engine's, so what depends on the local
        tensor alone (its shape, its dtype) is found once per local tensor (a weight map's ``w13_weight`` holds
        hundreds of them)."""
        reads_source = self.reads_source(message)
        tensors = self.sources if reads_source else self.destinations
        local: dict[str, tuple[tuple[int, ...], torch.dtype] | None] = {}
        wire_dtype = self.wire_dtype

        def where(tensor: str, target: str) -> tuple[str, tuple[int, ...], torch.dtype] | None:
            name = local_name(reads_source, tensor, target)
            if name in local:
                found = local[name]
            else:
                quantized = reads_source and self.quantizes(name)
                found = local[name] = (
                    None if quantized else (tuple(tensors[name].shape), self._local_dtype(message, name))
                )
            return None if found is None else (name, found[0], wire_dtype(tensor, found[1]))

        return where

    def piece_dtype(self, message: Message, piece: Piece) -> torch.dtype:
        """The dtype a piece of ``message`` travels in: its local tensor's (``name_of``: a source's, else the dtype
        its destination is written in, ``written_dtype``, so no staging copy is made for it), or a converting
        refit's wire dtype. What the runs, packing, landing and a delta refit's encoding all read a piece as."""
        return self.wire_dtype(piece.tensor, self._local_dtype(message, self.name_of(message, piece)))

    def _local_dtype(self, message: Message, name: str) -> torch.dtype:
        """The dtype of the local tensor ``name`` that ``message``'s pieces are read from or written in."""
        return self.sources[name].dtype if self.reads_source(message) else self.written_dtype(name)

    def target_of(self, piece: Piece) -> torch.Tensor:
        """The box of this rank's destination tensor a received piece lands in."""
        return view_of(self.written(piece.destination), piece.dst_offset, piece.shape)

    @staticmethod
    def reads_source(message: Message) -> bool:
        """Whether ``message``'s pieces are read from this rank's source tensors: a send at hop 0 (a relay's forward
        reads its destinations, a receive writes them)."""
        return message.send and not message.hop

    @classmethod
    def name_of(cls, message: Message, piece: Piece) -> str:
        """The local tensor ``message`` reads or writes ``piece`` in: its source tensor for a send from the
        sources, else the destination's (another one through a weight map)."""
        return local_name(cls.reads_source(message), piece.tensor, piece.target)


def local_name(reads_source: bool, tensor: str, target: str) -> str:
    """The local tensor a piece of manifest tensor ``tensor`` (``target``: a weight map's, or empty) is read from or
    written in: its source tensor when read from the sources, else the destination's (``Piece.destination``)."""
    return tensor if reads_source else target or tensor


__all__ = ["Plain", "local_name", "view_of"]
