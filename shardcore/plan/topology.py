"""Node topology: which groups of a layout cross the slow link between nodes.

A node holds ``ranks_per_node`` consecutive ranks (node = rank // ranks_per_node), as
``torchrun`` assigns them. Groups are sorted, so a group crosses a node boundary iff its
first and last rank sit on different nodes. The counts come from a histogram of group
first ranks modulo ``ranks_per_node``, built one grid dim at a time: the cost is
O(ranks_per_node * sum of dim sizes) per group name, never more than O(world); example
groups are enumerated only on demand and only when small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING, Any, Literal

from ..errors import LayoutError
from .arguments import check_count, counted, shown
from .grid import Grid
from .layout import GRID_GROUP_NAMES

if TYPE_CHECKING:
    from .layout import Layout, ShardPlan

Severity = Literal["ok", "info", "warning"]

TOPOLOGY_GROUPS: tuple[str, ...] = GRID_GROUP_NAMES
"""The grid group names checked (embd / pos_embd are subsets of pp and are left out)."""

BANDWIDTH_GROUPS: frozenset[str] = frozenset({"tp", "cp", "ep", "expt_tp", "tp_ep"})
"""Groups that run collectives every layer: crossing a node with one is a warning."""

EXAMPLE_LIMIT = 64
"""Largest example group listed rank by rank in text and JSON."""


@dataclass(frozen=True)
class GroupFinding:
    """How many of one shard's groups of one name cross a node boundary, and the first that does."""

    shard: int
    name: str
    severity: Severity
    crossing: int
    total: int
    group_size: int
    example_first: int | None
    """First rank of the first crossing group in Megatron's enumeration order; None when none cross."""
    _grid: Grid | None = field(default=None, repr=False, compare=False)
    _dims: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @property
    def crosses(self) -> bool:
        return self.crossing > 0

    @property
    def example(self) -> tuple[int, ...] | None:
        """The example group's ranks, enumerated on demand (a dp group may hold a million)."""
        if self.example_first is None or self._grid is None:
            return None
        return self._grid.group_ranks(self.example_first, self._dims)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the example's ranks are listed only up to EXAMPLE_LIMIT members."""
        example = self.example if self.group_size <= EXAMPLE_LIMIT else None
        return {
            "shard": self.shard,
            "name": self.name,
            "severity": self.severity,
            "crossing": self.crossing,
            "total": self.total,
            "group_size": self.group_size,
            "example_first": self.example_first,
            "example": None if example is None else list(example),
        }

    def describe_example(self) -> str:
        """The example group, elided in the middle when long, without enumerating a huge group."""
        example = self.example if self.group_size <= EXAMPLE_LIMIT else None
        if example is None:
            first, grid = self.example_first, self._grid
            last = first + _span(grid, self._dims) if grid is not None and first is not None else "?"
            return f"the {self.group_size}-rank group spanning ranks {self.example_first}-{last}"
        if len(example) <= 8:
            return f"[{', '.join(map(str, example))}]"
        return f"[{', '.join(map(str, example[:6]))}, ..., {example[-2]}, {example[-1]}] ({len(example)} ranks)"


@dataclass(frozen=True)
class NodeSpan:
    """Where one shard's window falls on the nodes, and whether it shares a node with other ranks (not the refit's
    ``ShardPlacement``, which is what a shard's ranks hold)."""

    shard: int
    ranks: range
    nodes: range
    starts_mid_node: bool
    ends_mid_node: bool

    @property
    def shares_node(self) -> bool:
        """The window starts or ends mid-node, so another shard (or idle ranks) shares that node."""
        return self.starts_mid_node or self.ends_mid_node

    @property
    def shared_nodes(self) -> tuple[int, ...]:
        """The nodes this shard shares with other ranks: its first when it starts mid-node, its last
        when it ends mid-node."""
        shared = [self.nodes.start] if self.starts_mid_node else []
        if self.ends_mid_node and self.nodes[-1] not in shared:
            shared.append(self.nodes[-1])
        return tuple(shared)

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "ranks": [self.ranks.start, self.ranks.stop],
            "nodes": [self.nodes.start, self.nodes.stop],
            "starts_mid_node": self.starts_mid_node,
            "ends_mid_node": self.ends_mid_node,
            "shares_node": self.shares_node,
        }


