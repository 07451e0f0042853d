"""fp8 through a layout on the wire: each destination rank quantizes its local tensors once they have landed.

``shardcore.refit.landing`` says why a refit through a layout converts on the receiver. Here is how a rank does
it. A converting destination tensor's pieces (received, copied locally) land in a *staging* copy of the rank's
local tensor, in the engine's high-precision dtype (the wire's), allocated at its first piece and zero-filled,
so that elements no piece feeds (an engine's vocabulary padding, which vLLM zeroes) quantize to zero. When its
last piece has landed, and a relay's last forward of it (fan-out: forwards read the staging) has been packed,
the rank computes the 128x128 block amax of the whole local tensor (of each expert's matrix, in stacked
experts: ``manifest.blocked_from``), writes the fp8 weight and its ``<name>_scale_inv`` with the same functions
and formula as a sender-side conversion (``convert.block_amax``, ``scale_inv_of``, ``quantize``), and frees the
staging.

Memory: at peak, the staging holds every converting local tensor that has begun to land and not finished, in
the source dtype (``peak_bytes``, ``TransferStats.landing_peak_bytes``). The schedule orders messages by peer
pairs, not by tensor, so a tensor fed by several senders stays open until the last of them has sent its part:
the peak can reach the rank's whole local share of the converting tensors in the source dtype (twice the fp8
weights for a bf16 source), on top of the fp8 destinations themselves. A tensor fed by one sender (tp alike on
both sides) closes as soon as that sender's messages of it have landed.

A piece is never written in place (the destination is fp8, the wire is not): every one goes through the
exchange's staging buffer, like any converting piece. A delta refit cannot build on these destinations (they
hold fp8, not the wire's bytes its deltas apply to), so the executor refuses the two together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING

from .convert import block_amax, quantize, scale_inv_of
from .pieces import Plain

if TYPE_CHECKING:
    import torch

    from ...refit.part import RankRefit
    from ...refit.plan import RefitPlan
    from ...refit.schedule import Piece


@dataclass
class Landing(Plain):
    """One rank's pieces in a refit that quantizes destination tensors on landing: moved as ``Plain`` ones are,
    but a converting tensor's pieces land in its staging copy (``written``), never in place.

    Attributes:
        destinations: The rank's destination tensors (the fp8 weights and their scale tensors).
        dtypes: Converting tensor name -> the torch dtype its staging (and the wire) holds it in.
        pending: Converting tensor name -> elements still to land in it, and to forward from it.
        staging: The staging copies allocated and not yet quantized.
        peak_bytes: The most bytes of staging held at once.
    """

    dtypes: dict[str, torch.dtype]
    pending: dict[str, int]
    staging: dict[str, torch.Tensor] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    held_bytes: int = 0
    peak_bytes: int = 0

    @classmethod
    def of(
        cls,
        plan: RefitPlan,
        mine: RankRefit,
        sources: dict[str, torch.Tensor],
        destinations: Mapping[str, torch.Tensor],
    ) -> Landing | None:
        """This rank's pieces in ``plan`` (``mine`` its part, ``sources`` and ``destinations`` its tensors), or None
        when it quantizes nothing on landing (a plan between Megatron shards quantizes on its senders:
        ``transfer.convert``)."""
        import torch

        placement = plan.destination_placement_of(mine.rank)
        landing = getattr(placement, "landing", None)  # a MappedPlacement's, through a layout
        if landing is None:
            return None
        specs = {name: landing.tensor(name) for name in mine.destination_shapes}
        converting = {name: spec for name, spec in specs.items() if spec.scale is not None}
        if not converting:
            return None
        pending = dict.fromkeys(converting, 0)
        for transfer in (*mine.recvs, *mine.copies, *(t for t in mine.sends if t.hop)):
            if transfer.destination in pending:
                pending[transfer.destination] += prod(stop - start for start, stop in transfer.box)
        dtypes = {name: getattr(torch, spec.dtype) for name, spec in converting.items()}
        return cls(sources=sources, destinations=destinations, dtypes=dtypes, pending=pending)

    def __contains__(self, name: object) -> bool:
        return name in self.pending

    def in_place(self, piece: Piece, send: bool) -> bool:
        """A converting tensor's pieces land in its staging copy, allocated when its first piece lands."""
        return send or piece.destination not in self.pending

    def written(self, name: str) -> torch.Tensor:
        """The tensor the pieces of destination ``name`` land in: a converting one's staging copy, allocated
        (zero-filled) when first asked for."""
        if name not in self.pending:
            return self.destinations[name]
        found = self.staging.get(name)
        if found is None:
            import torch

            target = self.destinations[name]
            found = self.staging[name] = torch.zeros(target.shape, dtype=self.dtypes[name], device=target.device)
            self.held_bytes += found.numel() * found.element_size()
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return found

    def written_dtype(self, name: str) -> torch.dtype:
        """A converting tensor's staging dtype, else its destination's."""
        return self.dtypes[name] if name in self.pending else self.destinations[name].dtype

    def landed(self, name: str, elements: int) -> None:
        """``elements`` of ``name`` have landed in its staging copy (or been packed for a forward): once none is
        left, quantize it into its destination."""
        if name not in self.pending:
            return
        self.pending[name] -= elements
        if self.pending[name] == 0:
            self._quantize(name)

    def finish(self) -> None:
        """Quantize what no piece fed (an engine tensor of padding alone: zeros), once every message has landed."""
        for name, left in self.pending.items():
            if left == 0 and name not in self.done:
                self._quantize(name)

    def _quantize(self, name: str) -> None:
        """The fp8 weight and its block scales from the staging copy, which is freed."""
        values = self.written(name)
        scale_inv = scale_inv_of(block_amax(values))
        self.destinations[f"{name}_scale_inv"].copy_(scale_inv)
        self.destinations[name].copy_(quantize(values, scale_inv, (0,) * values.dim()))
        del self.staging[name]
        self.held_bytes -= values.numel() * values.element_size()
        self.done.add(name)


__all__ = ["Landing"]
