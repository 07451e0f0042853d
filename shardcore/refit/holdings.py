"""What a rank of a Megatron shard holds, by index math: which pipeline stages hold a tensor, which ep rank owns an
expert, which tp (expt_tp) part of each packed block a rank holds, where it starts in the rank's local tensor, and
the ranks holding each part (Megatron's conventions: dense tensors split over tp and replicated over cp and dp on
the decoder grid; an expert's owned by one ep rank, split over expt_tp, replicated over expt_dp). A shard's
placement (``placement.ShardPlacement``) and the replan's surviving copies (``replan/copies.py``) read it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

from ..plan.layout import ShardPlan
from .boxes import Box, Holding
from .manifest import Manifest, TensorSpec


@dataclass(frozen=True)
class TpPart:
    """One tp rank's part of one packed block along ``tp_dim``: global [start, stop), local start."""

    block: int
    start: int
    stop: int
    local: int


def tp_size(tensor: TensorSpec, plan: ShardPlan) -> int:
    """How many ways the shard splits this tensor: expt_tp for an expert, tp otherwise (1 if unsplit)."""
    if tensor.tp_dim is None:
        return 1
    return plan.spec.expt_tp if tensor.expert is not None else plan.spec.tp


@lru_cache(maxsize=1 << 16)
def tp_parts(blocks: tuple[int, ...], tp: int, rank: int) -> tuple[TpPart, ...]:
    """The parts tp rank ``rank`` of ``tp`` holds along the split dim: its share of every block, in order."""
    parts, offset, local = [], 0, 0
    for block, size in enumerate(blocks):
        part = size // tp
        parts.append(TpPart(block, offset + rank * part, offset + (rank + 1) * part, local))
        offset += size
        local += part
    return tuple(parts)


def stages_of(tensor: TensorSpec, plan: ShardPlan, manifest: Manifest) -> tuple[int, ...]:
    """The pipeline stages of ``plan`` that hold ``tensor``."""
    pp = plan.spec.pp
    if tensor.layer is not None:
        for stage, layers in enumerate(manifest.stage_layers(pp)):
            if tensor.layer in layers:
                return (stage,)
    if "all" in tensor.stage:
        return tuple(range(pp))
    return tuple(sorted({0 if name == "first" else pp - 1 for name in tensor.stage}))


def ep_owner(tensor: TensorSpec, plan: ShardPlan, manifest: Manifest) -> int:
    """The ep rank owning an expert tensor: experts are spread evenly, in order, over ep."""
    return tensor.expert // (manifest.experts // plan.spec.ep)  # type: ignore[operator]


def expert_range(plan: ShardPlan, manifest: Manifest, ep_rank: int) -> range:
    """Global expert indices owned by ``ep_rank``."""
    if not manifest.experts:
        return range(0)
    per = manifest.experts // plan.spec.ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def tp_rank_of(tensor: TensorSpec, plan: ShardPlan, rank: int) -> int | None:
    """The tp (or expt_tp) coordinate under which ``rank`` holds ``tensor``, or None if it holds none."""
    if rank not in plan:
        return None
    if tensor.expert is not None:
        coords = plan.expert_grid.coords(rank)
        return coords["expt_tp"] if tensor.tp_dim is not None else 0
    coords = plan.decoder_grid.coords(rank)
    return coords["tp"] if tensor.tp_dim is not None else 0


def holds(tensor: TensorSpec, plan: ShardPlan, rank: int, manifest: Manifest) -> bool:
    """Whether ``rank`` holds any part of ``tensor`` in ``plan``."""
    if rank not in plan:
        return False
    if tensor.expert is not None:
        coords = plan.expert_grid.coords(rank)
        if coords["ep"] != ep_owner(tensor, plan, manifest):
            return False
    return plan.decoder_grid.coords(rank)["pp"] in stages_of(tensor, plan, manifest)


def holders(tensor: TensorSpec, plan: ShardPlan, manifest: Manifest, tp_rank: int) -> tuple[int, ...]:
    """Every rank of ``plan`` holding tp slice ``tp_rank`` of ``tensor``, ascending: its replicas
    over cp and dp (expt_dp for an expert), and over tp (expt_tp) too when the tensor is not split,
    on every stage that holds it."""
    split = tensor.tp_dim is not None
    ranks: list[int] = []
    for stage in stages_of(tensor, plan, manifest):
        if tensor.expert is not None:
            grid = plan.expert_grid
            base = grid.rank_at({"expt_tp": tp_rank, "ep": ep_owner(tensor, plan, manifest), "pp": stage})
            ranks += grid.group_ranks(base, ("expt_dp",) if split else ("expt_tp", "expt_dp"))
        else:
            grid = plan.decoder_grid
            base = grid.rank_at({"tp": tp_rank, "pp": stage})
            ranks += grid.group_ranks(base, ("cp", "dp") if split else ("tp", "cp", "dp"))
    return tuple(sorted(ranks))


def tp_boxes(tensor: TensorSpec, tp: int, tp_rank: int) -> Iterator[tuple[int, Box, tuple[int, ...]]]:
    """(block, global box, local offset) of each part tp rank ``tp_rank`` of ``tp`` holds; block -1 when unsplit."""
    full = tuple((0, size) for size in tensor.shape)
    if tensor.tp_dim is None:
        yield -1, full, (0,) * len(full)
        return
    dim = tensor.tp_dim
    for part in tp_parts(tensor.blocks, tp, tp_rank):
        box = (*full[:dim], (part.start, part.stop), *full[dim + 1 :])
        yield part.block, box, tuple(part.local if d == dim else 0 for d in range(len(full)))


def holdings(tensor: TensorSpec, plan: ShardPlan, rank: int, manifest: Manifest) -> tuple[Holding, ...]:
    """The global boxes of ``tensor`` that ``rank`` holds under ``plan``, with their local offsets.

    One box per packed block (one for an unsplit tensor), each a dense box of the rank's local
    tensor starting at the given local offset. Empty when the rank holds none of it.

    Args:
        tensor: A tensor of ``manifest``.
        plan: The shard (of any layout).
        rank: A global rank.
        manifest: The model, for the pipeline split and expert count.
    """
    tp_rank = tp_rank_of(tensor, plan, rank)
    if tp_rank is None or not holds(tensor, plan, rank, manifest):
        return ()
    return tuple((box, offset) for _, box, offset in tp_boxes(tensor, tp_size(tensor, plan), tp_rank))


def local_shape(tensor: TensorSpec, plan: ShardPlan, rank: int, manifest: Manifest) -> tuple[int, ...] | None:
    """The shape of ``rank``'s local ``tensor`` under ``plan``, or None when it holds none."""
    if not holds(tensor, plan, rank, manifest):
        return None
    return local_shape_on(tensor, plan)


def local_shape_on(tensor: TensorSpec, plan: ShardPlan) -> tuple[int, ...]:
    """The local shape of ``tensor`` on any rank of ``plan`` that holds it."""
    if tensor.tp_dim is None:
        return tensor.shape
    shape = list(tensor.shape)
    shape[tensor.tp_dim] //= tp_size(tensor, plan)
    return tuple(shape)


__all__ = [
    "TpPart",
    "ep_owner",
    "expert_range",
    "holders",
    "holdings",
    "holds",
    "local_shape",
    "local_shape_on",
    "stages_of",
    "tp_boxes",
    "tp_parts",
    "tp_rank_of",
    "tp_size",
]
