"""Refit a state dict of DTensors from one DeviceMesh to another, which torch cannot do.

``DTensor.redistribute`` works within one mesh only ("Cross device mesh comm not supported
yet!"). Here each rank reads its own holdings off its DTensors' placements (``Shard(d)`` and
``Replicate()``) as global boxes, one all-gather shares them (``all_gather_objects``, which
needs no numpy), and every rank derives the same plan from them: each destination box is cut
along the source shards it overlaps, and each cut comes from the destination rank itself when
it holds a source replica (a local copy), else from the least loaded replica so far.
shardcore's engine then moves the bytes (:func:`shardcore.execute_refit`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from math import prod
from typing import Any, NamedTuple

from shardcore import RefitInputError, TransferStats, execute_refit
from shardcore.engine import DEFAULT_BUCKET_BYTES, all_gather_objects
from shardcore.refit import Transfer

Box = tuple[tuple[int, int], ...]


class TensorInfo(NamedTuple):
    """What the source and destination state dicts agree a tensor is."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int


class _Holding(NamedTuple):
    side: str  # "src" or "dst"
    name: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    rank: int
    box: Box | None  # None: this rank's local shard is empty
    problem: str | None


@dataclass
class RankPart:
    """One rank's share of a plan, in the form shardcore's executor takes."""

    rank: int
    sends: list[Transfer] = field(default_factory=list)
    recvs: list[Transfer] = field(default_factory=list)
    copies: list[Transfer] = field(default_factory=list)
    source_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    destination_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class DTensorManifest:
    """The tensors both state dicts hold, by name."""

    tensors: dict[str, TensorInfo]

    def tensor(self, name: str) -> TensorInfo:
        return self.tensors[name]


@dataclass
class DTensorRefitPlan:
    """Every transfer of a refit between two sets of DTensor holdings; ``for_rank`` picks one rank's part."""

    manifest: DTensorManifest
    transfers: list[Transfer]
    holdings: dict[tuple[str, str, int], Box]

    def for_rank(self, rank: int) -> RankPart:
        part = RankPart(rank)
        for transfer in self.transfers:
            if transfer.src == rank and transfer.dst == rank:
                part.copies.append(transfer)
            elif transfer.src == rank:
                part.sends.append(transfer)
            elif transfer.dst == rank:
                part.recvs.append(transfer)
        for (side, name, holder), box in self.holdings.items():
            if holder == rank:
                shapes = part.source_shapes if side == "src" else part.destination_shapes
                shapes[name] = tuple(stop - start for start, stop in box)
        return part


