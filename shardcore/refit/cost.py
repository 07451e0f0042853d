"""What a refit plan costs: bytes moved and copied, each rank's load, the lower bound, node traffic, time.

The lower bound (``lower_bound``) is on the bytes the busiest sender sends, in any plan. The time
estimate assumes every rank sends and receives at once, intra-node traffic at ``intra_gbps`` and
inter-node traffic at ``inter_gbps`` (GB/s, 1e9 bytes), and no other contention: a rank's time is
the larger of its send and receive time, a hop's the largest rank's. With fan-out the relays'
forwards are a second hop, after the first (the executor runs them so): the plan's time is the
sum of the two hops' times.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from .placement import Placement
from .plan import RefitPlan
from .worklines import Piece, Run, Tile, TileRun, relay

DEFAULT_INTRA_GBPS = 200.0
"""Default intra-node bandwidth per rank and direction, GB/s (NVLink-class)."""
DEFAULT_INTER_GBPS = 25.0
"""Default inter-node bandwidth per rank and direction, GB/s (one 200 Gb/s NIC per GPU)."""

Load = list[int]
"""[sent intra-node, sent inter-node, received intra-node, received inter-node] bytes of one rank."""


def lower_bound(must_move: Mapping[frozenset[int], int]) -> float:
    """Bytes the busiest sender sends at least, in any plan, given the bytes each holder set must move.

    ``must_move[H]`` counts the elements whose holders are exactly the source ranks H, once per
    destination rank that needs the element and does not hold it already (with fan-out: once per rank
    that receives it from a holder; the relays forward it to the others). Only a rank of H can send
    such an element, so for any set R of source ranks, the bytes of every H inside R are sent by
    ranks of R, and some rank of R sends at least their sum / |R|. Each R gives a valid bound. The
    best R over all sets is the exact optimum when pieces may be split freely (max-flow/min-cut:
    Hall's condition on the bytes), but finding it is a densest-subgraph problem; this tries the R
    that decide real layouts, in time near-linear in the holder sets' sizes:

    - each holder set H, with every holder set inside it (an unsplit tensor's replicas contain
      each tp slice's holders): at least the bound of H alone;
    - the union of the holder sets that must move anything: the averaging bound, all bytes that
      must move / the number of source ranks holding any of them. A rank that holds none of them
      (idle, outside the source, or holding only what every destination has already) cannot take
      a share, so counting it would only lower the bound.
    """
    moving = {members: size for members, size in must_move.items() if size}
    if not moving:
        return 0.0
    everyone = frozenset().union(*moving)
    best = sum(moving.values()) / len(everyone)
    first = {members: min(members) for members in moving}
    starts = set(first.values())
    containing: dict[int, list[frozenset[int]]] = defaultdict(list)
    for outer in moving:
        for rank in starts & outer:
            containing[rank].append(outer)
    inside = dict.fromkeys(moving, 0)
    for members, size in moving.items():
        for outer in containing[first[members]]:
            if len(members) <= len(outer) and members <= outer:
                inside[outer] += size
    return max(best, max(size / len(outer) for outer, size in inside.items()))


def _hop_seconds(loads: Mapping[int, Load], intra: float, inter: float) -> float:
    return max(
        (
            max(s_in / intra + s_out / inter, r_in / intra + r_out / inter)
            for s_in, s_out, r_in, r_out in loads.values()
        ),
        default=0.0,
    )


def _seconds(loads: Mapping[int, Load], relayed: Mapping[int, Load], intra_gbps: float, inter_gbps: float) -> float:
    """The first hop's time (``loads`` less ``relayed``), then the relays' forwards' (``relayed``)."""
    intra, inter = intra_gbps * 1e9, inter_gbps * 1e9
    first = {
        rank: [a - b for a, b in zip(load, relayed[rank])] if rank in relayed else load for rank, load in loads.items()
    }
    return _hop_seconds(first, intra, inter) + _hop_seconds(relayed, intra, inter)


def _new_loads() -> defaultdict[int, Load]:
    return defaultdict(lambda: [0, 0, 0, 0])


@dataclass(frozen=True)
class ShardCost:
    """The traffic into one destination: ``index`` and ``spec`` are a shard's index and spec (another
    placement's index and label).

    ``busiest_rank`` / ``busiest_bytes``: the rank of the refit into it, sender or receiver, moving most in its
    busier direction (often a source rank); ``busiest_receiver`` / ``received``: the destination rank receiving
    most (None and 0 when it receives nothing over the wire)."""

    index: int
    spec: str
    bytes: int
    local_bytes: int
    busiest_rank: int | None
    busiest_bytes: int
    loads: dict[int, Load]
    relay_loads: dict[int, Load] = field(default_factory=dict)
    busiest_receiver: int | None = None
    received: int = 0

    def estimate_seconds(self, intra_gbps: float = DEFAULT_INTRA_GBPS, inter_gbps: float = DEFAULT_INTER_GBPS) -> float:
        """Estimated time of this shard's transfers alone."""
        return _seconds(self.loads, self.relay_loads, intra_gbps, inter_gbps)


@dataclass
class _Tally:
    """The running sums of one walk over a plan's tiles, whole-plan and per destination shard: kept
    apart from ``RefitStats`` so that adding a tile and reading the totals are separate steps.

    Attributes:
        per_node: The plan's ``ranks_per_node`` (None: every byte between ranks is inter-node).
        scales: Positions of the manifest's fp8 scale tensors.
        loads / relayed: Per rank, every hop's load and the relays' forwards' alone.
        shard_loads / shard_relayed / shard_bytes / shard_local: The same, and the bytes sent and
            copied locally, per destination shard.
        must_move: Bytes the holders must send, per holder set key (relays forward the rest).
        holder_sets: The members of each holder set key.
        pairs: Every (sender, receiver) pair that moves bytes.
        count / local / scale_bytes: Pieces, bytes copied inside a rank, bytes of scale tensors sent.
    """

    per_node: int | None
    scales: frozenset[int]
    shard_loads: list[defaultdict[int, Load]]
    shard_relayed: list[defaultdict[int, Load]]
    shard_bytes: list[int]
    shard_local: list[int]
    loads: defaultdict[int, Load] = field(default_factory=_new_loads)
    relayed: defaultdict[int, Load] = field(default_factory=_new_loads)
    must_move: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))
    holder_sets: dict[int, frozenset[int]] = field(default_factory=dict)
    pairs: set[tuple[int, int]] = field(default_factory=set)
    count: int = 0
    local: int = 0
    scale_bytes: int = 0

    @classmethod
    def start(cls, plan: RefitPlan) -> _Tally:
        """Empty sums, one set per destination shard of ``plan``."""
        shards = len(plan.destination_placements)
        return cls(
            per_node=plan.ranks_per_node,
            scales=plan.manifest.scale_positions,
            shard_loads=[_new_loads() for _ in range(shards)],
            shard_relayed=[_new_loads() for _ in range(shards)],
            shard_bytes=[0] * shards,
            shard_local=[0] * shards,
        )

    def add(self, tile: Tile, pieces: list[Piece]) -> None:
        """Add one tile's pieces: a local copy counts only as local bytes, a transfer as load."""
        row_bytes = tile.row_bytes
        self.holder_sets[tile.sources.key] = tile.sources.members
        self.count += len(pieces)
        for src, dst, lo, hi, hop in pieces:
            size = (hi - lo) * row_bytes
            if src == dst:
                self.local += size
                self.shard_local[tile.shard] += size
            else:
                self._add_moved(tile.shard, tile.sources.key, size * (tile.position in self.scales), size, hop)
                self._add_transfer(tile.shard, src, dst, size, hop)

    def add_run(self, run: Run) -> None:
        """Add every piece of a route's run at once: each fixed line's segments by arithmetic
        (``Run.shares``), each local copy as a whole run; with fan-out, the relays' line and the forwards
        (``_add_relayed``). A needer's bytes count for its own destination (with fan-out a route's needers
        are those of several destinations)."""
        key, width, routes = run.sources.key, run.starts[-1], run.routes
        shard_of = {rank: shard for shard, piece in run.group for rank in piece.holders.ranks}
        shard = run.shard
        self.holder_sets[key] = run.sources.members
        self.count += len(routes.local) * (len(run.starts) - 1)
        for needer in routes.local:
            self.local += width
            self.shard_local[shard_of.get(needer, shard)] += width
        for line in run.lines[: len(routes.lines)]:
            self.count += run.piece_count(line)
            self.must_move[key] += line.copies * width
            self.scale_bytes += line.copies * run.scaled
            for needer in line.needers:
                self.shard_bytes[shard_of.get(needer, shard)] += width
            for src, copy, size in run.shares(line):
                needer = line.needers[copy]
                self._add_transfer(shard_of.get(needer, shard), src, needer, size, 0)
        if routes.far:  # fan-out's runs keep their tiles: each tile's relay is its own (``RefitPlan.runs``)
            self._add_relayed(cast(TileRun, run), shard_of)

    def _add_relayed(self, run: TileRun, shard_of: Mapping[int, int]) -> None:
        """Fan-out: the relays' line (copy i to each tile's relay on the i-th node without holders) and each
        relay's forwards to its node's other needers. The relay changes from tile to tile, so the line is walked
        tile by tile, but its bytes are added per (sender, receiver) pair."""
        line, far = run.lines[-1], run.routes.far
        starts, cuts = run.starts, line.cuts
        key, width = run.tiles[0].sources.key, starts[-1]
        moved: defaultdict[tuple[int, int, int], int] = defaultdict(int)  # (sender, receiver, hop) -> bytes
        k, pieces = 0, 0
        for i, group in enumerate(far):
            base = i * width
            for j, tile in enumerate(run.tiles):
                forwarder = relay(group, tile.seed)
                low, high = base + starts[j], base + starts[j + 1]
                size = high - low
                while low < high:
                    while cuts[k + 1] <= low:
                        k += 1
                    end = min(high, cuts[k + 1])
                    moved[line.sender(k), forwarder, 0] += end - low
                    pieces += 1
                    low = end
                for needer in group:
                    self.shard_bytes[shard_of[needer]] += size
                    if needer != forwarder:
                        moved[forwarder, needer, 1] += size
                        pieces += 1
                if tile.position in self.scales:
                    self.scale_bytes += size * len(group)
        self.count += pieces
        self.must_move[key] += len(far) * width
        for (src, dst, hop), size in moved.items():
            self._add_transfer(shard_of[dst], src, dst, size, hop)

    def _add_moved(self, shard: int, key: int, scale_bytes: int, size: int, hop: int) -> None:
        """Count ``size`` bytes (``scale_bytes`` of them of scale tensors) moved into ``shard`` from holder set
        ``key``; at ``hop`` 0 the holders must send them (relays forward the rest)."""
        if not hop:
            self.must_move[key] += size
        self.shard_bytes[shard] += size
        self.scale_bytes += scale_bytes

    def _add_transfer(self, shard: int, src: int, dst: int, size: int, hop: int) -> None:
        """Add ``size`` bytes sent from ``src`` to ``dst``: to both ranks' loads, the shard's, and (for a
        relay's forward, ``hop`` set) the relay loads too."""
        self.pairs.add((src, dst))
        per_node = self.per_node
        inter = 1 if per_node is None or src // per_node != dst // per_node else 0
        tables = (self.loads, self.shard_loads[shard])
        for table in (*tables, self.relayed, self.shard_relayed[shard]) if hop else tables:
            table[src][inter] += size
            table[dst][2 + inter] += size

    def peers(self) -> dict[int, int]:
        """Per rank, the distinct ranks it sends to or receives from (each a connection), ranks with none absent."""
        found: defaultdict[int, set[int]] = defaultdict(set)
        for src, dst in self.pairs:
            found[src].add(dst)
            found[dst].add(src)
        return {rank: len(others) for rank, others in sorted(found.items())}

    def must_move_by_holders(self) -> dict[frozenset[int], int]:
        """Bytes the holders must send, per holder set's members (what ``lower_bound`` takes)."""
        by_members: dict[frozenset[int], int] = defaultdict(int)
        for key, size in self.must_move.items():
            by_members[self.holder_sets[key]] += size
        return by_members

    def shard_cost(self, index: int, destination: Placement) -> ShardCost:
        """The cost of the transfers into destination shard ``index`` (``destination``)."""
        table = self.shard_loads[index]
        volume = {rank: max(load[0] + load[1], load[2] + load[3]) for rank, load in table.items()}
        top = max(volume, key=lambda rank: (volume[rank], -rank), default=None)
        members = destination.ranks
        received = {rank: load[2] + load[3] for rank, load in table.items() if rank in members and load[2] + load[3]}
        receiver = max(received, key=lambda rank: (received[rank], -rank), default=None)
        return ShardCost(
            destination.index,
            destination.label,
            self.shard_bytes[index],
            self.shard_local[index],
            top,
            volume.get(top, 0) if top is not None else 0,
            dict(table),
            dict(self.shard_relayed[index]),
            receiver,
            received.get(receiver, 0) if receiver is not None else 0,
        )


