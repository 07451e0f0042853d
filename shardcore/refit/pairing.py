"""Whether both ends of every message of a refit agree on it, checked before any byte moves.

Each rank derives its batches from its own part of the plan (``schedule.rank_batches``). If two parts disagree
(a planner bug: one end posts a message the other does not, or posts it in another batch or at another size),
nothing else notices until the messages are on the wire: gloo aborts the process on a size mismatch, and NCCL
hangs or writes the wrong bytes. So each rank brings a *tally* to the refit's first meeting, and the meeting sums
them.

**The tally.** Each message weighs a 32-bit word drawn from what both of its ends must agree on: its batch, its
key (index, sender, receiver, hop), its size and whether it is a ledger. Its sender counts the word in, its
receiver counts it out. Over every rank, the words of messages both ends see alike cancel; any message seen by one
end only, or seen differently, leaves a word behind, so the sum is not 0 modulo ``MODULUS`` but by a chance of
2**-32. Its cost is one store ``add`` per rank at the first meeting, and one hash per message (made once per
schedule).

**Naming the pairs.** Only when the sum is not 0: each rank leaves a note of what it sends to and receives from
each peer (``note``), reads its peers' notes and names the pairs that disagree (``disagreements``). A pair that
disagrees is named by at least one of its ends: the end that knows of the pair reads the other's note.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from .schedule import Batch, Message

MODULUS = 1 << 32
"""A tally is a residue modulo this; so is the sum of every rank's."""
_SHOWN = 3
"""Disagreeing pairs a message names before it counts the rest."""


class Direction(NamedTuple):
    """What one end of a pair says of one direction of it: messages, bytes, and the words of those messages."""

    messages: int
    nbytes: int
    words: int

    def shown(self) -> str:
        return f"{self.messages} message{'s' * (self.messages != 1)} of {self.nbytes:,} B"


class Disagreement(NamedTuple):
    """One direction of one pair whose two ends disagree, in words."""

    sender: int
    receiver: int
    said: str


class PeerNote(NamedTuple):
    """What this rank sends to one peer and receives from it."""

    sent: Direction
    received: Direction


def _word(batch: Batch, message: Message) -> int:
    """The 32-bit word both ends of ``message`` derive alike when they agree on it."""
    fields = (*batch.key, *message.key, message.nbytes, int(message.ledger))
    return int.from_bytes(hashlib.blake2b(struct.pack("<9q", *fields), digest_size=4).digest(), "little")


def tally(batches: Sequence[Batch]) -> int:
    """This rank's term of the party's sum: every sent message's word in, every received one's out (mod 2**32).

    Args:
        batches: this rank's batches (``schedule.rank_batches``).
    """
    total = 0
    for batch in batches:
        for message in batch.messages:
            word = _word(batch, message)
            total += word if message.send else -word
    return total % MODULUS


def note(batches: Sequence[Batch]) -> dict[int, PeerNote]:
    """What this rank sends to and receives from each of its peers, by peer."""
    counts: dict[tuple[int, bool], list[int]] = {}
    for batch in batches:
        for message in batch.messages:
            entry = counts.setdefault((message.peer, message.send), [0, 0, 0])
            entry[0] += 1
            entry[1] += message.nbytes
            entry[2] = (entry[2] + _word(batch, message)) % MODULUS
    none = Direction(0, 0, 0)
    return {
        peer: PeerNote(
            Direction(*counts[(peer, True)]) if (peer, True) in counts else none,
            Direction(*counts[(peer, False)]) if (peer, False) in counts else none,
        )
        for peer in sorted({peer for peer, _ in counts})
    }


def encode(notes: Mapping[int, PeerNote]) -> str:
    """A note as text, for the store."""
    return ";".join(f"{peer}:{':'.join(str(v) for v in (*n.sent, *n.received))}" for peer, n in notes.items())


def decode(text: str) -> dict[int, PeerNote]:
    """The note ``encode`` made."""
    notes = {}
    for entry in filter(None, text.split(";")):
        peer, *values = (int(v) for v in entry.split(":"))
        notes[peer] = PeerNote(Direction(*values[:3]), Direction(*values[3:]))
    return notes


def disagreements(
    rank: int, mine: Mapping[int, PeerNote], theirs: Mapping[int, Mapping[int, PeerNote]]
) -> list[Disagreement]:
    """The directions of the pairs of ``rank`` whose two ends disagree.

    Args:
        rank: this rank.
        mine: this rank's note.
        theirs: each peer's note, by peer (the peers of ``mine``).
    """
    found = []
    nothing = PeerNote(Direction(0, 0, 0), Direction(0, 0, 0))
    for peer in sorted(mine):
        here, there = mine[peer], theirs.get(peer, {}).get(rank, nothing)
        for sender, receiver, sent, received in (
            (rank, peer, here.sent, there.received),
            (peer, rank, there.sent, here.received),
        ):
            if sent == received:
                continue
            if sent[:2] == received[:2]:
                said = f"both ends count {sent.shown()} but key or batch them apart"
            else:
                said = f"rank {sender} sends {sent.shown()}, rank {receiver} expects {received.shown()}"
            found.append(Disagreement(sender, receiver, said))
    return found


def shown(found: Sequence[Disagreement]) -> str:
    """The first disagreements, and how many more (a message stays short whatever the plan)."""
    more = f"; and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
    return "; ".join(f"{d.sender}->{d.receiver}: {d.said}" for d in found[:_SHOWN]) + more


__all__ = [
    "MODULUS",
    "Direction",
    "Disagreement",
    "PeerNote",
    "decode",
    "disagreements",
    "encode",
    "note",
    "shown",
    "tally",
]
