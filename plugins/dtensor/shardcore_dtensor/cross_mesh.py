"""Refit a state dict of DTensors from one DeviceMesh to another, which torch cannot do.

``DTensor.redistribute`` works within one mesh only ("Cross device mesh comm not supported
yet!"). Here each rank reads its own holdings off its DTensors' placements (``Shard(d)`` and
``Replicate()``) as global boxes, one all-gather shares them (``all_gather_objects``, which
needs no numpy), and every rank builds the same two explicit placements from them
(``shardcore.refit.ExplicitPlacement``) and the same plan with shardcore's planner
(``plan_refit_from``): sources spread over the replicas, large pieces split across them, local
copies where a rank holds both sides. shardcore's engine then moves the bytes
(:func:`shardcore.execute_refit`).

The plan is kept across calls (``kept_plans``, a ``shardcore.engine.KeptPlans``) under every rank's
records (names, global shapes, dtypes, meshes, boxes) and the world's size: a loop that refits the
same state dicts every step gathers and plans once.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

from shardcore import ExecuteOptions, RefitError, RefitInputError, TransferStats, execute_refit
from shardcore.engine import KeptPlans, all_gather_objects
from shardcore.refit import ExplicitPlacement, HeldBox, Manifest, Placement, RefitPlan, TensorSpec, plan_refit_from

Box = tuple[tuple[int, int], ...]


class _Record(NamedTuple):
    """What one rank holds of one tensor of one side, as gathered."""

    side: str  # "src" or "dst"
    name: str
    shape: tuple[int, ...]
    dtype: str
    rank: int
    mesh: tuple[int, ...]  # the ranks of the tensor's mesh
    box: Box | None  # None: this rank's local shard is empty
    problem: str | None


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
    if any(stop <= start for start, stop in box):
        return None, None
    return tuple(box), None


def local_shards(state: Any) -> dict[str, Any]:
    """This rank's local shard (``to_local()``) of every DTensor of a module or state dict, by name: the ``sources``
    (or ``destinations``, written in place) that ``shardcore.execute_refit`` takes for this rank.

    A DTensor with ``Shard(d)`` and ``Replicate()`` placements holds one dense global box (``local_box``), which is
    what a refit plan's placement says a rank holds. So these fit a plan read off the same DTensors (what ``refit``
    plans), and a plan of a shardcore layout (``plan_refit``) where the DTensors split the manifest's tp dim
    contiguously over the shard's tp ranks (``Shard(tp_dim)`` on the tp mesh dim, ``Replicate()`` on the others) and
    the tensor has no packed blocks: a packed tensor (Megatron's fused qkv, gate+up) is split block by block, which
    one ``Shard(d)`` does not express.

    Args:
        state: A module (its parameters and persistent buffers: ``state_dict(keep_vars=True)``) or a mapping of
            name -> DTensor.

    Raises:
        RefitInputError: a tensor is not a DTensor (its mesh is unknown: ``distribute_tensor(t, mesh, [Replicate()])``
            makes it one), or has a placement other than Shard/Replicate (a Partial, FSDP's strided shards).
    """
    import torch
    from torch.distributed.tensor import DTensor

    tensors = state.state_dict(keep_vars=True) if isinstance(state, torch.nn.Module) else state
    out = {}
    for name, tensor in tensors.items():
        if not isinstance(tensor, DTensor):
            raise RefitInputError(
                f"tensor {name!r} is a {type(tensor).__name__}, not a DTensor: make it one "
                f"(distribute_tensor(t, mesh, [Replicate()])) or leave it out of the state"
            )
        why = local_box(tensor)[1]
        if why is not None:
            raise RefitInputError(f"tensor {name!r}: {why}")
        out[name] = tensor.to_local()
    return out


def _records(side: str, state: Mapping[str, Any], rank: int) -> list[_Record]:
    from torch.distributed.tensor import DTensor

    records = []
    for name, tensor in state.items():
        if not isinstance(tensor, DTensor):
            wrong = f"{side} tensor {name!r} is a {type(tensor).__name__}, not a DTensor"
            records.append(_Record(side, name, (), "", rank, (rank,), None, wrong))
            continue
        box, why = local_box(tensor)
        problem = None if why is None else f"{side} tensor {name!r}: {why}"
        dtype = str(tensor.dtype).removeprefix("torch.")
        mesh = tuple(sorted(tensor.device_mesh.mesh.flatten().tolist()))
        records.append(_Record(side, name, tuple(tensor.shape), dtype, rank, mesh, box, problem))
    return records


def _manifest(records: Sequence[_Record]) -> Manifest | None:
    """The tensors the destination holds, checked for agreement between all ranks and both sides;
    None when it holds nothing to refit.

    A 0-d tensor is planned as one element of shape [1]; a tensor with no elements is left out.
    """
    problems = [r.problem for r in records if r.problem]
    if problems:
        raise RefitInputError(f"refit cannot read the DTensors: {problems[0]}")
    seen: dict[str, _Record] = {}
    for record in sorted(records, key=lambda r: (r.side != "src", r.rank)):
        first = seen.setdefault(record.name, record)
        if (record.shape, record.dtype) != (first.shape, first.dtype):
            raise RefitInputError(
                f"tensor {record.name!r}: the {first.side} side (rank {first.rank}) has global shape "
                f"{list(first.shape)} and dtype {first.dtype}, the {record.side} side (rank {record.rank}) has "
                f"{list(record.shape)} and {record.dtype}: both state dicts must describe the same global tensor"
            )
    sources = {r.name for r in records if r.side == "src"}
    wanted = sorted({r.name for r in records if r.side == "dst" and all(r.shape)})
    missing = [name for name in wanted if name not in sources]
    if missing:
        raise RefitInputError(
            f"destination tensor {missing[0]!r} has no source ({len(missing)} such): the source state dict must "
            f"hold every destination tensor under the same name"
        )
    if not wanted:
        return None
    try:
        specs = [TensorSpec(name, seen[name].shape or (1,), seen[name].dtype, stage=("all",)) for name in wanted]
        return Manifest(tuple(specs), name="dtensor state dict")
    except RefitError as error:
        raise RefitInputError(f"refit cannot plan the DTensors: {error}") from None


def _copies(meshes: Iterable[tuple[int, ...]]) -> list[frozenset[int]]:
    """The rank sets of the destination's copies: meshes that share a rank are one copy, in order of first rank."""
    copies: list[set[int]] = []
    for mesh in sorted(set(meshes)):
        joined = set(mesh)
        for copy in [c for c in copies if not c.isdisjoint(joined)]:
            joined |= copy
            copies.remove(copy)
        copies.append(joined)
    return sorted((frozenset(c) for c in copies), key=min)


def plan_from_records(records: Sequence[_Record], world_size: int) -> RefitPlan | None:
    """The same plan on every rank, from every rank's records; None when the destination holds nothing.

    The source is one explicit placement; the destination one per copy of the model (meshes over
    disjoint ranks, e.g. two inference engines), so that each tiles its tensors. ``stage="all"`` in
    the manifest only says the tensors have no pipeline placement; the placements say who holds what.

    Raises:
        RefitInputError: a placement that is not Shard/Replicate, sides that disagree on a tensor,
            a destination tensor with no source, or boxes of one copy that do not tile a tensor.
    """
    manifest = _manifest(records)
    if manifest is None:
        return None
    names = {tensor.name for tensor in manifest}
    held = [r for r in records if r.box is not None and r.name in names]
    copies = _copies(r.mesh for r in held if r.side == "dst")

    def placement(side: str, ranks: Collection[int], label: str, index: int = 0) -> ExplicitPlacement:
        boxes = [HeldBox(r.name, r.rank, r.box or ((0, 1),)) for r in held if r.side == side and r.rank in ranks]
        return ExplicitPlacement(manifest, boxes, index=index, label=label)

    try:
        source = placement("src", range(world_size), "the source state dict")
        targets = [
            placement("dst", ranks, f"the destination on ranks {sorted(ranks)[:8]}", index)
            for index, ranks in enumerate(copies)
        ]
        return plan_refit_from(source, targets, world_size=world_size)
    except RefitError as error:
        raise RefitInputError(f"refit cannot plan the DTensors: {error}") from None


kept_plans: KeptPlans[RefitPlan | None] = KeptPlans()
"""The plans ``refit`` keeps across calls; ``kept_plans.clear()`` on every rank forgets them."""


def refit(
    src_state: Mapping[str, Any] | None,
    dst_state: Mapping[str, Any] | None,
    *,
    options: ExecuteOptions | None = None,
    timeout: float | timedelta | None = None,
    bucket_bytes: int | None = None,
) -> TransferStats:
    """Copy every DTensor of ``src_state`` into the same-named DTensor of ``dst_state``, across meshes.

    Every rank of the default group calls it, with the DTensors it has (None or {} for a side
    it is not on). The meshes may span the same ranks (collocated) or different ones. A call whose
    state dicts hold what the previous ones held (names, shapes, dtypes, meshes, placements) on every
    rank reuses that call's plan (``kept_plans``).

    Args:
        src_state: name -> source DTensor (any mesh, Shard/Replicate placements).
        dst_state: name -> destination DTensor, written in place.
        options: the executor's knobs (timeout, bucket bytes, ops per batch, verification, version), as
            ``shardcore.execute_refit`` takes them.
        timeout: seconds for the whole transfer, in the place of ``options.timeout``.
        bucket_bytes: extra memory for packing, in the place of ``options.bucket_bytes``.

    Returns:
        This rank's TransferStats.

    Raises:
        RefitInputError: on every rank, before any byte moves, when a placement is not Shard/Replicate,
            the two sides disagree on a tensor's global shape or dtype, or a destination has no source.
        RefitPeerError: when a rank dies or never arrives (see ``shardcore.execute_refit``).
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _records("src", src_state or {}, rank) + _records("dst", dst_state or {}, rank)

    def build() -> RefitPlan | None:
        return plan_from_records([record for records in all_gather_objects(mine) for record in records], world)

    plan = kept_plans.get((mine, world), build)
    if plan is None:  # every rank saw the same records, so every rank returns here
        return TransferStats(rank)
    names = [tensor.name for tensor in plan.manifest]

    def local(state: Mapping[str, Any] | None, side: Placement) -> dict[str, Any]:
        """This rank's local tensors of one side, shaped as the plan has them (0-d as [1]). ``_records`` checked
        every tensor (a DTensor, Shard/Replicate) and a plan exists only for records without a problem, so the
        local shards are taken as they are (``local_shards`` would check them all again, every call)."""
        held = {names[tensor.position]: tensor.shape for tensor in side.held(rank)}
        return {name: t.to_local().view(held[name]) for name, t in (state or {}).items() if name in held}

    with torch.no_grad():
        sources = local(src_state, plan.source_placement)
        copy = plan.destination_placement_of(rank)
        targets = {} if copy is None else local(dst_state, copy)
        return execute_refit(plan, sources, targets, options=options, timeout=timeout, bucket_bytes=bucket_bytes)


__all__ = ["kept_plans", "local_box", "local_shards", "plan_from_records", "refit"]
