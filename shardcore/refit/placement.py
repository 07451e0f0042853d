"""What one side of a refit holds: a *placement* (a shard's by the index math of ``holdings.py``).

A placement answers, for one side of a refit (the source, or one destination), two questions:
for a tensor, its *slices* (dense global boxes, each held whole by a set of ranks and starting at
the same offset in each holder's local tensor), and for a rank, the tensors it holds, with their
local shapes and its slices of each. A tensor's slices on one side never overlap, so every element
has one holder set; that is all the planner needs (``plan.py``). Three kinds:

- ``ShardPlacement``: a ``ShardPlan`` and a ``Manifest``, by Megatron's conventions (``holdings.py``). Dense tensors
  live on the decoder grid: split over tp, replicated over cp and dp. Expert tensors live on the
  expert grid: owned by one ep rank, split over expt_tp, replicated over expt_dp. Both sit on the
  pipeline stage(s) of their layer or placement. A rank's local tensor is the concatenation, along
  ``tp_dim``, of its slice of every packed block (Megatron's layout of SwiGLU's [gate_r; up_r]).
  Lazy: a tensor's slices, or a rank's holdings, cost only those.
- ``ExplicitPlacement``: built from records (tensor, rank, box, local offset), such as the
  placements of a DTensor state dict give; checked to tile every tensor it names.
- ``placement.restrict(renumber)``: the same holdings on some ranks only, renumbered (the survivors
  of a failure, in a new world); a tensor may then have elements nobody holds.
- ``UnionPlacement(parts)``: several placements on disjoint ranks as one side (the survivors of every
  old shard, the source of a restore refit), each element still with one holder set.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from math import prod
from typing import Any, NamedTuple

from ..errors import ManifestError, RefitError
from ..plan.arguments import MAX_WORLD_SIZE, check_count, shown
from ..plan.layout import ShardPlan
from .boxes import Box, Holding, meets, subtract, volume
from .holdings import (
    ep_owner,
    expert_range,
    holders,
    local_shape_on,
    stages_of,
    tp_boxes,
    tp_size,
)
from .manifest import SCALE_BLOCK, Manifest, TensorSpec, blocked_from, tensor_label


class HolderSet(NamedTuple):
    """The ranks holding one slice, ascending. Interned per placement: many slices share one, and
    two slices of one placement with the same ``key`` have the same holders."""

    key: int
    ranks: tuple[int, ...]
    members: frozenset[int]


class Slice(NamedTuple):
    """One dense global box of a tensor, held whole by every rank of ``holders``.

    Attributes:
        box: Global [start, stop) per dim.
        offset: Where the box starts in each holder's local tensor, per dim.
        holders: The ranks holding it.
        block: The packed block it lies in; -1 for a tensor every holder holds whole.
        part: Which part of its block it is (a shard's tp rank; an explicit placement's order).
            With ``block`` it names the slice among its tensor's, and so seeds the planner's choice
            of sender.
        target: The local tensor the box lies in when a weight map puts it in another tensor than the
            manifest's (``weightmap.MappedPlacement``: an engine's ``qkv_proj``); then ``offset`` is in that
            tensor's coordinates, whose dims align with ``box``'s from the right. Empty: the manifest's tensor.
    """

    box: Box
    offset: tuple[int, ...]
    holders: HolderSet
    block: int
    part: int
    target: str = ""


def destination_kind(slices: Sequence[Slice]) -> tuple[tuple[Box, int, int], ...]:
    """What a tensor's destination slices share with another tensor's when the planner's tiles of one are the other's
    moved: their boxes, and the blocks and parts that seed the choice of sender."""
    return tuple([(piece.box, piece.block, piece.part) for piece in slices])


def source_kind(slices: Sequence[Slice]) -> tuple[tuple[Box, tuple[int, ...], int], ...]:
    """``destination_kind`` for a tensor's source slices: their boxes, offsets (a tile's source offset) and parts."""
    return tuple([(piece.box, piece.offset, piece.part) for piece in slices])


class HeldTensor(NamedTuple):
    """A tensor one rank holds: its position in the manifest, its local shape, and the rank's slices of it.

    Through a weight map, ``name`` is the local tensor's own name (an engine's), ``shape`` its shape, and
    ``slices`` the rank's slices of it that come from the manifest's tensor at ``position``."""

    position: int
    shape: tuple[int, ...]
    slices: tuple[Slice, ...]
    name: str = ""


Member = tuple[int, tuple[Slice, ...], Hashable]
"""A manifest tensor held in a local tensor (``HeldAlike``): its position, the rank's slices of it, its kind."""


