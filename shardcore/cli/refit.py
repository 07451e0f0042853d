"""``shardcore refit``: plan moving a model's weights between shards and print what it costs (no torch)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import TYPE_CHECKING, Any

from ..engine import DEFAULT_BUCKET_BYTES
from ..errors import RefitError
from ..plan.arguments import check_count, check_size, format_bytes, number_or_long, shown
from ..plan.layout import plan_layout
from ..refit.cost import DEFAULT_INTER_GBPS, DEFAULT_INTRA_GBPS, RefitStats
from ..refit.documents import model_manifest
from ..refit.manifest import Manifest, TensorSpec
from ..refit.models import PRESETS
from ..refit.planner import DEFAULT_MIN_PIECE_BYTES, RankRefit, ShardRefitPlan, plan_refit, tensors_matching
from ..views.tables import format_table
from .arguments import (
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    add_allow_idle_flag,
    add_nproc_flag,
    add_order_flag,
    add_timeout_flag,
    missing_flags,
)
from .check import check_machine, require_torch, torchrun_world
from .search import add_search_arguments, run_search

if TYPE_CHECKING:
    from ..engine.live.refit_check import RefitCheckOptions, RefitReport


def _shard_indices(text: str) -> list[int]:
    """``--to 1,2``: shard indices, each checked like any count (a typo, a sign, 5,000 digits)."""
    try:
        numbers = [number_or_long(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise RefitError(f"--to {shown(text)}: expected shard indices separated by commas, e.g. --to 1,2") from None
    if not numbers:
        raise RefitError("--to is empty: name at least one destination shard, e.g. --to 1")
    return [check_count("--to shard", number, minimum=0, error=RefitError) for number in numbers]


def summary_table(plan: ShardRefitPlan, stats: RefitStats, intra_gbps: float, inter_gbps: float) -> str:
    """One row per destination shard, then the totals and the balance against the lower bound."""

    rows = []
    for destination, shard in zip(plan.destinations, stats.shards):
        rows.append(
            (
                shard.index,
                destination.spec.role or "-",
                shard.spec,
                f"[{destination.rank_offset}, {destination.ranks.stop})",
                format_bytes(shard.bytes),
                format_bytes(shard.local_bytes),
                "-" if shard.busiest_rank is None else shard.busiest_rank,
                format_bytes(shard.busiest_bytes),
                f"{shard.estimate_seconds(intra_gbps, inter_gbps):.3g}",
            )
        )
    header = ("to", "role", "spec", "ranks", "bytes", "local", "busiest rank", "its bytes", "estimate s")
    source = plan.source
    busiest = (
        "none" if stats.busiest_sender is None else f"rank {stats.busiest_sender}, {format_bytes(stats.busiest_sent)}"
    )
    nodes = "" if plan.ranks_per_node else " (no --ranks-per-node: all inter-node)"
    subset = "" if plan.tensors is None else f", {len(plan.tensors)} of them refitted"
    relayed = (
        f"; fan-out relayed {format_bytes(stats.relayed_bytes)} inside nodes, "
        f"{format_bytes(stats.inter_node_bytes_without_fan_out)} inter-node without it"
        if plan.fan_out
        else ""
    )
    lines = [
        (
            f"refit {plan.manifest.name} ({len(plan.manifest)} tensors{subset}, {format_bytes(plan.manifest.nbytes)}) "
            f"from shard {source.index} ('{source.spec}', ranks [{source.rank_offset}, {source.ranks.stop}))"
        ),
        format_table(rows, header),
        (
            f"moved {format_bytes(stats.total_bytes)} in {stats.transfers} transfers "
            f"({format_bytes(stats.intra_node_bytes)} intra-node, {format_bytes(stats.inter_node_bytes)} inter-node), "
            f"local copies {format_bytes(stats.local_bytes)}{relayed}"
        ),
        *conversion_lines(plan.manifest, stats),
        f"busiest sender: {busiest}; lower bound {format_bytes(stats.lower_bound)} (x{stats.balance:.3f})",
        f"peers per rank (each a connection): max {stats.most_peers}, median {stats.median_peers}",
        (
            f"estimate {stats.estimate_seconds(intra_gbps, inter_gbps):.3g} s at {intra_gbps:g} GB/s intra-node, "
            f"{inter_gbps:g} GB/s inter-node{nodes}"
        ),
    ]
    return "\n".join(lines)


def conversion_lines(manifest: Manifest, stats: RefitStats) -> list[str]:
    """What a converting refit converts (none for a plain one): bytes above are then wire bytes."""
    kinds = Counter(
        f"{t.dtype} -> {t.to_dtype}" + (f" with {t.scale} scales" if t.scale else "") for t in manifest if t.to_dtype
    )
    if not kinds:
        return []
    shown = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items(), key=lambda item: -item[1]))
    return [
        f"converting {sum(kinds.values())} tensors ({shown}): bytes are wire bytes, in the narrower dtype; "
        f"scale tensors {format_bytes(stats.scale_bytes)} of them"
    ]


def _manifest(args: argparse.Namespace) -> Manifest:
    """``--model``, converted by ``--to-dtype`` / ``--scale`` when given."""
    manifest = model_manifest(args.model)
    if args.to_dtype is None:
        if args.scale is not None:
            raise RefitError(f"--scale {args.scale} needs --to-dtype float8_e4m3fn")
        return manifest
    return manifest.converted(args.to_dtype, args.scale)


def rank_table(mine: RankRefit) -> str:
    """One rank's transfers: sends, receives and local copies, each with its peer, box and bytes."""

    rows = []
    for kind, transfers in (("send", mine.sends), ("recv", mine.recvs), ("copy", mine.copies)):
        for t in transfers:
            peer = t.dst if kind == "send" else t.src
            box = "[" + ", ".join(f"{start}:{stop}" for start, stop in t.box) + "]"
            rows.append((kind, peer, t.tensor, box, format_bytes(t.bytes)))
    title = (
        f"rank {mine.rank}: sends {len(mine.sends)} ({format_bytes(mine.bytes_sent)}), "
        f"receives {len(mine.recvs)} ({format_bytes(mine.bytes_received)}), copies {len(mine.copies)}"
    )
    return title + ("\n" + format_table(rows, ("op", "peer", "tensor", "box", "bytes")) if rows else "")


