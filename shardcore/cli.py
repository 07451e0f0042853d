"""The ``shardcore`` command: plan a layout, check it on a live world, list backends."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence

from .errors import ShardcoreError
from .grid import Grid
from .layout import DECODER_GROUPS, EXPERT_GROUPS, ORDERS, Layout, ShardPlan, plan_layout
from .picture import DEFAULT_RANKS_PER_NODE, render_svg
from .topology import TOPOLOGY_GROUPS, check_topology

_COLUMNS = ("shard", "role", "name", "ranks", "tp", "cp", "pp", "dp", "ep", "expt_tp", "expt_dp")


def format_table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """A plain left-aligned text table."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def layout_table(layout: Layout) -> str:
    """One row per shard: role, name, window and every size."""
    rows = []
    for plan in layout.shards:
        spec = plan.spec
        rows.append((plan.index, spec.role or "-", spec.name or "-", f"[{plan.rank_offset}, {plan.ranks.stop})",
                     spec.tp, spec.cp, spec.pp, spec.dp, spec.ep, spec.expt_tp, spec.expt_dp))
    text = format_table(rows, _COLUMNS)
    idle = ", ".join(f"[{w.start}, {w.stop})" for w in layout.idle)
    return text + (f"\nidle ranks: {idle}" if idle else "")


MAX_SHOWN_RANKS = 1024
"""A group larger than this is shown as its size, first and last rank, never built as a list."""


def _group_span(grid: Grid, rank: int, dims: tuple[str, ...]) -> tuple[int, int, int]:
    """(size, first rank, last rank) of ``rank``'s group along ``dims``, in O(len(dims))."""
    coords = grid.coords(rank)
    first = rank - sum(coords[d] * grid.stride_of(d) for d in dims)
    last = first + sum((grid.size_of(d) - 1) * grid.stride_of(d) for d in dims)
    return math.prod(grid.size_of(d) for d in dims), first, last


def shown_groups(plan: ShardPlan, rank: int) -> dict[str, list[int] | dict[str, int] | None]:
    """A member rank's named groups for printing: lists up to MAX_SHOWN_RANKS ranks, else a summary.

    ``shardcore plan --rank`` on a world of millions must not build lists of millions of ranks.
    """
    shown: dict[str, list[int] | dict[str, int] | None] = {}
    for grid, groups in ((plan.decoder_grid, DECODER_GROUPS), (plan.expert_grid, EXPERT_GROUPS)):
        for name, dims in groups.items():
            size, first, last = _group_span(grid, rank, dims)
            shown[name] = (list(grid.group_ranks(rank, dims)) if size <= MAX_SHOWN_RANKS else
                           {"size": size, "first": first, "last": last})
    _, first, last = _group_span(plan.decoder_grid, rank, ("pp",))
    embd = [first, last] if last != first else [first]
    shown["embd"] = embd if rank in embd else None
    shown["pos_embd"] = [first] if rank == first else None
    return shown


def _format_group(ranks: list[int] | dict[str, int] | None) -> object:
    if ranks is None:
        return "-"
    if isinstance(ranks, dict):
        return f"[{ranks['first']}, ..., {ranks['last']}] ({ranks['size']} ranks, over {MAX_SHOWN_RANKS}: not listed)"
    return ranks


def rank_table(layout: Layout, rank: int) -> str:
    """One rank's shard, coordinates and named groups."""
    plan = layout.shard_of(rank)
    if plan is None:
        return f"rank {rank} is idle: it belongs to no shard"
    coords = ", ".join(f"{k}={v}" for k, v in plan.coords(rank).items())
    rows = [(name, _format_group(ranks)) for name, ranks in shown_groups(plan, rank).items()]
    return f"rank {rank} in shard {plan.index} ({plan.spec}), coords {coords}\n" + format_table(rows, ("group", "ranks"))


def _add_layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", required=True, help="e.g. 'tp=4,pp=2,role=train+tp=2,dp=4,role=prefill', or @file.yaml")
    parser.add_argument("--order", default="tp-cp-dp-pp", choices=[*ORDERS, "tp-dp-pp", "tp-pp-dp"])


