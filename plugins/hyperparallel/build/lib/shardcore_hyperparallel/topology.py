"""Hyper-Parallel's stage topology as pure index math, with its checks as LayoutErrors.

Hyper-Parallel keeps pipeline parallelism out of its meshes: stage ``s`` of a shard
owns the contiguous window of ``dp*cp*tp`` ranks starting at ``s*dp*cp*tp``, and
three meshes reshape that window (row-major, last dim fastest):
``(dp, cp, tp)``, ``(fsdp_replicate, fsdp_shard, tp)`` and
``([edp_replicate,] edp_shard, ep)``. The checks here mirror its ``build_meshs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardcore import LayoutError

MeshShape = tuple[tuple[int, ...], tuple[str, ...]]


def _positive(name: str, value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{where}{name}={value!r}: expected a positive integer")
    return value


@dataclass(frozen=True)
class StageSizes:
    """One shard's Hyper-Parallel sizes, already checked; every stage shares them."""

    dp: int
    cp: int
    tp: int
    pp: int
    ep: int
    dp_replicate: int
    dp_shard: int
    edp_shard: int

    @property
    def stage_size(self) -> int:
        """Ranks in one pipeline stage: Hyper-Parallel's dense and expert domain."""
        return self.dp * self.cp * self.tp

    @property
    def edp_replicate(self) -> int:
        """Expert data-parallel replicas; meaningful only when ep > 1."""
        return self.stage_size // self.ep // self.edp_shard

    def device_mesh(self) -> MeshShape:
        return (self.dp, self.cp, self.tp), ("dp", "cp", "tp")

    def fsdp_non_moe_mesh(self) -> MeshShape:
        """Size-1 axes are kept, as Hyper-Parallel does for the dense mesh."""
        return (self.dp_replicate, self.dp_shard, self.tp), ("fsdp_replicate", "fsdp_shard", "tp")

    def fsdp_moe_mesh(self) -> MeshShape | None:
        """None without EP; the replicate axis is dropped when it is 1 (unlike the dense mesh)."""
        if self.ep <= 1:
            return None
        if self.edp_replicate > 1:
            return (self.edp_replicate, self.edp_shard, self.ep), ("edp_replicate", "edp_shard", "ep")
        return (self.edp_shard, self.ep), ("edp_shard", "ep")


def resolve_sizes(
    *,
    world_size: int,
    dp: int,
    cp: int,
    tp: int,
    pp: int,
    ep: int = 1,
    dp_replicate: int | None = None,
    dp_shard: int | None = None,
    edp_shard: int | None = None,
    where: str = "",
) -> StageSizes:
    """Fill in the FSDP defaults and run Hyper-Parallel's checks, each with how to fix it.

    ``dp_replicate`` defaults to 1 and ``dp_shard`` to ``dp*cp``; given one of them,
    the other is derived from ``dp*cp``. ``where`` prefixes messages (e.g. the shard).
    """
    for name, value in (("dp", dp), ("cp", cp), ("tp", tp), ("pp", pp), ("ep", ep), ("world_size", world_size)):
        _positive(name, value, where)
    fsdp_domain = dp * cp
    if dp_replicate is None and dp_shard is None:
        dp_replicate, dp_shard = 1, fsdp_domain
    elif dp_shard is None:
        dp_replicate = _positive("dp_replicate", dp_replicate, where)
        dp_shard = max(1, fsdp_domain // dp_replicate)
    elif dp_replicate is None:
        dp_shard = _positive("dp_shard", dp_shard, where)
        dp_replicate = max(1, fsdp_domain // dp_shard)
    dp_replicate = _positive("dp_replicate", dp_replicate, where)
    dp_shard = _positive("dp_shard", dp_shard, where)
    edp_shard = 1 if edp_shard is None else _positive("edp_shard", edp_shard, where)
    if dp * cp * tp * pp != world_size:
        raise LayoutError(
            f"{where}dp*cp*tp*pp = {dp}*{cp}*{tp}*{pp} = {dp * cp * tp * pp} must equal the world of "
            f"{world_size} ranks: change dp, cp, tp or pp so that their product is {world_size}"
        )
    if dp_replicate * dp_shard != fsdp_domain:
        raise LayoutError(
            f"{where}dp_replicate*dp_shard = {dp_replicate}*{dp_shard} = {dp_replicate * dp_shard} must equal "
            f"dp*cp = {fsdp_domain} (the FSDP domain is DP x CP): pick dp_shard dividing {fsdp_domain} and "
            f"dp_replicate = {fsdp_domain} // dp_shard, or pass only one of them"
        )
    sizes = StageSizes(dp, cp, tp, pp, ep, dp_replicate, dp_shard, edp_shard)
    if ep > 1:
        domain = sizes.stage_size
        if domain % ep:
            raise LayoutError(
                f"{where}the expert domain of one stage, dp*cp*tp = {domain}, must be divisible by ep={ep}: "
                f"choose ep dividing {domain}"
            )
        edp = domain // ep
        if edp % edp_shard:
            raise LayoutError(
                f"{where}the expert data-parallel size dp*cp*tp/ep = {edp} must be divisible by "
                f"edp_shard={edp_shard}: choose edp_shard dividing {edp}"
            )
    return sizes


def stage_start(rank_offset: int, sizes: StageSizes, pp_rank: int) -> int:
    """First global rank of a pipeline stage of a shard starting at ``rank_offset``."""
    return rank_offset + pp_rank * sizes.stage_size


def _rank_list(mesh: Any) -> tuple[int, ...] | None:
    """A mesh's ranks in mesh order: Hyper-Parallel's ``rank_list`` or torch's ``mesh`` tensor."""
    if hasattr(mesh, "rank_list"):
        return tuple(int(r) for r in mesh.rank_list)
    tensor = getattr(mesh, "mesh", None)
    if tensor is not None and hasattr(tensor, "flatten"):
        return tuple(int(r) for r in tensor.flatten().tolist())
    return None


def check_dense_tp_layout(device_mesh: Any, fsdp_non_moe_mesh: Any) -> None:
    """The TP group and this rank's TP index must be the same in the device and dense-FSDP meshes.

    Skipped, as in Hyper-Parallel, when a mesh cannot list its ranks (lightweight test fakes).
    """
    if _rank_list(device_mesh) is None or _rank_list(fsdp_non_moe_mesh) is None:
        return
    dense_tp, fsdp_tp = device_mesh["tp"], fsdp_non_moe_mesh["tp"]
    dense_ranks, fsdp_ranks = _rank_list(dense_tp), _rank_list(fsdp_tp)
    if dense_ranks != fsdp_ranks:
        raise LayoutError(
            f"device_mesh['tp'] ranks {dense_ranks} differ from fsdp_non_moe_mesh['tp'] ranks {fsdp_ranks}: "
            f"both meshes must keep tp innermost over the same stage window"
        )
    if dense_tp.get_local_rank() != fsdp_tp.get_local_rank():
        raise LayoutError(
            f"this rank's tp index is {dense_tp.get_local_rank()} in device_mesh but {fsdp_tp.get_local_rank()} in "
            f"fsdp_non_moe_mesh: build both meshes over the same rank list"
        )


__all__ = ["StageSizes", "check_dense_tp_layout", "resolve_sizes", "stage_start"]
