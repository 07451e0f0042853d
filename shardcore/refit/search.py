"""Layout search: which destination spec to choose for R ranks and a memory budget, ranked by an objective.

Every valid spec of R ranks (``shardcore.plan.valid_specs``) is a candidate. The steps, cheapest first,
each on what the step before left:

1. **the model splits** over it (``Footprint.fits``: the manifest's split dims, layers and experts);
2. **the weights fit**: the busiest rank's weight bytes are at most the memory per rank (exact);
3. **estimate** the refit from the source shard (``estimate_refit``: received and moved bytes exact,
   sends the planner's even share), once per refit class: specs that differ only in how they split
   cp x dp hold and receive the same bytes on the same ranks, so they share one estimate;
4. **plan** the best ``plan`` candidates with ``plan_refit`` and ``RefitStats`` (their numbers become
   exact for the plan; the others keep the estimate, which the plan matched within 0.5 % on the
   measured models; see BENCHMARKS.md). Walking a DeepSeek-V3 plan costs seconds, so the default plans
   none.

The result is ranked by an **objective** (``OBJECTIVES``), the refit's cost always the last tie-breaker:
``replicas`` (the default: what a serving engineer wants first) puts the most replicas first (the spec's dp:
each replica serves requests on its own), then the most memory headroom (the fewest weight bytes per rank,
room for the KV cache), then the fastest refit; ``memory`` puts the most headroom first, then the fastest
refit; ``refit-time`` the fastest refit first, then the headroom. The Pareto front over (weight bytes per
rank, seconds) is marked. When no spec fits, a ``NoLayoutError`` names what cannot be met and the
nearest constraint that would admit a layout (more memory, or a nearby number of ranks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..errors import LayoutError, NoLayoutError, RefitError
from ..plan.arguments import MAX_WORLD_SIZE, check_count, format_bytes, shown
from ..plan.choices import AXES, check_axes, valid_specs
from ..plan.layout import Layout, ShardPlan, plan_layout
from ..plan.spec import ShardSpec
from .cost import DEFAULT_INTER_GBPS, DEFAULT_INTRA_GBPS, RefitStats
from .estimate import RefitEstimate, estimate_refit
from .footprint import Footprint
from .manifest import Manifest
from .planner import plan_refit, resolve_shard

Progress = Callable[[str], None]
OBJECTIVES = ("replicas", "memory", "refit-time")
"""What a search ranks by first (the module doc says each order); the first is the default."""
NEAREST_SPECS = 100_000
"""How many specs a failed search looks at, at most, for a nearby number of ranks that would fit."""
NEAREST_RANKS = 1024
"""How far a failed search looks for a number of ranks that would fit: R ranks each way, at least 64 and at
most this many."""


@dataclass(frozen=True)
class Candidate:
    """One destination spec that fits, with its cost.

    Attributes:
        spec: The destination spec.
        destination: Its shard, placed on the search's ranks.
        weight_bytes: The most weight bytes one of its ranks holds.
        estimate: The refit estimate (see ``shardcore.refit.estimate``).
        seconds: Its time: the plan's when planned, else the estimate's.
        stats: The planned refit's stats, when this candidate was planned.
        pareto: On the Pareto front over (weight bytes, seconds): nothing else is as small and as fast.
    """

    spec: ShardSpec
    destination: ShardPlan
    weight_bytes: int
    estimate: RefitEstimate
    seconds: float
    """The planned time when planned, else the estimate's."""
    stats: RefitStats | None = None
    pareto: bool = False

    @property
    def busiest(self) -> tuple[int, float]:
        """(rank, bytes) of the rank that takes longest: from the plan when planned, else the estimate."""
        if self.stats is None:
            return self.estimate.busiest
        loads = {rank: max(load[0] + load[1], load[2] + load[3]) for rank, load in self.stats.loads.items()}
        rank = max(loads, key=lambda r: (loads[r], -r), default=self.estimate.busiest[0])
        return rank, loads.get(rank, 0)

    @property
    def inter_node_bytes(self) -> int:
        return self.stats.inter_node_bytes if self.stats is not None else self.estimate.inter_node_bytes

    @property
    def replicas(self) -> int:
        """Copies of the model the destination serves with (its dp): each answers requests on its own."""
        return self.spec.dp

    def to_dict(self) -> dict[str, Any]:
        rank, size = self.busiest
        return {
            "spec": str(self.spec),
            "sizes": self.spec.to_dict(),
            "ranks": [self.destination.rank_offset, self.destination.ranks.stop],
            "replicas": self.replicas,
            "weight_bytes": self.weight_bytes,
            "estimate_seconds": self.seconds,
            "busiest_rank": rank,
            "busiest_bytes": size,
            "inter_node_bytes": self.inter_node_bytes,
            "pareto": self.pareto,
            "planned": self.stats is not None,
            "estimate": self.estimate.to_dict(),
        }


