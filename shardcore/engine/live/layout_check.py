"""What a destination in another layout must hold after a refit (``refit --check --to-layout``).

The reference is built without the planner or the executor: each of the rank's boxes of its own tensors is
filled, link by link of the weight map, from the source's global tensors; elements no link feeds (a layout's
vocabulary padding) are zeros where the map zeroes them (an engine's, ``WeightMap.zeroed``) or the rank quantizes
the tensor on landing (fp8 through a layout), and otherwise keep the fill value the check allocates them with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...refit.boxes import meets, moved, overlap
from ...refit.weightmap import MappedPlacement, translate

if TYPE_CHECKING:
    import torch

FILL = -1.0
"""What the check allocates destinations with: an element the refit leaves alone (Megatron's vocabulary padding)
keeps it, and one it should have written and did not shows."""


def _view(tensor: torch.Tensor, start: tuple[int, ...], box: Any) -> torch.Tensor:
    return tensor[tuple(slice(s, s + stop - lo) for s, (lo, stop) in zip(start, box))]


def through_map(plan: Any, rank: int) -> Callable[[str, Callable[[str], torch.Tensor]], torch.Tensor] | None:
    """For a rank of a destination seen through a weight map: a function giving its expected local tensor
    ``name`` from the source's global tensors (``full(source name)``); None for any other rank.

    A tensor quantized on landing (fp8 through a layout) is expected as the engine's high-precision local tensor,
    its padding zero (what the rank quantizes), quantized per block of it; its ``_scale_inv``, as those scales."""
    placement = plan.destination_placement_of(rank)
    if not isinstance(placement, MappedPlacement):
        return None
    weights, engine, local_tensors = placement.weights, placement.engine, placement.local_tensors()
    held = {weights.targets.tensors[h.position].name: h for h in engine.held(rank)}

    def gathered(name: str, full: Callable[[str], torch.Tensor], dtype: str, fill: float) -> torch.Tensor:
        import torch

        mine = held[name]
        local = torch.full(mine.shape, fill, dtype=getattr(torch, dtype))
        for piece in mine.slices:
            for link in weights.into(name):
                if meets(piece.box, link.box):
                    shared = overlap(piece.box, link.box)
                    target = _view(local, moved(piece.offset, piece.box, shared), shared)
                    origin = translate(shared, link.box, link.origin)
                    target.copy_(full(link.source)[tuple(slice(a, b) for a, b in origin)].reshape(target.shape))
        return local

    def expected(name: str, full: Callable[[str], torch.Tensor]) -> torch.Tensor:
        from ..transfer.convert import block_amax, quantize, scale_inv_of

        spec = local_tensors.tensor(name)
        weight = local_tensors.tensor(spec.scale_of or name)
        if weight.scale is None:
            return gathered(name, full, spec.destination_dtype, 0.0 if weights.zeroed else FILL)
        values = gathered(weight.name, full, weight.dtype, 0.0)
        scale_inv = scale_inv_of(block_amax(values))
        return scale_inv if spec.scale_of is not None else quantize(values, scale_inv, (0,) * values.dim())

    return expected


__all__ = ["FILL", "through_map"]
