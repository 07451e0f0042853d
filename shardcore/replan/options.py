"""Candidate new layouts after a loss: a spec per shard (same roles, same order) and the survivors released.

Five kinds, each cheap to propose (``shardcore.replan.replan`` evaluates and ranks them):

- **shrink**: each shard that lost ranks drops the whole replicas holding them: the blocks of dp that
  are also whole blocks of expt_dp (lcm(tp*cp, expt_tp*ep) ranks per stage), on every stage. Its other
  ranks keep their weights and coordinates; the rest of those blocks is released;
- **relayout**: each shard that lost ranks takes the largest valid spec its surviving ranks can hold
  (``shardcore.plan.valid_specs``, filtered by the model's split and the memory; tp, cp and expt_tp no
  larger than before), the closest to its old spec first; the surplus is released;
- **shift**: every shard keeps its spec, the windows close over the gap (every shard after the loss
  moves down), possible when the survivors and added ranks can hold them all;
- **replace**: every shard keeps its spec and every survivor its rank: added ranks take the lost ranks'
  places (``Renumbering.replaced``), so only they need weights, and no group moves to another node;
  possible when at least as many ranks are added as were lost;
- **borrow**: a shard named in ``keep`` that lost ranks keeps its spec by taking the places of ranks another
  shard gives up: that shard drops whole dp replicas (as shrink does) from its end, and every window between
  them closes over the gap, as shift does;
- **grow**: any of the above, with the last shard grown into the idle and added ranks at the end.

A proposal's kind says what it did: ``shrink+relayout`` when a shard that could not shrink (one replica
left) was re-laid out, ``keep`` when nothing was lost.

Shards that lost nothing keep their spec and processes in every kind but shift. A shard named in
``keep`` may not change its spec: only shift can keep it when it lost ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from math import lcm

from ..plan.arguments import counted
from ..plan.choices import valid_specs
from ..plan.layout import Layout, Order, ShardPlan
from ..plan.spec import ShardSpec
from ..refit.footprint import Footprint
from .renumbering import Renumbering

RELAYOUT_SIZES = 1024
"""How many sizes below its survivors a relayout looks through for one with a spec that fits."""


DEFAULT_TRAIN_BYTES_PER_PARAM = 16.0
"""What a training rank holds per parameter with mixed-precision Adam: bf16 weights 2, fp32 master weights 4,
Adam's two fp32 moments 8, bf16 gradients 2 (activations not counted)."""


@dataclass(frozen=True)
class Constraints:
    """What every new shard must satisfy: the model splits over it, its memory fits, kept shards keep their spec.

    A shard of role ``train`` holds its gradients and optimizer state too: ``train_bytes_per_param`` bytes per
    parameter of its weights (``memory_of``)."""

    footprint: Footprint
    memory: float
    keep: frozenset[int]
    order: Order
    axes: dict[str, int]
    """The axes a new spec may vary (``Footprint.axes``: ep and expt_tp only for a model with experts)."""
    train_bytes_per_param: float = DEFAULT_TRAIN_BYTES_PER_PARAM

    @cached_property
    def weight_bytes_per_param(self) -> float:
        """The model's weight bytes per parameter (scale tensors not counted), read from the manifest once:
        ``memory_of`` asks for it per candidate spec (tens of thousands in a large replan), and a large model's
        manifest holds tens of thousands of tensors (DeepSeek-V3: about 30,000)."""
        manifest = self.footprint.manifest
        return manifest.nbytes / max(1, sum(t.numel for t in manifest if t.scale_of is None))

    def memory_of(self, spec: ShardSpec) -> float:
        """The most memory a rank of a shard of ``spec`` needs: its weights, and for a train shard its weights'
        parameters times ``train_bytes_per_param`` (weights, master weights, gradients, optimizer state)."""
        weights = self.footprint.weight_bytes(spec)
        if spec.role != "train":
            return weights
        return weights / self.weight_bytes_per_param * self.train_bytes_per_param

    def admits(self, spec: ShardSpec) -> bool:
        return self.footprint.fits(spec) is None and self.memory_of(spec) <= self.memory


@dataclass(frozen=True)
class Proposal:
    """A candidate: the new spec of every shard (in the old order), the survivors released, and what was done."""

    kind: str
    specs: tuple[ShardSpec, ...]
    released: tuple[int, ...]
    notes: tuple[str, ...]
    replaced: tuple[int, ...] = ()
    """Lost ranks whose places added ranks take (replace)."""


def _closeness(old: ShardSpec, spec: ShardSpec, constraints: Constraints) -> tuple[int, ...]:
    """Sort key: fewer changed axes first (tp, then pp, the costliest to change), then smaller weights."""
    changed = [getattr(old, axis) != getattr(spec, axis) for axis in ("tp", "pp", "ep", "expt_tp", "cp")]
    return (sum(changed), *changed, constraints.footprint.weight_bytes(spec))