@dataclass(frozen=True)
class SearchResult:
    """The candidates that fit, ranked, and how many each step kept.

    Attributes:
        candidates: Ranked by ``objective`` (see the module doc), then enumeration order.
        objective: What they are ranked by first (``OBJECTIVES``).
        enumerated / split / fit_memory: Specs enumerated, those the model splits over, those that fit memory.
        estimated: Refit classes estimated (specs sharing one estimate count once).
        planned: Candidates planned with plan_refit and RefitStats.
        seconds: Wall time of the search.
    """

    source: ShardPlan
    manifest: Manifest
    ranks: int
    memory_bytes: float
    candidates: tuple[Candidate, ...]
    enumerated: int
    split: int
    fit_memory: int
    estimated: int
    planned: int
    seconds: float
    shared_node: bool
    intra_gbps: float
    inter_gbps: float
    objective: str = OBJECTIVES[0]

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def front(self) -> tuple[Candidate, ...]:
        """The Pareto front, by weight bytes ascending."""
        return tuple(sorted((c for c in self.candidates if c.pareto), key=lambda c: (c.weight_bytes, c.seconds)))

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        shown_candidates = self.candidates if top is None else self.candidates[:top]
        return {
            "model": self.manifest.name,
            "source": {"index": self.source.index, "spec": str(self.source.spec)},
            "ranks": self.ranks,
            "memory_bytes": self.memory_bytes,
            "objective": self.objective,
            "enumerated": self.enumerated,
            "split": self.split,
            "fit_memory": self.fit_memory,
            "estimated": self.estimated,
            "planned": self.planned,
            "seconds": self.seconds,
            "shared_node": self.shared_node,
            "bandwidth_gbps": {"intra_node": self.intra_gbps, "inter_node": self.inter_gbps},
            "candidates": [candidate.to_dict() for candidate in shown_candidates],
            "front": [str(candidate.spec) for candidate in self.front],
        }


def _fitting(
    ranks: int, footprint: Footprint, memory: float, axes: Mapping[str, int], order: str
) -> tuple[list[ShardSpec], list[ShardSpec], list[ShardSpec]]:
    """(every valid spec of ``ranks``, those the model splits over, those whose weights fit ``memory``)."""
    specs = list(valid_specs(ranks, order=order, axes=axes))
    split = [spec for spec in specs if footprint.fits(spec) is None]
    return specs, split, [spec for spec in split if footprint.weight_bytes(spec) <= memory]


def _nearest_ranks(ranks: int, footprint: Footprint, memory: float, axes: Mapping[str, int], order: str) -> str:
    """A nearby number of ranks with a fitting spec, as a clause for the error ('; 256 ranks would fit: ...').

    Looks R ranks each way (at least 64, at most NEAREST_RANKS), nearest first, and stops at the first
    fitting spec or after NEAREST_SPECS specs (a size like 2^16 has hundreds of thousands).
    """
    reach, examined = min(max(ranks, 64), NEAREST_RANKS), 0
    for distance in range(1, reach + 1):
        for other in (ranks + distance, ranks - distance):
            if not 1 <= other <= MAX_WORLD_SIZE:
                continue
            for spec in valid_specs(other, order=order, axes=axes):
                examined += 1
                if footprint.fits(spec) is None and footprint.weight_bytes(spec) <= memory:
                    held = format_bytes(footprint.weight_bytes(spec))
                    return f"; {other} ranks would fit: e.g. '{spec}' holds {held} per rank"
                if examined >= NEAREST_SPECS:
                    return (
                        f"; no nearby number of ranks fits either ({examined} specs looked at, up to {distance} away)"
                    )
    return f"; no number of ranks within {reach} of {ranks} fits either"


