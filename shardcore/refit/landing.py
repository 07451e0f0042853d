"""fp8 through a layout: the destination ranks quantize what lands, with the scales of their own tensors.

Between Megatron shards an fp8 weight is quantized by its senders (``scales.py``): ``check_fits`` keeps every
scale block in one source part, so each sender knows the scales of what it sends. Through a weight map that no
longer holds: one 128x128 block of an engine's local tensor (128 rows of vLLM's ``qkv_proj`` on one tp rank)
gathers elements of several source tensors and ranks (q, k and v of Megatron's interleaved ``linear_qkv``), so
sender-side scales would need one partial amax per block from each of them, an exchange as large as the
scale tensors and a phase of its own before any data moves.

So a refit through a layout converts on the *receiver*, as vLLM's online fp8 and verl's fp8 rollout do (the
engine receives high-precision weights and quantizes them at load): pieces travel in the source dtype (the
plan's transfers and stats count those wire bytes), each destination rank lands them into a high-precision
staging copy of its local tensor and, once every piece of that tensor has landed, quantizes it per 128x128
block of the *local* tensor (for ``qkv_proj``, of the fused tensor) into the fp8 weight and its
``<name>_scale_inv`` (``shardcore.engine.transfer.landing``). For the weights it quantizes the wire carries twice
the bytes of an fp8 one (bf16 sources); no partial amax is exchanged, and no block spans two ranks by construction.
What converts is the source manifest's choice (``Manifest.converted`` quantizes the linear layers' weights only), so
an engine's embedding, head, norms, biases and router land in the model's dtype, with no scale tensor.

Here, torch-free, is what a plan needs of it: which destination tensors convert (those whose source tensors
convert, all alike: a destination tensor is quantized whole), the engine's tensors as the destination holds them
(``landed``: each converting one with its dtype and scale tensor, what the executor checks the caller's tensors
against), and the check that every scale block of a destination rank is the engine's own:

- a rank's box of a split tensor starts and ends on a multiple of 128 (or at the tensor's end) along each
  blocked dim, so that its local blocks are blocks of the whole tensor and its scale tensor is a slice of the
  whole's; vLLM refuses a tp share of a block-quantized linear layer that is not whole blocks;
- where vLLM packs two weights into one tensor (``qkv_proj``'s q, k and v; ``gate_up_proj``'s gate and up;
  each expert's gate and up in ``w13_weight``) each part is whole blocks: vLLM's ``validate_fp8_block_shape``
  refuses a packed part that is not, since one block would mix two weights.

Both are planning errors (``ManifestError``, naming the tensor and the fix), before any byte moves. Per-tensor
scales (``scale: tensor``) and plain casts are refused through a layout: a per-tensor scale of a fused tensor
needs the amax of every rank's part of it, and vLLM keeps one per packed part; convert them between Megatron
shards instead. A source in an HF layout (a checkpoint) converts as the Megatron tensors that feed each of its
tensors do (``carried``): ``q_proj`` as ``linear_qkv``, so the same weights are quantized from either side.

Stacked experts (vLLM's ``w13_weight [local experts, 2*moe_ffn/tp, hidden]`` and ``w2_weight``, the
``hf-stacked`` layout's ``gate_up_proj`` and ``down_proj``) are blocked per expert, as vLLM's block-quantized
``FusedMoE`` holds them: the leading dim is batch, each expert's matrix has blocks of its own, so
``w13_weight_scale_inv`` is [local experts, ceil(2*moe_ffn/tp / 128), ceil(hidden / 128)]
(``manifest.blocked_from`` and ``scale_shape`` say it once; the amax and quantize functions follow them). The
checks above apply to the last two dims; an expert dim is split over ep anywhere, since no block spans two
experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise

from ..errors import ManifestError, RefitInputError
from .manifest import SCALE_BLOCK, SCALED, Manifest, TensorSpec, blocked_from, tensor_label
from .placement import Placement
from .weightmap import MappedPlacement, WeightMap

NO_DELTA = (
    "with fp8 through a layout: the destinations quantize what lands, so they hold fp8, not the wire's bytes a "
    "delta builds on; refit without delta"
)
"""Why a delta refit cannot land quantized (after the flag or keyword that asked for delta)."""
FIX = "leave that tensor in its dtype (to_dtype per tensor in a manifest file), or choose sizes or a tp that do"
"""How to get past a tensor that cannot be block-quantized where the destination holds it."""


def landed(source: Manifest, destination: Placement, packing: WeightMap | None) -> MappedPlacement:
    """``destination`` (a side of a refit through a layout) quantizing on landing what ``source`` converts.

    Args:
        source: The converting manifest of the refit's source tensors (``Manifest.converted``, or per tensor), by
            the names the source holds them (a source in an HF layout: ``carried`` through Megatron -> HF).
        destination: A destination's placement through its weight map (``families.sides``).
        packing: The map from the HF tensors into the destination's (vLLM's packing), whose parts each converting
            tensor must keep whole blocks of; None for a layout that packs nothing.

    Raises:
        ManifestError: a destination in the source's own layout, a conversion other than float8_e4m3fn with block
            scales, a destination tensor fed by tensors converted unlike, or one whose rank boxes or packed parts
            cut a scale block (of one expert's matrix, in stacked experts); each naming the tensor and the fix.
    """
    if not isinstance(destination, MappedPlacement):
        raise ManifestError(
            f"{destination.describe()} holds the source's own layout: a refit through a layout converts where the "
            f"layout changes; convert into this shard in a refit of its own (without layouts)"
        )
    weights = destination.weights
    converting: list[TensorSpec] = []
    for target in weights.targets:
        to_dtype, scale = _conversion(destination.label, target.name, _feeding(source, weights, target.name))
        if to_dtype is None:
            continue
        if to_dtype != SCALED or scale != "block":
            what = f"{to_dtype} with {scale} scales" if scale else f"a cast to {to_dtype}"
            raise ManifestError(
                f"{destination.label}: tensor {tensor_label(target.name)}: {what} is not planned through a layout "
                f"(only {SCALED} with block scales, quantized by the destination ranks); convert it in a refit "
                f"between Megatron shards"
            )
        _check_boxes(destination, target)
        _check_parts(destination, target, packing)
        converting.append(target)
    chosen = {spec.name for spec in converting}
    tensors = tuple(
        replace(spec, to_dtype=SCALED, scale="block") if spec.name in chosen else spec for spec in weights.targets
    )
    return MappedPlacement(destination.engine, weights, replace(weights.targets, tensors=tensors))


def carried(converting: Manifest, into: WeightMap) -> Manifest:
    """``converting``'s conversions carried through ``into`` onto its targets: the converting manifest of a source
    in an HF layout (a checkpoint), each HF tensor converted as the Megatron tensors that feed it are, so that what
    converts is the same choice whichever layout the source holds (``linear``: q_proj as linear_qkv).

    Raises:
        ManifestError: an HF tensor fed by Megatron tensors converted unlike.
    """
    tensors = []
    for target in into.targets:
        to_dtype, scale = _conversion(into.name, target.name, _feeding(converting, into, target.name))
        tensors.append(replace(target, to_dtype=to_dtype, scale=scale))
    return replace(into.targets, tensors=tuple(tensors))


def _feeding(converting: Manifest, weights: WeightMap, target: str) -> list[TensorSpec]:
    """The tensors of ``converting`` that feed ``target`` through ``weights`` (its sources, with their conversions)."""
    return [converting.tensor(weights.sources.tensors[position].name) for position in set(weights.feeds(target))]


def _conversion(where: str, target: str, feeding: list[TensorSpec]) -> tuple[str | None, str | None]:
    """The (to_dtype, scale) of a tensor made of ``feeding``: theirs, which must be alike, since a tensor is
    converted whole.

    Raises:
        ManifestError: tensors converted unlike, naming them.
    """
    kinds = {(spec.to_dtype, spec.scale): spec.name for spec in feeding}
    if len(kinds) > 1:
        shown = ", ".join(f"{name} to {to or 'its dtype'}" for (to, _), name in kinds.items())
        raise ManifestError(
            f"{where}: tensor {tensor_label(target)} is made of tensors converted unlike "
            f"({shown}): convert all the tensors that feed one destination tensor alike"
        )
    ((to_dtype, scale),) = kinds
    return to_dtype, scale


def _check_boxes(destination: MappedPlacement, target: TensorSpec) -> None:
    """Every rank's box of ``target`` is whole scale blocks along each blocked dim (ends at the tensor's end);
    a stacked tensor's expert dim is batch, cut anywhere (``blocked_from``)."""
    engine = destination.engine
    first = blocked_from(len(target.shape))
    for piece in engine.slices(engine.manifest.index(target.name)):
        for dim, ((start, stop), size) in enumerate(zip(piece.box, target.shape)):
            if dim < first:
                continue
            if start % SCALE_BLOCK or (stop % SCALE_BLOCK and stop != size):
                raise ManifestError(
                    f"{destination.label}: tensor {tensor_label(target.name)} {list(target.shape)}: rank "
                    f"{piece.holders.ranks[0]} holds [{start}, {stop}) of dim {dim}, which cuts a {SCALE_BLOCK}x"
                    f"{SCALE_BLOCK} scale block (its local blocks would not be the tensor's): {FIX}"
                )


