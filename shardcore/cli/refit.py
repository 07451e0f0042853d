"""``shardcore refit``: plan moving a model's weights between shards and print what it costs (no torch)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import OptionValueError, RefitError, RefitInputError
from ..plan.arguments import check_count, check_size, counted, format_bytes, number_or_long, shown
from ..refit.cost import DEFAULT_INTER_GBPS, DEFAULT_INTRA_GBPS, RefitStats
from ..refit.families import LAYOUTS
from ..refit.landing import refuse_delta
from ..refit.manifest import SCALED, Manifest, TensorSpec
from ..refit.models import PRESETS
from ..refit.options import (
    DELTA_SHAPING,
    OPTION_FLAGS,
    ExecuteOptions,
    OptionFlag,
)
from ..refit.part import RankRefit, Transfer
from ..refit.plan import DEFAULT_MIN_PIECE_BYTES, ShardRefitPlan
from ..refit.request import RefitRequest
from ..refit.weightmap import MappedPlacement
from ..views.tables import format_table
from .arguments import (
    FRACTION,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    add_allow_idle_flag,
    add_nproc_flag,
    add_order_flag,
    add_timeout_flag,
    lone_flags,
    missing_flags,
)
from .check import JoinedProgress, Load, Progress, check_load, check_machine, require_torch, torchrun_world
from .search import add_search_arguments, run_search

if TYPE_CHECKING:
    from ..engine.live.refit_check import RefitReport


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
                "-" if shard.busiest_receiver is None else shard.busiest_receiver,
                format_bytes(shard.received),
                f"{shard.estimate_seconds(intra_gbps, inter_gbps):.3g}",
            )
        )
    header = ("to", "role", "spec", "ranks", "bytes", "local", "busiest receiver", "it receives", "estimate s")
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
        *landing_lines(plan),
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


def landing_lines(plan: ShardRefitPlan) -> list[str]:
    """fp8 through a layout (none otherwise): the destination ranks quantize what lands, so the bytes above are
    the source dtype's (``shardcore.refit.landing``)."""
    landings = [
        placement.landing
        for placement in plan.destination_placements
        if isinstance(placement, MappedPlacement) and placement.landing is not None
    ]
    if not landings:
        return []
    count = sum(tensor.scale is not None for landing in landings for tensor in landing)
    return [
        f"quantized on landing: {count} destination tensors to float8_e4m3fn with 128x128 block scales of each "
        f"rank's own tensor, by the destination ranks; bytes above are wire bytes, in the source dtype"
    ]


COORDS = ("global", "dest")
"""How ``--coords`` shows a transfer's box: in the source model's global coordinates (the default), or in the
destination rank's own local tensor (``Transfer.dst_box``; an engine's own tensor through a weight map)."""


def transfer_table(mine: RankRefit, coords: str = "global") -> str:
    """One rank's transfers: sends, receives and local copies, each with its peer, box and bytes; the box in the
    source model's global coordinates, or (``coords="dest"``) in the destination's local tensor, named."""

    rows = []
    for kind, transfers in (("send", mine.sends), ("recv", mine.recvs), ("copy", mine.copies)):
        for t in transfers:
            peer = t.dst if kind == "send" else t.src
            box = "[" + ", ".join(f"{start}:{stop}" for start, stop in (t.dst_box if coords == "dest" else t.box)) + "]"
            name = f"{t.tensor} -> {t.target}" if t.target else t.tensor
            rows.append((kind, peer, name, box, format_bytes(t.bytes)))
    title = (
        f"rank {mine.rank}: sends {len(mine.sends)} ({format_bytes(mine.bytes_sent)}), "
        f"receives {len(mine.recvs)} ({format_bytes(mine.bytes_received)}), copies {len(mine.copies)}"
    )
    column = "global box" if coords == "global" else "box in the destination rank's tensor"
    return title + ("\n" + format_table(rows, ("op", "peer", "tensor", column, "bytes")) if rows else "")