def _no_layout(
    ranks: int,
    footprint: Footprint,
    memory: float,
    axes: Mapping[str, int],
    order: str,
    specs: list[ShardSpec],
    split: list[ShardSpec],
) -> NoLayoutError:
    """Why nothing fits (no spec, none the model splits over, none within memory), and the nearest
    constraint that would admit a layout."""
    model = footprint.manifest.name
    relevant = [axis for axis in AXES if footprint.manifest.experts or axis not in ("ep", "expt_tp")]
    named = (axis if limit >= MAX_WORLD_SIZE else f"{axis}<={limit}" for axis, limit in axes.items())
    restricted = any(limit < MAX_WORLD_SIZE for limit in axes.values()) or set(relevant) - set(axes)
    over = f" over axes {', '.join(named)}" if restricted else ""
    if not specs:
        reason = f"no spec of {ranks} ranks{over} exists: allow dp or more axes"
    elif not split:
        reason = f"no spec of {ranks} ranks{over} splits {model} (e.g. {footprint.fits(specs[0])})"
    else:
        smallest = min(split, key=footprint.weight_bytes)
        need = footprint.weight_bytes(smallest)
        reason = (
            f"no layout of {ranks} ranks{over} fits {format_bytes(memory)} per rank for {model}: the smallest "
            f"footprint, '{smallest}', holds {format_bytes(need)} per rank ({format_bytes(need - memory)} more memory "
            f"per rank would admit it)"
        )
    return NoLayoutError(reason + _nearest_ranks(ranks, footprint, memory, axes, order))


def _check_window(layout: Layout, source: ShardPlan, ranks: int, offset: int | None) -> int:
    """The first rank of the destination window: after the last shard unless given; disjoint from the source."""
    end = max(plan.ranks.stop for plan in layout.shards)
    start = end if offset is None else check_count("offset", offset, minimum=0, maximum=layout.world_size - 1)
    if start + ranks > layout.world_size:
        where = "after the shards" if offset is None else f"from rank {start}"
        raise LayoutError(
            f"the world of {layout.world_size} has no room for {ranks} ranks {where}: grow the world to "
            f"{start + ranks} (--world) or give fewer ranks"
        )
    if start < source.ranks.stop and source.rank_offset < start + ranks:
        raise LayoutError(
            f"ranks [{start}, {start + ranks}) overlap the source shard [{source.rank_offset}, {source.ranks.stop}): "
            f"search places the destination on other ranks; plan a collocated refit with plan_refit"
        )
    return start


_ORDERS: dict[str, Callable[[Candidate], tuple[float, ...]]] = {
    "replicas": lambda c: (-c.replicas, c.weight_bytes, c.seconds),
    "memory": lambda c: (c.weight_bytes, c.seconds),
    "refit-time": lambda c: (c.seconds, c.weight_bytes),
}
"""Each objective's sort key: smaller first."""


def _rank(candidates: Iterable[Candidate], objective: str) -> tuple[Candidate, ...]:
    """Sorted by ``objective`` (stable: enumeration order last), with the Pareto front marked."""
    ranked = sorted(candidates, key=_ORDERS[objective])
    best_seconds, marked = float("inf"), set()
    by_memory = sorted(range(len(ranked)), key=lambda i: (ranked[i].weight_bytes, ranked[i].seconds))
    position = 0
    while position < len(by_memory):  # one memory level at a time: its fastest are on the front if faster
        level = ranked[by_memory[position]].weight_bytes
        same = [i for i in by_memory[position:] if ranked[i].weight_bytes == level]
        fastest = min(ranked[i].seconds for i in same)
        if fastest < best_seconds:
            marked |= {i for i in same if ranked[i].seconds == fastest}
            best_seconds = fastest
        position += len(same)
    return tuple(replace(c, pareto=i in marked) for i, c in enumerate(ranked))


