"""Plain-text tables of a layout and of one rank's groups, for the CLI and the live checks."""

from __future__ import annotations

from collections.abc import Sequence

from ..plan.arguments import counted
from ..plan.layout import GRID_GROUP_NAMES, GroupName, Layout, ShardPlan

_COLUMNS = ("shard", "role", "name", "ranks", "tp", "cp", "pp", "dp", "ep", "expt_tp", "expt_dp")


def ordered_coords(plan: ShardPlan, rank: int) -> list[tuple[str, int]]:
    """The rank's coordinates, outermost dim first: the decoder grid (``pp, dp, cp, tp`` under
    ``tp-cp-dp-pp``), then the expert grid without its shared pp (``expt_dp, ep, expt_tp``)."""
    decoder, expert = plan.decoder_grid, plan.expert_grid
    dense = decoder.coords(rank)
    experts = expert.coords(rank)
    return [(name, dense[name]) for name in reversed(decoder.dim_names)] + [
        (name, experts[name]) for name in reversed(expert.dim_names) if name not in dense
    ]


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
        rows.append(
            (
                plan.index,
                spec.role or "-",
                spec.name or "-",
                f"[{plan.rank_offset}, {plan.ranks.stop})",
                spec.tp,
                spec.cp,
                spec.pp,
                spec.dp,
                spec.ep,
                spec.expt_tp,
                spec.expt_dp,
            )
        )
    text = format_table(rows, _COLUMNS)
    idle = ", ".join(f"[{w.start}, {w.stop})" for w in layout.idle)
    return text + (f"\nidle ranks: {idle}" if idle else "")


MAX_SHOWN_RANKS = 1024
"""A group larger than this is shown as its size, first and last rank, never built as a list."""


def shown_groups(plan: ShardPlan, rank: int) -> dict[str, list[int] | dict[str, int] | None]:
    """A member rank's named groups for printing: lists up to MAX_SHOWN_RANKS ranks, else a summary.

    ``shardcore plan --rank`` on a world of millions must not build lists of millions of ranks.
    """
    shown: dict[str, list[int] | dict[str, int] | None] = {}
    for name in GRID_GROUP_NAMES:
        size, first, last = plan.group_span(rank, name)
        shown[name] = (
            list(plan.groups_of(rank, (name,))[name] or ())
            if size <= MAX_SHOWN_RANKS
            else {"size": size, "first": first, "last": last}
        )
    for name, ranks in plan.groups_of(rank, (GroupName.EMBD, GroupName.POS_EMBD)).items():
        shown[name] = None if ranks is None else list(ranks)
    return shown


def _format_group(ranks: list[int] | dict[str, int] | None) -> object:
    if ranks is None:
        return "-"
    if isinstance(ranks, dict):
        size = counted(ranks["size"], "rank")
        return f"[{ranks['first']}, ..., {ranks['last']}] ({size}, over {MAX_SHOWN_RANKS}: not listed)"
    return ranks


def rank_table(layout: Layout, rank: int) -> str:
    """One rank's shard, coordinates and named groups."""
    plan = layout.shard_of(rank)
    if plan is None:
        return f"rank {rank} is idle: it belongs to no shard"
    coords = ", ".join(f"{k}={v}" for k, v in ordered_coords(plan, rank))
    rows = [(name, _format_group(ranks)) for name, ranks in shown_groups(plan, rank).items()]
    return f"rank {rank} in shard {plan.index} ({plan.spec}), coords {coords}\n" + format_table(
        rows, ("group", "ranks")
    )


__all__ = ["MAX_SHOWN_RANKS", "format_table", "layout_table", "ordered_coords", "rank_table", "shown_groups"]
