"""Converting refits on the wire: casts, fp8 scales, and the exchange of partial amaxes that per-tensor scales need.

Every piece travels in its tensor's wire dtype (``TensorSpec.wire_dtype``, the narrower one): the sender casts
what narrows (into the staging buffer, so such a send is never in place), the receiver casts what widens (out
of the staging buffer). A ``float8_e4m3fn`` piece is quantized by its sender with its elements' scales:
``q = (x.float() / scale_inv).to(float8_e4m3fn)``, so that ``q * scale_inv`` dequantizes it, where a block's
(or the tensor's) ``scale_inv`` is its amax / 448 in float32 (1 for an all-zero block): the block's largest
magnitude maps to 448, e4m3fn's largest finite value. The source ranks compute the scale tensors before the
data moves (``shardcore.refit.scales`` says why they can) and send them like any tensor.

Through a layout the destination ranks quantize what lands instead (``transfer.landing``), with the same
``block_amax``, ``scale_inv_of`` and ``quantize``.

The partial-amax exchange runs first, on the refit's own tag: between two ranks both post every message of
it before any of the data's, and point-to-point messages between two ranks on one tag are matched in order,
so neither phase's messages can match the other's. Its batches precede the data's in the order every rank
shares, so the schedule's deadlock-freedom argument holds for the two phases together.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from ...refit.manifest import SCALE_BLOCK, Manifest, TensorSpec, blocked_from
from ...refit.scales import AmaxExchange, amax_exchange
from ...refit.schedule import Batch, rank_batches
from .exchange import Exchange
from .pieces import Plain

if TYPE_CHECKING:
    import torch

    from ...refit.part import RankRefit
    from ...refit.plan import RefitPlan
    from ...refit.schedule import Piece

E4M3_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` value: a block's largest magnitude is scaled to it."""


QUANTIZE_ELEMENTS = 1 << 19
"""Elements quantized at a time: the float32 temporaries of a chunk stay in cache (3x faster than whole pieces)."""


def scale_inv_of(amax: torch.Tensor) -> torch.Tensor:
    """``scale_inv`` from an amax (any shape): amax / 448 in float32, correctly rounded on every device, and 1
    where the amax is 0. The divisor is a tensor on the amax's device: CUDA multiplies by the reciprocal of a
    Python number instead of dividing, which differs in the last bit for most amaxes (seen on an H100), so a
    GPU sender's scales would differ from a CPU check's."""
    import torch

    amax = amax.float()
    return torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))