def _check_arguments(
    layout: Layout,
    source: int | ShardPlan,
    manifest: Manifest,
    ranks: int,
    memory_bytes: float,
    ranks_per_node: int | None,
    axes: Collection[str] | Mapping[str, int],
    bandwidths: tuple[float, float],
    plan: int,
    objective: str,
) -> tuple[ShardPlan, dict[str, int]]:
    """The source shard and the axis limits, once every argument is checked."""
    if objective not in OBJECTIVES:
        raise RefitError(f"objective={shown(objective)}: choose one of {', '.join(OBJECTIVES)}")
    if not isinstance(layout, Layout):
        raise LayoutError(f"layout must be a shardcore Layout; got {type(layout).__name__}")
    if not isinstance(manifest, Manifest):
        raise RefitError(f"manifest must be a shardcore.refit.Manifest; got {type(manifest).__name__}")
    origin = resolve_shard(layout, source, "source")
    check_count("ranks", ranks)
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, (int, float)) or not memory_bytes > 0:
        raise LayoutError(f"memory_bytes={shown(memory_bytes)}: expected a positive number of bytes per rank")
    if ranks_per_node is not None:
        check_count("ranks_per_node", ranks_per_node)
    for name, value in zip(("intra_gbps", "inter_gbps"), bandwidths):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise RefitError(f"{name}={shown(value)}: expected a positive bandwidth in GB/s")
    check_count("plan", plan, minimum=0, error=RefitError)
    return origin, check_axes(axes)


def _estimate_all(
    layout: Layout,
    origin: ShardPlan,
    fitting: list[ShardSpec],
    start: int,
    footprint: Footprint,
    ranks_per_node: int | None,
    inter_gbps: float,
    say: Progress,
) -> tuple[list[Candidate], int]:
    """Every fitting spec as a Candidate placed at ``start``, estimated once per refit class; and how many classes."""
    estimates: dict[tuple[int, ...], RefitEstimate] = {}
    candidates = []
    for spec in fitting:
        destination = plan_layout(layout.world_size, spec, order=layout.order, rank_offset=start, allow_idle=True)
        key = (spec.tp, spec.pp, spec.ep, spec.expt_tp, spec.cp * spec.dp)
        if key not in estimates:
            estimates[key] = estimate_refit(
                origin, destination.shards[0], footprint, ranks_per_node=ranks_per_node, inter_gbps=inter_gbps
            )
            if len(estimates) % 200 == 0:
                say(f"estimated {len(estimates)} refit classes")
        estimate = estimates[key]
        candidates.append(
            Candidate(spec, destination.shards[0], footprint.weight_bytes(spec), estimate, estimate.seconds)
        )
    return candidates, len(estimates)


def _plan_best(
    ranked: list[Candidate],
    count: int,
    layout: Layout,
    origin: ShardPlan,
    manifest: Manifest,
    ranks_per_node: int | None,
    bandwidths: tuple[float, float],
    say: Progress,
) -> list[Candidate]:
    """The first ``count`` of ``ranked`` planned with plan_refit and RefitStats: their cost becomes the plan's."""
    for position in range(min(count, len(ranked))):
        candidate = ranked[position]
        say(f"planning {position + 1}/{min(count, len(ranked))}: '{candidate.spec}'")
        stats = RefitStats.of(plan_refit(layout, origin, candidate.destination, manifest, ranks_per_node))
        ranked[position] = replace(candidate, stats=stats, seconds=stats.estimate_seconds(*bandwidths))
    return ranked