def local_box(tensor: Any) -> tuple[Box | None, str | None]:
    """This rank's global box of a DTensor from its mesh coordinate and placements, or why it has none.

    Follows ``torch.chunk``: along a dim sharded over n ranks, shard k holds rows
    [k*c, min((k+1)*c, size)) with c = ceil(size / n); a dim sharded twice is chunked again.
    """
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = tensor.device_mesh, tensor.placements
    for placement in placements:
        if type(placement) is not Shard and not isinstance(placement, Replicate):
            return None, (
                f"placement {placement} is not supported: refit reads Shard(d) and Replicate() only "
                f"(redistribute a Partial to Replicate, and FSDP's strided shards to plain ones, first)"
            )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None, None
    box = [(0, size) for size in tensor.shape]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            dim, n, k = placement.dim, mesh.size(mesh_dim), coordinate[mesh_dim]
            start, stop = box[dim]
            chunk = -(-(stop - start) // n)
            box[dim] = (min(stop, start + k * chunk), min(stop, start + (k + 1) * chunk))
    if any(stop <= start for start, stop in box) and len(box) > 0:
        return None, None
    return tuple(box), None


def _holdings(side: str, state: Mapping[str, Any], rank: int) -> list[_Holding]:
    from torch.distributed.tensor import DTensor

    records = []
    for name, tensor in state.items():
        if not isinstance(tensor, DTensor):
            wrong = f"{side} tensor {name!r} is a {type(tensor).__name__}, not a DTensor"
            records.append(_Holding(side, name, (), "", 0, rank, None, wrong))
            continue
        box, why = local_box(tensor)
        problem = None if why is None else f"{side} tensor {name!r}: {why}"
        dtype = str(tensor.dtype).removeprefix("torch.")
        records.append(_Holding(side, name, tuple(tensor.shape), dtype, tensor.element_size(), rank, box, problem))
    return records


def _manifest(records: Sequence[_Holding]) -> DTensorManifest:
    """The tensors every destination needs, checked for agreement between all ranks and both sides."""
    problems = [r.problem for r in records if r.problem]
    if problems:
        raise RefitInputError(f"refit cannot read the DTensors: {problems[0]}")
    seen: dict[str, _Holding] = {}
    for record in sorted(records, key=lambda r: (r.side != "src", r.rank)):
        first = seen.setdefault(record.name, record)
        if (record.shape, record.dtype) != (first.shape, first.dtype):
            raise RefitInputError(
                f"tensor {record.name!r}: the {first.side} side (rank {first.rank}) has global shape "
                f"{list(first.shape)} and dtype {first.dtype}, the {record.side} side (rank {record.rank}) has "
                f"{list(record.shape)} and {record.dtype}: both state dicts must describe the same global tensor"
            )
    sources = {r.name for r in records if r.side == "src"}
    wanted = sorted({r.name for r in records if r.side == "dst"})
    missing = [name for name in wanted if name not in sources]
    if missing:
        raise RefitInputError(
            f"destination tensor {missing[0]!r} has no source ({len(missing)} such): the source state dict must "
            f"hold every destination tensor under the same name"
        )
    return DTensorManifest({n: TensorInfo(n, seen[n].shape, seen[n].dtype, seen[n].itemsize) for n in wanted})


def _overlap(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(start < stop for start, stop in box) or not box else None


def plan_from_holdings(records: Sequence[_Holding]) -> DTensorRefitPlan:
    """The same plan on every rank, from every rank's holdings (see the module docstring)."""
    manifest = _manifest(records)
    holders: dict[str, dict[Box, list[int]]] = {}
    for r in records:
        if r.side == "src" and r.box is not None and r.name in manifest.tensors:
            holders.setdefault(r.name, {}).setdefault(r.box, []).append(r.rank)
    load: dict[int, int] = {}
    transfers = []
    needs = sorted((r.name, r.rank, r.box) for r in records if r.side == "dst" and r.box is not None)
    for name, dst, box in needs:
        info = manifest.tensor(name)
        covered = 0
        for src_box, ranks in sorted(holders.get(name, {}).items()):
            piece = _overlap(src_box, box)
            if piece is None:
                continue
            src = dst if dst in ranks else min(ranks, key=lambda r: (load.get(r, 0), r))
            nbytes = prod(stop - start for start, stop in piece) * info.itemsize
            if src != dst:
                load[src] = load.get(src, 0) + nbytes
            covered += nbytes
            src_offset = tuple(p0 - s0 for (p0, _), (s0, _) in zip(piece, src_box))
            dst_offset = tuple(p0 - d0 for (p0, _), (d0, _) in zip(piece, box))
            transfers.append(Transfer(name, src, dst, piece, src_offset, dst_offset, nbytes))
        needed = prod(stop - start for start, stop in box) * info.itemsize
        if covered != needed:
            raise RefitInputError(
                f"tensor {name!r}: the source shards cover {covered} of the {needed} bytes rank {dst} needs "
                f"(box {[list(b) for b in box]}): source placements must tile the tensor"
            )
    holdings = {(r.side, r.name, r.rank): r.box for r in records if r.box is not None and r.name in manifest.tensors}
    return DTensorRefitPlan(manifest, transfers, holdings)


def refit(
    src_state: Mapping[str, Any] | None,
    dst_state: Mapping[str, Any] | None,
    *,
    timeout: float | timedelta | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> TransferStats:
    """Copy every DTensor of ``src_state`` into the same-named DTensor of ``dst_state``, across meshes.

    Every rank of the default group calls it, with the DTensors it has (None or {} for a side
    it is not on). The meshes may span the same ranks (collocated) or different ones.

    Args:
        src_state: name -> source DTensor (any mesh, Shard/Replicate placements).
        dst_state: name -> destination DTensor, written in place.
        timeout: seconds for the whole transfer, as in ``shardcore.execute_refit``.
        bucket_bytes: extra memory for packing, as in ``shardcore.execute_refit``.

    Returns:
        This rank's TransferStats.

    Raises:
        RefitInputError: on every rank, before any byte moves, when a placement is not Shard/Replicate,
            the two sides disagree on a tensor's global shape or dtype, or a destination has no source.
        RefitPeerError: when a rank dies or never arrives (see ``shardcore.execute_refit``).
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = _holdings("src", src_state or {}, rank) + _holdings("dst", dst_state or {}, rank)
    plan = plan_from_holdings([record for records in all_gather_objects(mine) for record in records])
    with torch.no_grad():
        sources = {n: t.to_local() for n, t in (src_state or {}).items() if ("src", n, rank) in plan.holdings}
        targets = {n: t.to_local() for n, t in (dst_state or {}).items() if ("dst", n, rank) in plan.holdings}
        return execute_refit(plan, sources, targets, timeout=timeout, bucket_bytes=bucket_bytes)


__all__ = ["DTensorManifest", "DTensorRefitPlan", "TensorInfo", "local_box", "plan_from_holdings", "refit"]