def _plan(args: argparse.Namespace) -> tuple[RefitRequest, ShardRefitPlan]:
    """The refit the flags describe and its plan (``RefitRequest.plan``): every flag checked first.

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
    request = _request(args)
    plan = request.plan(args.world)
    if args.rank is not None:
        plan.layout.shard_of(args.rank)  # a rank outside the world fails before any work (the plan is lazy)
    return request, plan


def _request(args: argparse.Namespace) -> RefitRequest:
    """The refit the flags describe, each flag checked on its own (the request checks them together when it
    plans).

    Raises:
        RefitError: ``--fan-out`` without ``--ranks-per-node``, a bad ``--min-piece``, ``--tensors``, ``--from``,
            ``--to``, or ``--scale`` without ``--to-dtype``.
    """
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
    if args.scale is not None and args.to_dtype is None:
        raise RefitError(f"--scale {args.scale} needs --to-dtype float8_e4m3fn")
    return RefitRequest(
        model=args.model,
        shards=args.shards,
        src=check_count("--from", args.src, minimum=0, error=RefitError),  # a 4,000-digit index is shown short
        dst=tuple(_shard_indices(args.dst)),
        order=args.order,
        allow_idle=args.allow_idle,
        ranks_per_node=args.ranks_per_node,
        min_piece_bytes=floor,
        fan_out=args.fan_out,
        tensors=patterns,
        to_dtype=args.to_dtype,
        scale=args.scale,
        from_layout=args.from_layout,
        to_layout=args.to_layout,
    )


def _execute_options(args: argparse.Namespace) -> ExecuteOptions:
    """``--timeout`` and the executor's flags (``OPTION_FLAGS``): checked here, before a process starts.

    Raises:
        RefitInputError: a value the executor cannot run, naming the flag.
    """
    given = {field: getattr(args, _dest(option)) for field, option in OPTION_FLAGS.items()}
    if args.delta and given["version"] is None:
        given["version"] = 1
    try:
        return ExecuteOptions.merged(  # a flag not given (None, or a switch left off) keeps the executor's default
            timeout=args.timeout, **{field: None if value is False else value for field, value in given.items()}
        )
    except OptionValueError as error:
        raise RefitInputError(f"{OPTION_FLAGS[error.field].flag} {error.value}: {error.problem}") from None


def _dest(option: OptionFlag) -> str:
    """Where argparse keeps ``option``'s value."""
    return option.flag.removeprefix("--").replace("-", "_")


def _check(args: argparse.Namespace) -> int:
    """``--check``: plan once here (bad input fails before any process starts), then execute the plan on a
    live world (shardcore.engine.live.refit_check): progress on stderr as ``check`` prints it, then one row per
    destination shard and a summary line, or ``--json``."""
    if args.world is not None:
        raise RefitError("--check takes its world from --nproc (or torchrun), not --world")
    execute = _execute_options(args)
    torchrun = torchrun_world()
    joined = torchrun is not None
    warnings = [] if joined else check_machine(args.nproc)  # the limits on processes alone, before planning
    require_torch("refit --check")
    args.world = args.nproc if torchrun is None else torchrun
    request, plan = _plan(args)
    if execute.delta:
        refuse_delta(plan.destination_placements, "--delta")
    from ..engine.live import refit_check

    if not joined:
        check_load(args.nproc, _load(plan, execute, refit_check.check_held_bytes))
    changes = (0.02 if args.changed is None else args.changed,) if args.delta else ()
    options = refit_check.RefitCheckOptions(request, execute, changes)
    speaks = not args.quiet and (not joined or os.environ["RANK"] == "0")
    if speaks and not args.json:
        print(_check_header(plan, execute, args.world, joined), flush=True)
        print(f"checking {_checked_text(_checked(request, execute))}", flush=True)
    for warning in warnings:
        print(f"shardcore: warning: {warning}", file=sys.stderr)
    if joined:
        reports = refit_check.run_joined(options, JoinedProgress(args.world, args.verbose, args.quiet))
    else:
        progress = Progress(args.world, args.verbose, args.quiet)
        reports = refit_check.run_local(args.world, options, progress, progress.held)
    if reports is None:
        return 0
    rows = _check_rows(reports, plan, execute.delta)
    ok = all(row["ok"] for row in rows)
    checked = _checked(request, execute)
    if args.json:
        print(json.dumps({**_check_document(plan, execute, rows), "checked": checked}, indent=2))
    else:
        print(f"checked {_checked_text(checked)}")
        print(_check_table(rows))
        print(_check_line(plan, rows))
    return 0 if ok else 1


def _load(plan: ShardRefitPlan, execute: ExecuteOptions, held: Callable[[Any, int, int], int]) -> Load:
    """What each rank of ``refit --check`` holds (``held``: ``refit_check.check_held_bytes``), for the memory
    check before any process starts."""
    return Load(
        [held(plan, rank, execute.bucket_bytes) for rank in range(plan.layout.world_size)],
        "the refit's tensors: each rank makes whole the ones it checks",
        "refit a smaller model or part of it (--tensors), or use fewer processes",
    )