def amax_of(tensor: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in ``tensor``, as a float32 [1] (two reductions, no copy of the tensor)."""
    import torch

    low, high = torch.aminmax(_comparable(tensor))
    return torch.maximum(high, -low).float().reshape(1)


def block_amax(tensor: torch.Tensor) -> torch.Tensor:
    """The amax of each 128x128 block (128 for a 1-d tensor) as float32, shape ``scale_shape(tensor.shape)``: a
    stacked tensor's leading dims are batch, each matrix blocked on its own (``blocked_from``); a block cut by the
    tensor's end covers what there is of it."""
    import torch

    first = blocked_from(tensor.dim())
    lead, blocked = tuple(tensor.shape[:first]), tuple(tensor.shape[first:])
    cells = [-(-size // SCALE_BLOCK) for size in blocked]
    tensor = _comparable(tensor)
    if any(size % SCALE_BLOCK for size in blocked):  # padded with zeros: no magnitude's maximum changes
        padded = [*lead, *(n * SCALE_BLOCK for n in cells)]
        magnitudes = torch.zeros(padded, dtype=tensor.dtype, device=tensor.device)
        magnitudes[tuple(slice(0, size) for size in tensor.shape)] = tensor
        magnitudes.abs_()
    else:
        magnitudes = tensor.abs()
    if len(cells) == 1:
        return magnitudes.reshape(*lead, cells[0], SCALE_BLOCK).amax(dim=-1).float()
    grid = magnitudes.reshape(*lead, cells[0], SCALE_BLOCK, cells[1], SCALE_BLOCK)
    return grid.amax(dim=-1).amax(dim=-2).float()


def _comparable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in a dtype torch reduces on every device: float8 sources (torch has no fp8 max) as float32."""
    return tensor.float() if tensor.element_size() == 1 else tensor


def quantize(values: torch.Tensor, scale_inv: torch.Tensor, offset: tuple[int, ...]) -> torch.Tensor:
    """``values``, the box at ``offset`` of a local tensor whose scales are ``scale_inv`` (its blocks', or a [1]
    per-tensor scale), as float8_e4m3fn: each element / its block's scale_inv in float32, then cast; in chunks
    of rows, elementwise alike whatever the chunks. A stacked tensor's block scales are one matrix's per index
    of its batch dims (``blocked_from``): each matrix is quantized with its own."""
    import torch

    out = torch.empty(values.shape, dtype=torch.float8_e4m3fn, device=values.device)
    if blocked_from(values.dim()) and scale_inv.dim() == values.dim():  # per block of each stacked matrix
        for index in range(values.shape[0]):
            out[index] = quantize(values[index], scale_inv[offset[0] + index], offset[1:])
        return out
    step = max(1, QUANTIZE_ELEMENTS // max(1, values[0].numel()))
    for start in range(0, values.shape[0], step):
        chunk = values[start : start + step]
        out[start : start + step].copy_(_divided(chunk, scale_inv, (offset[0] + start, *offset[1:])))
    return out


def _divided(chunk: torch.Tensor, scale_inv: torch.Tensor, origin: tuple[int, ...]) -> torch.Tensor:
    """``chunk`` (at ``origin``) / each element's scale_inv, in float32, broadcasting the scales where it can."""
    import torch

    if scale_inv.dim() == 1 and scale_inv.numel() == 1:
        return chunk.float() / scale_inv
    rows = scale_inv[torch.arange(origin[0], origin[0] + chunk.shape[0], device=chunk.device) // SCALE_BLOCK]
    if chunk.dim() == 1:
        return chunk.float() / rows
    (count, width), first = chunk.shape, origin[1]
    if first % SCALE_BLOCK == 0 and width % SCALE_BLOCK == 0:  # whole blocks across: one scale per 128 columns
        cells = width // SCALE_BLOCK
        scales = rows[:, first // SCALE_BLOCK : first // SCALE_BLOCK + cells, None]
        return (chunk.float().view(count, cells, SCALE_BLOCK) / scales).view(count, width)
    columns = torch.arange(first, first + width, device=chunk.device) // SCALE_BLOCK
    return chunk.float() / rows[:, columns]


@dataclass
class Conversion(Plain):
    """One rank's pieces in a converting refit: moved as ``Plain`` ones are, each in its tensor's wire dtype (cast
    by the copies, or quantized with the scales this rank computes), after its part of the partial-amax exchange.

    Attributes:
        manifest: The plan's model.
        wire: Tensor name -> its torch wire dtype, for the tensors this rank moves that convert.
        scaled: The fp8 weights whose scales this rank computes (it sends or copies them or their scales from
            its sources; a relay forwards scales it received).
        amax: Its part of the partial-amax exchange.

    ``of`` makes it before this rank's tensors are checked (``needed_sources`` says which it needs); the executor
    gives it them (``dataclasses.replace``) once they are.
    """

    manifest: Manifest
    wire: dict[str, torch.dtype]
    scaled: set[str]
    amax: AmaxExchange
    scale_inv: dict[str, torch.Tensor] = field(default_factory=dict)
    """Weight name -> this rank's local scale tensor of it, once computed."""

    @classmethod
    def of(cls, plan: RefitPlan, mine: RankRefit, rank: int) -> Conversion | None:
        """This rank's conversions in ``plan`` (``mine`` its part), or None when the plan converts nothing."""
        import torch

        manifest = plan.manifest
        if not manifest.converts:
            return None
        specs = [manifest.tensor(name) for name in {t.tensor for t in (*mine.sends, *mine.recvs, *mine.copies)}]
        wire = {spec.name: getattr(torch, spec.wire_dtype) for spec in specs if spec.to_dtype is not None}
        outgoing = mine.sources_read  # a relay forwards bytes already converted
        scaled = {
            spec.scale_of or spec.name
            for spec in specs
            if spec.name in outgoing and (spec.scale_of is not None or spec.scale is not None)
        }
        return cls(manifest, wire, scaled, amax_exchange(plan, rank))

    def needed_sources(self, sent: set[str]) -> set[str]:
        """The source tensors the caller must pass: those this rank sends or copies, with each scale tensor's
        weight in its place, and the weights whose partial amax it sends."""
        names = {self.manifest.tensor(name).scale_of or name for name in sent}
        return names | {t.tensor for t in self.amax.sends}

    def in_place(self, piece: Piece, send: bool) -> bool:
        """Whether ``piece`` can go from the source tensor (``send``) or into the destination as it is: its bytes
        on that side are the wire's (else it is cast on the way, through the staging buffer)."""
        spec = self.manifest.tensor(piece.tensor)
        return spec.to_dtype is None or spec.wire_dtype == (spec.dtype if send else spec.destination_dtype)

    def wire_dtype(self, name: str, default: torch.dtype) -> torch.dtype:
        return self.wire.get(name, default)

    def casts(self) -> Container[str]:
        """The tensors that travel in their wire dtype."""
        return self.wire

    def quantizes(self, name: str) -> bool:
        """An fp8 weight's pieces are quantized with its scales on their way out."""
        return name in self.scaled

    def outgoing(self, name: str, view: torch.Tensor, offset: tuple[int, ...]) -> torch.Tensor:
        """What to copy into the wire (or a local destination) for ``view``, the box at ``offset`` of the local
        source tensor ``name``: quantized with its scales for an fp8 weight, else the view itself (the copy into
        the wire's or the destination's dtype casts it)."""
        scale_inv = self.scale_inv.get(name)
        return view if scale_inv is None else quantize(view, scale_inv, offset)

    def amax_batches(self, rank: int, world: int, bucket_bytes: int, max_ops: int) -> list[Batch]:
        """This rank's batches of the partial-amax exchange, one float32 per part of each weight: what ``prepare``
        posts, made before the refit's first meeting so that its tally counts them too (``refit.pairing``)."""
        shapes = {name: (parts,) for name, (_, parts) in self.amax.parts.items()}
        return rank_batches(self.amax, rank, world, bucket_bytes, max_ops, shapes)

    def prepare(self, exchange: Exchange, batches: list[Batch]) -> None:
        """Compute this rank's source scales, after the partial-amax exchange (``batches``: ``amax_batches``), and
        add the scale tensors to its sources; a failure here makes ``exchange`` drain, as any other of this
        rank's."""
        import torch

        partials: dict[str, torch.Tensor] = {}
        gathered: dict[str, torch.Tensor] = {}
        for name, (_, parts) in self.amax.parts.items():
            device = self.sources[name].device if name in self.sources else self.device
            partials[name] = torch.zeros(1, device=device)
            gathered[name] = torch.zeros(parts, device=device)
        try:
            for name in partials:
                if name in self.sources:
                    partials[name].copy_(amax_of(self.sources[name]))
                    gathered[name][self.amax.parts[name][0]] = partials[name][0]
        except Exception as error:  # published and drained: the peers still get every message they wait for
            exchange.fail(error)
        exchange.run_first(batches, Plain(sources=partials, destinations=gathered), "the partial-amax exchange")
        if exchange.draining:
            return
        try:
            self._scales(gathered)
        except Exception as error:
            exchange.fail(error)

    def _scales(self, gathered: Mapping[str, torch.Tensor]) -> None:
        for name in sorted(self.scaled):
            spec = self.manifest.tensor(name)
            if spec.scale == "tensor":
                scale_inv = scale_inv_of(gathered[name].amax().reshape(1))
            else:
                scale_inv = scale_inv_of(block_amax(self.sources[name]))
            self.scale_inv[name] = scale_inv
            self.sources[cast(TensorSpec, spec.scale_spec()).name] = scale_inv  # a weight of ``scaled`` has a scale


__all__ = ["E4M3_MAX", "QUANTIZE_ELEMENTS", "Conversion", "amax_of", "block_amax", "quantize", "scale_inv_of"]
