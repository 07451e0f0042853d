"""Where a manifest tensor lies on a shard: which ranks hold it and which global boxes of it, by index math.

A rank's local tensor is the concatenation, along ``tp_dim``, of its slice of every packed block
(Megatron's layout of SwiGLU's [gate_r; up_r]). Dense tensors live on the decoder grid: split over
tp, replicated over cp and dp. Expert tensors live on the expert grid: owned by one ep rank, split
over expt_tp, replicated over expt_dp. Both sit on the pipeline stage(s) of their layer or placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..errors import ManifestError
from ..plan.arguments import shown
from ..plan.layout import ShardPlan
from .manifest import Manifest, TensorSpec, tensor_label

Box = tuple[tuple[int, int], ...]
"""A global box: [start, stop) per dim."""

Holding = tuple[Box, tuple[int, ...]]
"""A global box a rank holds, and where it starts in the rank's local tensor."""


@dataclass(frozen=True)
class Slice:
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
def tp_slices(blocks: tuple[int, ...], tp: int, rank: int) -> tuple[Slice, ...]:
    """The slices tp rank ``rank`` of ``tp`` holds along the split dim: its share of every block, in order."""
    slices, offset, local = [], 0, 0
    for block, size in enumerate(blocks):
        part = size // tp
        slices.append(Slice(block, offset + rank * part, offset + (rank + 1) * part, local))
        offset += size
        local += part
    return tuple(slices)


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
    if not holds(tensor, plan, rank, manifest):
        return ()
    full = tuple((0, size) for size in tensor.shape)
    if tensor.tp_dim is None:
        return ((full, (0,) * len(full)),)
    dim = tensor.tp_dim
    out = []
    for piece in tp_slices(tensor.blocks, tp_size(tensor, plan), tp_rank_of(tensor, plan, rank)):
        box = (*full[:dim], (piece.start, piece.stop), *full[dim + 1 :])
        offset = tuple(piece.local if d == dim else 0 for d in range(len(full)))
        out.append((box, offset))
    return tuple(out)


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
        if tensor.tp_dim is None:
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


__all__ = [
    "Box",
    "Holding",
    "Slice",
    "check_fits",
    "ep_owner",
    "expert_range",
    "holders",
    "holdings",
    "holds",
    "local_shape",
    "local_shape_on",
    "stages_of",
    "tp_rank_of",
    "tp_size",
    "tp_slices",
]