def _replica_block(spec: ShardSpec) -> int:
    """The dp coordinates of the smallest block of whole dp replicas that is also a block of whole expt_dp
    replicas (lcm(tp*cp, expt_tp*ep) ranks per stage): what shrink and borrow drop at a time, so that every
    replica left, dense or expert, is whole."""
    return lcm(spec.tp * spec.cp, spec.expt_tp * spec.ep) // (spec.tp * spec.cp)


def shrink(plan: ShardPlan, lost: Sequence[int], constraints: Constraints) -> tuple[ShardSpec, list[int]] | None:
    """Drop the replica blocks holding ``lost``: (the new spec, the ranks released), or None when no replica
    would remain (or the spec does not fit the constraints)."""
    spec, grid = plan.spec, plan.decoder_grid
    block = _replica_block(spec)
    stride = grid.stride_of("dp")

    def block_of(rank: int) -> int:
        return (rank - plan.rank_offset) // stride % spec.dp // block

    touched = {block_of(rank) for rank in lost}
    dp = spec.dp - len(touched) * block
    if dp < 1 or not constraints.admits(spec):
        return None
    gone = set(lost)
    released = [rank for rank in plan.ranks if block_of(rank) in touched and rank not in gone]
    return replace(spec, dp=dp), released


def relayout(spec: ShardSpec, ranks: int, constraints: Constraints, above: int = 0) -> ShardSpec | None:
    """The spec closest to ``spec`` among those of the largest size in (above, ranks] that fit, or None.

    tp, cp and expt_tp stay at most what ``spec`` had (their groups were sized for a node, and each size of
    a large shard has tens of thousands of specs otherwise); pp, dp and ep are free.
    """
    limits = dict(constraints.axes)
    for axis in ("tp", "cp", "expt_tp"):
        if axis in limits:
            limits[axis] = min(limits[axis], getattr(spec, axis))
    for size in range(ranks, max(above, ranks - RELAYOUT_SIZES), -1):
        fits = [
            s
            for s in valid_specs(size, order=constraints.order, axes=limits, role=spec.role, name=spec.name)
            if constraints.admits(s)
        ]
        if fits:
            return min(fits, key=lambda s: _closeness(spec, s, constraints))
    return None


def _rework(
    kind: str, plan: ShardPlan, gone: Sequence[int], constraints: Constraints
) -> tuple[str, ShardSpec, list[int], str] | str:
    """How a shard that lost ``gone`` is reworked in place: (what was done, the new spec, the ranks released,
    a note), or why it cannot be. A relayout that would hold no more ranks than shrinking shrinks."""
    where = f"shard {plan.index} ('{plan.spec}') lost {len(gone)} of {plan.size} ranks"
    if plan.index in constraints.keep:
        return f"{kind}: {where} and must keep its spec"
    dropped = shrink(plan, gone, constraints)
    chosen = None
    if kind == "relayout" or dropped is None:
        lost = set(gone)
        survivors = [rank for rank in plan.ranks if rank not in lost]
        chosen = relayout(plan.spec, len(survivors), constraints, dropped[0].world_size if dropped else 0)
        if chosen is not None:
            on = counted(chosen.world_size, "survivor")
            freed = survivors[chosen.world_size :]
            return "relayout", chosen, freed, f"{where}: re-laid out as '{chosen}' on {on}, releases {len(freed)}"
    if dropped is None:
        return f"{kind}: {where}; no spec of at most {plan.size - len(gone)} ranks fits"
    spec, freed = dropped
    replicas = counted(plan.spec.dp - spec.dp, "dp replica")
    return "shrink", spec, freed, f"{where}: drops {replicas} -> '{spec}', releases {len(freed)}"


def _in_place(
    kind: str, old: Layout, base: Renumbering, constraints: Constraints, failed: list[str]
) -> Proposal | None:
    """Shrink or relayout every shard that lost ranks, each within its own window; None, with the reason in
    ``failed``, when a shard can do neither."""
    specs, released, notes, done = [], [], [], set()
    for plan in old.shards:
        gone = base.lost_within(plan.ranks)
        if not gone:
            specs.append(plan.spec)
            continue
        reworked = _rework(kind, plan, gone, constraints)
        if isinstance(reworked, str):
            failed.append(reworked)
            return None
        what, spec, freed, note = reworked
        specs.append(spec)
        released += freed
        notes.append(note)
        done.add(what)
    named = "+".join(name for name in ("shrink", "relayout") if name in done) or "keep"
    return Proposal(named, tuple(specs), tuple(released), tuple(notes))