def _checked(request: RefitRequest, execute: ExecuteOptions) -> dict[str, Any]:
    """What a live check checked, echoed in its text and JSON: the two sides' layouts, the destination dtype
    (None: the source's), the scales an fp8 target carries, and whether a delta refit followed the dense one."""
    scale = request.scale or ("block" if request.to_dtype == SCALED else None)
    return {
        "from_layout": request.from_layout,
        "to_layout": request.to_layout,
        "to_dtype": request.to_dtype,
        "scale": scale,
        "delta": execute.delta_terms,
    }


def _checked_text(checked: dict[str, Any]) -> str:
    """``_checked`` in words, e.g. "megatron -> vllm layout, to float8_e4m3fn with block scales, dense then delta"."""
    dtype = "in the source's dtypes" if checked["to_dtype"] is None else f"to {checked['to_dtype']}"
    scale = "" if checked["scale"] is None else f" with {checked['scale']} scales"
    delta = "dense only" if checked["delta"] == "off" else f"dense then delta ({checked['delta']})"
    return f"{checked['from_layout']} -> {checked['to_layout']} layout, {dtype}{scale}, {delta}"


def _check_header(plan: ShardRefitPlan, execute: ExecuteOptions, world: int, joined: bool) -> str:
    where = (
        f"torchrun world of {counted(world, 'rank')}"
        if joined
        else counted(world, "local gloo process", "local gloo processes")
    )
    targets = ", ".join(str(target.index) for target in plan.destinations)
    subset = "" if plan.tensors is None else f" ({len(plan.tensors)} of {len(plan.manifest)} tensors)"
    return (
        f"shardcore refit --check: {where}, {plan.manifest.name}{subset} from shard {plan.source.index} to "
        f"{targets}, bucket {format_bytes(execute.bucket_bytes)}, {execute.max_ops} ops per batch, "
        f"verify {execute.verify}, timeout {execute.wait.total_seconds():g}s"
        + ("" if not execute.delta else f", delta {execute.delta_terms} (a second refit after a step)")
    )


def _check_rows(reports: list[RefitReport], plan: ShardRefitPlan, delta: bool = False) -> list[dict[str, Any]]:
    """Per destination shard: its ranks, the bytes its ranks received and copied, the slowest rank's seconds,
    the tensors that differ, and whether every rank of it reported and matched. With ``delta``, the same for the
    dense refit and the delta refit after it, side by side (``refits``); the top-level figures are the last one's."""
    rows = []
    for target in plan.destinations:
        mine = [r for r in reports if r.shard == target.index]
        mismatches = [m for r in mine for m in r.mismatches]
        refits = {}
        if delta:
            for lap, name in enumerate(("dense", "delta")):
                laps = [r.laps[lap] for r in mine if len(r.laps) > lap]
                refits[name] = {
                    "bytes": sum(received + copied for received, copied, _, _ in laps),
                    "wire_bytes": sum(wire for _, _, wire, _ in laps),
                    "seconds": max((seconds for *_, seconds in laps), default=0.0),
                }
        rows.append(
            {
                "shard": target.index,
                "spec": str(target.spec),
                "ranks": [target.rank_offset, target.ranks.stop],
                "bytes": sum(r.bytes_received + r.bytes_copied for r in mine),
                "wire_bytes": sum(r.wire_bytes_received for r in mine),
                "local_bytes": sum(r.bytes_copied for r in mine),
                "seconds": max((r.seconds for r in mine), default=0.0),
                "tensors_checked": sum(r.checked for r in mine),
                "mismatches": mismatches,
                "ok": not mismatches and len(mine) == target.size and all(r.checked for r in mine),
                **({"refits": refits} if refits else {}),
            }
        )
    return rows