def _cmd_plan(args: argparse.Namespace) -> int:
    usage = ("--strict needs --ranks-per-node K" if args.strict and args.ranks_per_node is None else
             "--highlight needs --svg FILE" if args.highlight and not args.svg else None)
    if usage:
        print(f"shardcore: error: {usage}", file=sys.stderr)
        return 2
    layout = plan_layout(args.world, args.shards, order=args.order, rank_offset=args.rank_offset, allow_idle=args.allow_idle)
    if args.rank is not None:
        layout.shard_of(args.rank)  # a rank outside the world fails here, before anything is printed
    report = None if args.ranks_per_node is None else check_topology(layout, args.ranks_per_node)
    if args.svg:
        per_node = DEFAULT_RANKS_PER_NODE if args.ranks_per_node is None else args.ranks_per_node
        text = render_svg(layout, per_node, args.highlight)
        try:
            with open(args.svg, "w", encoding="utf-8") as file:
                file.write(text)
        except OSError as error:
            print(f"shardcore: error: cannot write {args.svg!r}: {error}", file=sys.stderr)
            return 2
        print(f"wrote {args.svg}: {layout.world_size} ranks, nodes of {per_node}", file=sys.stderr)
    failed = bool(args.strict and report is not None and report.warnings)
    if args.json:
        data = layout.to_dict()
        if args.rank is not None:
            plan = layout.shard_of(args.rank)
            data["rank"] = {"rank": args.rank, "shard": None if plan is None else plan.index,
                            "groups": {} if plan is None else shown_groups(plan, args.rank)}
        if report is not None:
            data["topology"] = report.to_dict()
        print(json.dumps(data, indent=2))
        return 1 if failed else 0
    print(layout_table(layout))
    if args.rank is not None:
        print()
        print(rank_table(layout, args.rank))
    if report is not None:
        print()
        print(report.format())
    return 1 if failed else 0


def _cmd_check(args: argparse.Namespace) -> int:
    from . import check

    options = {"shards": args.shards, "backend": args.backend, "order": args.order, "allow_idle": args.allow_idle,
               "strategy": args.strategy, "timeout": args.timeout}
    joined = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if joined else args.nproc
    layout = plan_layout(world, args.shards, order=args.order, allow_idle=args.allow_idle)
    if not joined:
        print(f"shardcore check: {world} local gloo processes, backend {args.backend or 'default'}, "
              f"strategy {args.strategy}, order {layout.order}")
    reports = check.run_joined(options) if joined else check.run_local(world, options)
    if reports is None:
        return 0
    table, ok = check.summary(reports, layout)
    print(table)
    print("all groups match the plan" if ok else "MISMATCH: some groups differ from the plan")
    return 0 if ok else 1


def _cmd_backends(args: argparse.Namespace) -> int:
    from .plugins import list_backends

    rows = [(info.name, info.distribution, info.version, "available" if info.available else f"unavailable: {info.reason}",
             info.device or "-", info.description) for info in list_backends()]
    print(format_table(rows, ("backend", "distribution", "version", "status", "device", "description")) if rows else
          "no backends installed: pip install ./plugins/dtensor (or megatron, hyperparallel)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardcore", description="Lay out heterogeneous parallel jobs.")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print the layout of shards over a world (no torch needed)")
    plan.add_argument("--world", type=int, required=True, help="total number of ranks")
    _add_layout_args(plan)
    plan.add_argument("--rank-offset", type=int, default=0, help="first rank of the first shard")
    plan.add_argument("--allow-idle", action="store_true", help="allow ranks after the last shard to stay idle")
    plan.add_argument("--rank", type=int, help="also show this rank's groups")
    plan.add_argument("--json", action="store_true", help="print the full layout as JSON")
    plan.add_argument("--ranks-per-node", type=int, metavar="K",
                      help="check which groups cross a node of K ranks (node = rank // K) and print the findings")
    plan.add_argument("--strict", action="store_true",
                      help="with --ranks-per-node: exit 1 when a tp, cp, ep, expt_tp or tp_ep group crosses nodes")
    plan.add_argument("--svg", metavar="FILE", help="write a picture of the layout as SVG: nodes as rows, ranks as "
                      f"cells (nodes of --ranks-per-node ranks, {DEFAULT_RANKS_PER_NODE} when not given)")
    plan.add_argument("--highlight", metavar="NAME", choices=TOPOLOGY_GROUPS,
                      help=f"with --svg: outline every group of this name ({', '.join(TOPOLOGY_GROUPS)})")
    plan.set_defaults(func=_cmd_plan)
    check = sub.add_parser("check", help="build the layout on a live world and verify every group with a collective")
    check.add_argument("--nproc", type=int, default=8, help="local gloo processes to start (ignored under torchrun)")
    _add_layout_args(check)
    check.add_argument("--backend", help="backend name (default: $SHARDCORE_BACKEND, else dtensor)")
    check.add_argument("--strategy", default="local", choices=["local", "world"])
    check.add_argument("--allow-idle", action="store_true", help="allow ranks after the last shard to stay idle")
    check.add_argument("--timeout", type=float, default=120.0, help="seconds before a stuck group is an error")
    check.set_defaults(func=_cmd_check)
    from .refit.command import add_refit_parser  # the refit subcommand lives with the planner

    add_refit_parser(sub)
    backends = sub.add_parser("backends", help="list installed backends and whether they work here")
    backends.set_defaults(func=_cmd_backends)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ShardcoreError as error:
        print(f"shardcore: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
