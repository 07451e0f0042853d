"""replan: after losing (or gaining) ranks, the best new layouts, what survives of the old one, and what must move.

Each candidate (``shardcore.replan.options``) is evaluated the same way: the new layout over the renumbered
world, the ranks that move (``fate.rank_moves``), every group's fate (``fate.group_fates``), the parts of
tensors with no surviving copy (``copies.Copies.missing``), and the bytes the moving ranks must receive.
Options are ranked: those with every tensor still held first, then those with no more tp, cp, ep,
expt_tp and tp_ep groups spanning nodes than the old layout had, then by the bytes to restore, the ranks
used (more first) and the groups rebuilt.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import LayoutError, NoLayoutError, RefitError
from ..plan.arguments import check_count, format_bytes, shown
from ..plan.choices import AXES, check_axes
from ..plan.layout import Layout, plan_layout, resolve_order
from ..plan.topology import check_topology
from ..refit.footprint import Footprint
from ..refit.holdings import expert_range
from ..refit.manifest import Manifest
from ..refit.placement import check_fits
from .copies import Copies, MissingCopy, RestoreSources
from .fate import GroupFate, RankMove, group_fates, rank_moves
from .options import DEFAULT_TRAIN_BYTES_PER_PARAM, Constraints, Proposal, proposals
from .renumbering import Renumbering, named_ranks


@dataclass(frozen=True)
class ReplanOption:
    """One new layout and what it does to the old one.

    Attributes:
        kind: shrink, relayout, shift, replace, borrow or keep, with ``+grow`` when the last shard grows (see
            ``options``).
        notes: What was done to each shard that changed, for people.
        layout: The new layout over the new world.
        renumbering: Old ranks to new ones (lost, released, added).
        moves: The ranks that change shard or weights (``RankMove``), ascending by new rank.
        fates: Per new shard and group name, the groups kept and rebuilt (``GroupFate``).
        missing: Parts of tensors no survivor holds, each with the ranks that held it (``MissingCopy``).
        restore_bytes: Bytes the moving ranks must receive (their new weights, counted whole).
    """

    kind: str
    notes: tuple[str, ...]
    layout: Layout
    renumbering: Renumbering
    moves: tuple[RankMove, ...]
    fates: tuple[GroupFate, ...]
    missing: tuple[MissingCopy, ...]
    restore_bytes: int
    _copies: Copies = field(repr=False, compare=False)

    @property
    def old(self) -> Layout:
        """The old layout the option re-lays out."""
        return self._copies.old

    @property
    def manifest(self) -> Manifest:
        """The model every shard, old and new, holds."""
        return self._copies.manifest

    @property
    def used(self) -> int:
        """Ranks in a shard of the new layout."""
        return sum(plan.size for plan in self.layout.shards)

    @property
    def kept_groups(self) -> int:
        return sum(fate.kept for fate in self.fates)

    @property
    def rebuilt_groups(self) -> int:
        return sum(fate.rebuilt for fate in self.fates)

    @property
    def crossing(self) -> int:
        """Bandwidth-hungry groups spanning physical nodes (0 without a node size)."""
        return sum(fate.crossing for fate in self.fates)

    def needing_weights(self, shard: int) -> tuple[RankMove, ...]:
        """The moves into new shard ``shard`` that must receive weights."""
        return tuple(move for move in self.moves if move.new_shard == shard and move.needs_weights)

    def restore_sources(self, shard: int) -> RestoreSources:
        """The seam for the restore refit: for each tensor that a rank of new shard ``shard`` must receive,
        every surviving copy of any part of it (old shard, slice, global boxes, holders as new ranks), as a
        mapping from tensor name whose values are computed on access.

        The refit planner turns these holdings into a ``RefitPlan`` toward the new shard; a part of a
        tensor with no copy here is in ``missing``.

        Raises:
            LayoutError: no such shard in the new layout.
        """
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < len(self.layout.shards):
            raise LayoutError(f"shard {shown(shard)}: the new layout has shards 0 to {len(self.layout.shards) - 1}")
        plan, manifest = self.layout.shards[shard], self._copies.manifest
        positions: set[int] = set()
        classes: set[tuple[int, int]] = set()
        for move in self.needing_weights(shard):
            stage, ep = plan.decoder_grid.coords(move.new)["pp"], plan.expert_grid.coords(move.new)["ep"]
            if (stage, ep) not in classes:
                classes.add((stage, ep))
                positions.update(manifest.on_stage(stage, plan.spec.pp, expert_range(plan, manifest, ep)))
        return RestoreSources(self._copies, positions)

    def rank_key(self, crossing_before: int = 0) -> tuple[Any, ...]:
        """How options are ranked (smaller first; see the module doc); ``crossing_before``: the old layout's
        bandwidth groups spanning nodes (an option is not penalized for those)."""
        return (
            bool(self.missing),
            self.crossing > crossing_before,
            self.restore_bytes,
            -self.used,
            self.rebuilt_groups,
        )

    def to_dict(self, moves: bool = True) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "notes": list(self.notes),
            "layout": self.layout.to_dict(),
            "spec": "+".join(str(plan.spec) for plan in self.layout.shards),
            "world_size": self.layout.world_size,
            "used": self.used,
            "released": list(self.renumbering.released),
            "replaced": list(self.renumbering.replaced),
            "moved": len(self.moves),
            "needing_weights": sum(move.needs_weights for move in self.moves),
            "restore_bytes": self.restore_bytes,
            "groups": {"kept": self.kept_groups, "rebuilt": self.rebuilt_groups, "crossing_nodes": self.crossing},
            "fates": [fate.to_dict() for fate in self.fates],
            "missing": [proof.to_dict() for proof in self.missing],
            **({"moves": [move.to_dict() for move in self.moves]} if moves else {}),
        }


@dataclass(frozen=True)
class ReplanResult:
    """The ranked options for one loss.

    Attributes:
        old: The old layout.
        manifest: The model every shard holds.
        renumbering: The loss itself: lost ranks and added ranks (no option's releases).
        options: Best first (``ReplanOption.rank_key``).
        seconds: Wall time of the replan.
    """

    old: Layout
    manifest: Manifest
    renumbering: Renumbering
    options: tuple[ReplanOption, ...]
    seconds: float

    @property
    def best(self) -> ReplanOption:
        return self.options[0]

    def to_dict(self, moves: bool = True) -> dict[str, Any]:
        return {
            "old": self.old.to_dict(),
            "model": self.manifest.name,
            "lost": list(self.renumbering.lost),
            "added": self.renumbering.added,
            "seconds": self.seconds,
            "options": [option.to_dict(moves) for option in self.options],
        }


def _restore_bytes(layout: Layout, moves: tuple[RankMove, ...], footprint: Footprint) -> int:
    """What the ranks that need weights hold in the new layout, in bytes."""
    total = 0
    for plan in layout.shards:
        held = {(c.stage, c.ep_rank): c.held_bytes(plan.spec) for c in footprint.classes(plan.spec)}
        for move in moves:
            if move.new_shard == plan.index and move.needs_weights:
                total += held[plan.decoder_grid.coords(move.new)["pp"], plan.expert_grid.coords(move.new)["ep"]]
    return total


def _evaluate(
    old: Layout,
    base: Renumbering,
    proposal: Proposal,
    manifest: Manifest,
    footprint: Footprint,
    ranks_per_node: int | None,
) -> ReplanOption:
    """A proposal's new layout and everything it does to the old one."""
    renumbering = base.with_released(proposal.released).with_replaced(proposal.replaced)
    layout = plan_layout(
        renumbering.new_world,
        proposal.specs,
        order=old.order,
        rank_offset=renumbering.survivors_below(old.rank_offset),
        allow_idle=True,
    )
    moves = tuple(move for plan in layout.shards for move in rank_moves(old, plan, renumbering, manifest))
    fates = tuple(fate for plan in layout.shards for fate in group_fates(old, plan, renumbering, ranks_per_node))
    copies = Copies(old, manifest, renumbering)
    return ReplanOption(
        proposal.kind,
        proposal.notes,
        layout,
        renumbering,
        moves,
        fates,
        copies.missing(),
        _restore_bytes(layout, moves, footprint),
        copies,
    )


def _loss(old: Layout, lost: Collection[int], world_size: int | None) -> Renumbering:
    """The lost ranks and added ranks, from lost ranks and/or the new world size.

    Raises:
        LayoutError: a lost rank outside the world, a world size smaller than the survivors, or every rank lost.
    """
    if isinstance(lost, (str, bytes)) or not isinstance(lost, Collection):
        raise LayoutError(f"lost={shown(lost)}: expected a collection of ranks")
    for rank in lost:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < old.world_size:
            raise LayoutError(
                f"lost rank {shown(rank)} is outside the world [0, {old.world_size}): name ranks of the old world"
            )
    gone = tuple(sorted(set(lost)))
    added = 0
    if world_size is not None:
        check_count("world_size", world_size)
        survivors = old.world_size - len(gone)
        if not gone and world_size < old.world_size:
            gone = tuple(range(world_size, old.world_size))  # a smaller world loses its last ranks
        elif world_size < survivors:
            raise LayoutError(
                f"world_size={world_size} is less than the {survivors} survivors of losing {len(gone)} ranks: "
                f"name every lost rank, or give world_size {survivors} or more"
            )
        else:
            added = world_size - survivors
    if len(gone) == old.world_size:
        raise NoLayoutError(f"every one of the {old.world_size} ranks is lost: there is nothing to re-lay out")
    return Renumbering(old.world_size, gone, (), added)


def _no_layout(
    old: Layout, base: Renumbering, failed: list[str], constraints: Constraints, footprint: Footprint
) -> NoLayoutError:
    """Why no option exists, and the nearest layout with one constraint relaxed."""
    nearest = []
    if constraints.keep:
        found, _ = proposals(old, base, replace(constraints, keep=frozenset()))
        if found:
            nearest.append(f"without keep ({found[0].kind}: {'+'.join(map(str, found[0].specs))})")
    if math.isfinite(constraints.memory):
        found, _ = proposals(old, base, replace(constraints, memory=math.inf))
        if found:
            need = max(constraints.memory_of(spec) for spec in found[0].specs)
            nearest.append(
                f"with {format_bytes(need)} per rank ({found[0].kind}: {'+'.join(map(str, found[0].specs))})"
            )
    short = old.rank_offset + sum(plan.size for plan in old.shards) - base.new_world
    if short > 0:
        more = "1 more rank" if short == 1 else f"{short} more ranks"
        nearest.append(f"with {more} (world_size {base.new_world + short}) every shard keeps its spec")
    what = f"losing {named_ranks(base.lost)}" if base.lost else f"a world of {base.new_world}"
    reasons = "; ".join(failed[:4])
    closest = "; nearest: " + "; or ".join(nearest) if nearest else ""
    return NoLayoutError(f"no layout survives {what}: {reasons}{closest}")


def replan(
    layout: Layout,
    manifest: Manifest,
    *,
    lost: Collection[int] = (),
    world_size: int | None = None,
    memory_bytes: float | None = None,
    ranks_per_node: int | None = None,
    keep: Collection[int] = (),
    train_bytes_per_param: float = DEFAULT_TRAIN_BYTES_PER_PARAM,
) -> ReplanResult:
    """The new layouts possible after losing ``lost`` (or moving to a world of ``world_size``), ranked.

    Survivors keep their order in the new world (new rank = old rank minus the ranks gone below it); added
    ranks come last. Every shard keeps its role and name and must be a valid layout the model splits over,
    within ``memory_bytes`` per rank. Every shard holds the manifest's model.

    Args:
        layout: The old layout.
        manifest: The model (its conversions, if any, are dropped: the survivors hold each tensor in its own dtype).
        lost: Old ranks that are gone.
        world_size: The new world's size instead (or as well): with no lost ranks, a smaller world loses
            its last ranks; a larger one than the survivors gains ranks at the end.
        memory_bytes: Memory per rank (None: no limit): for a shard's weights, and for a train shard's weights,
            gradients and optimizer state (``train_bytes_per_param``).
        ranks_per_node: Node size: groups spanning physical nodes are counted (and ranked against).
        keep: Indices of shards that must keep their spec.
        train_bytes_per_param: What a rank of a train shard holds per parameter (default 16, mixed-precision
            Adam: bf16 weights 2 + fp32 master weights 4 + Adam's moments 8 + bf16 gradients 2); what
            ``memory_bytes`` must hold of a train shard.

    Raises:
        LayoutError: a lost rank outside the world, a bad world size, node size, memory, bytes per parameter or
            shard index.
        NoLayoutError: every rank lost, or no option: naming what cannot be met and the nearest layout with
            one constraint relaxed (no kept shards, more memory, more ranks).
        ManifestError: the model does not split over an old shard.
    """
    started = time.perf_counter()
    if not isinstance(layout, Layout):
        raise LayoutError(f"layout must be a shardcore Layout; got {type(layout).__name__}")
    if not isinstance(manifest, Manifest):
        raise RefitError(f"manifest must be a shardcore.refit.Manifest; got {type(manifest).__name__}")
    manifest = manifest.as_held()  # a converting refit's dtypes are not what the survivors hold
    base = _loss(layout, lost, world_size)
    if ranks_per_node is not None:
        check_count("ranks_per_node", ranks_per_node)
    if memory_bytes is not None and (
        isinstance(memory_bytes, bool) or not isinstance(memory_bytes, (int, float)) or not memory_bytes > 0
    ):
        raise LayoutError(f"memory_bytes={shown(memory_bytes)}: expected a positive number of bytes per rank")
    if (
        isinstance(train_bytes_per_param, bool)
        or not isinstance(train_bytes_per_param, (int, float))
        or not 0 < train_bytes_per_param < math.inf
    ):
        raise LayoutError(
            f"train_bytes_per_param={shown(train_bytes_per_param)}: expected a positive number of bytes, e.g. 16 "
            "for mixed-precision Adam"
        )
    kept = frozenset(keep) if isinstance(keep, Collection) and not isinstance(keep, str) else None
    if kept is None or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(layout.shards) for i in kept
    ):
        raise LayoutError(f"keep={shown(keep)}: expected shard indices from 0 to {len(layout.shards) - 1}")
    for plan in layout.shards:
        check_fits(manifest, plan)
    footprint = Footprint(manifest)
    memory = math.inf if memory_bytes is None else memory_bytes
    axes = footprint.axes(check_axes(AXES))
    constraints = Constraints(footprint, memory, kept, resolve_order(layout.order), axes, train_bytes_per_param)
    found, failed = proposals(layout, base, constraints)
    if not found:
        raise _no_layout(layout, base, failed, constraints, footprint)
    before = 0 if ranks_per_node is None else sum(f.crossing for f in check_topology(layout, ranks_per_node).warnings)
    options = sorted(
        (_evaluate(layout, base, proposal, manifest, footprint, ranks_per_node) for proposal in found),
        key=lambda option: option.rank_key(before),
    )
    return ReplanResult(layout, manifest, base, tuple(options), time.perf_counter() - started)


__all__ = ["ReplanOption", "ReplanResult", "replan"]
