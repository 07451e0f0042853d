"""The ``shardcore`` command: plan a layout, check it on a live world, list backends."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from ..engine.groups import Strategy
from ..errors import ShardcoreError
from ..plan.arguments import MAX_TIMEOUT, as_timedelta, shown
from ..plan.layout import DEFAULT_ORDER, ORDER_ALIASES, Order, plan_layout
from ..views.picture import DEFAULT_RANKS_PER_NODE, render_svg
from ..views.tables import format_table, layout_table, rank_table, shown_groups
from ..views.topology import TOPOLOGY_GROUPS, check_topology
from .check import cmd_check


def _whole_number(text: str) -> int:
    """argparse type of the count flags: an int, refused in one short line (never thousands of digits)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {shown(text)}") from None


def _seconds(text: str) -> float:
    """argparse type of --timeout: seconds as build_shards takes them (above 0, finite, at most MAX_TIMEOUT)."""
    try:
        seconds = float(text)
        as_timedelta(seconds)
    except ValueError:  # float() refused it, or as_timedelta (a LayoutError is a ValueError)
        limit = MAX_TIMEOUT.total_seconds()
        raise argparse.ArgumentTypeError(
            f"expected seconds above 0 and at most {limit:.0f}, got {shown(text)}"
        ) from None
    return seconds


def _one_line_warning(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
    """Warnings (a key repeated in a shard) as one line, like errors, without Python's source line."""
    print(f"shardcore: warning: {message}", file=sys.stderr)


def _add_layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shards", required=True, help="e.g. 'tp=4,pp=2,role=train+tp=2,dp=4,role=prefill', or @file.yaml"
    )
    parser.add_argument("--order", default=DEFAULT_ORDER, choices=[*Order, *ORDER_ALIASES])


def _cmd_plan(args: argparse.Namespace) -> int:
    usage = (
        "--strict needs --ranks-per-node K"
        if args.strict and args.ranks_per_node is None
        else "--highlight needs --svg FILE"
        if args.highlight and not args.svg
        else None
    )
    if usage:
        print(f"shardcore: error: {usage}", file=sys.stderr)
        return 2
    layout = plan_layout(
        args.world, args.shards, order=args.order, rank_offset=args.rank_offset, allow_idle=args.allow_idle
    )
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
            data["rank"] = {
                "rank": args.rank,
                "shard": None if plan is None else plan.index,
                "groups": {} if plan is None else shown_groups(plan, args.rank),
            }
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


def _cmd_backends(args: argparse.Namespace) -> int:
    from ..engine.plugins import list_backends

    rows = [
        (
            info.name,
            info.distribution,
            info.version,
            "available" if info.available else f"unavailable: {info.reason}",
            info.device or "-",
            info.description,
        )
        for info in list_backends()
    ]
    print(
        format_table(rows, ("backend", "distribution", "version", "status", "device", "description"))
        if rows
        else "no backends installed: pip install ./plugins/dtensor (or megatron, hyperparallel)"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardcore", description="Lay out heterogeneous parallel jobs.")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print the layout of shards over a world (no torch needed)")
    plan.add_argument("--world", type=_whole_number, required=True, help="total number of ranks")
    _add_layout_args(plan)
    plan.add_argument("--rank-offset", type=_whole_number, default=0, help="first rank of the first shard")
    plan.add_argument("--allow-idle", action="store_true", help="allow ranks after the last shard to stay idle")
    plan.add_argument("--rank", type=_whole_number, help="also show this rank's groups")
    plan.add_argument("--json", action="store_true", help="print the full layout as JSON")
    plan.add_argument(
        "--ranks-per-node",
        type=_whole_number,
        metavar="K",
        help="check which groups cross a node of K ranks (node = rank // K) and print the findings",
    )
    plan.add_argument(
        "--strict",
        action="store_true",
        help="with --ranks-per-node: exit 1 when a tp, cp, ep, expt_tp or tp_ep group crosses nodes",
    )
    plan.add_argument(
        "--svg",
        metavar="FILE",
        help="write a picture of the layout as SVG: nodes as rows, ranks as "
        f"cells (nodes of --ranks-per-node ranks, {DEFAULT_RANKS_PER_NODE} when not given)",
    )
    plan.add_argument(
        "--highlight",
        metavar="NAME",
        choices=TOPOLOGY_GROUPS,
        help=f"with --svg: outline every group of this name ({', '.join(TOPOLOGY_GROUPS)})",
    )
    plan.set_defaults(func=_cmd_plan)
    check = sub.add_parser("check", help="build the layout on a live world and verify every group with a collective")
    check.add_argument(
        "--nproc", type=_whole_number, default=8, help="local gloo processes to start (ignored under torchrun)"
    )
    _add_layout_args(check)
    check.add_argument("--backend", help="backend name (default: $SHARDCORE_BACKEND, else dtensor)")
    check.add_argument("--strategy", default=Strategy.LOCAL, choices=list(Strategy))
    check.add_argument("--allow-idle", action="store_true", help="allow ranks after the last shard to stay idle")
    check.add_argument("--timeout", type=_seconds, default=120.0, help="seconds before a stuck group is an error")
    check.set_defaults(func=cmd_check)
    backends = sub.add_parser("backends", help="list installed backends and whether they work here")
    backends.set_defaults(func=_cmd_backends)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        try:
            return int(args.func(args))
        except ShardcoreError as error:
            print(f"shardcore: error: {error}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
