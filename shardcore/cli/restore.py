"""``shardcore replan --check``: lose the ranks for real on local processes, form the survivors' world, restore.

Everything that can fail before a process starts is checked here first (the replan, the option, the
restore plan: a tensor with no surviving copy is one line); then ``engine.live.restore_check`` runs one
process per old rank, and the table says, per new shard, how many ranks were restored and how many kept
their weights, what moved, and whether every tensor matched bitwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import TYPE_CHECKING

from ..errors import CheckError
from ..plan.arguments import counted, format_bytes
from ..refit.options import ExecuteOptions
from ..replan import ReplanOption, ReplanRequest, format_ranks, named_ranks
from ..views.tables import format_table
from .check import TORCH_HINT, Load, Progress, check_load, check_machine

if TYPE_CHECKING:
    from ..engine.live.restore_check import RestoreCheckOptions, RestoreReport


def _options(args: argparse.Namespace, request: ReplanRequest) -> RestoreCheckOptions:
    from ..engine.live.ports import free_port
    from ..engine.live.restore_check import RestoreCheckOptions

    return RestoreCheckOptions(
        request,
        option=1 if args.option is None else args.option,
        backend=args.backend,
        shrink=args.shrink,
        rendezvous_port=free_port(),
        execute=ExecuteOptions(timeout=args.timeout),
    )


def restore_summary(option: ReplanOption, reports: list[RestoreReport]) -> tuple[str, bool]:
    """The header, one row per new shard (restored and kept ranks, bytes, tensors checked, status), the
    slowest survivor's times; and whether every rank of the new layout holds exactly its weights."""
    from ..engine.live.restore_check import PHASES
    from ..engine.survivors import SHRINK

    rows, ok = [], len(reports) == option.layout.world_size
    for plan in option.layout.shards:
        mine = [report for report in reports if report.shard == plan.index]
        bad = [m for report in mine for m in report.mismatches]
        good = not bad and len(mine) == plan.size and all(report.checked for report in mine)
        ok &= good
        rows.append(
            (
                plan.index,
                plan.spec.role or "-",
                str(plan.spec),
                f"[{plan.rank_offset}, {plan.ranks.stop})",
                sum(report.restored for report in mine),
                sum(not report.restored for report in mine),
                format_bytes(sum(report.bytes_received + report.bytes_copied for report in mine)),
                sum(report.checked for report in mine),
                "ok" if good else f"FAILED ({len(bad)} tensors differ)",
            )
        )
    header = ("shard", "role", "new spec", "new ranks", "restored", "kept", "moved", "tensors checked", "status")
    first = reports[0] if reports else None
    how = "shrunk world (torch's shrink_group)" if first is not None and first.how == SHRINK else "new world"
    formed = f"{how}; its store: {first.store}" if first is not None else "world: none"
    slowest = ", ".join(
        f"{phase} {max(report.seconds.get(phase, 0.0) for report in reports):.2f} s" for phase in PHASES
    )
    received = sum(report.bytes_received for report in reports)
    copied = sum(report.bytes_copied for report in reports)
    lines = [
        f"survivors: {counted(len(reports), 'rank')} of {option.renumbering.old_world} formed a {formed}",
        format_table(rows, header),
        f"slowest survivor: {slowest}",
        f"restored {format_bytes(received + copied)}: {format_bytes(received)} received, {format_bytes(copied)} "
        f"copied locally",
        *[m for report in reports for m in report.mismatches][:20],
    ]
    return "\n".join(lines), ok


def run_restore_check(args: argparse.Namespace, request: ReplanRequest) -> int:
    """``replan --check``: the option planned and its restore checked here, then the live run and its table."""
    if importlib.util.find_spec("torch") is None:
        raise CheckError(TORCH_HINT.replace("shardcore check", "shardcore replan --check"))
    from ..engine.live import restore_check
    from ..engine.torch_state import check_torch_imports

    check_torch_imports()
    if args.new_world is not None:
        raise CheckError("--check runs the survivors of --lost: it cannot start the ranks --new-world adds")
    if args.json or args.svg:
        raise CheckError("--check prints its own table: drop --json and --svg (run them without --check)")
    warnings = check_machine(args.world)  # the limits on processes alone, before planning
    options = _options(args, request)
    option = restore_check.choose_option(options)  # bad input and missing copies fail here, before any start
    bucket = options.execute.bucket_bytes
    held = [restore_check.check_held_bytes(option, rank, bucket) for rank in range(args.world)]
    what = "each rank's old and new tensors, and a whole tensor while it is drawn"
    check_load(args.world, Load(held, what, "check a smaller model or world", "--world"))
    gone = option.renumbering.gone
    print(
        f"replan --check: {counted(args.world, 'local process', 'local processes')}, losing "
        f"{named_ranks(request.lost)}; option {options.option} ({option.kind}): "
        f"{' + '.join(str(plan.spec) for plan in option.layout.shards)} on {counted(option.layout.world_size, 'rank')}"
        f"{'' if gone == request.lost else f' (released too: {format_ranks(option.renumbering.released)})'}"
        f"{'; the world starts on gloo that can shrink' if args.shrink else ''}",
        flush=True,
    )
    for warning in warnings:
        print(f"shardcore: warning: {warning}", file=sys.stderr, flush=True)
    progress = Progress(args.world, args.verbose, args.quiet)
    reports = restore_check.run_local(options, progress, progress.held)
    table, ok = restore_summary(option, reports)
    print(table)
    return 0 if ok else 1


__all__ = ["restore_summary", "run_restore_check"]