@dataclass(frozen=True)
class TopologyReport:
    """Every shard's placement and, for each of its 13 group names, the node crossings."""

    ranks_per_node: int
    world_size: int
    placements: tuple[NodeSpan, ...]
    groups: tuple[GroupFinding, ...]

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    @property
    def warnings(self) -> tuple[GroupFinding, ...]:
        """Bandwidth-hungry groups that cross nodes: what ``--strict`` fails on."""
        return tuple(f for f in self.groups if f.severity == "warning")

    @property
    def crossings(self) -> tuple[GroupFinding, ...]:
        """Every group name that crosses nodes somewhere, warning or info."""
        return tuple(f for f in self.groups if f.crosses)

    @property
    def sharing(self) -> tuple[NodeSpan, ...]:
        """Shards that share a node with other ranks."""
        return tuple(p for p in self.placements if p.shares_node)

    def communicators(self, findings: Sequence[GroupFinding]) -> list[list[GroupFinding]]:
        """``findings`` grouped by communicator: names of one shard whose groups are the same rank
        sets (tp, expt_tp and tp_ep when expt_tp = tp and ep = 1) are one communicator, so one line."""
        merged: dict[tuple[object, ...], list[GroupFinding]] = {}
        for f in findings:
            merged.setdefault((f.shard, *_partition(f)), []).append(f)
        return list(merged.values())

    def finding(self, shard: int, name: str) -> GroupFinding:
        """The finding for one shard and group name."""
        for f in self.groups:
            if f.shard == shard and f.name == name:
                return f
        raise LayoutError(f"no finding for shard {shard}, group {shown(name)}: names are {', '.join(TOPOLOGY_GROUPS)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks_per_node": self.ranks_per_node,
            "nodes": self.num_nodes,
            "placements": [p.to_dict() for p in self.placements],
            "groups": [f.to_dict() for f in self.groups],
            "warnings": len(self.warnings),
        }

    def format(self) -> str:
        """Text for the CLI: placements, then every crossing name, warnings first."""
        rest = self.world_size % self.ranks_per_node
        partial = f", the last holding only {rest}" if rest else ""
        lines = [
            f"node topology: {counted(self.world_size, 'rank')} on {counted(self.num_nodes, 'node')} of "
            f"{self.ranks_per_node}{partial}"
        ]
        for p in self.placements:
            lines.append(
                f"  shard {p.shard}: ranks [{p.ranks.start}, {p.ranks.stop}) on {_nodes(p.nodes)}"
                f"{_sharing_note(p, self.ranks_per_node)}"
            )
        warnings = self.communicators(self.warnings)
        for same in warnings:
            f = same[0]
            names = " = ".join(g.name for g in same) + (" (one communicator)" if len(same) > 1 else "")
            lines.append(
                f"  warning  shard {f.shard} {names}: {f.crossing} of {counted(f.total, 'group')} "
                f"{'crosses' if f.crossing == 1 else 'cross'} nodes, "
                f"e.g. {f.describe_example()}"
            )
        for p in self.placements:
            infos = [
                f"{'/'.join(g.name for g in same)} {same[0].crossing}/{same[0].total}"
                for same in self.communicators([f for f in self.crossings if f.shard == p.shard])
                if same[0].severity == "info"
            ]
            if infos:
                lines.append(f"  info     shard {p.shard}: groups crossing nodes: {', '.join(infos)}")
        if warnings:
            names = ", ".join(dict.fromkeys(f.name for f in self.warnings))
            lines.append(
                f"{counted(len(warnings), 'warning')}: {names} groups span nodes; place them within a "
                f"node (shards starting on node boundaries, group sizes dividing {self.ranks_per_node})"
            )
        else:
            lines.append("no warnings: tp, cp, ep, expt_tp and tp_ep groups all stay within a node")
        return "\n".join(lines)


def _nodes(nodes: range) -> str:
    return f"node {nodes.start}" if len(nodes) == 1 else f"nodes {nodes.start}-{nodes.stop - 1}"


def _sharing_note(p: NodeSpan, ranks_per_node: int) -> str:
    """Which node(s) the shard shares with other ranks, and where on them it starts or ends."""
    if not p.shares_node:
        return ""
    shared = p.shared_nodes
    where = f"node {shared[0]}" if len(shared) == 1 else f"nodes {shared[0]} and {shared[1]}"
    ends = [f"starts at local rank {p.ranks.start % ranks_per_node}"] if p.starts_mid_node else []
    if p.ends_mid_node:
        ends.append(f"ends at local rank {(p.ranks.stop - 1) % ranks_per_node}")
    return f", shares {where} with other ranks ({', '.join(ends)})"


