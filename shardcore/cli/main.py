"""The ``shardcore`` command: plan a layout, check it on a live world, list backends."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import textwrap
import traceback
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..engine import Strategy, install_hint
from ..errors import ShardcoreError
from ..plan.arguments import clipped
from ..plan.layout import plan_layout
from ..plan.loading import shown_path
from ..plan.topology import TOPOLOGY_GROUPS, check_topology
from ..views.picture import DEFAULT_RANKS_PER_NODE, draws_ranks, render_svg
from ..views.tables import format_table, layout_table, rank_table, shown_groups
from .arguments import (
    ERROR,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    Parser,
    add_allow_idle_flag,
    add_nproc_flag,
    add_order_flag,
    add_timeout_flag,
)
from .check import cmd_check, report_error
from .refit import add_refit_parser
from .replan import add_replan_parser

TORCH_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
"""torch's C++ log level (INFO, WARNING, ERROR, FATAL), read once when torch loads."""

if TYPE_CHECKING:
    from ..plan.layout import Layout
    from ..plan.topology import TopologyReport


def _one_line_warning(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
    """Warnings (a key repeated in a shard) as one line, like errors, without Python's source line."""
    print(f"shardcore: warning: {message}", file=sys.stderr)


def _add_layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shards", required=True, help="e.g. 'tp=4,pp=2,role=train+tp=2,dp=4,role=prefill', or @file.yaml"
    )
    add_order_flag(parser)


def _plan_usage_error(args: argparse.Namespace) -> str | None:
    """A flag ``plan`` was given without the one it needs (argparse cannot say so), or None."""
    if args.strict and args.ranks_per_node is None:
        return "--strict needs --ranks-per-node K"
    if args.highlight and not args.svg:
        return "--highlight needs --svg FILE"
    return None


def _write_plan_svg(args: argparse.Namespace, layout: Layout) -> bool:
    """``--svg FILE``: write the picture and say so on stderr; False (said why) when the file cannot be written."""
    per_node = DEFAULT_RANKS_PER_NODE if args.ranks_per_node is None else args.ranks_per_node
    text = render_svg(layout, per_node, args.highlight)
    try:
        with open(args.svg, "w", encoding="utf-8") as file:
            file.write(text)
    except OSError as error:
        print(
            f"{ERROR} cannot write {shown_path(args.svg)}: {error.strerror or type(error).__name__}",
            file=sys.stderr,
        )
        return False
    print(f"wrote {args.svg}: {layout.world_size} ranks, nodes of {per_node}", file=sys.stderr)
    if args.highlight and not draws_ranks(layout, per_node):
        print(
            f"note: --highlight {args.highlight} was not drawn: the picture shows one cell per node "
            "at this size (use fewer ranks or larger nodes to see each rank)",
            file=sys.stderr,
        )
    return True


def _plan_document(args: argparse.Namespace, layout: Layout, report: TopologyReport | None) -> dict[str, Any]:
    """``plan --json``: the layout, with ``--rank``'s groups and the topology findings when asked for."""
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
    return data


def _print_plan_tables(args: argparse.Namespace, layout: Layout, report: TopologyReport | None) -> None:
    """``plan``'s text: the layout table, then ``--rank``'s groups and the topology findings when asked for."""
    print(layout_table(layout))
    if args.rank is not None:
        print()
        print(rank_table(layout, args.rank))
    if report is not None:
        print()
        print(report.format())


def _cmd_plan(args: argparse.Namespace) -> int:
    """The ``plan`` subcommand: 1 when ``--strict`` finds a group crossing nodes, 2 on a usage error."""
    usage = _plan_usage_error(args)
    if usage:
        print(f"{ERROR} {usage}", file=sys.stderr)
        return 2
    layout = plan_layout(
        args.world, args.shards, order=args.order, rank_offset=args.rank_offset, allow_idle=args.allow_idle
    )
    if args.rank is not None:
        layout.shard_of(args.rank)  # a rank outside the world fails here, before anything is printed
    report = None if args.ranks_per_node is None else check_topology(layout, args.ranks_per_node)
    if args.svg and not _write_plan_svg(args, layout):
        return 2
    failed = bool(args.strict and report is not None and report.warnings)
    if args.json:
        print(json.dumps(_plan_document(args, layout, report), indent=2))
    else:
        _print_plan_tables(args, layout, report)
    return 1 if failed else 0


