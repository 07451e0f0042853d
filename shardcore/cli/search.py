"""``shardcore refit --search``: which destination layout to choose for R ranks and a memory budget (no torch)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from ..errors import RefitError
from ..plan.arguments import MAX_WORLD_SIZE, format_bytes
from ..plan.choices import AXES
from ..plan.layout import plan_layout
from ..plan.topology import check_topology
from ..refit.documents import model_manifest
from ..refit.search import OBJECTIVES, Candidate, SearchResult, search
from ..views.tables import format_table
from .arguments import NON_NEGATIVE_INT, POSITIVE_INT, missing_flags

OBJECTIVE_HELP = {
    "replicas": "most replicas (the spec's dp) first, then the most memory headroom, then the fastest refit",
    "memory": "most memory headroom (fewest weight bytes per rank) first, then the fastest refit",
    "refit-time": "fastest refit first, then the most memory headroom",
}
"""What each objective ranks by, as the table's header and ``--help`` say it."""
PROGRESS_AFTER = 1.0
"""Seconds a search runs before its progress lines appear on stderr."""


def parse_axes(text: str) -> dict[str, int]:
    """``--axes tp:8,pp,dp,ep,expt_tp``: the axes a destination may use, each with an optional largest size."""
    limits: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, size = item.partition(":")
        if name not in AXES:
            raise RefitError(f"--axes: unknown axis {name!r}; choose from {', '.join(AXES)} (e.g. tp:8,dp,ep)")
        try:
            limits[name] = int(size) if size else MAX_WORLD_SIZE
        except ValueError:
            raise RefitError(f"--axes {item!r}: the largest size after ':' must be a whole number, e.g. tp:8") from None
    if not limits:
        raise RefitError("--axes is empty: name the axes a destination may use, e.g. --axes tp:8,dp,ep")
    return limits


class _Progress:
    """Progress lines on stderr for a search that runs long: nothing for the first PROGRESS_AFTER seconds (a
    quick search says nothing), then the step in progress, and each step as it starts. A step that began
    before then and is still running (planning one large model takes seconds) is printed when that time is
    up, by a timer, so a long run never stays silent. With -q, nothing."""

    def __init__(self, quiet: bool) -> None:
        self.quiet, self.started = quiet, time.perf_counter()
        self.pending: str | None = None
        self.lock = threading.Lock()
        self.timer = threading.Timer(PROGRESS_AFTER, self._flush)
        self.timer.daemon = True
        if not quiet:
            self.timer.start()

    def __call__(self, line: str) -> None:
        with self.lock:
            self.pending = line
            if time.perf_counter() - self.started >= PROGRESS_AFTER:
                self._print()

    def _flush(self) -> None:
        with self.lock:
            if self.pending is not None:
                self._print()

    def _print(self) -> None:
        if not self.quiet and self.pending is not None:
            print(f"search: {self.pending} ({time.perf_counter() - self.started:.1f} s)", file=sys.stderr, flush=True)
        self.pending = None

    def close(self) -> None:
        """The search is over: no line after its result."""
        self.timer.cancel()
        with self.lock:
            self.pending = None


def _crossing(candidate: Candidate, ranks_per_node: int | None) -> str | None:
    """The bandwidth-hungry groups (tp, cp, ep, expt_tp, tp_ep) of the candidate that cross nodes ('' for
    none), or None without a node size."""
    if ranks_per_node is None:
        return None
    destination = candidate.destination
    layout = plan_layout(destination.ranks.stop, destination.spec, rank_offset=destination.rank_offset, allow_idle=True)
    names = dict.fromkeys(finding.name for finding in check_topology(layout, ranks_per_node).warnings)
    return ",".join(names)


def _rows(result: SearchResult, top: int, ranks_per_node: int | None) -> list[tuple[object, ...]]:
    """The best ``top`` distinct costs, one row each: candidates with the same cost are one row ('+N alike')."""
    rows: list[tuple[object, ...]] = []
    seen: dict[tuple[object, ...], int] = {}
    alike: list[int] = []
    for candidate in result.candidates:
        rank, size = candidate.busiest
        planned = candidate.stats is not None  # a planned cost is never alike an estimated one
        key = (
            candidate.replicas,
            candidate.weight_bytes,
            candidate.seconds,
            rank,
            size,
            candidate.inter_node_bytes,
            planned,
        )
        if key in seen:
            alike[seen[key]] += 1
            continue
        if len(rows) == top:
            continue
        seen[key] = len(rows)
        alike.append(0)
        rows.append(
            (
                len(rows) + 1,
                str(candidate.spec),
                candidate.replicas,
                format_bytes(candidate.weight_bytes),
                format_bytes(result.memory_bytes - candidate.weight_bytes),
                f"{candidate.seconds:.3g}",
                rank,
                format_bytes(size),
                format_bytes(candidate.inter_node_bytes),
                _crossing(candidate, ranks_per_node) or ("?" if ranks_per_node is None else "-"),
                "*" if candidate.pareto else "",
                "yes" if planned else "",
            )
        )
    return [(*row[:-1], f"+{alike[i]}" if alike[i] else "", row[-1]) for i, row in enumerate(rows)]


