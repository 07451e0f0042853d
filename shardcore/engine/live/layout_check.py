"""What a destination in another layout must hold after a refit (``refit --check --to-layout``).

The reference is built without the planner or the executor: each of the rank's boxes of its own tensors is
filled, link by link of the weight map, from the source's global tensors; elements no link feeds (an engine's
vocabulary padding) keep the fill value the check allocates them with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...refit.placement import meets, moved, overlap
from ...refit.weightmap import MappedPlacement, translate

if TYPE_CHECKING:
    import torch

FILL = -1.0
"""What the check allocates destinations with: an element the refit leaves alone keeps it."""


def _view(tensor: torch.Tensor, start: tuple[int, ...], box: Any) -> torch.Tensor:
    return tensor[tuple(slice(s, s + stop - lo) for s, (lo, stop) in zip(start, box))]


def through_map(plan: Any, rank: int) -> Callable[[str, Callable[[str], torch.Tensor]], torch.Tensor] | None:
    """For a rank of a destination seen through a weight map: a function giving its expected local tensor
    ``name`` from the source's global tensors (``full(source name)``); None for any other rank."""
    placement = next((p for p in plan.destination_placements if rank in p.ranks), None)
    if not isinstance(placement, MappedPlacement):
        return None
    weights, engine = placement.weights, placement.engine
    held = {weights.targets.tensors[h.position].name: h for h in engine.held(rank)}

    def expected(name: str, full: Callable[[str], torch.Tensor]) -> torch.Tensor:
        import torch

        mine = held[name]
        dtype = getattr(torch, plan.destination_tensor(name).destination_dtype)
        local = torch.full(mine.shape, FILL, dtype=dtype)
        for piece in mine.slices:
            for link in weights.into(name):
                if meets(piece.box, link.box):
                    shared = overlap(piece.box, link.box)
                    target = _view(local, moved(piece.offset, piece.box, shared), shared)
                    origin = translate(shared, link.box, link.origin)
                    target.copy_(full(link.source)[tuple(slice(a, b) for a, b in origin)].reshape(target.shape))
        return local

    return expected


__all__ = ["FILL", "through_map"]