def _plan(args: argparse.Namespace) -> tuple[ShardRefitPlan, tuple[str, ...]]:
    """The plan the flags describe, and the ``--tensors`` patterns it was cut to: every flag checked first.

    Raises:
        RefitError: a missing flag, a bandwidth that is not positive, bad planner options or shard indices.
        ShardcoreError: a bad spec, model or ``--rank`` (from the layout and manifest).
    """
    missing = missing_flags(args, "--world", "--shards", "--from", "--to", "--model")
    if missing:
        raise RefitError(f"refit needs {', '.join(missing)} (or --list-models)")
    for flag, value in (("--intra-gbps", args.intra_gbps), ("--inter-gbps", args.inter_gbps)):
        if not value > 0:
            raise RefitError(f"{flag} {value}: expected a positive bandwidth in GB/s")
    floor, patterns = _planner_options(args)
    layout = plan_layout(args.world, args.shards, order=args.order, allow_idle=args.allow_idle)
    if args.rank is not None:
        layout.shard_of(args.rank)  # a rank outside the world fails before any work
    src = check_count("--from", args.src, minimum=0, error=RefitError)  # a 4,000-digit index is shown short
    manifest = _manifest(args)
    plan = plan_refit(
        layout,
        src,
        _shard_indices(args.dst),
        manifest,
        args.ranks_per_node,
        min_piece_bytes=floor,
        fan_out=args.fan_out,
    )
    return (plan.subset(tensors_matching(manifest, patterns)) if patterns else plan), patterns


def _planner_options(args: argparse.Namespace) -> tuple[int, tuple[str, ...]]:
    """``--min-piece`` in bytes and the ``--tensors`` patterns, checked before anything is planned."""
    if args.fan_out and args.ranks_per_node is None:
        raise RefitError("--fan-out relays tiles inside nodes: give --ranks-per-node K too")
    floor = (
        DEFAULT_MIN_PIECE_BYTES
        if args.min_piece is None
        else check_size("--min-piece", args.min_piece, error=RefitError)
    )
    patterns = () if args.tensors is None else tuple(p.strip() for p in args.tensors.split(",") if p.strip())
    if args.tensors is not None and not patterns:
        raise RefitError("--tensors is empty: give name patterns separated by commas, e.g. --tensors '*.experts.*'")
    return floor, patterns


def _check_options(args: argparse.Namespace, plan: ShardRefitPlan, patterns: tuple[str, ...]) -> RefitCheckOptions:
    """What every worker plans again from: the parent's checked plan's shards and planner options (one
    owner, so a worker plans what the parent checked), with the executor's knobs from the flags."""
    from ..engine.live.refit_check import RefitCheckOptions

    return RefitCheckOptions(
        model=args.model,
        shards=args.shards,
        src=plan.source.index,
        dst=tuple(destination.index for destination in plan.destinations),
        order=args.order,
        ranks_per_node=plan.ranks_per_node,
        timeout=args.timeout,
        bucket_bytes=args.bucket_bytes,
        min_piece_bytes=plan.min_piece_bytes,
        fan_out=plan.fan_out,
        tensors=patterns,
        to_dtype=args.to_dtype,
        scale=args.scale,
    )