def _check_table(rows: list[dict[str, Any]]) -> str:
    """One row per destination shard, in human units (a delta check: its dense and delta refits side by side, the
    bytes on the wire and the seconds of each); then the first tensors that differ."""
    delta = any("refits" in row for row in rows)

    def figures(row: dict[str, Any]) -> tuple[str, ...]:
        if not delta:
            speed = f"{row['bytes'] / row['seconds'] / 1e9:.3f}" if row["seconds"] > 0 else "-"
            return (format_bytes(row["bytes"]), format_bytes(row["local_bytes"]), f"{row['seconds']:.3f}", speed)
        dense, changed = row["refits"]["dense"], row["refits"]["delta"]
        return (
            format_bytes(dense["wire_bytes"]),
            f"{dense['seconds']:.3f}",
            format_bytes(changed["wire_bytes"]),
            f"{changed['seconds']:.3f}",
        )

    table = format_table(
        [
            (
                row["shard"],
                row["spec"],
                f"[{row['ranks'][0]}, {row['ranks'][1]})",
                *figures(row),
                "ok" if row["ok"] else f"FAILED ({counted(len(row['mismatches']), 'tensor')} differ)",
            )
            for row in rows
        ],
        (
            "shard",
            "spec",
            "ranks",
            *(("dense wire", "dense s", "delta wire", "delta s") if delta else ("moved", "local", "seconds", "GB/s")),
            "status",
        ),
    )
    details = [m for row in rows for m in row["mismatches"]][:20]
    return table + ("\n" + "\n".join(details) if details else "")


def _check_line(plan: ShardRefitPlan, rows: list[dict[str, Any]]) -> str:
    """The last line: whether every destination rank holds its slices of the source's tensors, bitwise."""
    ranks = sum(target.size for target in plan.destinations)
    moved = format_bytes(sum(row["bytes"] for row in rows))
    wire = sum(row["wire_bytes"] for row in rows)
    slowest = max((row["seconds"] for row in rows), default=0.0)
    if all(row["ok"] for row in rows):
        received = sum(row["bytes"] - row["local_bytes"] for row in rows)
        delta = f" ({format_bytes(wire)} on the wire)" if wire != received else ""
        return (
            f"all {counted(ranks, 'destination rank')} hold the source's tensors bitwise: {moved} moved{delta}, "
            f"the slowest rank in {slowest:.3f} s"
        )
    failed = [str(row["shard"]) for row in rows if not row["ok"]]
    return f"MISMATCH: destination shard{'s' if len(failed) > 1 else ''} {', '.join(failed)} differ from the source"