@dataclass(frozen=True)
class RefitStats:
    """The cost of a whole plan. Byte counts exclude local copies unless named ``local``.

    Attributes:
        model_bytes: Bytes of the model (each tensor once).
        total_bytes: Bytes sent between ranks (wire bytes: a converting refit sends the narrower dtype).
        local_bytes: Bytes copied inside a rank.
        transfers: Number of transfers, local copies included.
        sent / received: Bytes per rank (ranks with none are absent).
        busiest_sender: The rank sending most from its source tensors (None when nothing moves) and
            ``busiest_sent`` those bytes: what the lower bound is on. With fan-out, the relays' forwards (a
            second hop, inside a node) are not among them: they are in ``relay_loads``.
        lower_bound: Bytes the busiest sender must send at least, in any plan (``lower_bound``).
        intra_node_bytes / inter_node_bytes: Split by node when the plan has ``ranks_per_node``;
            without it every byte counts as inter-node.
        relayed_bytes: Bytes relays forwarded inside their node (fan-out; 0 without it).
        shards: Per destination shard.
        peers: Per rank, how many distinct ranks it sends to or receives from: each is a connection (an
            NCCL communicator's buffers per peer and channel); ranks with none are absent.
        loads: Per rank, every hop: [sent intra, sent inter, received intra, received inter] bytes.
        relay_loads: The same for the relays' forwards alone (the second hop).
        scale_bytes: Of ``total_bytes``, those of fp8 scale tensors.
    """

    model_bytes: int
    total_bytes: int
    local_bytes: int
    transfers: int
    sent: dict[int, int]
    received: dict[int, int]
    busiest_sender: int | None
    busiest_sent: int
    lower_bound: float
    intra_node_bytes: int
    inter_node_bytes: int
    shards: tuple[ShardCost, ...]
    loads: dict[int, Load]
    peers: dict[int, int] = field(default_factory=dict)
    relay_loads: dict[int, Load] = field(default_factory=dict)
    relayed_bytes: int = 0
    scale_bytes: int = 0

    @classmethod
    def of(cls, plan: RefitPlan) -> RefitStats:
        """Add up every piece of ``plan``, a route's run at once (``_Tally.add_run``)."""
        tally = _Tally.start(plan)
        for run in plan.runs():
            tally.add_run(run)
        return cls.of_tally(plan, tally)

    @classmethod
    def of_tally(cls, plan: RefitPlan, tally: _Tally) -> RefitStats:
        """The stats of ``plan`` from the sums of a walk over it (the tests walk tile by tile, as an oracle)."""
        loads, relayed = tally.loads, tally.relayed
        sent = {rank: load[0] + load[1] for rank, load in sorted(loads.items()) if load[0] + load[1]}
        received = {rank: load[2] + load[3] for rank, load in sorted(loads.items()) if load[2] + load[3]}
        forwarded = {rank: load[0] + load[1] for rank, load in relayed.items()}
        first_hop = {rank: size - forwarded.get(rank, 0) for rank, size in sent.items()}
        busiest = max(first_hop, key=lambda rank: (first_hop[rank], -rank), default=None)
        return cls(
            model_bytes=plan.manifest.nbytes,
            total_bytes=sum(sent.values()),
            local_bytes=tally.local,
            transfers=tally.count,
            sent=sent,
            received=received,
            busiest_sender=busiest,
            busiest_sent=first_hop[busiest] if busiest is not None else 0,
            lower_bound=lower_bound(tally.must_move_by_holders()),
            intra_node_bytes=sum(load[0] for load in loads.values()),
            inter_node_bytes=sum(load[1] for load in loads.values()),
            shards=tuple(
                tally.shard_cost(index, destination) for index, destination in enumerate(plan.destination_placements)
            ),
            loads=dict(loads),
            peers=tally.peers(),
            relay_loads=dict(relayed),
            relayed_bytes=sum(load[0] + load[1] for load in relayed.values()),
            scale_bytes=tally.scale_bytes,
        )

    @property
    def inter_node_bytes_without_fan_out(self) -> int:
        """Inter-node bytes the same refit moves without fan-out: every forwarded copy would cross the link
        (a relay and the needers it forwards to share a node, and no holder is on it)."""
        return self.inter_node_bytes + self.relayed_bytes

    @property
    def most_peers(self) -> int:
        """The most peers one rank has (0 when nothing moves)."""
        return max(self.peers.values(), default=0)

    @property
    def median_peers(self) -> int:
        """The median of the peers of the ranks that move anything (the lower middle one; 0 when nothing moves)."""
        counts = sorted(self.peers.values())
        return counts[(len(counts) - 1) // 2] if counts else 0

    @property
    def balance(self) -> float:
        """Busiest sender's bytes over the lower bound (1.0 is optimal; 1.0 when nothing moves)."""
        return self.busiest_sent / self.lower_bound if self.lower_bound else 1.0

    def estimate_seconds(self, intra_gbps: float = DEFAULT_INTRA_GBPS, inter_gbps: float = DEFAULT_INTER_GBPS) -> float:
        """Estimated time of the whole plan, all destination shards at once (with fan-out: both hops)."""
        return _seconds(self.loads, self.relay_loads, intra_gbps, inter_gbps)

    def to_dict(self, intra_gbps: float = DEFAULT_INTRA_GBPS, inter_gbps: float = DEFAULT_INTER_GBPS) -> dict[str, Any]:
        """JSON form, estimates at the given bandwidths."""
        return {
            "model_bytes": self.model_bytes,
            "total_bytes": self.total_bytes,
            "scale_bytes": self.scale_bytes,
            "local_bytes": self.local_bytes,
            "transfers": self.transfers,
            "busiest_sender": self.busiest_sender,
            "busiest_sent": self.busiest_sent,
            "lower_bound": self.lower_bound,
            "balance": self.balance,
            "intra_node_bytes": self.intra_node_bytes,
            "inter_node_bytes": self.inter_node_bytes,
            "inter_node_bytes_without_fan_out": self.inter_node_bytes_without_fan_out,
            "relayed_bytes": self.relayed_bytes,
            "peers_per_rank": {"max": self.most_peers, "p50": self.median_peers},
            "bandwidth_gbps": {"intra_node": intra_gbps, "inter_node": inter_gbps},
            "estimate_seconds": self.estimate_seconds(intra_gbps, inter_gbps),
            "sent": {str(rank): size for rank, size in self.sent.items()},
            "received": {str(rank): size for rank, size in self.received.items()},
            "shards": [
                {
                    "shard": shard.index,
                    "spec": shard.spec,
                    "bytes": shard.bytes,
                    "local_bytes": shard.local_bytes,
                    "busiest_rank": shard.busiest_rank,
                    "busiest_bytes": shard.busiest_bytes,
                    "busiest_receiver": shard.busiest_receiver,
                    "received": shard.received,
                    "estimate_seconds": shard.estimate_seconds(intra_gbps, inter_gbps),
                }
                for shard in self.shards
            ],
        }


__all__ = ["DEFAULT_INTER_GBPS", "DEFAULT_INTRA_GBPS", "RefitStats", "ShardCost", "lower_bound"]
