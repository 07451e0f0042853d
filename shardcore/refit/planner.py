"""Making a refit plan: ``plan_refit`` between shards of a layout (their placements by index math, or through an
engine's layout), ``plan_refit_from`` between any placements. Each checks every argument, so that what it returns,
a lazy ``RefitPlan`` (``plan.py``), cannot fail later on what it was given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import RefitError
from ..plan.arguments import check_count, check_size, shown
from ..plan.layout import Layout, ShardPlan
from .boxes import overlap, volume
from .collector import gc_paused
from .families import ModelLayout, sides
from .landing import carried, landed
from .manifest import Manifest
from .placement import Placement, Renumbered, ShardPlacement, check_fits
from .plan import DEFAULT_MIN_PIECE_BYTES, RefitPlan, ShardRefitPlan
from .weightmap import WeightMap


def resolve_shard(layout: Layout, shard: int | ShardPlan, what: str) -> ShardPlan:
    if isinstance(shard, ShardPlan):
        if shard.ranks.stop > layout.world_size:
            raise RefitError(
                f"{what} shard ('{shard.spec}') has ranks [{shard.rank_offset}, {shard.ranks.stop}) outside the "
                f"world of {layout.world_size}: a shard of another layout must lie in the same world"
            )
        return shard
    if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < len(layout.shards):
        raise RefitError(
            f"{what} shard {shown(shard)}: expected a shard index in [0, {len(layout.shards)}) or a ShardPlan"
        )
    return layout.shards[shard]


def _check_options(ranks_per_node: object, min_piece_bytes: object, fan_out: object) -> int:
    """The planner's options, checked; returns the floor in bytes."""
    if ranks_per_node is not None and (
        isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1
    ):
        raise RefitError(f"ranks_per_node={shown(ranks_per_node)}: expected a positive integer")
    if not isinstance(fan_out, bool):
        raise RefitError(f"fan_out={shown(fan_out)}: expected True or False")
    if fan_out and ranks_per_node is None:
        raise RefitError("fan_out=True needs ranks_per_node: fan-out relays a tile inside each node, so give the nodes")
    return check_size("min_piece_bytes", min_piece_bytes, error=RefitError)


def plan_refit(
    layout: Layout,
    src: int | ShardPlan,
    dst: int | ShardPlan | Sequence[int | ShardPlan],
    manifest: Manifest,
    ranks_per_node: int | None = None,
    *,
    min_piece_bytes: int | str = DEFAULT_MIN_PIECE_BYTES,
    fan_out: bool = False,
    layouts: Mapping[int, ModelLayout] | None = None,
) -> ShardRefitPlan:
    """Plan moving ``manifest``'s weights from shard ``src`` to shard(s) ``dst``; no model, no collective, no torch.

    Args:
        layout: The layout whose world the shards live in (``shardcore.plan_layout``).
        src: The source shard: an index into ``layout.shards``, or a ShardPlan (for the collocated
            two-layout case, a shard of another layout over the same world).
        dst: One destination shard or a sequence of them, given the same way; they may not overlap.
        manifest: The model's tensors.
        ranks_per_node: Ranks per node (node = rank // K): same-node sources are chosen first and
            the stats split traffic into intra- and inter-node.
        min_piece_bytes: The floor on piece size, in bytes or as a size such as ``'1MiB'``; 0: none.
        fan_out: Send each tile once into every node that holds no source of it, through a relay
            there (see the module doc); needs ``ranks_per_node``.
        layouts: The layout of some shards, by shard index, when not Megatron's: ``model.layout("hf")``,
            ``model.layout("vllm")`` of a ``manifest_from_hf_config`` model, whose ``.manifest`` is then
            ``manifest``. Each destination rank receives exactly its own slices of its own tensors, in its
            layout's names and packing (``families.py``); a plan's ``Transfer.target`` names them. A manifest
            converting to float8_e4m3fn with block scales is quantized by the destination ranks on landing, with
            the blocks of their own tensors (``landing.py``): the pieces travel in the source dtype.

    Returns:
        A lazy ShardRefitPlan; every check that can fail has been made.

    Raises:
        RefitError: a layout that is not a Layout, bad shard indices, overlapping destinations, a
            manifest that is not a Manifest, bad ranks_per_node, fan_out without it, or a
            min_piece_bytes that is not a size.
        ManifestError: a tensor, the layers or the experts do not split over a shard; with ``layouts``,
            layouts of another model than ``manifest``'s, a shard in a layout it cannot hold, or, converting
            through a layout, a conversion other than fp8 with block scales or a destination tensor whose rank
            boxes or packed parts cut a scale block (``landing.landed``).
    """
    if not isinstance(layout, Layout):
        raise RefitError(
            f"layout={shown(layout)}: expected a Layout; build one with shardcore.plan_layout(world_size, shards)"
        )
    source = resolve_shard(layout, src, "source")
    if isinstance(dst, (str, bytes)) or not isinstance(dst, (int, ShardPlan, Sequence)):
        raise RefitError(f"dst={shown(dst)}: expected a shard index, a ShardPlan, or a list of them, e.g. dst=[1, 2]")
    items = dst if isinstance(dst, Sequence) else [dst]
    if not items:
        raise RefitError("no destination shard given: name at least one, e.g. dst=1")
    destinations = tuple(resolve_shard(layout, item, "destination") for item in items)
    for i, first in enumerate(destinations):
        for second in destinations[i + 1 :]:
            if first.rank_offset < second.ranks.stop and second.rank_offset < first.ranks.stop:
                raise RefitError(
                    f"destination shards '{first.spec}' [{first.rank_offset}, {first.ranks.stop}) and "
                    f"'{second.spec}' [{second.rank_offset}, {second.ranks.stop}) overlap: each rank can hold one copy"
                )
    floor = _check_options(ranks_per_node, min_piece_bytes, fan_out)
    if not isinstance(manifest, Manifest):
        raise RefitError(f"manifest must be a shardcore.refit.Manifest; got {type(manifest).__name__}")
    if layouts:
        return _through_layouts(layout, source, destinations, manifest, layouts, ranks_per_node, floor, fan_out)
    for plan in (source, *destinations):
        check_fits(manifest, plan)
    return ShardRefitPlan(
        ShardPlacement(source, manifest),
        tuple(ShardPlacement(plan, manifest) for plan in destinations),
        layout.world_size,
        ranks_per_node,
        floor,
        fan_out,
        layout=layout,
    )


