"""``shardcore replan``: after losing ranks, the best new layouts and what survives of the old one (no torch)."""

from __future__ import annotations

import argparse
import json
import sys
from bisect import bisect_left
from typing import Any

from ..errors import LayoutError
from ..plan.arguments import counted, format_bytes
from ..replan import DEFAULT_TRAIN_BYTES_PER_PARAM, ReplanOption, ReplanRequest, ReplanResult, format_ranks, named_ranks
from ..views.picture import DEFAULT_RANKS_PER_NODE, render_svg
from ..views.tables import format_table
from .arguments import POSITIVE_INT, add_allow_idle_flag, add_order_flag, add_timeout_flag, lone_flags

MAX_RANGES = 4096
"""A --lost list of more ranges than this is data, not a list of failed ranks."""


def parse_ranks(text: str, flag: str) -> list[int]:
    """``8-15,40``: ranks and inclusive ranges, comma separated.

    Raises:
        LayoutError: a token that is not a rank or a range, naming it.
    """
    ranks: list[int] = []
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or len(items) > MAX_RANGES:
        raise LayoutError(f"{flag}: expected 1 to {MAX_RANGES} ranks or ranges, e.g. {flag} 8-15,40")
    for item in items:
        first, dash, last = item.partition("-")
        try:
            low, high = int(first), int(last) if dash else int(first)
        except ValueError:
            raise LayoutError(f"{flag} {item[:40]!r}: expected a rank or a range like 8-15") from None
        if low < 0 or high < low or high - low >= 1 << 24:
            raise LayoutError(f"{flag} {item[:40]!r}: expected a rank or a range FIRST-LAST with FIRST <= LAST")
        ranks.extend(range(low, high + 1))
    return ranks