BACKENDS_WIDTH = 100
"""Columns ``shardcore backends`` fits its text in: the table holds short fields, the long ones follow it."""


def _backend_entries() -> tuple[list[dict[str, Any]], list[str]]:
    """Every installed backend and every shipped one that is not installed (with its install command), as
    ``backends --json`` prints them; and the notes on torch and the NPU that explain the unavailable ones."""
    from ..engine.backends.plugins import SHIPPED_BACKENDS, list_backends
    from ..engine.device import device_notes

    notes = device_notes()  # first: it imports torch through the guard, which the listing then reuses
    long_reasons = {note.partition(": ")[2] for note in notes}
    entries = [
        {
            "name": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "installed": True,
            "available": info.available,
            "reason": "torch does not import (see below)" if info.reason in long_reasons else info.reason,
            "device": info.device,
            "description": info.description,
            "install": None,  # installed: the reason names the fix when it does not work
        }
        for info in list_backends()
    ]
    installed = {entry["name"] for entry in entries}
    entries += [
        {
            "name": name,
            "distribution": f"shardcore-{name}",
            "version": None,
            "installed": False,
            "available": False,
            "reason": None,
            "device": None,
            "description": "",
            "install": install_hint(name),
        }
        for name in SHIPPED_BACKENDS
        if name not in installed
    ]
    return sorted(entries, key=lambda entry: (not entry["installed"], entry["name"])), notes


def _backends_text(entries: list[dict[str, Any]], notes: list[str]) -> str:
    """The short table, then one wrapped paragraph per backend (what it gives, its device, why it does not
    work and the fix), then the notes: nothing wider than BACKENDS_WIDTH."""

    def status(entry: dict[str, Any]) -> str:
        return "available" if entry["available"] else "unavailable" if entry["installed"] else "not installed"

    def device(entry: dict[str, Any]) -> str:  # 'would use cpu+gloo (why)' -> 'cpu+gloo'
        return (entry["device"] or "-").removeprefix("would use ").partition(" (")[0]

    rows = [(entry["name"], entry["version"] or "-", status(entry), device(entry)) for entry in entries]
    lines = [format_table(rows, ("backend", "version", "status", "device")), ""]
    for entry in entries:
        facts = [entry["description"]] if entry["description"] else []
        facts += [entry["device"]] if entry["device"] else []
        facts += [f"unavailable: {entry['reason']}"] if entry["installed"] and not entry["available"] else []
        facts += [f"install: {entry['install']}"] if entry["install"] else []
        where = f" ({entry['distribution']})" if entry["installed"] else " (not installed)"
        lines.append(_wrapped(f"{entry['name']}{where}: {'; '.join(facts)}"))
    lines += ["", *map(_wrapped, notes)] if notes else []
    return "\n".join(lines)


