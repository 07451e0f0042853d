"""``shardcore check``: build a layout on a live world, verify every group, print one row per shard."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from ..plan.layout import Layout, plan_layout
from ..views.tables import format_table

if TYPE_CHECKING:
    from ..engine.check import RankReport


def cmd_check(args: argparse.Namespace) -> int:
    """Plan in the parent (a bad spec fails before any process starts), then run the check and print it."""
    from ..engine import check

    options = {
        "shards": args.shards,
        "backend": args.backend,
        "order": args.order,
        "allow_idle": args.allow_idle,
        "strategy": args.strategy,
        "timeout": args.timeout,
    }
    joined = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if joined else args.nproc
    layout = plan_layout(world, args.shards, order=args.order, allow_idle=args.allow_idle)
    if not joined:
        print(
            f"shardcore check: {world} local gloo processes, backend {args.backend or 'default'}, "
            f"strategy {args.strategy}, order {layout.order}"
        )
    reports = check.run_joined(options) if joined else check.run_local(world, options)
    if reports is None:
        return 0
    table, ok = summary(reports, layout)
    print(table)
    print("all groups match the plan" if ok else "MISMATCH: some groups differ from the plan")
    return 0 if ok else 1


def summary(reports: list[RankReport], layout: Layout) -> tuple[str, bool]:
    """One table row per shard (and idle ranks), and whether everything matched."""
    rows: list[tuple[object, ...]] = []
    ok = True
    for plan in layout.shards:
        mine = [r for r in reports if r.shard == plan.index]
        failures = [f for r in mine for f in r.failures]
        ok &= not failures and len(mine) == plan.size
        status = "ok" if not failures and len(mine) == plan.size else f"FAILED ({len(failures)} mismatches)"
        rows.append(
            (
                plan.index,
                plan.spec.role or "-",
                f"[{plan.rank_offset}, {plan.ranks.stop})",
                str(plan.spec),
                sum(r.verified for r in mine),
                f"{max((r.build_seconds for r in mine), default=0):.3f}",
                status,
            )
        )
    idle = [r for r in reports if r.shard is None]
    if idle:
        rows.append(("idle", "-", f"{len(idle)} ranks", "-", 0, f"{max(r.build_seconds for r in idle):.3f}", "ok"))
    table = format_table(rows, ("shard", "role", "ranks", "spec", "groups verified", "build s (max)", "status"))
    details = [f for r in reports for f in r.failures]
    return table + ("\n" + "\n".join(details) if details else ""), ok


__all__ = ["cmd_check", "summary"]
