"""Which survivors hold which part of each tensor, and, for a part none holds, the proof.

Every shard of a layout holds the whole model (one manifest), each split its own way, so a slice a new
shard needs can come from any old shard: from a replica of the same slice, or from pieces of other
shards' slices that cover it. A part of a tensor has no surviving copy exactly when every old rank
holding it, in every old shard, is gone; ``MissingCopy`` names the tensor, the part and those ranks.

The search for missing parts starts from the gone ranks: only a slice that a gone rank held can have lost
all its holders, and ranks holding the same weights (``holdings_key``) are looked at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..plan.layout import Layout, ShardPlan
from ..refit.boxes import Box, Holding
from ..refit.holdings import ep_owner, holders, holdings, stages_of, tp_parts, tp_size
from ..refit.manifest import Manifest, TensorSpec
from .fate import holdings_key
from .renumbering import Renumbering, format_ranks, named_ranks

Interval = tuple[int, int]
"""[start, stop) along a tensor's split dim (the whole dim for an unsplit tensor)."""


@dataclass(frozen=True)
class SurvivingCopy:
    """One old shard's slice of one tensor, and the survivors holding it: a source for the restore refit.

    Attributes:
        tensor: The tensor's name.
        old_shard: The old shard the slice belongs to.
        slice: Its tp (expt_tp for an expert) index in that shard.
        boxes: The global boxes the slice holds, each with where it starts in a holder's local tensor
            (``shardcore.refit.holdings``' form).
        ranks: The survivors holding it, as new ranks, ascending.
        old_ranks: The same survivors' old ranks.
    """

    tensor: str
    old_shard: int
    slice: int
    boxes: tuple[Holding, ...]
    ranks: tuple[int, ...]
    old_ranks: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "old_shard": self.old_shard,
            "slice": self.slice,
            "boxes": [[list(pair) for pair in box] for box, _ in self.boxes],
            "ranks": list(self.ranks),
        }


@dataclass(frozen=True)
class MissingCopy:
    """A part of a tensor that no survivor holds, and every old rank that held it (all gone).

    Attributes:
        tensor: The tensor's name.
        box: The part, as a global box ([start, stop) per dim).
        lost: The old ranks that held it and were lost.
        released: The old ranks that held it and that the option releases.
    """

    tensor: str
    box: Box
    lost: tuple[int, ...]
    released: tuple[int, ...]

    def describe(self) -> str:
        """One line: the tensor, the part and the ranks that held it."""
        box = "[" + ", ".join(f"{a}:{b}" for a, b in self.box) + "]"
        released = f"; released by this option: {format_ranks(self.released)}" if self.released else ""
        return f"{self.tensor} {box}: no surviving copy; held only by lost {named_ranks(self.lost)}{released}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "box": [list(pair) for pair in self.box],
            "lost": list(self.lost),
            "released": list(self.released),
        }


def _intervals(tensor: TensorSpec, plan: ShardPlan, index: int) -> list[Interval]:
    """What slice ``index`` of ``plan`` covers of ``tensor``'s split dim (the whole dim when unsplit)."""
    if tensor.tp_dim is None:
        return [(0, tensor.shape[0])]
    return [(piece.start, piece.stop) for piece in tp_parts(tensor.blocks, tp_size(tensor, plan), index)]


def _subtract(intervals: Iterable[Interval], covered: Iterable[Interval]) -> list[Interval]:
    """``intervals`` minus the union of ``covered``."""
    cuts = sorted(covered)
    out = []
    for start, stop in intervals:
        for low, high in cuts:
            if high <= start or low >= stop:
                continue
            if low > start:
                out.append((start, low))
            start = max(start, high)
            if start >= stop:
                break
        if start < stop:
            out.append((start, stop))
    return out