def search(
    layout: Layout,
    source: int | ShardPlan,
    manifest: Manifest,
    ranks: int,
    memory_bytes: float,
    *,
    offset: int | None = None,
    ranks_per_node: int | None = None,
    axes: Collection[str] | Mapping[str, int] = AXES,
    role: str | None = None,
    intra_gbps: float = DEFAULT_INTRA_GBPS,
    inter_gbps: float = DEFAULT_INTER_GBPS,
    plan: int = 0,
    progress: Progress | None = None,
    objective: str = OBJECTIVES[0],
) -> SearchResult:
    """Every destination spec of ``ranks`` ranks that the model splits over and whose weights fit
    ``memory_bytes`` per rank, ranked by ``objective``, the estimated time to refit it from ``source`` last.

    Args:
        layout: The layout holding the source shard; the destination goes on ranks no shard uses.
        source: The source shard: an index into ``layout.shards`` or a ShardPlan over the same world.
        manifest: The model.
        ranks: Ranks for the destination shard.
        memory_bytes: Memory per rank for weights, in bytes.
        offset: First rank of the destination (default: the rank after the last shard).
        ranks_per_node: Node size (node = rank // K), for the plan's routes and node sharing.
        axes: The axes a destination may use (tp, pp, cp, dp, ep, expt_tp), or a mapping of them to their
            largest size ({"tp": 8, ...}: keep tp within a node); the others stay at 1 (expt_tp at tp).
        role: The role given to every candidate spec.
        intra_gbps / inter_gbps: Bandwidths per rank and direction for the time, GB/s.
        plan: How many of the best candidates to plan exactly (plan_refit and RefitStats).
        progress: Called with a line of progress at each step (the CLI prints it on stderr).
        objective: What to rank by first: "replicas" (most dp, then fewest weight bytes per rank, then fastest
            refit), "memory" (fewest weight bytes, then fastest) or "refit-time" (fastest, then fewest bytes).

    Raises:
        NoLayoutError: no spec fits, naming what cannot be met and the nearest constraint that would
            admit a layout.
        LayoutError: a bad argument, or no room for the destination in the world.
        RefitError: a bad source shard, bandwidth, plan count or objective.
        ManifestError: the model does not split over the source shard.
    """
    started = time.perf_counter()
    say = progress or (lambda line: None)
    bandwidths = (intra_gbps, inter_gbps)
    origin, limits = _check_arguments(
        layout, source, manifest, ranks, memory_bytes, ranks_per_node, axes, bandwidths, plan, objective
    )
    start = _check_window(layout, origin, ranks, offset)
    footprint = Footprint(manifest)
    unfit = footprint.fits(origin.spec)
    if unfit is not None:
        raise unfit
    limits = footprint.axes(limits)
    specs, split, fitting = _fitting(ranks, footprint, memory_bytes, limits, layout.order)
    say(f"{len(specs)} specs of {ranks} ranks; {len(split)} split {manifest.name}; {len(fitting)} fit memory")
    if not fitting:
        raise _no_layout(ranks, footprint, memory_bytes, limits, layout.order, specs, split)
    if role is not None:
        fitting = [replace(spec, role=role) for spec in fitting]
    candidates, classes = _estimate_all(layout, origin, fitting, start, footprint, ranks_per_node, inter_gbps, say)
    ranked = _plan_best(
        list(_rank(candidates, objective)), plan, layout, origin, manifest, ranks_per_node, bandwidths, say
    )
    return SearchResult(
        source=origin,
        manifest=manifest,
        ranks=ranks,
        memory_bytes=memory_bytes,
        candidates=_rank(ranked, objective),
        enumerated=len(specs),
        split=len(split),
        fit_memory=len(fitting),
        estimated=classes,
        planned=min(plan, len(ranked)),
        seconds=time.perf_counter() - started,
        shared_node=any(candidate.estimate.shared_node for candidate in candidates),
        intra_gbps=intra_gbps,
        inter_gbps=inter_gbps,
        objective=objective,
    )


__all__ = ["OBJECTIVES", "Candidate", "SearchResult", "search"]
