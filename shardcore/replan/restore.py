"""The restore refit: the weights of the ranks that move come back from what the survivors hold.

The source is every old shard's placement restricted to its survivors, under their new ranks
(``Placement.restrict``), joined into one side (``UnionPlacement``): a new shard may take a slice from
any old shard, since every shard holds the whole model. The old shards that the moving ranks come
from are preferred where copies lie differently, so that a rank still holding part of what it needs
copies it locally. The destinations are the new shards, each restricted to its ranks that need
weights: a rank that keeps its weights keeps its tensors and receives nothing. One ``RefitPlan`` from
the one planner covers every new shard; a part of a tensor with no surviving copy fails before any
plan is made, naming the tensor and the lost ranks that held it.
"""

from __future__ import annotations

from collections import Counter

from ..errors import LostWeightsError, RefitError
from ..refit.placement import ShardPlacement, UnionPlacement
from ..refit.plan import DEFAULT_MIN_PIECE_BYTES, RefitPlan
from ..refit.planner import plan_refit_from
from .renumbering import format_ranks
from .replan import ReplanOption

SHOWN_PROOFS = 3
"""Missing parts named in a LostWeightsError; the rest are counted."""


def _lost_weights(option: ReplanOption) -> LostWeightsError:
    """The proof that the option cannot be restored from the survivors, short whatever the model."""
    missing = option.missing
    lost = sorted({rank for proof in missing for rank in proof.lost})
    shown = "; ".join(proof.describe()[:300] for proof in missing[:SHOWN_PROOFS])
    more = f"; and {len(missing) - SHOWN_PROOFS} more parts" if len(missing) > SHOWN_PROOFS else ""
    spec = "+".join(str(plan.spec) for plan in option.layout.shards)
    return LostWeightsError(
        f"cannot restore the weights of {option.kind} '{spec[:200]}' from the survivors: {shown}{more}; load them "
        f"from a checkpoint, or choose an option that keeps the ranks that held them (lost: {format_ranks(lost)})",
        lost,
    )


def restore_plan(option: ReplanOption, *, min_piece_bytes: int = DEFAULT_MIN_PIECE_BYTES) -> RefitPlan:
    """The refit that gives every rank of ``option``'s new layout that needs weights its new tensors, from the
    survivors' old ones, in the new world (ranks numbered as ``option.renumbering`` says).

    Every rank of the new world executes it (``shardcore.execute_refit``): its sources are the local tensors
    it held in the old layout; its destinations, when it needs weights, its tensors in the new layout.

    Args:
        option: A replan option (``shardcore.replan.replan(...).options``).
        min_piece_bytes: Do not split a piece across replicas below this size (the planner's option).

    Returns:
        A lazy RefitPlan over the new world (``source_placement``: the survivors of every old shard;
        ``destination_placements``: per new shard, its ranks that need weights, possibly none).

    Raises:
        LostWeightsError: part of a tensor has no surviving copy, naming the tensor, the part and the lost
            ranks that held it (``option.missing``); nothing is planned.
        RefitError: ``option`` is not a ReplanOption, or a bad ``min_piece_bytes``.
    """
    if not isinstance(option, ReplanOption):
        raise RefitError(
            f"option={type(option).__name__}: expected a ReplanOption (shardcore.replan.replan(...).options)"
        )
    if option.missing:
        raise _lost_weights(option)
    numbering, manifest = option.renumbering, option.manifest
    supplies = Counter(move.old_shard for move in option.moves if move.needs_weights)
    preferred = sorted(option.old.shards, key=lambda plan: (-supplies[plan.index], plan.index))
    parts = []
    for plan in preferred:
        survivors = {old: new for old in plan.ranks if (new := numbering.new_of(old)) is not None}
        parts.append(ShardPlacement(plan, manifest).restrict(survivors))
    source = UnionPlacement(parts, label=f"the survivors of {len(option.old.shards)} old shards")
    destinations = [
        ShardPlacement(plan, manifest).restrict({move.new: move.new for move in option.needing_weights(plan.index)})
        for plan in option.layout.shards
    ]
    return plan_refit_from(source, destinations, min_piece_bytes=min_piece_bytes, world_size=option.layout.world_size)


__all__ = ["restore_plan"]