def _through_layouts(
    layout: Layout,
    source: ShardPlan,
    destinations: tuple[ShardPlan, ...],
    manifest: Manifest,
    layouts: Mapping[int, ModelLayout],
    ranks_per_node: int | None,
    floor: int,
    fan_out: bool,
) -> ShardRefitPlan:
    """``plan_refit`` where some shards hold another layout: the same planning, in the source's coordinates."""
    if not isinstance(layouts, Mapping) or not all(isinstance(item, ModelLayout) for item in layouts.values()):
        raise RefitError(
            f"layouts={shown(layouts)}: expected a mapping of shard index -> model.layout(kind), e.g. "
            f"{{1: model.layout('vllm')}} with model = shardcore.refit.manifest_from_hf_config(path)"
        )
    shards = {plan.index for plan in (source, *destinations)}
    stray = next((index for index in layouts if index not in shards), None)
    if stray is not None:
        raise RefitError(f"layouts names shard {shown(stray)}, which is neither the source nor a destination")
    model = next(iter(layouts.values())).model
    converting = manifest
    if manifest.converts:  # planned in the source dtype: the destinations quantize what lands (``landing.py``)
        manifest = manifest.as_held()
    model.check_manifest(manifest)
    with gc_paused():
        origin, targets = sides(source, destinations, layouts)
        if converting.converts:
            start = layouts.get(source.index)
            if start is not None and start.kind != "megatron":  # an HF source: its tensors convert as Megatron's do
                converting = carried(converting, model.hf_layout(start.kind)[1])
            targets = tuple(
                landed(converting, placement, _packing(layouts, plan)) for placement, plan in zip(targets, destinations)
            )
        _check_covered(origin, targets)
    return ShardRefitPlan(
        origin,
        targets,
        layout.world_size,
        ranks_per_node,
        floor,
        fan_out,
        layout=layout,
        shards=(source, *destinations),
    )


def _packing(layouts: Mapping[int, ModelLayout], plan: ShardPlan) -> WeightMap | None:
    """The map that packs the HF tensors into destination ``plan``'s (vLLM's), whose packed parts an fp8 landing
    keeps whole blocks of; None for a layout that packs nothing."""
    chosen = layouts.get(plan.index)
    if chosen is None or chosen.kind != "vllm":
        return None
    return chosen.model.vllm(plan.spec.tp, plan.spec.expt_tp)[1]