def _check(args: argparse.Namespace) -> int:
    """``--check``: plan once here (bad input fails before any process starts), then execute the plan on a
    live world (shardcore.engine.live.refit_check) and print one row per destination shard."""
    if args.world is not None:
        raise RefitError("--check takes its world from --nproc (or torchrun), not --world")
    torchrun = torchrun_world()
    joined = torchrun is not None
    warnings = [] if joined else check_machine(args.nproc)
    require_torch("refit --check")
    args.world = args.nproc if torchrun is None else torchrun
    plan, patterns = _plan(args)
    for warning in warnings:
        print(f"shardcore: warning: {warning}", file=sys.stderr)
    from ..engine.live import refit_check

    options = _check_options(args, plan, patterns)
    reports = refit_check.run_joined(options) if joined else refit_check.run_local(args.world, options)
    if reports is None:
        return 0
    table, ok = check_summary(reports, plan)
    print(table)
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    """The ``refit`` subcommand."""
    if args.list_models:
        print("\n".join(PRESETS))
        return 0
    if args.search:
        if args.fan_out or args.min_piece is not None or args.tensors is not None:
            raise RefitError("--search ranks whole refits by estimate: drop --fan-out, --min-piece and --tensors")
        if args.to_dtype is not None or args.scale is not None:
            raise RefitError("--search ranks layouts by the manifest's own dtypes: drop --to-dtype and --scale")
        return run_search(args)
    if args.check:
        return _check(args)
    plan, _ = _plan(args)
    stats = RefitStats.of(plan)
    mine = plan.for_rank(args.rank) if args.rank is not None else None
    if args.json:
        data: dict[str, Any] = stats.to_dict(args.intra_gbps, args.inter_gbps)
        data["model"] = plan.manifest.name
        data["source"] = plan.source.index
        data["destinations"] = [destination.index for destination in plan.destinations]
        data["min_piece_bytes"], data["fan_out"] = plan.min_piece_bytes, plan.fan_out
        data["refitted_tensors"] = len(plan.manifest) if plan.tensors is None else len(plan.tensors)
        data["tensors"] = {t.name: _tensor_entry(t) for t in plan.manifest}
        if args.transfers:
            data["transfers"] = [transfer.to_dict() for transfer in plan.transfers()]
        if mine is not None:
            data["rank"] = {
                "rank": mine.rank,
                "sends": [t.to_dict() for t in mine.sends],
                "recvs": [t.to_dict() for t in mine.recvs],
                "copies": [t.to_dict() for t in mine.copies],
            }
        print(json.dumps(data, indent=None if args.transfers else 2))  # every transfer: one compact document
        return 0
    print(summary_table(plan, stats, args.intra_gbps, args.inter_gbps))
    if mine is not None:
        print()
        print(rank_table(mine))
    return 0


def _tensor_entry(tensor: TensorSpec) -> dict[str, Any]:
    """A tensor in ``--json``: shape, dtype and element size; with its destination and wire dtypes when it
    converts, and the weight a scale tensor scales."""
    entry: dict[str, Any] = {"shape": list(tensor.shape), "dtype": tensor.dtype, "itemsize": tensor.itemsize}
    if tensor.to_dtype is not None:
        entry.update(to_dtype=tensor.to_dtype, wire_dtype=tensor.wire_dtype, wire_itemsize=tensor.wire_itemsize)
        if tensor.scale is not None:
            entry["scale"] = tensor.scale
    if tensor.scale_of is not None:
        entry["scale_of"] = tensor.scale_of
    return entry


def check_summary(reports: list[RefitReport], plan: ShardRefitPlan) -> tuple[str, bool]:
    """One row per destination shard: bytes, the slowest rank's seconds, GB/s, status; and whether all matched."""
    rows: list[tuple[object, ...]] = []
    ok = True
    for target in plan.destinations:
        mine = [r for r in reports if r.shard == target.index]
        moved = sum(r.bytes_received + r.bytes_copied for r in mine)
        seconds = max((r.seconds for r in mine), default=0.0)
        bad = [m for r in mine for m in r.mismatches]
        good = not bad and len(mine) == target.size and all(r.checked for r in mine)
        ok &= good
        rate = f"{moved / seconds / 1e9:.3f}" if seconds > 0 else "-"
        status = "ok" if good else f"FAILED ({len(bad)} tensors differ)"
        rows.append(
            (
                target.index,
                str(target.spec),
                f"[{target.rank_offset}, {target.ranks.stop})",
                moved,
                sum(r.bytes_copied for r in mine),
                f"{seconds:.3f}",
                rate,
                status,
            )
        )
    table = format_table(rows, ("shard", "spec", "ranks", "bytes", "local bytes", "seconds", "GB/s", "status"))
    details = [m for r in reports for m in r.mismatches][:20]
    return table + ("\n" + "\n".join(details) if details else ""), ok