def _partition(f: GroupFinding) -> tuple[object, ...]:
    """What fixes a name's groups on one shard: the window and the group's shape as (size, stride)
    runs, adjacent dims merged (expt_tp=2 then ep=2 at stride 2 is one run of 4 at stride 1, like
    tp=4). Names with equal keys have the same rank sets."""
    grid = f._grid
    if grid is None:
        return (f.name,)
    runs: list[tuple[int, int]] = []
    steps = [(grid.size_of(d), grid.stride_of(d)) for d in f._dims if grid.size_of(d) > 1]
    for size, stride in sorted(steps, key=lambda step: step[1]):
        if runs and runs[-1][0] * runs[-1][1] == stride:
            runs[-1] = (runs[-1][0] * size, runs[-1][1])
        else:
            runs.append((size, stride))
    return (grid.rank_offset, grid.size, tuple(runs))


def check_ranks_per_node(ranks_per_node: object) -> int:
    """Validate a node size; shared with the picture."""
    return check_count("ranks_per_node", ranks_per_node)  # a huge one is shown short, never printed whole


def _span(grid: Grid, dims: Sequence[str]) -> int:
    """Last rank minus first rank of any group along ``dims``."""
    return sum((grid.size_of(d) - 1) * grid.stride_of(d) for d in dims)


def _first_ranks_histograms(grid: Grid, others: Sequence[str], k: int) -> list[dict[int, int]]:
    """Histograms (residue mod k -> count) of group first ranks, after each of ``others`` in turn."""
    hists = [{grid.rank_offset % k: 1}]
    for dim in others:
        size, stride = grid.size_of(dim), grid.stride_of(dim)
        step: dict[int, int] = {}
        for residue, count in hists[-1].items():
            for c in range(size):
                key = (residue + c * stride) % k
                step[key] = step.get(key, 0) + count
        hists.append(step)
    return hists


def node_crossings(grid: Grid, dims: Sequence[str], k: int) -> tuple[int, int | None]:
    """(how many groups along ``dims`` cross a node of ``k`` ranks, the first rank of the first that does).

    A group with first rank b and span s crosses iff ``b % k + s >= k``. Group first ranks are
    ordered lexicographically by the other dims' coords, largest stride first, so a greedy walk
    back through the histograms finds the smallest crossing first rank.
    """
    span = _span(grid, dims)
    if span == 0:
        return 0, None
    others = [d for d in grid.dim_names if d not in dims]
    hists = _first_ranks_histograms(grid, others, k)
    targets = {r for r in hists[-1] if r + span >= k}
    count = sum(hists[-1][r] for r in targets)
    if not count:
        return 0, None
    first = grid.rank_offset
    for dim, before in zip(reversed(others), reversed(hists[:-1])):
        stride = grid.stride_of(dim)
        for c in range(grid.size_of(dim)):
            reachable = {(t - c * stride) % k for t in targets} & before.keys()
            if reachable:
                targets, first = reachable, first + c * stride
                break
    return count, first


def _placement(plan: ShardPlan, k: int, world_size: int) -> NodeSpan:
    ranks = plan.ranks
    return NodeSpan(
        shard=plan.index,
        ranks=ranks,
        nodes=range(ranks.start // k, (ranks.stop - 1) // k + 1),
        starts_mid_node=ranks.start % k != 0,
        ends_mid_node=ranks.stop % k != 0 and ranks.stop != world_size,
    )


def check_topology(layout: Layout, ranks_per_node: int) -> TopologyReport:
    """Every shard's placement on nodes and, per group name, how many groups cross a node."""
    k = check_ranks_per_node(ranks_per_node)
    findings = []
    for plan in layout.shards:
        for name in TOPOLOGY_GROUPS:
            grid, dims = plan.grid_of(name)
            crossing, first = node_crossings(grid, dims, k)
            group_size = prod(grid.size_of(d) for d in dims)
            severity: Severity = "ok" if not crossing else ("warning" if name in BANDWIDTH_GROUPS else "info")
            findings.append(
                GroupFinding(
                    plan.index, name, severity, crossing, grid.size // group_size, group_size, first, grid, dims
                )
            )
    placements = tuple(_placement(plan, k, layout.world_size) for plan in layout.shards)
    return TopologyReport(k, layout.world_size, placements, tuple(findings))


__all__ = [
    "BANDWIDTH_GROUPS",
    "TOPOLOGY_GROUPS",
    "GroupFinding",
    "NodeSpan",
    "TopologyReport",
    "check_ranks_per_node",
    "check_topology",
    "node_crossings",
]