def _check_document(plan: ShardRefitPlan, execute: ExecuteOptions, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``--check --json``: what was run and, per destination shard, what it got."""
    return {
        "model": plan.manifest.name,
        "source": plan.source.index,
        "destinations": [target.index for target in plan.destinations],
        "refitted_tensors": len(plan.manifest) if plan.tensors is None else len(plan.tensors),
        "execute": {
            "timeout": execute.wait.total_seconds(),
            "bucket_bytes": execute.bucket_bytes,
            "max_ops": execute.max_ops,
            "verify": execute.verify,
            "version": execute.version,
            "delta": execute.delta_terms,
        },
        "shards": rows,
        "ok": all(row["ok"] for row in rows),
    }


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
    _refuse_lone_flags(args)
    if args.check:
        return _check(args)
    _, plan = _plan(args)
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
        data["from_layout"], data["to_layout"] = args.from_layout, args.to_layout
        data["destination_tensors"] = _destination_tensors(plan)

        def entry(transfer: Transfer) -> dict[str, Any]:
            out = transfer.to_dict()
            if args.coords == "dest":
                out["dst_box"] = [list(pair) for pair in transfer.dst_box]
            return out

        if args.transfers:
            data["transfers"] = [entry(transfer) for transfer in plan.transfers()]
        if mine is not None:
            data["rank"] = {
                "rank": mine.rank,
                "sends": [entry(t) for t in mine.sends],
                "recvs": [entry(t) for t in mine.recvs],
                "copies": [entry(t) for t in mine.copies],
            }
        print(json.dumps(data, indent=None if args.transfers else 2))  # every transfer: one compact document
        return 0
    print(summary_table(plan, stats, args.intra_gbps, args.inter_gbps))
    if mine is not None:
        print()
        print(transfer_table(mine, args.coords or "global"))
    return 0


def _refuse_lone_flags(args: argparse.Namespace) -> None:
    """Flags that only act with another one are refused without it, before any work (never silently ignored).

    Raises:
        RefitError: naming the flag and the one it needs.
    """
    if args.transfers and args.check:
        raise RefitError("--transfers lists the plan's transfers, not the live run's: drop it with --check")
    lone = lone_flags(args, {"--transfers": "transfers"}, "--json") if not args.json else None
    lone = lone or (None if args.check else lone_flags(args, _CHECK_ONLY, "--check"))
    lone = lone or (None if args.delta else lone_flags(args, _DELTA_ONLY, "--delta"))
    lone = lone or lone_flags(args, {"--objective": "objective"}, "--search")
    if not lone and args.coords is not None and args.rank is None and not args.transfers:
        lone = "--coords needs --rank or --transfers"
    if lone:
        raise RefitError(lone)


_CHECK_ONLY = {option.flag: _dest(option) for field, option in OPTION_FLAGS.items() if field not in DELTA_SHAPING}
"""The executor's flags (their defaults None, so a given one is seen)."""
_DELTA_ONLY = {
    **{OPTION_FLAGS[field].flag: _dest(OPTION_FLAGS[field]) for field in DELTA_SHAPING},
    "--changed": "changed",
}
"""The flags that shape a delta check."""


def _destination_tensors(plan: ShardRefitPlan) -> dict[str, dict[str, dict[str, Any]]]:
    """``--json``: per destination shard holding another layout than the source's, its own local tensors (names,
    shapes, dtypes), with what it quantizes on landing and the scale tensors it makes; a destination in the
    source's layout holds ``tensors`` and is left out."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for placement in plan.destination_placements:
        local = placement.local_tensors()
        if local is not plan.manifest:
            found[str(placement.index)] = {t.name: _tensor_entry(t) for t in local}
    return found


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
    parser.add_argument(
        "--model",
        metavar="FILE|PRESET|hf:PATH",
        help="manifest file (JSON/YAML), a preset name, or hf:PATH/config.json (a Hugging Face config)",
    )
    parser.add_argument(
        "--to-layout",
        choices=LAYOUTS,
        default="megatron",
        help="the destinations' layout: hf (the transformers model class), hf-stacked (transformers 5's MoE), "
        "vllm (vLLM/SGLang tp packing); needs --model hf:PATH",
    )
    parser.add_argument(
        "--from-layout",
        choices=LAYOUTS,
        default="megatron",
        help="the source's layout (hf: a training job starting from a Hugging Face model); needs --model hf:PATH",
    )
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
    parser.add_argument(
        "--json", action="store_true", help="print the stats (and tensors) as JSON; with --check, the live run's result"
    )
    parser.add_argument("--transfers", action="store_true", help="with --json: include every transfer")
    parser.add_argument(
        "--coords",
        choices=COORDS,
        help="with --rank or --transfers: show each box in the source model's global coordinates (global, the "
        "default) or in the destination rank's own local tensor (dest: rows of an engine's own qkv_proj; "
        "JSON adds dst_box)",
    )
    parser.add_argument("--list-models", action="store_true", help="print the preset model names, one a line")


def _add_conversion_flags(parser: argparse.ArgumentParser) -> None:
    """A converting refit: the destination dtype and fp8 scales."""
    parser.add_argument(
        "--to-dtype",
        metavar="DTYPE",
        help=(
            "destination dtype, in the plan and in --check: a cast (e.g. bfloat16) converts every floating tensor, "
            "float8_e4m3fn the linear layers' weights only (norms, biases, embeddings, output layer and router keep "
            "their dtype)"
        ),
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
    for field, option in OPTION_FLAGS.items():
        if field not in DELTA_SHAPING:
            _add_option_flag(parser, option, "with --check: ")
    parser.add_argument(
        "--changed",
        type=FRACTION,
        metavar="F",
        help="with --delta: the fraction of elements the optimizer step changes (default 0.02)",
    )
    for field in DELTA_SHAPING:
        _add_option_flag(parser, OPTION_FLAGS[field], "with --delta: ")


def _add_option_flag(parser: argparse.ArgumentParser, option: OptionFlag, when: str) -> None:
    """An executor option's flag, as its ``OPTION_FLAGS`` row names and describes it: a choice, a switch or a
    whole number of at least ``option.minimum``."""
    if option.choices is not None:
        parser.add_argument(option.flag, choices=list(option.choices), help=when + option.help)
    elif option.metavar is None:
        parser.add_argument(option.flag, action="store_true", help=when + option.help)
    else:
        number = NON_NEGATIVE_INT if option.minimum == 0 else POSITIVE_INT
        parser.add_argument(option.flag, type=number, metavar=option.metavar, help=when + option.help)


__all__ = ["add_refit_parser", "format_bytes", "run", "summary_table", "transfer_table"]