def add_refit_parser(subparsers: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register ``shardcore refit`` on the main parser's subparsers (``common``: the -v / -q flags)."""
    parser = subparsers.add_parser(
        "refit", help="plan moving a model's weights from one shard to others (no torch)", parents=[common]
    )
    _add_plan_flags(parser)
    _add_output_flags(parser)
    _add_conversion_flags(parser)
    _add_estimate_flags(parser)
    _add_check_flags(parser)
    add_search_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def _add_plan_flags(parser: argparse.ArgumentParser) -> None:
    """What the plan moves: the layout, the source and destination shards, the model, the planner options."""
    parser.add_argument("--world", type=POSITIVE_INT, help="total number of ranks")
    parser.add_argument("--shards", help="e.g. 'tp=8,pp=4,dp=4,role=train+tp=8,role=decode', or @file.yaml")
    add_order_flag(parser)
    add_allow_idle_flag(parser)
    parser.add_argument(
        "--from", dest="src", type=NON_NEGATIVE_INT, metavar="I", help="source shard index (e.g. training)"
    )
    parser.add_argument("--to", dest="dst", metavar="J[,K...]", help="destination shard indices, comma separated")
    parser.add_argument("--model", metavar="FILE|PRESET", help="manifest file (JSON/YAML) or a preset name")
    parser.add_argument(
        "--ranks-per-node",
        type=POSITIVE_INT,
        metavar="K",
        help="node = rank // K: prefer same-node sources and split traffic by node",
    )
    parser.add_argument(
        "--fan-out",
        action="store_true",
        help="with --ranks-per-node: send each tile once into a node without its sources, relayed there",
    )
    parser.add_argument(
        "--min-piece",
        metavar="SIZE",
        help=f"floor on piece size, e.g. 1MiB, 512kB, 0 for none (default {DEFAULT_MIN_PIECE_BYTES >> 20}MiB)",
    )
    parser.add_argument(
        "--tensors",
        metavar="PATTERNS",
        help="refit only the tensors matching these comma-separated patterns, e.g. '*.experts.*' (a partial refit)",
    )


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    """What is printed: a rank's transfers, JSON, every transfer, the preset names."""
    parser.add_argument("--rank", type=NON_NEGATIVE_INT, metavar="R", help="also print rank R's transfers")
    parser.add_argument("--json", action="store_true", help="print the stats (and tensors) as JSON")
    parser.add_argument("--transfers", action="store_true", help="with --json: include every transfer")
    parser.add_argument("--list-models", action="store_true", help="print the preset model names, one a line")


def _add_conversion_flags(parser: argparse.ArgumentParser) -> None:
    """A converting refit: the destination dtype and fp8 scales."""
    parser.add_argument(
        "--to-dtype",
        metavar="DTYPE",
        help="destination dtype of every floating tensor (e.g. bfloat16, float8_e4m3fn), in the plan and in --check",
    )
    parser.add_argument(
        "--scale",
        metavar="block|tensor",
        help="with --to-dtype float8_e4m3fn: one scale per 128x128 block (default) or per tensor",
    )


def _add_estimate_flags(parser: argparse.ArgumentParser) -> None:
    """The bandwidths the time estimate assumes."""
    parser.add_argument(
        "--intra-gbps",
        type=float,
        default=DEFAULT_INTRA_GBPS,
        help=f"intra-node bandwidth per rank for the estimate, GB/s (default {DEFAULT_INTRA_GBPS:g})",
    )
    parser.add_argument(
        "--inter-gbps",
        type=float,
        default=DEFAULT_INTER_GBPS,
        help=f"inter-node bandwidth per rank for the estimate, GB/s (default {DEFAULT_INTER_GBPS:g})",
    )


def _add_check_flags(parser: argparse.ArgumentParser) -> None:
    """``--check``: run the plan on a live world, and that world's knobs."""
    parser.add_argument(
        "--check",
        action="store_true",
        help="execute the plan on a live world of --nproc gloo processes (or under torchrun) and "
        "compare every destination element; needs torch",
    )
    add_nproc_flag(parser, when="with --check: ")
    add_timeout_flag(parser, when="with --check: ")
    parser.add_argument(
        "--bucket-bytes",
        type=POSITIVE_INT,
        default=DEFAULT_BUCKET_BYTES,
        help="with --check: bytes one batch of messages may hold, and so the staging memory a rank uses "
        "(default: %(default)s)",
    )


__all__ = ["add_refit_parser", "format_bytes", "rank_table", "run", "summary_table"]