class Copies:
    """The old layout's holdings of one manifest, seen through one renumbering.

    Args:
        old: The old layout (every shard holds the manifest's model).
        manifest: The model.
        renumbering: Which old ranks are gone, and the new ranks of the others.
    """

    def __init__(self, old: Layout, manifest: Manifest, renumbering: Renumbering) -> None:
        self.old, self.manifest, self.renumbering = old, manifest, renumbering
        self._sets: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
        self._kinds: dict[int, dict[tuple[Any, ...], list[int]]] = {}

    def _kind(self, plan: ShardPlan, tensor: TensorSpec) -> tuple[Any, ...]:
        """What fixes a tensor's holder sets in ``plan``: its expert owner, its stages, whether it is split."""
        owner = -1 if tensor.expert is None else ep_owner(tensor, plan, self.manifest)
        return (owner, stages_of(tensor, plan, self.manifest), tensor.tp_dim is not None)

    def kinds(self, plan: ShardPlan) -> dict[tuple[Any, ...], list[int]]:
        """The manifest's tensor positions by ``_kind`` in old shard ``plan`` (computed once per shard)."""
        if plan.index not in self._kinds:
            kinds: dict[tuple[Any, ...], list[int]] = {}
            for position, tensor in enumerate(self.manifest.tensors):
                kinds.setdefault(self._kind(plan, tensor), []).append(position)
            self._kinds[plan.index] = kinds
        return self._kinds[plan.index]

    def holder_set(
        self, plan: ShardPlan, tensor: TensorSpec, index: int
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(every old holder, the surviving ones, their new ranks) of slice ``index`` of ``tensor`` in old
        shard ``plan``; cached by what fixes it, so tensors alike share one (and its tuples)."""
        key = (plan.index, *self._kind(plan, tensor), index)
        found = self._sets.get(key)
        if found is None:
            every = holders(tensor, plan, self.manifest, index)
            alive = tuple(r for r in every if not self.renumbering.is_gone(r))
            new = tuple(rank for rank in map(self.renumbering.new_of, alive) if rank is not None)  # each has one
            found = self._sets[key] = (every, alive, new)
        return found

    def surviving(self, tensor: TensorSpec) -> tuple[SurvivingCopy, ...]:
        """Every old shard's slices of ``tensor`` that a survivor holds, with the survivors (new ranks)."""
        out = []
        for plan in self.old.shards:
            for index in range(tp_size(tensor, plan)):
                _, alive, new = self.holder_set(plan, tensor, index)
                if alive:
                    boxes = holdings(tensor, plan, alive[0], self.manifest)
                    out.append(SurvivingCopy(tensor.name, plan.index, index, boxes, new, alive))
        return tuple(out)

    def _lost_slices(self) -> set[tuple[int, int, int]]:
        """(tensor position, old shard, slice) of every slice whose holders are all gone: for each kind of
        tensor a gone rank holds, one holder set is looked at (ranks alike once)."""
        found: set[tuple[int, int, int]] = set()
        seen: set[tuple[Any, ...]] = set()
        for rank in self.renumbering.gone:
            plan = self.old.shard_of(rank)
            if plan is None or (plan.index, holdings_key(plan, rank, self.manifest)) in seen:
                continue
            seen.add((plan.index, holdings_key(plan, rank, self.manifest)))
            dense, expert = plan.decoder_grid.coords(rank), plan.expert_grid.coords(rank)
            for (owner, stages, split), positions in self.kinds(plan).items():
                if dense["pp"] not in stages or owner not in (-1, expert["ep"]):
                    continue
                index = (dense["tp"] if owner == -1 else expert["expt_tp"]) if split else 0
                if not self.holder_set(plan, self.manifest.tensors[positions[0]], index)[1]:
                    found.update((position, plan.index, index) for position in positions)
        return found

    def missing(self) -> tuple[MissingCopy, ...]:
        """Every part of a tensor no survivor holds, with the ranks that held it; in manifest order, then by box."""
        proofs: dict[tuple[str, Box], MissingCopy] = {}
        for position, shard, index in sorted(self._lost_slices()):
            tensor = self.manifest.tensors[position]
            alive = [
                interval
                for plan in self.old.shards
                for other in range(tp_size(tensor, plan))
                if self.holder_set(plan, tensor, other)[1]
                for interval in _intervals(tensor, plan, other)
            ]
            for start, stop in _subtract(_intervals(tensor, self.old.shards[shard], index), alive):
                proof = self._proof(tensor, start, stop)
                proofs.setdefault((proof.tensor, proof.box), proof)
        return tuple(proofs[key] for key in sorted(proofs, key=lambda key: (self.manifest.index(key[0]), key[1])))

    def _proof(self, tensor: TensorSpec, start: int, stop: int) -> MissingCopy:
        """The ranks, in every old shard, that held [start, stop) of ``tensor``'s split dim."""
        held: set[int] = set()
        for plan in self.old.shards:
            for index in range(tp_size(tensor, plan)):
                if any(low < stop and start < high for low, high in _intervals(tensor, plan, index)):
                    held.update(self.holder_set(plan, tensor, index)[0])
        dim = 0 if tensor.tp_dim is None else tensor.tp_dim
        box = tuple((start, stop) if d == dim else (0, size) for d, size in enumerate(tensor.shape))
        lost = set(self.renumbering.lost)
        return MissingCopy(tensor.name, box, tuple(sorted(held & lost)), tuple(sorted(held - lost)))


class RestoreSources(Mapping[str, tuple[SurvivingCopy, ...]]):
    """Tensor name -> every surviving copy of it, for the tensors one new shard's moving ranks need; each
    value computed when asked for (a shard of a large model needs tens of thousands of tensors)."""

    def __init__(self, copies: Copies, positions: Iterable[int]) -> None:
        self._copies = copies
        self._tensors = {copies.manifest.tensors[p].name: copies.manifest.tensors[p] for p in sorted(positions)}

    def __getitem__(self, name: str) -> tuple[SurvivingCopy, ...]:
        return self._copies.surviving(self._tensors[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


__all__ = ["Copies", "MissingCopy", "RestoreSources", "SurvivingCopy"]
