"""A rank's refit tensors, allocated from its part of the plan: what a user passes to ``execute_refit``.

``RankRefit`` names every tensor a rank must give (``source_shapes``/``source_dtypes``) and hold
(``destination_shapes``/``destination_dtypes``); ``allocate_refit`` makes them, with the dtypes the
executor checks (a bf16 model's sources are bf16, an fp8 target's destinations float8_e4m3fn). Seeded
sources are a pure function of each element's global index and the seed, computed in integers (exact on
any device), so every rank, in any layout and any process, fills the same element with the same value:
the two ends of a refit agree without talking, and each rank computes its own boxes only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ...errors import LayoutError
from ...plan.arguments import shown

if TYPE_CHECKING:
    import torch

    from ...refit.boxes import Box
    from ...refit.plan import RefitPlan

_MULTIPLIER = 0x9E3779B1
"""Knuth's multiplicative hash constant (2^32 / golden ratio): spreads consecutive indices across the range."""
_LEVELS = 2001
"""A seeded element is one of 2001 values in [-1, 1] (steps of 1/1000), rounded to its dtype alike everywhere."""


class RefitTensors(NamedTuple):
    """One rank's tensors for ``execute_refit(plan, sources, destinations)``, by the names the plan uses."""

    sources: dict[str, torch.Tensor]
    destinations: dict[str, torch.Tensor]


def seeded_box(shape: tuple[int, ...], box: Box, seed: int, dtype: torch.dtype, device: Any = None) -> torch.Tensor:
    """The values of ``box`` of a global tensor of ``shape``, seeded: element i (its row-major index in the global
    tensor) is ``((i * 0x9E3779B1 + seed) mod 2^32 mod 2001 - 1000) / 1000``, in ``dtype``. Integer arithmetic,
    so every device and process computes the same bits; a box is computed alone, never the whole tensor."""
    import torch

    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in range(len(shape) - 1, -1, -1):
        start, stop = box[dim]
        steps = torch.arange(start, stop, dtype=torch.int64, device=device) * stride
        index = index + steps.reshape((-1,) + (1,) * (len(shape) - 1 - dim))
        stride *= shape[dim]
    hashed = (index * _MULTIPLIER + seed) % (1 << 32) % _LEVELS
    return ((hashed - _LEVELS // 2).to(torch.float32) / (_LEVELS // 2)).to(dtype)


def allocate_refit(plan: RefitPlan, rank: int, *, seed: int | None = None, device: Any = None) -> RefitTensors:
    """Allocate ``rank``'s sources and destinations for ``plan``, in the shapes and dtypes its part names.

    Args:
        plan: The refit plan (``plan_refit``, ``plan_refit_from``, ``RefitRequest.plan``).
        rank: The rank whose part to allocate (its global rank in the plan's world).
        seed: None: every tensor empty (``torch.empty``: fill the sources with the model's weights). An int:
            each source holds its slices of global tensors seeded by element index (``seeded_box``; the same
            ``seed`` gives the same global tensors on every rank and in every layout, so a destination can be
            compared with ``allocate_refit(reverse_plan, rank, seed=seed).sources``). Destinations are empty.
        device: Where to allocate (a ``torch.device`` or its name); None: torch's default device.

    Returns:
        ``RefitTensors(sources, destinations)``: two dicts of name -> tensor, nothing more and nothing less
        than ``execute_refit`` expects of this rank.

    Raises:
        LayoutError: the rank is outside the plan's world, or ``seed`` is not an int.
    """
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise LayoutError(f"seed={shown(seed)}: expected an int (or None for empty tensors)")
    mine = plan.for_rank(rank)
    sources = _empty(mine.source_shapes, mine.source_dtypes, device)
    if seed is not None:
        manifest = plan.manifest
        for held in plan.source_placement.held(rank):
            spec = manifest.tensors[held.position]
            local = sources.get(spec.name)
            if local is None:  # outside a partial refit's subset, or a derived scale tensor
                continue
            for piece in held.slices:
                target = tuple(slice(o, o + stop - start) for o, (start, stop) in zip(piece.offset, piece.box))
                local[target] = seeded_box(spec.shape, piece.box, seed, local.dtype, local.device)
    return RefitTensors(sources, _empty(mine.destination_shapes, mine.destination_dtypes, device))


def _empty(shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str], device: Any) -> dict[str, torch.Tensor]:
    import torch

    return {
        name: torch.empty(shape, dtype=getattr(torch, dtypes[name]), device=device) for name, shape in shapes.items()
    }