class HeldAlike(NamedTuple):
    """A local tensor one rank holds, and the manifest's tensors whose slices lie in it, each with its kind.

    Tensors of one kind have slices of the same boxes, offsets, holders, blocks and parts (the same weight of every
    layer, on one rank); their slices may then be one object they share, which names no local tensor (``name``
    does). A kind of None is unknown: compare the slices.

    Attributes:
        name: The local tensor, when a weight map puts the manifest's tensors in another one (an engine's
            ``w13_weight``); empty: the one member's own tensor.
        shape: Its local shape.
        members: (position, slices, kind) of each manifest tensor held in it, by ascending position.
    """

    name: str
    shape: tuple[int, ...]
    members: list[Member]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Placement(ABC):
    """What one side of a refit holds (see the module doc); immutable.

    Attributes:
        manifest: The model; a tensor's position is its position in the manifest.
        index: Which side it is, for reports (a shard's index in its layout).
        label: Its name in reports and errors (a shard's spec).
    """

    manifest: Manifest
    index: int
    label: str

    @property
    @abstractmethod
    def ranks(self) -> Collection[int]:
        """The ranks of this side (for a shard every rank of it, even one that holds nothing)."""

    @abstractmethod
    def slices(self, position: int) -> Sequence[Slice]:
        """Every slice of tensor ``position``, in a fixed order; empty when this side holds none of it."""

    def slices_each(self, positions: Iterable[int]) -> list[Sequence[Slice]]:
        """``slices`` of each of ``positions``: a rank's part asks for a local tensor's hundreds of members at once."""
        return list(map(self.slices, positions))

    def overlapping(self, position: int, box: Box) -> Iterator[Slice]:
        """The slices of tensor ``position`` that share an element with ``box``, in a fixed order."""
        return (piece for piece in self.slices(position) if meets(piece.box, box))

    def kind_of(self, position: int) -> tuple[Hashable, tuple[HolderSet, ...]]:
        """What tensors whose slices lie alike share (their boxes, blocks and parts: the planner finds the tiles of
        such tensors once), and each slice's holders, in ``slices``' order. Two positions of one placement with equal
        kinds have slices of the same boxes, blocks and parts."""
        slices = self.slices(position)
        return destination_kind(slices), tuple([piece.holders for piece in slices])

    @abstractmethod
    def held(self, rank: int) -> Iterator[HeldTensor]:
        """The tensors ``rank`` holds, by ascending position; none for a rank outside this side."""

    def held_alike(self, rank: int) -> Iterator[HeldAlike]:
        """``held``'s tensors by local tensor, each with its kind (``HeldAlike``): what lets a rank's part of a refit
        find the transfers of alike tensors once. Here each tensor alone, of no kind: a placement that knows which of
        its tensors lie alike says so."""
        for held in self.held(rank):
            yield HeldAlike(held.name, held.shape, [(held.position, held.slices, None)])

    @abstractmethod
    def describe(self) -> str:
        """This side as ranks must agree it is before a refit runs: short, and equal for equal holdings."""

    def local_tensors(self) -> Manifest:
        """The tensors this side's ranks hold, by the names of their local tensors: the manifest's, unless a
        weight map puts them in an engine's own (``weightmap.MappedPlacement``)."""
        return self.manifest

    def zeroed(self, rank: int) -> dict[str, tuple[Box, ...]]:
        """The boxes of ``rank``'s local tensors that a refit writes as zeros (no source feeds them), by tensor
        name, in local coordinates: none, unless a weight map pads an engine's tensors (``MappedPlacement``)."""
        return {}

    def restrict(self, renumber: Mapping[int, int]) -> Placement:
        """These holdings on the ranks ``renumber`` names only, each under its new number.

        Args:
            renumber: Old rank -> new rank; a rank it does not name is dropped (with its holdings).

        Raises:
            RefitError: an entry that is not two whole numbers >= 0, or two old ranks given one new one.
        """
        return Renumbered(self, renumber)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label!r})"