def _check_covered(source: Placement, destinations: Sequence[Placement]) -> None:
    """Every element a destination holds must have a source holder (a source's slices never overlap,
    so one whose slices add up to the whole tensor holds all of it)."""
    for position, tensor in enumerate(source.manifest):
        if sum(volume(piece.box) for piece in source.slices(position)) == tensor.numel:
            continue  # the destinations' slices are not made: an engine's are many, and made when asked for
        needed = [(placement, target) for placement in destinations for target in placement.slices(position)]
        for placement, target in needed:
            covered = sum(volume(overlap(piece.box, target.box)) for piece in source.overlapping(position, target.box))
            if covered < volume(target.box):
                ranks = target.holders.ranks
                others = f" and {len(ranks) - 1} others" if len(ranks) > 1 else ""
                raise RefitError(
                    f"tensor {tensor.name}: {placement.label} needs box {[list(b) for b in target.box]} (rank "
                    f"{ranks[0]}{others}), but {source.label} holds only {covered} of its {volume(target.box)} "
                    f"elements: every element a destination needs must be held by a source rank"
                )


def plan_refit_from(
    source: Placement,
    destinations: Placement | Sequence[Placement],
    ranks_per_node: int | None = None,
    *,
    min_piece_bytes: int | str = DEFAULT_MIN_PIECE_BYTES,
    fan_out: bool = False,
    world_size: int | None = None,
) -> RefitPlan:
    """Plan moving the weights ``source`` holds to where ``destinations`` need them; no collective, no torch.

    The placements may be of any kind (``ExplicitPlacement`` from records, ``ShardPlacement``, a
    ``restrict``-ed one) over one manifest; the plan is the one ``plan_refit`` makes for shards.

    Args:
        source: What the source side holds.
        destinations: One placement or a sequence of them; no rank may be in two.
        ranks_per_node: Ranks per node (node = rank // K): same-node sources are chosen first.
        min_piece_bytes: The floor on piece size, in bytes or as a size such as ``'1MiB'``; 0: none.
        fan_out: Relay each tile once into every node without a source of it (needs ranks_per_node).
        world_size: The world's size; by default one more than the highest rank of any placement.

    Returns:
        A lazy RefitPlan; every check that can fail has been made.

    Raises:
        RefitError: an argument that is not a placement, placements of different manifests,
            destinations sharing a rank, a world too small for them, bad options (a floor that is
            not a size, fan_out without ranks_per_node), or an element a destination needs that no
            source rank holds (naming the tensor and the box).
    """
    if not isinstance(source, Placement):
        raise RefitError(f"source={shown(source)}: expected a Placement (e.g. shardcore.refit.ExplicitPlacement)")
    items = [destinations] if isinstance(destinations, Placement) else destinations
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or not items:
        raise RefitError(f"destinations={shown(destinations)}: expected a Placement or a non-empty list of them")
    for item in items:
        if not isinstance(item, Placement):
            raise RefitError(
                f"destination {shown(item)}: expected a Placement (e.g. shardcore.refit.ExplicitPlacement)"
            )
        if item.manifest is not source.manifest:
            raise RefitError(
                f"{item.label} describes manifest {item.manifest.name!r}, {source.label} another one: build every "
                f"placement of a refit from the same Manifest"
            )
    for i, first in enumerate(items):
        for second in items[i + 1 :]:
            shared = next((rank for rank in first.ranks if rank in second.ranks), None)
            if shared is not None:
                raise RefitError(
                    f"destinations {first.label} and {second.label} share rank {shared}: each rank can hold one copy"
                )
    floor = _check_options(ranks_per_node, min_piece_bytes, fan_out)
    needed = 1 + max((max(p.ranks, default=-1) for p in (source, *items)), default=-1)
    if world_size is None:
        world_size = needed
    elif check_count("world_size", world_size, error=RefitError) < needed:
        raise RefitError(
            f"world_size={world_size}: the placements hold ranks up to {needed - 1}; give at least {needed}"
        )
    _check_scaled(source, items)
    _check_covered(source, items)
    return RefitPlan(source, tuple(items), world_size, ranks_per_node, floor, fan_out)


def _check_scaled(source: Placement, destinations: Sequence[Placement]) -> None:
    """fp8 scales are computed from a rank's local tensors by the index math of shards: every placement of a
    manifest with scale tensors must be a shard's (``ShardPlacement``, or one ``restrict``-ed)."""
    scaled = next((tensor for tensor in source.manifest if tensor.scale_of is not None), None)
    if scaled is None:
        return
    for placement in (source, *destinations):
        base = placement
        while isinstance(base, Renumbered):
            base = base.base
        if not isinstance(base, ShardPlacement):
            raise RefitError(
                f"{placement.label}: tensor {scaled.scale_of} converts to float8_e4m3fn with scales, which are "
                f"planned between shards' placements only (plan_refit): convert it without scales, or plan shards"
            )


__all__ = ["plan_refit", "plan_refit_from", "resolve_shard"]