def _grown(proposal: Proposal, spare: int, constraints: Constraints) -> Proposal | None:
    """``proposal`` with its last shard grown into ``spare`` idle ranks at the end, or None when it cannot."""
    last, index = proposal.specs[-1], len(proposal.specs) - 1
    if spare < 1 or index in constraints.keep:
        return None
    grown = relayout(last, last.world_size + spare, constraints, above=last.world_size)
    if grown is None:
        return None
    note = f"shard {index} grows into {grown.world_size - last.world_size} of {spare} idle ranks: '{last}' -> '{grown}'"
    return replace(
        proposal, kind=f"{proposal.kind}+grow", specs=(*proposal.specs[:-1], grown), notes=(*proposal.notes, note)
    )


def _borrowed(old: Layout, base: Renumbering, constraints: Constraints, failed: list[str]) -> list[Proposal]:
    """Keep the kept shard that lost ranks whole by shrinking another (each other one in turn, nearest first):
    the lender drops as few whole replica blocks as cover the loss, and gives the ranks at its edge nearest the
    kept shard to it (the windows in between close over the gap); ranks it drops beyond the loss are released."""
    needy = [plan for plan in old.shards if plan.index in constraints.keep and base.lost_within(plan.ranks)]
    if len(needy) != 1 or base.added:
        return []  # nothing to make whole, more than one kept shard to, or added ranks that shift or replace can use
    keeper = needy[0]
    short = len(base.lost_within(keeper.ranks))
    found = []
    for lender in sorted(old.shards, key=lambda plan: abs(plan.index - keeper.index)):
        if lender is keeper or lender.index in constraints.keep or base.lost_within(lender.ranks):
            continue
        lent = _lend(lender, short, lender.index > keeper.index, constraints)
        if lent is None:
            failed.append(f"borrow: shard {lender.index} ('{lender.spec}') cannot give {short} ranks and still fit")
            continue
        spec, freed = lent
        specs = tuple(spec if plan is lender else plan.spec for plan in old.shards)
        note = (
            f"shard {keeper.index} ('{keeper.spec}') keeps its spec on {counted(short, 'rank')} shard {lender.index} "
            f"gives up: '{lender.spec}' -> '{spec}'" + (f", releases {len(freed)}" if freed else "")
        )
        found.append(Proposal("borrow", specs, tuple(freed), (note,)))
    return found


def _lend(plan: ShardPlan, short: int, after: bool, constraints: Constraints) -> tuple[ShardSpec, list[int]] | None:
    """``plan`` less the fewest whole replica blocks holding ``short`` ranks: (its new spec, the ranks released),
    or None when no replica would remain or the spec does not fit. It gives its first ``short`` ranks (``after``:
    it lies after the kept shard) or its last, and releases the next ones it drops."""
    spec = plan.spec
    block = _replica_block(spec)
    per_block = spec.world_size // spec.dp * block
    blocks = -(-short // per_block)
    dp = spec.dp - blocks * block
    smaller = replace(spec, dp=dp) if dp >= 1 else None
    if smaller is None or not constraints.admits(smaller):
        return None
    dropped, ranks = blocks * per_block, plan.ranks
    freed = ranks[short:dropped] if after else ranks[plan.size - dropped : plan.size - short]
    return smaller, list(freed)


def proposals(old: Layout, base: Renumbering, constraints: Constraints) -> tuple[list[Proposal], list[str]]:
    """Every candidate for losing ``base.lost`` (and gaining ``base.added``), and why the other kinds failed."""
    head = base.survivors_below(old.rank_offset)
    found: list[Proposal] = []
    failed: list[str] = []
    for kind in ("shrink", "relayout"):
        proposal = _in_place(kind, old, base, constraints, failed)
        if proposal is not None and all(proposal.specs != other.specs for other in found):
            found.append(proposal)
    specs = tuple(plan.spec for plan in old.shards)
    needed = head + sum(spec.world_size for spec in specs)
    if any(proposal.specs == specs and not proposal.released for proposal in found):
        pass  # nothing to close over (no shard lost a rank): shift is the layout already found
    elif needed <= base.new_world:
        found.append(Proposal("shift", specs, (), ("every shard keeps its spec; the windows close over the gap",)))
    else:
        failed.append(f"shift: the shards need {needed} ranks, the new world has {base.new_world}")
    if base.lost and base.added >= len(base.lost):
        note = (
            f"every shard keeps its spec and every survivor its rank: {len(base.lost)} added ranks take the lost places"
        )
        found.append(Proposal("replace", specs, (), (note,), base.lost))
    elif base.lost and base.added:
        failed.append(f"replace: {len(base.lost)} ranks lost, only {base.added} added to take their places")
    found += _borrowed(old, base, constraints, failed)
    for proposal in list(found):
        start = base.with_replaced(proposal.replaced).survivors_below(old.rank_offset)
        spare = base.new_world - len(proposal.released) - start - sum(spec.world_size for spec in proposal.specs)
        grown = _grown(proposal, spare, constraints)
        if grown is not None:
            found.append(grown)
    return found, failed


__all__ = ["Constraints", "Proposal", "proposals", "relayout", "shrink"]
