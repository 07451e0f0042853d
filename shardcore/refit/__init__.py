"""Refit: move a model's weights from one shard's layout to others', planned from the layouts alone.

The manifest and planner are pure Python (no torch); only execution imports torch.

- ``Manifest`` / ``TensorSpec``: the model's tensors and how each lies on a shard
  (``load_manifest`` for JSON/YAML, ``manifest_from_config``, ``preset``, ``PRESETS``, ``model_manifest``
  for either a preset name or a file).
- ``holdings(tensor, plan, rank, manifest)``: the global boxes a rank holds, with their offsets in
  its local tensor; ``local_shape(tensor, plan, rank, manifest)``: its local shape (None if none).
- Placements, what one side of a refit holds: ``Placement`` (``slices(position)``, ``held(rank)``,
  ``restrict(renumber)``), ``ShardPlacement(plan, manifest)`` by index math,
  ``ExplicitPlacement(manifest, [HeldBox(tensor, rank, box, offset), ...])`` from records, and
  ``UnionPlacement([placement, ...])``: several on disjoint ranks as one side (a restore's survivors).
- ``plan_refit(layout, src, dst, manifest, ranks_per_node=None, *, min_piece_bytes=1MiB, fan_out=False)``
  -> ``ShardRefitPlan`` between shards; ``plan_refit_from(source, destinations)`` -> ``RefitPlan``
  between any placements: ``.for_rank(r)`` -> ``RankRefit`` (sends, recvs, copies, shapes),
  ``.transfers()`` -> every ``Transfer`` in the global order, ``.subset(names or predicate)`` -> the
  plan of a partial refit (``tensors_matching(manifest, patterns)`` finds names);
  ``RefitStats.of(plan)``: what it costs.
- ``RefitRequest``: a refit between shards by value (spec, shard indices, model, options, tensors, conversion),
  picklable; ``.plan(world_size)`` is where the CLI, the live check and the tests build its plan.
- ``ExecuteOptions``: the executor's knobs (timeout, bucket bytes, ops per batch, verification, version),
  checked when made; what ``execute_refit(options=...)`` and the plugins' ``refit()`` take.
- ``search(layout, src, manifest, ranks, memory_bytes)`` -> ``SearchResult``: every destination spec of
  R ranks that the model splits over and whose weights fit, ranked by estimated refit time
  (``Candidate``s, the Pareto front marked); ``Footprint`` (what a rank of a spec holds, whether the
  model splits over it) and ``estimate_refit`` -> ``RefitEstimate`` (a refit's cost without walking a plan).

- Another side's own layout: ``manifest_from_hf_config(path)`` -> ``HFModel`` (``.manifest``, Megatron's;
  ``.layout("hf" | "hf-stacked" | "vllm")``) and ``plan_refit(..., layouts={shard: model.layout(kind)})``:
  each rank receives its own slices of its own tensors (``WeightMap``, ``MappedPlacement``; ``families.py``).

Executing a plan needs torch and lives in the engine: ``shardcore.execute_refit``. Its old name here,
``shardcore.refit.execute``, still works for this release with a DeprecationWarning (``version.moved``).
"""

from __future__ import annotations

from typing import Any

from ..version import moved
from .cost import RefitStats, ShardCost
from .documents import load_manifest, manifest_from_dict, model_manifest
from .estimate import RefitEstimate, estimate_refit
from .families import LAYOUTS, HFModel, ModelLayout, manifest_from_hf_config
from .footprint import Footprint
from .hf_config import FAMILIES
from .holdings import holdings, local_shape
from .manifest import Manifest, TensorSpec
from .models import PRESETS, TransformerConfig, manifest_from_config, preset
from .options import ExecuteOptions
from .part import RankRefit, Received, Rows, Transfer
from .placement import (
    ExplicitPlacement,
    HeldAlike,
    HeldBox,
    HeldTensor,
    HolderSet,
    Placement,
    ShardPlacement,
    Slice,
    UnionPlacement,
)
from .plan import RefitPlan, ShardRefitPlan, tensors_matching
from .planner import plan_refit, plan_refit_from
from .request import RefitRequest
from .search import Candidate, SearchResult, search
from .weightmap import Link, MappedPlacement, WeightMap


def __getattr__(name: str) -> Any:
    """Names that moved out of ``shardcore.refit`` (``execute``, its errors and stats), for one more release."""
    return moved(__name__, name)


__all__ = [
    "FAMILIES",
    "LAYOUTS",
    "PRESETS",
    "Candidate",
    "ExecuteOptions",
    "ExplicitPlacement",
    "Footprint",
    "HFModel",
    "HeldAlike",
    "HeldBox",
    "HeldTensor",
    "HolderSet",
    "Link",
    "Manifest",
    "MappedPlacement",
    "ModelLayout",
    "Placement",
    "RankRefit",
    "Received",
    "RefitEstimate",
    "RefitPlan",
    "RefitRequest",
    "RefitStats",
    "Rows",
    "SearchResult",
    "ShardCost",
    "ShardPlacement",
    "ShardRefitPlan",
    "Slice",
    "TensorSpec",
    "Transfer",
    "TransformerConfig",
    "UnionPlacement",
    "WeightMap",
    "estimate_refit",
    "holdings",
    "load_manifest",
    "local_shape",
    "manifest_from_config",
    "manifest_from_dict",
    "manifest_from_hf_config",
    "model_manifest",
    "plan_refit",
    "plan_refit_from",
    "preset",
    "search",
    "tensors_matching",
]
