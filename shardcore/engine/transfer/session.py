"""A refit session: what a process keeps between its refits, so that the next one knows what the last left.

Between refits a rank remembers the version each destination tensor holds (``held_version``), the schedule of the
plan part it last ran (an RL job refits one plan thousands of times, and a schedule costs milliseconds), and for
delta refits (``transfer.delta``) the bytes it last sent of each piece (its snapshots) and each destination's
in-place counter when a delta refit last completed into it. All of it belongs to one ``RefitSession``:
``execute_refit`` keeps it in this process's default session unless given one of its own (two models refitted by
one process, say, or a test that wants a fresh sender). Nothing is shared between sessions: a session that never
saw a tensor knows no version of it, and its first delta refit sends dense.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ...refit import pairing
from ...refit.schedule import Batch, Piece

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from ...refit.part import RankRefit
    from .exchange import Place
    from .runs import Run

TensorKey = tuple[str, int, tuple[int, ...]]
"""A tensor as a session knows it: (device, address, shape)."""


def tensor_key(tensor: torch.Tensor) -> TensorKey:
    return str(tensor.device), tensor.data_ptr(), tuple(tensor.shape)


class HeldVersion(NamedTuple):
    """The version a destination holds: the last refit that completed into it, and whether a failed refit
    has since written part of it (then it holds a mix: refit again before serving)."""

    version: int | None
    intact: bool


@dataclass
class Schedule:
    """A plan part's schedule on this rank, for given options: its batches (read-only), and where its messages
    that travel in place lie in their tensors once a refit found it (``Exchange.places``)."""

    mine: RankRefit
    options: tuple[int, int, int, int, frozenset[str]]
    batches: list[Batch]
    places: dict[tuple[int, ...], Place] | None = None
    runs: dict[tuple[int, ...], tuple[list[Run], list[tuple[Piece, int]]]] = field(default_factory=dict)
    """The strided runs of each received message (``transfer.runs``), by key, as refits find them."""

    @functools.cached_property
    def tally(self) -> int:
        """This rank's term of the check that both ends of every message agree (``refit.pairing``)."""
        return pairing.tally(self.batches)


class Snapshot:
    """The bytes a sender last put on the wire for one piece toward one peer, and the version that delivered
    them (None until the refit that sent them completed everywhere)."""

    __slots__ = ("data", "version")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.version: int | None = None


SnapshotKey = tuple[int, int, Piece, str]
"""(peer, hop, piece, wire dtype): what a snapshot is of; another cut, shape or dtype is another key."""


@dataclass
class RefitSession:
    """What a process keeps between its refits (see the module's docstring); pass one to ``execute_refit``'s
    ``session=`` to keep a set of refits apart from the default session's.

    Attributes:
        held: Destination tensors -> the version each holds (``held_version``).
        schedule: The schedule of the plan part this process last ran, kept while its part is the plan's.
        snapshots: A sender's snapshots (``transfer.delta``): lost with the session, so a new one sends dense.
        counters: A receiver's destination tensors -> their in-place version counter when a delta refit last
            completed into them. A tensor whose counter moved since (written by anything else), or a new tensor
            that took a freed one's address, holds no base a delta can build on, whatever ``held`` recorded.
    """

    held: dict[TensorKey, HeldVersion] = field(default_factory=dict)
    schedule: Schedule | None = None
    snapshots: dict[SnapshotKey, Snapshot] = field(default_factory=dict)
    counters: dict[TensorKey, int] = field(default_factory=dict)

    def held_version(self, destinations: Mapping[str, torch.Tensor]) -> HeldVersion | None:
        """The version ``destinations`` hold (as refits with ``version=`` in this session recorded it), None if
        never recorded. When the tensors hold different versions, the oldest is reported, not intact."""
        found = {self.held.get(tensor_key(tensor)) for tensor in destinations.values()}
        if None in found or not found:
            return None
        versions = [held for held in found if held is not None]
        oldest = min(versions, key=lambda held: -1 if held.version is None else held.version)
        return HeldVersion(oldest.version, len(versions) == 1 and oldest.intact)

    def hold(self, destinations: Mapping[str, torch.Tensor], held: HeldVersion) -> None:
        """Record that every tensor of ``destinations`` holds ``held``."""
        for tensor in destinations.values():
            self.held[tensor_key(tensor)] = held

    def bases_held(
        self, held: Mapping[str, int | None], destinations: Mapping[str, torch.Tensor]
    ) -> dict[str, int | None]:
        """The version each destination tensor holds as a delta's base: ``held`` (its intact ``held_version``),
        unless the tensor was written since a delta refit last completed into it, or is not the tensor it was."""
        return {
            name: version if self.counters.get(tensor_key(tensor)) == tensor._version else None
            for name, version in held.items()
            if (tensor := destinations.get(name)) is not None
        }

    def snapshot_bytes(self) -> int:
        """The memory this session's snapshots hold: about the bytes it sent in its last refits of each tensor."""
        return sum(snapshot.data.numel() for snapshot in self.snapshots.values())

    def forget_snapshots(self) -> None:
        """Drop every snapshot (the next refit sends dense): what a restarted sender has."""
        self.snapshots.clear()


DEFAULT_SESSION = RefitSession()
"""The session ``execute_refit`` and ``held_version`` use when given none: this process's."""


__all__ = ["DEFAULT_SESSION", "HeldVersion", "RefitSession", "Schedule", "Snapshot", "SnapshotKey", "tensor_key"]