def search_table(result: SearchResult, top: int, ranks_per_node: int | None) -> str:
    """The header, one row per distinct cost (the best ``top``), and what the numbers are."""
    source, manifest, best = result.source, result.manifest, result.best
    lines = [
        (
            f"search {manifest.name} ({len(manifest)} tensors, {format_bytes(manifest.nbytes)}) from shard "
            f"{source.index} ('{source.spec}', ranks [{source.rank_offset}, {source.ranks.stop})) to {result.ranks} "
            f"ranks [{best.destination.rank_offset}, {best.destination.ranks.stop}), "
            f"{format_bytes(result.memory_bytes)} per rank"
        ),
        (
            f"{result.enumerated} specs enumerated, {result.split} split the model, {result.fit_memory} fit memory; "
            f"{result.estimated} refit classes estimated, {result.planned} planned; {result.seconds:.2f} s"
        ),
        f"ranked by {result.objective}: {OBJECTIVE_HELP[result.objective]} (--objective {', '.join(OBJECTIVES)})",
        format_table(
            _rows(result, top, ranks_per_node),
            (
                "#",
                "spec",
                "replicas",
                "weight/rank",
                "headroom",
                "estimate s",
                "slowest rank",
                "its bytes",
                "inter-node",
                "crosses nodes",
                "front",
                "alike",
                "planned",
            ),
        ),
        (
            "replicas: the spec's dp; headroom: memory per rank left after the weights; slowest rank: the rank, "
            "source or destination, whose share of the refit takes longest; front: on the Pareto front over (weight "
            "bytes per rank, estimate); alike: more specs with the same cost (other ep x expt_tp or cp x dp splits)"
        ),
        (
            f"estimate at {result.inter_gbps:g} GB/s per rank between nodes: received and moved bytes exact, "
            f"sends the planner's even share over replicas (--plan K plans the best K exactly)"
        ),
    ]
    if result.planned:
        rows = _rows(result, top, None)
        shown = sum(1 + int(str(row[-2]) or "0") for row in rows if row[-1] == "yes")
        hidden = f"; {result.planned - shown} rank below the rows shown (--top)" if shown < result.planned else ""
        lines.append(
            f"planned: the {result.planned} best by {result.objective}, planned exactly (time and slowest rank are the "
            f"plan's): the rows marked yes{hidden}"
        )
    if result.shared_node:
        lines.append("note: a node holds ranks of both shards; the plan keeps some of its bytes inside the node")
    if ranks_per_node is None:
        lines.append("crosses nodes: '?' without --ranks-per-node")
    return "\n".join(lines)


def run_search(args: argparse.Namespace) -> int:
    """The ``refit --search`` subcommand."""
    missing = missing_flags(args, "--world", "--shards", "--from", "--ranks", "--memory-gb", "--model")
    if missing:
        raise RefitError(f"refit --search needs {', '.join(missing)}")
    if args.dst is not None or args.check or args.rank is not None or args.transfers:
        raise RefitError("--search chooses the destination: give --ranks R, not --to, --check, --rank or --transfers")
    if not args.memory_gb > 0:
        raise RefitError(f"--memory-gb {args.memory_gb}: expected a positive number of GB per rank")
    layout = plan_layout(args.world, args.shards, order=args.order, allow_idle=True)
    manifest, axes = model_manifest(args.model), parse_axes(args.axes) if args.axes is not None else AXES
    progress = _Progress(args.quiet)
    try:
        result = search(
            layout,
            args.src,
            manifest,
            args.ranks,
            args.memory_gb * 1e9,
            offset=args.at,
            ranks_per_node=args.ranks_per_node,
            axes=axes,
            intra_gbps=args.intra_gbps,
            inter_gbps=args.inter_gbps,
            plan=args.plan,
            progress=progress,
            objective=args.objective or OBJECTIVES[0],
        )
    finally:  # a search that fails says nothing more after its error
        progress.close()
    if args.json:
        data = result.to_dict(top=args.top or None)
        for candidate, shown in zip(result.candidates, data["candidates"]):
            shown["crosses_nodes"] = _crossing(candidate, args.ranks_per_node)
        print(json.dumps(data, indent=2))
        return 0
    print(search_table(result, args.top or len(result.candidates), args.ranks_per_node))
    return 0


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--search`` flags of ``shardcore refit``."""
    search_flags = parser.add_argument_group("layout search (--search)")
    search_flags.add_argument(
        "--search",
        action="store_true",
        help="rank every destination spec of --ranks R ranks that fits --memory-gb by --objective",
    )
    search_flags.add_argument(
        "--objective",
        choices=OBJECTIVES,
        help="what to rank by first, the estimated refit time always the last tie-breaker: "
        + "; ".join(f"{name}: {text}" for name, text in OBJECTIVE_HELP.items())
        + f" (default {OBJECTIVES[0]})",
    )
    search_flags.add_argument("--ranks", type=POSITIVE_INT, metavar="R", help="ranks for the destination shard")
    search_flags.add_argument(
        "--memory-gb", type=float, metavar="G", help="memory per rank for weights, GB (1e9 bytes)"
    )
    search_flags.add_argument(
        "--at",
        type=NON_NEGATIVE_INT,
        metavar="RANK",
        help="first rank of the destination (default: after the last shard)",
    )
    search_flags.add_argument(
        "--axes",
        metavar="AXES",
        help="axes a destination may use, each with an optional largest size: e.g. tp:8,pp,dp,ep,expt_tp "
        "(default: all of tp, pp, cp, dp, ep, expt_tp)",
    )
    search_flags.add_argument(
        "--top",
        type=NON_NEGATIVE_INT,
        default=10,
        metavar="N",
        help="rows (distinct costs) to print; 0 for all (default 10)",
    )
    search_flags.add_argument(
        "--plan",
        type=NON_NEGATIVE_INT,
        default=0,
        metavar="K",
        help="plan the best K candidates exactly (slow for large models)",
    )


__all__ = ["add_search_arguments", "parse_axes", "run_search", "search_table"]
