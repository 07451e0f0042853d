"""Expected mesh groups by plain reshape math, written independently of the plugin and of Grid."""

from __future__ import annotations


def unravel(index: int, shape: tuple[int, ...]) -> list[int]:
    """Row-major coordinates of ``index`` (last dim fastest), as numpy's unravel_index."""
    coords = []
    for size in reversed(shape):
        coords.append(index % size)
        index //= size
    return coords[::-1]


def ravel(coords: list[int], shape: tuple[int, ...]) -> int:
    index = 0
    for coord, size in zip(coords, shape):
        index = index * size + coord
    return index


def group_along(window: list[int], shape: tuple[int, ...], rank: int, dim: int) -> list[int]:
    """The ranks of ``window.reshape(shape)`` sharing ``rank``'s coordinates except along ``dim``."""
    coords = unravel(window.index(rank), shape)
    out = []
    for k in range(shape[dim]):
        moved = list(coords)
        moved[dim] = k
        out.append(window[ravel(moved, shape)])
    return out


def hp_meshes(tp: int, cp: int, dp: int, pp: int, ep: int, dp_shard: int, edp_shard: int) -> dict:
    """The (shape, names) of the three meshes Hyper-Parallel's build_meshs makes for one stage."""
    dense = dp * cp * tp
    meshes = {
        "device_mesh": ((dp, cp, tp), ("dp", "cp", "tp")),
        "fsdp_non_moe_mesh": ((dp * cp // dp_shard, dp_shard, tp), ("fsdp_replicate", "fsdp_shard", "tp")),
    }
    if ep > 1:
        edp_rep = dense // ep // edp_shard
        meshes["fsdp_moe_mesh"] = (
            ((edp_rep, edp_shard, ep), ("edp_replicate", "edp_shard", "ep"))
            if edp_rep > 1
            else ((edp_shard, ep), ("edp_shard", "ep"))
        )
    return meshes


def stage_window(offset: int, tp: int, cp: int, dp: int, rank: int) -> list[int]:
    """PP outermost: the stage of ``rank`` is a contiguous block of dp*cp*tp ranks."""
    dense = dp * cp * tp
    start = offset + (rank - offset) // dense * dense
    return list(range(start, start + dense))
