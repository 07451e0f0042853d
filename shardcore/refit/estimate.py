"""What a refit between two disjoint shards costs, from the layouts and the manifest alone (no plan walked).

Walking a plan costs its transfers (millions for DeepSeek-V3), so a layout search cannot afford it for
every candidate. The cost follows from the plan's contract and its balance instead:

- **received, exact**: every element a destination rank holds arrives exactly once, so each rank
  receives what it holds (``Footprint``); every destination element crosses between two ranks, so the
  bytes moved are each tensor's bytes times its destination replicas;
- **sent, the even share**: the planner spreads each element over its source replicas, so a source
  rank sends, of every tensor it holds, its slice times (destination replicas / source replicas). The
  busiest plan sender measured within 0.5 % of this (``tests/core/test_refit_search.py``,
  BENCHMARKS.md); it is an estimate, not a bound;
- **time**: the cost model of ``RefitStats``: the slowest rank's larger direction. When no node holds
  ranks of both shards (or ``ranks_per_node`` is not given) every byte crosses nodes, exactly as the
  plan routes it; when a node is shared the planner keeps some traffic inside it, and the estimate
  (which counts all of it as inter-node) is marked ``shared_node``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import RefitError
from ..plan.layout import ShardPlan
from .cost import DEFAULT_INTER_GBPS
from .footprint import Footprint, replicas, split_ways


@dataclass(frozen=True)
class RefitEstimate:
    """The estimated cost of refitting one destination shard from one source shard.

    Attributes:
        total_bytes: Bytes moved between ranks (exact).
        inter_node_bytes: Of them, bytes that cross nodes (exact unless ``shared_node``).
        busiest_receiver / received: A destination rank receiving most, and its bytes (exact).
        busiest_sender / sent: A source rank sending most, and its bytes (the even share).
        seconds: The estimated time at ``inter_gbps`` (every byte inter-node).
        shared_node: A node holds ranks of both shards: the plan keeps some bytes inside it.
    """

    total_bytes: int
    inter_node_bytes: int
    busiest_receiver: int
    received: int
    busiest_sender: int
    sent: float
    seconds: float
    shared_node: bool

    @property
    def busiest(self) -> tuple[int, float]:
        """(rank, bytes) of the rank that takes longest: the busier of the receiver and the sender."""
        return (
            (self.busiest_receiver, self.received) if self.received >= self.sent else (self.busiest_sender, self.sent)
        )

    def to_dict(self) -> dict[str, Any]:
        rank, size = self.busiest
        return {
            "total_bytes": self.total_bytes,
            "inter_node_bytes": self.inter_node_bytes,
            "busiest_rank": rank,
            "busiest_bytes": size,
            "busiest_receiver": self.busiest_receiver,
            "received": self.received,
            "busiest_sender": self.busiest_sender,
            "sent": self.sent,
            "estimate_seconds": self.seconds,
            "shared_node": self.shared_node,
        }


def _nodes(plan: ShardPlan, ranks_per_node: int) -> range:
    return range(plan.rank_offset // ranks_per_node, (plan.ranks.stop - 1) // ranks_per_node + 1)


def estimate_refit(
    source: ShardPlan,
    destination: ShardPlan,
    footprint: Footprint,
    *,
    ranks_per_node: int | None = None,
    inter_gbps: float = DEFAULT_INTER_GBPS,
) -> RefitEstimate:
    """Estimate refitting ``destination`` from ``source`` (see the module doc for what is exact).

    Args:
        source: The source shard.
        destination: The destination shard, on ranks disjoint from the source's.
        footprint: The model's footprint (its manifest must split over both shards).
        ranks_per_node: Node size, to tell whether a node holds ranks of both shards.
        inter_gbps: Inter-node bandwidth per rank and direction, GB/s.

    Raises:
        RefitError: the shards overlap.
    """
    if source.rank_offset < destination.ranks.stop and destination.rank_offset < source.ranks.stop:
        raise RefitError(
            f"destination '{destination.spec}' [{destination.rank_offset}, {destination.ranks.stop}) overlaps the "
            f"source '{source.spec}' [{source.rank_offset}, {source.ranks.stop}): the estimate is for disjoint shards; "
            f"plan a collocated refit with plan_refit"
        )
    src, dst = source.spec, destination.spec
    total = sum(size * replicas(dst, category) for category, size in footprint.totals.items())
    receiver, received = max(
        ((rank_class, rank_class.held_bytes(dst)) for rank_class in footprint.classes(dst)), key=lambda item: item[1]
    )
    sender, sent = max(
        (
            (
                rank_class,
                sum(
                    size / split_ways(src, category) * replicas(dst, category) / replicas(src, category)
                    for category, size in rank_class.bytes.items()
                ),
            )
            for rank_class in footprint.classes(src)
        ),
        key=lambda item: item[1],
    )
    shared = False
    if ranks_per_node is not None:
        first, second = _nodes(source, ranks_per_node), _nodes(destination, ranks_per_node)
        shared = max(first.start, second.start) < min(first.stop, second.stop)
    return RefitEstimate(
        total_bytes=total,
        inter_node_bytes=total,
        busiest_receiver=destination.expert_grid.rank_at({"pp": receiver.stage, "ep": receiver.ep_rank}),
        received=received,
        busiest_sender=source.expert_grid.rank_at({"pp": sender.stage, "ep": sender.ep_rank}),
        sent=sent,
        seconds=max(received, sent) / (inter_gbps * 1e9),
        shared_node=shared,
    )


__all__ = ["RefitEstimate", "estimate_refit"]