def _check_parts(destination: MappedPlacement, target: TensorSpec, packing: WeightMap | None) -> None:
    """Where ``packing`` puts two weights one above the other in ``target`` (in one expert's matrix of a stacked
    tensor: vLLM's ``w13_weight`` = per expert [gate; up]), the seam is on a scale block's edge."""
    if packing is None:
        return
    rows = blocked_from(len(target.shape))  # the packed dim: the first blocked one, after an expert dim
    links = sorted(packing.into(target.name), key=lambda link: link.box)
    for before, link in pairwise(links):
        seam = link.box[rows][0]
        beside = before.box[:rows] == link.box[:rows] and before.box[rows][1] == seam
        if link.source != before.source and beside and seam % SCALE_BLOCK:
            raise ManifestError(
                f"{destination.label}: tensor {tensor_label(target.name)} {list(target.shape)}: the engine packs "
                f"{before.source} and {link.source} into it at row {seam}, inside a {SCALE_BLOCK}-row scale block "
                f"(vLLM takes block-scaled fp8 only where each packed part is whole blocks): {FIX}"
            )


def refuse_delta(destinations: Sequence[Placement], asked: str) -> None:
    """Refuse a delta refit into destinations that quantize on landing, from the plan alone: before any process
    starts (``refit --check``), as the executor refuses it on each rank.

    Args:
        destinations: the plan's destination placements.
        asked: how delta was asked for, for the message (``--delta``, ``delta=True``).

    Raises:
        RefitInputError: a destination quantizes on landing.
    """
    if any(isinstance(placement, MappedPlacement) and placement.landing is not None for placement in destinations):
        raise RefitInputError(f"{asked} {NO_DELTA}")


__all__ = ["NO_DELTA", "carried", "landed", "refuse_delta"]