def _lost_line(result: ReplanResult, ranks_per_node: int | None) -> str:
    """What was lost, where (shards, whole nodes), and what was added."""
    old, base = result.old, result.renumbering
    lost = base.lost  # sorted
    hit = [(plan, bisect_left(lost, plan.ranks.stop) - bisect_left(lost, plan.rank_offset)) for plan in old.shards]
    where = ", ".join(f"{count} of shard {plan.index} '{plan.spec}'" for plan, count in hit if count)
    nodes = ""
    if ranks_per_node is not None and lost:
        gone = set(lost)
        whole = [
            node
            for node in sorted({rank // ranks_per_node for rank in lost})
            if all(r in gone for r in range(node * ranks_per_node, min((node + 1) * ranks_per_node, old.world_size)))
        ]
        nodes = f" (whole {named_ranks(whole, 'node')})" if whole else ""
    gained = f", {counted(base.added, 'rank')} added" if base.added else ""
    what = f"losing {named_ranks(lost)}{nodes}: {where}" if lost else "no loss"
    return (
        f"replan {result.manifest.name} on a world of {old.world_size} after {what}{gained}; "
        f"{counted(len(result.options), 'option')} in {result.seconds:.2f} s"
    )


def _options_table(result: ReplanResult) -> str:
    rows = [
        (
            number,
            option.kind,
            " + ".join(str(plan.spec) for plan in option.layout.shards),
            option.layout.world_size,
            option.used,
            len(option.renumbering.released),
            sum(move.needs_weights for move in option.moves),
            format_bytes(option.restore_bytes),
            f"{option.kept_groups}/{option.rebuilt_groups}",
            option.crossing,
            len(option.missing),
        )
        for number, option in enumerate(result.options, 1)
    ]
    header = ("#", "kind", "new spec", "world", "used", "released", "moved", "restore", "groups kept/rebuilt")
    return format_table(rows, (*header, "crossing nodes", "missing"))


def _shards_table(result: ReplanResult, option: ReplanOption) -> str:
    rows = []
    for plan in option.layout.shards:
        fates = [fate for fate in option.fates if fate.shard == plan.index]
        rebuilt = [f"{fate.name} {fate.rebuilt}/{fate.total}" for fate in fates if fate.rebuilt]
        moves = [move for move in option.moves if move.new_shard == plan.index]
        rows.append(
            (
                plan.index,
                plan.spec.role or "-",
                str(result.old.shards[plan.index].spec),
                str(plan.spec),
                f"[{plan.rank_offset}, {plan.ranks.stop})",
                len(moves),
                sum(move.needs_weights for move in moves),
                sum(fate.kept for fate in fates),
                ", ".join(rebuilt) or "-",
            )
        )
    header = ("shard", "role", "old spec", "new spec", "new ranks", "moved", "need weights", "groups kept")
    return format_table(rows, (*header, "rebuilt (name rebuilt/total)"))


def replan_report(result: ReplanResult, ranks_per_node: int | None) -> str:
    """The options, then the best one shard by shard: what moves, which groups are rebuilt, what is missing."""
    best = result.best
    released = best.renumbering.released
    lines = [
        _lost_line(result, ranks_per_node),
        _options_table(result),
        "",
        f"best: option 1 ({best.kind}), a world of {best.layout.world_size}",
        *(f"  {note}" for note in best.notes),
    ]
    if released:
        lines.append(f"  released (old ranks; they leave with the lost ones): {format_ranks(released)}")
    if best.renumbering.replaced:
        replaced = format_ranks(best.renumbering.replaced)
        lines.append(f"  replaced (new processes take these lost ranks' numbers and places): {replaced}")
    lines.append(_shards_table(result, best))
    needing = [move for move in best.moves if move.needs_weights]
    if needing:
        lines.append(
            f"restore: {len(needing)} ranks need weights ({format_bytes(best.restore_bytes)}); "
            + ("every part they need has a surviving copy" if not best.missing else "see the missing parts below")
        )
    else:
        lines.append("restore: no rank needs other weights")
    for proof in best.missing[:20]:
        lines.append(f"  missing: {proof.describe()}")
    if len(best.missing) > 20:
        lines.append(f"  ... and {len(best.missing) - 20} more missing parts (--json lists every one)")
    lines.append(
        "moved: ranks that change shard or weights; groups kept: the same processes as an old group of the same "
        "name (the communicator can stay); crossing nodes: tp, cp, ep, expt_tp, tp_ep groups spanning nodes"
    )
    return "\n".join(lines)


def _write_svg(path: str, option: ReplanOption, ranks_per_node: int | None) -> None:
    per_node = DEFAULT_RANKS_PER_NODE if ranks_per_node is None else ranks_per_node
    moved = [move.new for move in option.moves if move.needs_weights]
    numbering = option.renumbering
    places = [numbering.physical(rank) for rank in range(option.layout.world_size)]
    absent = {rank: "lost" for rank in numbering.lost if rank not in numbering.replaced}
    absent |= {rank: "released" for rank in numbering.released}
    text = render_svg(
        option.layout,
        per_node,
        marked=moved,
        marked_label="ranks that need other weights",
        places=places,
        absent=absent,
    )
    try:
        with open(path, "w", encoding="utf-8") as file:
            file.write(text)
    except OSError as error:
        raise LayoutError(f"cannot write {path!r}: {error}") from None
    print(f"wrote {path}: option 1 ({option.kind}), {option.layout.world_size} ranks", file=sys.stderr)


def cmd_replan(args: argparse.Namespace) -> int:
    """The ``replan`` subcommand."""
    if args.lost is None and args.new_world is None:
        raise LayoutError("replan needs --lost RANKS (e.g. --lost 8-15) or --new-world M")
    lone = None if args.check else lone_flags(args, _CHECK_ONLY, "--check")
    if lone:
        raise LayoutError(lone)
    if not args.train_bytes_per_param > 0 or args.train_bytes_per_param == float("inf"):
        raise LayoutError(
            f"--train-bytes-per-param {args.train_bytes_per_param}: expected a positive number of bytes per "
            "parameter, e.g. 16 for mixed-precision Adam"
        )
    request = ReplanRequest(
        model=args.model,
        shards=args.shards,
        world=args.world,
        lost=tuple(parse_ranks(args.lost, "--lost") if args.lost else ()),
        new_world=args.new_world,
        order=args.order,
        allow_idle=args.allow_idle,
        memory_bytes=None if args.memory_gb is None else _memory(args.memory_gb),
        ranks_per_node=args.ranks_per_node,
        keep=tuple(parse_ranks(args.keep, "--keep") if args.keep else ()),
        train_bytes_per_param=args.train_bytes_per_param,
    )
    if args.check:
        from .restore import run_restore_check

        request.layout()  # a bad spec is named first, even where --check then finds no torch
        return run_restore_check(args, request)
    result = request.result()
    if args.svg:
        _write_svg(args.svg, result.best, args.ranks_per_node)
    if args.json:
        data: dict[str, Any] = result.to_dict()
        print(json.dumps(data, indent=2))
        return 0
    print(replan_report(result, args.ranks_per_node))
    return 0


_CHECK_ONLY = {"--option": "option", "--backend": "backend", "--shrink": "shrink"}
"""The live run's flags (their defaults None or False, so a given one is seen)."""


def _memory(gb: float) -> float:
    if not gb > 0:
        raise LayoutError(f"--memory-gb {gb}: expected a positive number of GB per rank")
    return gb * 1e9


def add_replan_parser(subparsers: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register ``shardcore replan`` (``common``: the -v / -q flags)."""
    parser = subparsers.add_parser(
        "replan",
        help="after losing ranks: the best new layouts, what survives and what must move (no torch)",
        description="After losing ranks (or changing the world size), rank the new layouts: same roles, every "
        "shard valid for the model and its memory; say which groups survive, which ranks move, and which "
        "tensors have no surviving copy.",
        parents=[common],
    )
    parser.add_argument("--world", type=POSITIVE_INT, required=True, help="ranks in the old world")
    parser.add_argument("--shards", required=True, help="the old layout's spec, e.g. 'tp=8,pp=2,dp=4,role=train+...'")
    add_order_flag(parser)
    add_allow_idle_flag(parser, meaning="the old layout leaves ranks after its shards idle")
    parser.add_argument("--lost", metavar="RANKS", help="lost old ranks and ranges, e.g. 8-15,40")
    parser.add_argument(
        "--new-world",
        type=POSITIVE_INT,
        metavar="M",
        help="the new world size: with no --lost, a smaller world loses its last ranks; a larger one adds ranks",
    )
    parser.add_argument("--model", required=True, metavar="FILE|PRESET", help="manifest file or a preset name")
    parser.add_argument(
        "--memory-gb",
        type=float,
        metavar="G",
        help="memory per rank, GB (1e9 bytes): for a shard's weights; for a train shard's weights, gradients and "
        "optimizer state (--train-bytes-per-param)",
    )
    parser.add_argument(
        "--train-bytes-per-param",
        type=float,
        default=DEFAULT_TRAIN_BYTES_PER_PARAM,
        metavar="B",
        help="bytes a train shard's rank holds per parameter, checked against --memory-gb (default 16: "
        "mixed-precision Adam, bf16 weights 2 + fp32 master weights 4 + Adam's two fp32 moments 8 + bf16 "
        "gradients 2; activations not counted)",
    )
    parser.add_argument(
        "--ranks-per-node", type=POSITIVE_INT, metavar="K", help="node size: count groups spanning physical nodes"
    )
    parser.add_argument("--keep", metavar="I,J", help="indices of shards that must keep their spec")
    parser.add_argument("--json", action="store_true", help="print every option as JSON (moves, fates, proofs)")
    parser.add_argument(
        "--svg",
        metavar="FILE",
        help="draw the best option's new layout on the nodes as they are (each rank at its old rank's place, the "
        "lost and released places empty), the ranks that need weights outlined",
    )
    live = parser.add_argument_group("--check: the loss for real, on one local process per old rank (needs torch)")
    live.add_argument(
        "--check",
        action="store_true",
        help="build the old layout, kill the lost ranks, form the survivors' world, build the new layout, restore "
        "the weights from the survivors' memory and compare every tensor bitwise",
    )
    live.add_argument("--option", type=POSITIVE_INT, metavar="N", help="with --check: run option N (default 1: best)")
    live.add_argument("--backend", help="with --check: the shardcore backend building both layouts (default: dtensor)")
    live.add_argument(
        "--shrink",
        action="store_true",
        help="with --check: start on gloo that can shrink (a stand-in for NCCL), so the survivors call shrink_group",
    )
    add_timeout_flag(live, when="with --check: ")
    parser.set_defaults(func=cmd_replan)
    return parser


__all__ = ["add_replan_parser", "cmd_replan", "parse_ranks", "replan_report"]
