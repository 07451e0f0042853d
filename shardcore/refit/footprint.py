"""What one rank of a shard holds of a model, in bytes, and whether the model splits over a shard at all.

Both depend on the spec alone, never on where the shard sits, so a search over thousands of specs
asks them thousands of times: ``Footprint`` reads the manifest once and answers each spec from
per-layer and per-expert byte totals.

The ranks of a shard at one pipeline stage and one ep rank hold the same tensors (each tp and expt_tp
rank its slice of them): a ``RankClass``. Its bytes are kept by ``Category`` (where the tensors sit,
whether they are experts, whether they are split), because each category is replicated differently
(``replicas``), which is what a refit estimate needs (``shardcore.refit.estimate``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate
from math import gcd
from typing import NamedTuple

from ..errors import ManifestError
from ..plan.layout import plan_layout
from ..plan.spec import ShardSpec
from .manifest import Manifest, TensorSpec
from .placement import check_fits


class Category(NamedTuple):
    """How a group of tensors is placed: ``where`` (layer, first, last, tied: first and last, all stages),
    whether they are experts, whether they are split over tp (expt_tp)."""

    where: str
    expert: bool
    split: bool


def category_of(tensor: TensorSpec) -> Category:
    """The category of one tensor."""
    if tensor.layer is not None:
        where = "layer"
    elif "all" in tensor.stage:
        where = "all"
    else:
        where = "tied" if len(tensor.stage) == 2 else tensor.stage[0]
    return Category(where, tensor.expert is not None, tensor.tp_dim is not None)


def split_ways(spec: ShardSpec, category: Category) -> int:
    """Into how many slices a shard of ``spec`` cuts each tensor of ``category``."""
    if not category.split:
        return 1
    return spec.expt_tp if category.expert else spec.tp


def replicas(spec: ShardSpec, category: Category) -> int:
    """How many ranks of a shard of ``spec`` hold each element of a tensor of ``category``: its replicas over
    cp and dp (expt_dp for an expert), over tp (expt_tp) too when unsplit, times the stages holding it."""
    if category.expert:
        copies = spec.expt_dp * (1 if category.split else spec.expt_tp)
    else:
        copies = spec.cp * spec.dp * (1 if category.split else spec.tp)
    stages = {"all": spec.pp, "tied": min(2, spec.pp)}.get(category.where, 1)
    return copies * stages


@dataclass(frozen=True)
class RankClass:
    """The ranks of a shard at pipeline stage ``stage`` and ep rank ``ep_rank``: the global bytes of the
    tensors they hold, by category (each rank holds its ``split_ways`` share of the split ones)."""

    stage: int
    ep_rank: int
    bytes: dict[Category, int]

    def held_bytes(self, spec: ShardSpec) -> int:
        """Bytes one rank of this class holds under ``spec``."""
        return sum(size // split_ways(spec, category) for category, size in self.bytes.items())


class Footprint:
    """Per-spec facts about one manifest: whether it splits over a shard, and what each rank holds.

    Args:
        manifest: the model.
    """

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        experts = manifest.experts
        dense: list[dict[Category, int]] = [{} for _ in range(manifest.layers)]
        per_expert: list[list[list[int]]] = [[[0] * experts for _ in range(2)] for _ in range(manifest.layers)]
        placed: dict[Category, int] = {}
        totals: dict[Category, int] = {}
        representatives: dict[tuple[object, ...], TensorSpec] = {}
        for tensor in manifest:
            category = category_of(tensor)
            totals[category] = totals.get(category, 0) + tensor.nbytes
            if tensor.tp_dim is not None:
                representatives.setdefault((tensor.blocks, tensor.unit, category.expert), tensor)
            if tensor.expert is not None:
                per_expert[tensor.layer][category.split][tensor.expert] += tensor.nbytes  # type: ignore[index]
            elif tensor.layer is not None:
                dense[tensor.layer][category] = dense[tensor.layer].get(category, 0) + tensor.nbytes
            else:
                placed[category] = placed.get(category, 0) + tensor.nbytes
        self.totals = totals
        """Bytes of every tensor of each category, each tensor once."""
        self._dense = dense
        self._expert_prefix = [[[0, *accumulate(row)] for row in layer] for layer in per_expert]
        self._placed = placed
        self._signature = Manifest(
            tuple(representatives.values()) or (manifest.tensors[0],),
            layers=manifest.layers,
            first_stage_layers=manifest.first_stage_layers,
            last_stage_layers=manifest.last_stage_layers,
            experts=manifest.experts,
            name=manifest.name,
        )
        """One tensor per split signature: what ``check_fits`` looks at, so checking it checks the manifest."""
        self._fit_errors: dict[tuple[int, ...], ManifestError | None] = {}
        self._layer_errors: dict[int, ManifestError | None] = {}
        self._classes: dict[tuple[int, int], tuple[RankClass, ...]] = {}
        self._weights: dict[tuple[int, ...], int] = {}

    def axes(self, axes: Mapping[str, int]) -> dict[str, int]:
        """The axes of ``axes`` (axis -> largest size) worth varying for this model: a dense model has no
        experts to spread, so its ep and expt_tp stay at their defaults (other values repeat a layout)."""
        if self.manifest.experts:
            return dict(axes)
        return {axis: limit for axis, limit in axes.items() if axis not in ("ep", "expt_tp")}

    def fits(self, spec: ShardSpec) -> ManifestError | None:
        """None when every tensor, the layers and the experts split over a shard of ``spec``, else the
        error ``check_fits`` raises (naming a tensor of the model, its shape and the fix).

        The layers depend on pp alone and the rest on (tp, expt_tp, ep), so each part is checked once per
        value: a search meets thousands of pp values and a few hundred of the others.
        """
        if spec.pp not in self._layer_errors:
            try:
                self.manifest.stage_layers(spec.pp)
                self._layer_errors[spec.pp] = None
            except ManifestError as error:
                self._layer_errors[spec.pp] = ManifestError(f"'{spec}': {error}")
        key = (spec.tp, spec.expt_tp, spec.ep)
        if key not in self._fit_errors:
            try:
                expert = spec.expt_tp * spec.ep  # the smallest shard with this split: lcm(tp, expt_tp*ep) ranks
                flat = ShardSpec(tp=spec.tp, ep=spec.ep, expt_tp=spec.expt_tp, dp=expert // gcd(spec.tp, expert))
                check_fits(self._signature, plan_layout(flat.world_size, flat).shards[0])
                self._fit_errors[key] = None
            except ManifestError as error:
                self._fit_errors[key] = error
        return self._layer_errors[spec.pp] or self._fit_errors[key]

    def classes(self, spec: ShardSpec) -> tuple[RankClass, ...]:
        """One RankClass per (pipeline stage, ep rank) of a shard of ``spec``, stage-major.

        Raises:
            ManifestError: the layers do not split over spec's pp (see ``fits``).
        """
        key = (spec.pp, spec.ep)
        if key not in self._classes:
            self._classes[key] = tuple(
                RankClass(stage, ep_rank, held)
                for stage, layers in enumerate(self.manifest.stage_layers(spec.pp))
                for ep_rank, held in enumerate(self._held_on_stage(stage, spec.pp, layers, spec.ep))
            )
        return self._classes[key]

    def _held_on_stage(self, stage: int, pp: int, layers: range, ep: int) -> list[dict[Category, int]]:
        """Bytes by category that each ep rank of one pipeline stage holds."""
        common: dict[Category, int] = {}
        ends = stage in (0, pp - 1)
        for where, present in (("all", True), ("first", stage == 0), ("last", stage == pp - 1), ("tied", ends)):
            for split in (False, True):
                category = Category(where, False, split)
                if present and category in self._placed:
                    common[category] = self._placed[category]
        for layer in layers:
            for category, size in self._dense[layer].items():
                common[category] = common.get(category, 0) + size
        per = self.manifest.experts // ep if self.manifest.experts else 0
        out = []
        for ep_rank in range(ep):
            held = dict(common)
            low, high = ep_rank * per, (ep_rank + 1) * per
            for split in (False, True):
                size = sum(
                    self._expert_prefix[layer][split][high] - self._expert_prefix[layer][split][low] for layer in layers
                )
                if size:
                    held[Category("layer", True, split)] = size
            out.append(held)
        return out

    def weight_bytes(self, spec: ShardSpec) -> int:
        """The most weight bytes any rank of a shard of ``spec`` holds (what must fit its memory).

        Raises:
            ManifestError: the layers do not split over spec's pp (see ``fits``).
        """
        key = (spec.tp, spec.expt_tp, spec.ep, spec.pp)
        if key not in self._weights:
            self._weights[key] = max(rank_class.held_bytes(spec) for rank_class in self.classes(spec))
        return self._weights[key]


__all__ = ["Category", "Footprint", "RankClass", "category_of", "replicas", "split_ways"]
