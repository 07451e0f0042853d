"""Where an fp8 weight's scales are computed: by the source ranks holding its data, before it moves.

A weight converted to ``float8_e4m3fn`` carries ``<name>_scale_inv`` (``TensorSpec.scale_spec``), a tensor of
the plan like any other: placed like its weight on both sides, sent by source ranks, checked and written
into the destinations. The sender of a piece of the weight quantizes it with the scales of its elements, so
every source rank that holds part of the weight needs the scales of the part it holds:

- **Per 128x128 block**: ``check_fits`` keeps every tp part of a block-scaled weight a run of whole blocks,
  on the source as on the destinations, so a block lies in one part and each of its holders computes its
  scale from its own local tensor: nothing to exchange. The destinations need that alignment anyway (a local
  scale tensor is the blocks of the local weight; vLLM refuses tp slices that cut a block), and every preset
  meets it at tp <= 8. A block that straddled two source parts would need one partial amax per block from
  each; a layout that would is a ``ManifestError`` at planning time, before any byte moves.
- **Per tensor**: the scale is the amax of the whole weight, whose tp parts lie on different ranks; no rule
  can avoid that. So before the data moves, each holder of a part receives the partial amax (one float32)
  of every other part, from the holder of that part in the same place of its replica set (the same dp and
  cp coordinates, in a shard). ``amax_exchange`` says which: it is a tiny exchange of its own, run by the
  executor with the refit's messages and checks, and each rank derives its part from the source placement
  alone, as it derives its transfers.

Through a layout (an engine's names and packing) a block of the destination's tensor gathers elements of
several source tensors and ranks, so there the destination ranks quantize instead, once their tensors have
landed (``landing.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .part import Transfer, transfer_order
from .placement import Placement

AMAX_BYTES = 4
"""A partial amax travels as one float32."""


class AmaxExchange(NamedTuple):
    """One rank's part of the partial-amax exchange of per-tensor scales.

    A transfer's tensor is the weight's name and its box is one part's entry in the vector of every part's
    partial: the sender's own partial is a [1] tensor, the receiver's vector has one entry per part.

    Attributes:
        sends: This rank's partial amax to each rank that needs it, in the order of a plan's part (``transfer_order``).
        recvs: Every other part's partial amax this rank needs.
        parts: For each per-tensor-scaled weight this rank holds: (its own part's index, the number of parts).
    """

    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    parts: dict[str, tuple[int, int]]


def amax_exchange(plan: Any, rank: int) -> AmaxExchange:
    """Which partial amaxes ``rank`` sends and receives so that every source holder of a per-tensor-scaled
    weight knows its whole amax: the holder of part j at index k of its part's holders is served by index
    ``k % |holders of j|`` of each other part's.

    Args:
        plan: A refit plan (``source_placement``, ``manifest`` and ``tensors``, a partial refit's positions).
        rank: A rank of its world.
    """
    source: Placement = plan.source_placement
    manifest = plan.manifest
    sends: list[Transfer] = []
    recvs: list[Transfer] = []
    parts: dict[str, tuple[int, int]] = {}
    chosen = plan.tensors  # a partial refit's tensors (None: every one): no other weight is read or scaled
    for held in source.held(rank):
        tensor = manifest.tensors[held.position]
        if tensor.scale != "tensor" or not held.slices or (chosen is not None and held.position not in chosen):
            continue
        holder_sets = sorted({piece.holders.ranks for piece in source.slices(held.position)})
        own = held.slices[0].holders.ranks  # a shard's rank holds one tp part of a tensor
        mine, k = holder_sets.index(own), own.index(rank)
        parts[tensor.name] = (mine, len(holder_sets))
        for j, other in enumerate(holder_sets):
            if j == mine:
                continue
            recvs.append(Transfer(tensor.name, other[k % len(other)], rank, ((j, j + 1),), (0,), (j,), AMAX_BYTES))
            for client in other[k :: len(own)]:  # the holders of part j that this rank serves
                sends.append(Transfer(tensor.name, rank, client, ((mine, mine + 1),), (0,), (mine,), AMAX_BYTES))
    order = transfer_order(manifest)
    return AmaxExchange(tuple(sorted(sends, key=order)), tuple(sorted(recvs, key=order)), parts)


__all__ = ["AMAX_BYTES", "AmaxExchange", "amax_exchange"]