def _wrapped(paragraph: str) -> str:
    return textwrap.fill(paragraph, BACKENDS_WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def _cmd_backends(args: argparse.Namespace) -> int:
    """The ``backends`` subcommand: what is installed, whether it works here, and what to install."""
    entries, notes = _backend_entries()
    if args.json:
        print(json.dumps({"backends": entries, "notes": notes}, indent=2))
    else:
        print(_backends_text(entries, notes))
    return 0


def _talk_flags() -> Parser:
    """The -v / -q flags every subcommand takes (a parent parser)."""
    common = Parser(add_help=False)
    talk = common.add_mutually_exclusive_group()
    talk.add_argument("-v", "--verbose", action="store_true", help="say more: every rank's progress, log lines")
    talk.add_argument("-q", "--quiet", action="store_true", help="say less: no header or progress, results only")
    return common


def _add_plan_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register ``shardcore plan``."""
    plan = sub.add_parser("plan", help="print the layout of shards over a world (no torch needed)", parents=[common])
    plan.add_argument("--world", type=POSITIVE_INT, required=True, help="total number of ranks")
    _add_layout_args(plan)
    plan.add_argument(
        "--rank-offset", type=NON_NEGATIVE_INT, default=0, help="first rank of the first shard (default: %(default)s)"
    )
    add_allow_idle_flag(plan)
    plan.add_argument("--rank", type=NON_NEGATIVE_INT, help="also show this rank's groups")
    plan.add_argument("--json", action="store_true", help="print the full layout as JSON")
    plan.add_argument(
        "--ranks-per-node",
        type=POSITIVE_INT,
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


def _add_check_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register ``shardcore check``."""
    check = sub.add_parser(
        "check",
        help="build the layout on a live world and verify every group with a collective",
        description="Build the layout on a live world and verify every group with a collective. Alone it "
        "starts --nproc local gloo processes; under torchrun (RANK and WORLD_SIZE set) it joins torchrun's "
        "world, one rank per process, on each process's LOCAL_RANK device.",
        parents=[common],
    )
    add_nproc_flag(check)
    _add_layout_args(check)
    check.add_argument("--backend", help="backend name (default: $SHARDCORE_BACKEND, else dtensor)")
    check.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a backend option, repeatable; VALUE is read as JSON when it parses (2, true, [1,2]), else as text",
    )
    check.add_argument(
        "--strategy",
        default=Strategy.AUTO,
        choices=[str(strategy) for strategy in Strategy],
        help="who creates each group: local = its members only (a rank's cost is its own groups); world = "
        "every rank creates every group (Megatron's pattern); auto = world where torch creates groups with "
        "every rank (a device-bound default group, TORCH_DIST_INIT_BARRIER=1, TorchComms), else local "
        "(default: %(default)s)",
    )
    add_allow_idle_flag(check)
    add_timeout_flag(check)
    check.add_argument(
        "--json", action="store_true", help="print the result as JSON (what was checked, per shard what it found)"
    )
    check.set_defaults(func=cmd_check)


def build_parser() -> argparse.ArgumentParser:
    """The ``shardcore`` parser: plan, check, refit, replan and backends, each with -v / -q."""
    common = _talk_flags()
    parser = Parser(prog="shardcore", description="Lay out heterogeneous parallel jobs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan_parser(sub, common)
    _add_check_parser(sub, common)
    add_refit_parser(sub, common)
    add_replan_parser(sub, common)
    backends = sub.add_parser(
        "backends",
        help="list the backends: installed ones, whether they work here, and the shipped ones to install",
        parents=[common],
    )
    backends.add_argument("--json", action="store_true", help="print the list as JSON")
    backends.set_defaults(func=_cmd_backends)
    return parser


def _quiet_broken_pipe() -> int:
    """``shardcore plan ... | head``: the reader left; end without a traceback, as cat does."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141


@contextmanager
def _quiet_torch_logs(verbose: bool) -> Iterator[None]:
    """Keep torch's C++ log lines off the terminal unless ``-v``: a store connection that timed out and was
    retried (``check --timeout 0.5`` on a busy machine) prints a C++ stack trace from every rank, though the
    command goes on and reports every real failure itself as one line. c10 reads the level once, when torch
    loads, so it is set for the command, before any import of torch in this process or its spawned workers
    (they inherit it), and taken back after it; a level the user set is kept."""
    if verbose or TORCH_LOG_LEVEL_ENV in os.environ:
        yield
        return
    os.environ[TORCH_LOG_LEVEL_ENV] = "FATAL"
    try:
        yield
    finally:
        os.environ.pop(TORCH_LOG_LEVEL_ENV, None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``shardcore`` command; returns the exit status (2: bad input, 130: interrupted)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s", level=logging.INFO if args.verbose else logging.WARNING)
    with warnings.catch_warnings(), _quiet_torch_logs(args.verbose):
        warnings.showwarning = _one_line_warning
        try:
            return int(args.func(args))
        except ShardcoreError as error:
            report_error(str(error))
            return 2
        except KeyboardInterrupt:
            print("shardcore: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:
            return _quiet_broken_pipe()
        except Exception as error:  # never a traceback for a user; -v shows it
            if args.verbose:
                traceback.print_exc()
            hint = "" if args.verbose else " (run with -v for the traceback)"
            print(f"{ERROR} {type(error).__name__}: {clipped(str(error))}{hint}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