# -- a shard's placement, by index math ----------------------------------------------------------


def check_fits(manifest: Manifest, plan: ShardPlan) -> None:
    """Check that every tensor of ``manifest`` splits over ``plan``: tp (expt_tp) divides each
    block in whole units, the layers split over pp as asked, and ep divides the experts.

    Distinct split signatures are checked once each, so a 30,000-tensor MoE manifest costs a few
    hundred checks.

    Raises:
        ManifestError: naming the tensor, its shape, the shard and the fix.
    """
    spec, where = plan.spec, f"shard {plan.index} ('{plan.spec}')"
    try:
        manifest.stage_layers(spec.pp)
    except ManifestError as error:
        raise ManifestError(f"{where}: {error}") from None
    if manifest.experts and manifest.experts % spec.ep:
        raise ManifestError(
            f"{where}: the model's {manifest.experts} experts do not divide by ep={spec.ep}: "
            f"choose an ep that divides them"
        )
    seen: set[tuple[object, ...]] = set()
    for tensor in manifest:
        if tensor.tp_dim is None or tensor.scale_of is not None:  # a scale tensor splits where its weight does
            continue
        tp = tp_size(tensor, plan)
        key = (tensor.blocks, tensor.unit, tp)
        if key in seen:
            continue
        seen.add(key)
        bad = next((size for size in tensor.blocks if size % (tp * tensor.unit)), None)
        if bad is not None:
            name = "expt_tp" if tensor.expert is not None else "tp"
            what = f"block of {bad}" if len(tensor.blocks) > 1 else f"dim {tensor.tp_dim} ({bad})"
            units = f" of whole {tensor.unit}-element units" if tensor.unit > 1 else ""
            raise ManifestError(
                f"tensor {tensor_label(tensor.name)} {shown(list(tensor.shape))}: its {what} does not split "
                f"into {tp} equal parts{units} "
                f"over {name}={tp} of {where}: choose a {name} that divides it"
            )
    _check_scale_blocks(manifest, plan, where)


def _check_scale_blocks(manifest: Manifest, plan: ShardPlan, where: str) -> None:
    """A block-scaled tensor's tp parts must be whole 128-element blocks: then every block lies in one part, on
    both sides of a refit, and its scale is computed where it is (no part holds half a block). A split along a
    stacked tensor's batch dim (``blocked_from``) cuts between blocks by construction.

    Raises:
        ManifestError: naming the tensor, the shard and the fix.
    """
    seen: set[tuple[object, ...]] = set()
    for tensor in manifest:
        if tensor.scale != "block" or tensor.tp_dim is None or tensor.tp_dim < blocked_from(len(tensor.shape)):
            continue
        tp = tp_size(tensor, plan)
        if tp == 1 or (tensor.blocks, tp) in seen:
            continue
        seen.add((tensor.blocks, tp))
        bad = next((size for size in tensor.blocks if size % (SCALE_BLOCK * tp)), None)
        if bad is not None:
            name = "expt_tp" if tensor.expert is not None else "tp"
            what = f"block of {bad}" if len(tensor.blocks) > 1 else f"dim {tensor.tp_dim} ({bad})"
            fix = (
                f"choose a {name} that divides its {bad // SCALE_BLOCK} blocks"
                if bad % SCALE_BLOCK == 0
                else f"{bad} is no multiple of {SCALE_BLOCK}, so only {name}=1 keeps them whole"
            )
            raise ManifestError(
                f"tensor {tensor_label(tensor.name)} {shown(list(tensor.shape))}: its {what} splits into parts of "
                f"{bad // tp} over "
                f"{name}={tp} of {where}, not into whole {SCALE_BLOCK}-element scale blocks: {fix}; or give "
                f"it scale: tensor (--scale tensor)"
            )


class ShardPlacement(Placement):
    """A shard's holdings by index math: ``plan`` and ``manifest`` say which box every rank holds.

    Build it after ``check_fits(manifest, plan)``; ``plan_refit`` does both.
    """

    def __init__(self, plan: ShardPlan, manifest: Manifest) -> None:
        self.plan, self.manifest = plan, manifest
        self.index, self.label = plan.index, str(plan.spec)
        self._stages: dict[object, tuple[int, ...]] = {}
        self._holder_sets: dict[tuple[Any, ...], HolderSet] = {}
        self._parts: dict[tuple[Any, ...], tuple[Slice, ...]] = {}
        self._slices: dict[int, tuple[Slice, ...]] = {}

    @property
    def ranks(self) -> range:
        return self.plan.ranks

    def describe(self) -> str:
        return f"shard {self.index} '{self.label}' [{self.plan.rank_offset}, {self.plan.ranks.stop})"

    def _slices_of(self, tensor: TensorSpec, tp_rank: int) -> tuple[Slice, ...]:
        """Tp rank ``tp_rank``'s slices of ``tensor``: one per packed block, or the whole tensor if unsplit.

        Cached by what they depend on (shape, split, stages, ep owner, tp rank), which most
        tensors share with the same weight of other layers: a 30,000-tensor model has a few
        thousand distinct entries.
        """
        where = tensor.layer if tensor.layer is not None else tensor.stage
        stages = self._stages.get(where)
        if stages is None:
            stages = self._stages[where] = stages_of(tensor, self.plan, self.manifest)
        owner = -1 if tensor.expert is None else ep_owner(tensor, self.plan, self.manifest)
        key = (tensor.shape, tensor.tp_dim, tensor.blocks, stages, owner, tp_rank)
        found = self._parts.get(key)
        if found is None:
            replicas = (owner, stages, tensor.tp_dim is not None, tp_rank)  # what the holders depend on
            owners = self._holder_sets.get(replicas)
            if owners is None:
                ranks = holders(tensor, self.plan, self.manifest, tp_rank)
                owners = self._holder_sets[replicas] = HolderSet(len(self._holder_sets), ranks, frozenset(ranks))
            tp = tp_size(tensor, self.plan)
            found = self._parts[key] = tuple(
                Slice(box, offset, owners, block, tp_rank) for block, box, offset in tp_boxes(tensor, tp, tp_rank)
            )
        return found

    def slices(self, position: int) -> tuple[Slice, ...]:
        """Every tp rank's slices of the tensor, kept per position (a plan asks for them tile after tile)."""
        found = self._slices.get(position)
        if found is None:
            tensor = self.manifest.tensors[position]
            tp = tp_size(tensor, self.plan)
            found = self._slices[position] = (
                self._slices_of(tensor, 0)  # the cached tuple itself, which the same weight of other layers shares
                if tp == 1
                else tuple(piece for u in range(tp) for piece in self._slices_of(tensor, u))
            )
        return found

    def slices_each(self, positions: Iterable[int]) -> list[Sequence[Slice]]:
        """``slices`` of each of ``positions``, looked up in C where found before."""
        positions = list(positions)
        found: list[Sequence[Slice] | None] = list(map(self._slices.get, positions))
        if None in found:
            return list(map(self.slices, positions))
        return found  # type: ignore[return-value]

    def overlapping(self, position: int, box: Box) -> Iterator[Slice]:
        """The slices meeting ``box``, found by arithmetic along the split dim: block, then tp rank."""
        tensor = self.manifest.tensors[position]
        if tensor.tp_dim is None:  # one slice, the whole tensor
            yield from self._slices_of(tensor, 0)
            return
        lo, hi = box[tensor.tp_dim]
        tp, start = tp_size(tensor, self.plan), 0
        for block, size in enumerate(tensor.blocks):
            if start < hi and lo < start + size:
                part = size // tp
                for k in range((max(lo, start) - start) // part, (min(hi, start + size) - 1 - start) // part + 1):
                    yield self._slices_of(tensor, k)[block]
            start += size

    def held(self, rank: int) -> Iterator[HeldTensor]:
        plan, manifest = self.plan, self.manifest
        if rank not in plan:
            return
        dense, expert = plan.decoder_grid.coords(rank), plan.expert_grid.coords(rank)
        for position in manifest.on_stage(dense["pp"], plan.spec.pp, expert_range(plan, manifest, expert["ep"])):
            tensor = manifest.tensors[position]
            tp_rank = 0 if tensor.tp_dim is None else expert["expt_tp"] if tensor.expert is not None else dense["tp"]
            yield HeldTensor(position, local_shape_on(tensor, plan), self._slices_of(tensor, tp_rank))

    def held_alike(self, rank: int) -> Iterator[HeldAlike]:
        """``held``'s tensors, of one kind when they share their slices' object (``_slices_of``, kept per what the
        slices depend on: the same weight of every layer of a stage)."""
        for held in self.held(rank):
            yield HeldAlike("", held.shape, [(held.position, held.slices, id(held.slices))])


# -- explicit holdings, from records ---------------------------------------------------------------


class HeldBox(NamedTuple):
    """One record of an explicit placement: ``rank`` holds ``box`` of ``tensor``, starting at
    ``offset`` in its local tensor (None: at the origin)."""

    tensor: str
    rank: int
    box: Box
    offset: tuple[int, ...] | None = None


def _whole(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RefitError(f"{what}={shown(value)}: expected a whole number >= 0")
    return value


def _rank(value: object, what: str) -> int:
    return check_count(what, value, minimum=0, maximum=MAX_WORLD_SIZE - 1, error=RefitError)


def _record(manifest: Manifest, record: object, where: str) -> tuple[int, int, Holding]:
    """(position, rank, (box, offset)) of one record, every field checked against the manifest."""
    if not isinstance(record, tuple) or len(record) not in (3, 4):
        raise RefitError(f"{where}: {shown(record)} is not a HeldBox(tensor, rank, box, offset)")
    name, rank, box, offset = (*record, None) if len(record) == 3 else record
    if not isinstance(name, str):
        raise RefitError(f"{where}: tensor {shown(name)}: expected the name of a tensor of the manifest")
    try:
        position = manifest.index(name)
    except ManifestError as error:
        raise RefitError(f"{where}: {error}") from None
    shape = manifest.tensors[position].shape
    rank = _rank(rank, f"{where}: rank")
    what = f"{where}: tensor {name} {list(shape)}"
    if not isinstance(box, Sequence) or len(box) != len(shape):
        raise RefitError(f"{what}: box {shown(box)} must give [start, stop) for each of its {len(shape)} dims")
    for pair, size in zip(box, shape):
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise RefitError(f"{what}: box {shown(box)} must give [start, stop) for each of its {len(shape)} dims")
        if not _whole(pair[0], f"{what}: box start") < _whole(pair[1], f"{what}: box stop") <= size:
            raise RefitError(f"{what}: box {shown(box)} is empty or reaches outside the tensor")
    offset = (0,) * len(shape) if offset is None else offset
    if not isinstance(offset, Sequence) or len(offset) != len(shape):
        raise RefitError(f"{what}: offset {shown(offset)} must give one start per dim")
    return position, rank, (tuple((a, b) for a, b in box), tuple(_whole(o, f"{what}: offset") for o in offset))


def _few(ranks: Sequence[int]) -> str:
    """Ranks for an error message: at most four, then the count."""
    return ", ".join(map(str, ranks[:4])) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 4 else "")


def _check_tiles(tensor: TensorSpec, slices: Sequence[Slice], label: str) -> None:
    """A tensor's slices, sorted by box, must not overlap and must cover it."""
    for i, first in enumerate(slices):
        for second in slices[i + 1 :]:
            if second.box[0][0] >= first.box[0][1]:  # sorted by start along dim 0: no later box meets first
                break
            if meets(first.box, second.box):
                raise RefitError(
                    f"{label}: tensor {tensor.name}: box {[list(b) for b in first.box]} (ranks "
                    f"{_few(first.holders.ranks)}) and box {[list(b) for b in second.box]} (ranks "
                    f"{_few(second.holders.ranks)}) overlap: each element must lie in one box (replicas give the "
                    f"same box at the same local offset)"
                )
    covered = sum(volume(piece.box) for piece in slices)
    if covered != tensor.numel:
        raise RefitError(
            f"{label}: tensor {tensor.name} {list(tensor.shape)}: its boxes cover {covered} of its {tensor.numel} "
            f"elements: the boxes of a tensor the placement names must tile it"
        )


def _local_shape(tensor: TensorSpec, rank: int, parts: Sequence[Holding], label: str) -> tuple[int, ...]:
    """The local shape a rank's boxes of a tensor give, checked to be filled exactly (no overlap, no gap)."""
    shape = tuple(max(offset[d] + box[d][1] - box[d][0] for box, offset in parts) for d in range(len(tensor.shape)))
    local = [tuple((o, o + stop - start) for (start, stop), o in zip(box, offset)) for box, offset in parts]
    overlap = any(meets(a, b) for i, a in enumerate(local) for b in local[i + 1 :])
    if overlap or sum(volume(box) for box in local) != prod(shape):
        raise RefitError(
            f"{label}: rank {rank}'s boxes of tensor {tensor.name} do not fill a local tensor {list(shape)} "
            f"({'they overlap' if overlap else 'they leave a gap'}): give each box its offset in the local tensor"
        )
    return shape


class ExplicitPlacement(Placement):
    """Holdings listed box by box (``HeldBox`` records), e.g. read off a DTensor state dict's placements.

    Records of one tensor with the same box and offset are replicas of one slice. The boxes of
    every tensor the records name must tile it, and a rank's boxes of a tensor must fill its local
    tensor, whose shape they give. The result does not depend on the records' order.

    Args:
        manifest: The model (names, shapes).
        records: Every rank's boxes.
        index: The side's index in reports.
        label: Its name in reports and errors.

    Raises:
        RefitError: a malformed record (naming it and the field), an unknown tensor, boxes that
            overlap or leave part of their tensor uncovered, or a rank's boxes that do not fill a
            local tensor.
    """

    def __init__(
        self, manifest: Manifest, records: Iterable[HeldBox], *, index: int = 0, label: str = "explicit"
    ) -> None:
        if not isinstance(manifest, Manifest):
            raise RefitError(f"manifest must be a shardcore.refit.Manifest; got {type(manifest).__name__}")
        self.manifest, self.index, self.label = manifest, index, label
        replicas: dict[int, dict[Holding, set[int]]] = {}
        parts: dict[int, dict[int, set[Holding]]] = {}
        for number, record in enumerate(records):
            position, rank, part = _record(manifest, record, f"{label}, record {number}")
            replicas.setdefault(position, {}).setdefault(part, set()).add(rank)
            parts.setdefault(rank, {}).setdefault(position, set()).add(part)
        sets: dict[tuple[int, ...], HolderSet] = {}
        found: dict[tuple[int, Holding], Slice] = {}
        self._slices: dict[int, tuple[Slice, ...]] = {}
        for position, pieces in sorted(replicas.items()):
            ordered = []
            for order, ((box, offset), ranks) in enumerate(sorted(pieces.items())):
                key = tuple(sorted(ranks))
                owners = sets.setdefault(key, HolderSet(len(sets), key, frozenset(key)))
                ordered.append(found.setdefault((position, (box, offset)), Slice(box, offset, owners, 0, order)))
            _check_tiles(manifest.tensors[position], ordered, label)
            self._slices[position] = tuple(ordered)
        self._held = {
            rank: tuple(
                HeldTensor(
                    position,
                    _local_shape(manifest.tensors[position], rank, sorted(held), label),
                    tuple(found[position, part] for part in sorted(held)),
                )
                for position, held in sorted(tensors.items())
            )
            for rank, tensors in parts.items()
        }
        self._ranks = frozenset(self._held)
        listing = sorted((p, part, tuple(sorted(r))) for p, pieces in replicas.items() for part, r in pieces.items())
        self._digest = _digest(repr(listing))

    @property
    def ranks(self) -> frozenset[int]:
        return self._ranks

    def describe(self) -> str:
        return f"{self.label}: boxes on {len(self._ranks)} ranks, digest {self._digest}"

    def slices(self, position: int) -> tuple[Slice, ...]:
        return self._slices.get(position, ())

    def held(self, rank: int) -> Iterator[HeldTensor]:
        return iter(self._held.get(rank, ()))


# -- restricted and renumbered ---------------------------------------------------------------------


class Renumbered(Placement):
    """``base``'s holdings on the ranks ``renumber`` maps, under their new numbers (``Placement.restrict``)."""

    def __init__(self, base: Placement, renumber: Mapping[int, int]) -> None:
        if not isinstance(renumber, Mapping):
            raise RefitError(f"renumber={shown(renumber)}: expected a mapping of old rank to new rank")
        self._new: dict[int, int] = {}
        self._old: dict[int, int] = {}
        for old, new in renumber.items():
            old, new = _rank(old, "renumber: old rank"), _rank(new, f"renumber[{old}]")
            if new in self._old:
                raise RefitError(
                    f"renumber maps ranks {self._old[new]} and {old} both to {new}: "
                    f"each new rank takes one old rank's holdings"
                )
            self._new[old], self._old[new] = new, old
        self.base, self.manifest, self.index, self.label = base, base.manifest, base.index, base.label
        self._ranks = frozenset(new for old, new in self._new.items() if old in base.ranks)
        self._sets: dict[int, HolderSet | None] = {}

    @property
    def ranks(self) -> frozenset[int]:
        return self._ranks

    def describe(self) -> str:
        renumbered = _digest(repr(sorted(self._new.items())))
        return f"{self.base.describe()}, on {len(self._ranks)} ranks renumbered (digest {renumbered})"

    def _kept(self, pieces: Iterable[Slice]) -> Iterator[Slice]:
        """The slices some kept rank holds, with their holders renumbered."""
        for piece in pieces:
            key = piece.holders.key
            if key not in self._sets:
                ranks = tuple(sorted(self._new[r] for r in piece.holders.ranks if r in self._new))
                self._sets[key] = HolderSet(key, ranks, frozenset(ranks)) if ranks else None
            owners = self._sets[key]
            if owners is not None:
                yield piece._replace(holders=owners)

    def slices(self, position: int) -> tuple[Slice, ...]:
        return tuple(self._kept(self.base.slices(position)))

    def overlapping(self, position: int, box: Box) -> Iterator[Slice]:
        return self._kept(self.base.overlapping(position, box))

    def held(self, rank: int) -> Iterator[HeldTensor]:
        old = self._old.get(rank)
        if old is None:
            return
        for tensor in self.base.held(old):
            yield tensor._replace(slices=tuple(self._kept(tensor.slices)))


# -- several placements as one side -----------------------------------------------------------------


class UnionPlacement(Placement):
    """What several placements on disjoint ranks hold together, as one side: the survivors of every old
    shard, say, which together are a restore refit's source.

    The planner needs one holder set per element. Where slices of the parts coincide (the same box at the
    same local offset, as in shards split alike), their holders are merged into one set; elsewhere the
    first part holding an element keeps it, and a later part's slice is cut to what no earlier part
    holds. So ``parts`` is in order of preference where the parts' copies lie differently.

    Args:
        parts: The placements, most preferred first; one manifest, no rank in two.
        index: The side's index in reports.
        label: Its name in reports and errors (default: the parts' labels).

    Raises:
        RefitError: no part, one that is not a Placement, parts of different manifests, or a rank in two parts.
    """

    def __init__(self, parts: Sequence[Placement], *, index: int = 0, label: str | None = None) -> None:
        if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence) or not parts:
            raise RefitError(f"parts={shown(parts)}: expected a non-empty list of placements")
        for part in parts:
            if not isinstance(part, Placement):
                raise RefitError(f"part {shown(part)}: expected a Placement (e.g. shardcore.refit.ShardPlacement)")
            if part.manifest is not parts[0].manifest:
                raise RefitError(
                    f"{part.label} describes manifest {part.manifest.name!r}, {parts[0].label} another one: "
                    f"build every part of a union from the same Manifest"
                )
        self.parts, self.manifest = tuple(parts), parts[0].manifest
        self.index, self.label = index, label if label is not None else " | ".join(part.label for part in parts)
        self._ranks: frozenset[int] = frozenset().union(*(part.ranks for part in parts))
        if len(self._ranks) != sum(len(part.ranks) for part in parts):
            first, second, rank = next(
                (a, b, r) for i, a in enumerate(parts) for b in parts[i + 1 :] for r in a.ranks if r in b.ranks
            )
            raise RefitError(
                f"{first.label} and {second.label} share rank {rank}: the parts of a union hold disjoint ranks"
            )
        self._sets: dict[tuple[tuple[int, int], ...], HolderSet] = {}
        self._slices: dict[int, tuple[Slice, ...]] = {}

    @property
    def ranks(self) -> frozenset[int]:
        return self._ranks

    def describe(self) -> str:
        return "union of (" + "; ".join(part.describe() for part in self.parts) + ")"

    def _holders(self, members: tuple[tuple[int, int], ...], sets: Mapping[tuple[int, int], HolderSet]) -> HolderSet:
        """The one holder set of the merged (part, holder-set key) ``members``, interned across tensors."""
        found = self._sets.get(members)
        if found is None:
            ranks = tuple(sorted(rank for member in members for rank in sets[member].ranks))
            found = self._sets[members] = HolderSet(len(self._sets), ranks, frozenset(ranks))
        return found

    def slices(self, position: int) -> tuple[Slice, ...]:
        """Every part's slices of the tensor, merged where they coincide, cut where an earlier part holds them."""
        found = self._slices.get(position)
        if found is not None:
            return found
        pieces: list[tuple[Box, tuple[int, ...], int, list[tuple[int, int]]]] = []  # box, offset, block, members
        at: dict[tuple[Box, tuple[int, ...]], int] = {}
        sets: dict[tuple[int, int], HolderSet] = {}
        for number, part in enumerate(self.parts):
            for piece in part.slices(position):
                member = (number, piece.holders.key)
                sets[member] = piece.holders
                same = at.get((piece.box, piece.offset))
                if same is not None:
                    pieces[same][3].append(member)
                    continue
                rest = [piece.box]
                for held, _, _, _ in pieces:
                    rest = [left for box in rest for left in subtract(box, held)]
                for box in rest:
                    offset = tuple(o + lo - a for o, (lo, _), (a, _) in zip(piece.offset, box, piece.box))
                    at[box, offset] = len(pieces)
                    pieces.append((box, offset, piece.block, [member]))
        found = self._slices[position] = tuple(
            Slice(box, offset, self._holders(tuple(members), sets), block, order)
            for order, (box, offset, block, members) in enumerate(pieces)
        )
        return found

    def held(self, rank: int) -> Iterator[HeldTensor]:
        part = next((part for part in self.parts if rank in part.ranks), None)
        if part is None:
            return
        for tensor in part.held(rank):
            mine = tuple(piece for piece in self.slices(tensor.position) if rank in piece.holders.members)
            yield tensor._replace(slices=mine)


__all__ = [
    "ExplicitPlacement",
    "HeldAlike",
    "HeldBox",
    "HeldTensor",
    "HolderSet",
    "Member",
    "Placement",
    "Renumbered",
    "ShardPlacement",
    "Slice",
    "UnionPlacement",
    "check_fits",
]
