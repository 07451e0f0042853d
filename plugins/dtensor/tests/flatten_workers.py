"""Functions run on every rank of a live gloo world by the flattened-mesh tests."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from shardcore import ShardcoreError, build_shards
from shardcore.engine import all_gather_objects
from shardcore.engine.backends.shards import destroy_shards, my_shard
from shardcore.engine.torch_state import group_counter, live_group_count
from shardcore_dtensor.backend import window_mesh


def summed(group: Any) -> int:
    """The sum of the members' global ranks, as an all-reduce over ``group`` computes it."""
    value = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(value, group=group)
    return int(value.item())


def members(mesh: Any) -> list[int]:
    """The global ranks of a 1-D mesh's group, as an all-gather over it reports them."""
    group = mesh.get_group()
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, torch.tensor([dist.get_rank()]), group=group)
    return [int(t.item()) for t in out]


def dtensor_checks(flat: Any) -> dict[str, bool]:
    """A sharded matmul and redistributes across a 1-D (flattened) mesh, compared with local results."""
    size = flat.size()
    torch.manual_seed(1234)  # every rank builds the same inputs
    a, b = torch.randn(4 * size, 6), torch.randn(6, 5)
    a_rows = distribute_tensor(a, flat, [Shard(0)])
    product = torch.mm(a_rows, distribute_tensor(b, flat, [Replicate()]))
    gathered = a_rows.redistribute(flat, [Replicate()])
    # Each rank contributes its global rank: the Partial sum over the mesh is the sum of its members.
    partial = torch.distributed.tensor.DTensor.from_local(
        torch.full((2,), float(dist.get_rank())), flat, [Partial()], run_check=False
    )
    return {
        "matmul": bool(torch.allclose(product.full_tensor(), a @ b, atol=1e-5)),
        "matmul_sharded": tuple(product.placements) == (Shard(0),),
        "redistribute": bool(torch.equal(gathered.to_local(), a)),
        "partial_sum": float(partial.redistribute(flat, [Replicate()]).to_local()[0]) == float(sum(members(flat))),
    }


def _error(call: Any) -> str:
    try:
        call()
    except ShardcoreError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def flatten_report(mine: Any, names_by_window: dict[int, list[tuple[str, tuple[str, ...]]]]) -> dict[str, Any]:
    """Flatten, in this rank's window, each (name, dims) listed for it; report members, sums and DTensor checks."""
    mesh, report = mine.handle.mesh, {}
    for name, dims in names_by_window[mine.index]:
        flat = mesh[dims]._flatten(name)
        report[name] = {"members": members(flat), "sum": summed(flat.get_group()), **dtensor_checks(flat)}
    return report


def windows(rank: int, world: int, spec: str, plan: dict[int, list[tuple[str, tuple[str, ...]]]]) -> dict[str, Any]:
    """Declared and undeclared flattens in every window, then world-collective creation, rebuilds and teardown."""
    shards = build_shards(
        world, spec, backend="dtensor", device_type="cpu", timeout=60, flatten={"dp_tp": ("tp", "dp")}
    )
    mine = my_shard(shards)
    assert mine is not None
    mesh = mine.handle.mesh
    before = (group_counter(), live_group_count())
    declared = mesh["dp", "tp"]._flatten("dp_tp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that slicing a flattened name off the root is deprecated
        by_name = mesh["dp_tp"]
    default_dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    result: dict[str, Any] = {
        "window": mine.index,
        "declared_created_nothing": (group_counter(), live_group_count()) == before,
        "declared_is_engine_group": declared.get_group() is mine.groups["flatten:dp_tp"],
        "by_name_same_group": by_name.get_group() is declared.get_group(),
        "dp_cp_is_engine_group": default_dp_cp.get_group() is mine.groups["dp_cp"],
        "declared": {"members": members(declared), "sum": summed(declared.get_group()), **dtensor_checks(declared)},
        "undeclared": flatten_report(mine, plan),
    }
    unflat = mesh["dp", "tp"]._flatten("dp_tp")._unflatten(0, (2, mine.size // 2), ("u_outer", "u_inner"))
    result["unflatten_inner"] = members(unflat["u_inner"])
    result["repeat_is_same"] = mesh["dp", "tp"]._flatten("dp_tp") is declared
    result["counters"] = _gathered(group_counter())
    # A world-collective group after the window-local ones still agrees on its name.
    world_group = dist.new_group(list(range(world)))
    result["world_sum"] = summed(world_group)
    dist.destroy_process_group(world_group)
    # A second build while the first lives, then flatten on it too.
    second = build_shards(world, spec, backend="dtensor", device_type="cpu", timeout=60)
    other = my_shard(second)
    assert other is not None
    result["second"] = members(other.handle.mesh["dp", "tp"]._flatten("again"))
    destroy_shards(second)
    destroy_shards(shards)
    result["closed"] = _error(lambda: mine.new_group([rank]))
    # Destroy and rebuild: the same flattens on the new windows.
    rebuilt = build_shards(world, spec, backend="dtensor", device_type="cpu", timeout=60)
    again = my_shard(rebuilt)
    assert again is not None
    result["rebuilt"] = flatten_report(again, plan)
    destroy_shards(rebuilt)
    result["groups_left"] = live_group_count()
    return result


def refusals(rank: int, world: int) -> dict[str, Any]:
    """A window mesh build_shards did not make refuses to create groups; a rank skipping a flatten is named."""
    shards = build_shards(world, "tp=2 + tp=2", backend="dtensor", device_type="cpu", timeout=4)
    mine = my_shard(shards)
    assert mine is not None
    bare = window_mesh(mine.plan.decoder_grid, mine.groups, "cpu")
    result = {
        "bare_flatten": _error(lambda: bare["pp", "tp"]._flatten("pp_tp")),
        "bare_unflatten": _error(lambda: bare["tp"]._unflatten(0, (2, 1), ("a", "b"))),
        "not_member": _error(lambda: next(s for s in shards if not s.is_member).new_group([rank])),
        "outside": _error(lambda: mine.new_group([0, 3])),
        "unknown_dim": _error(lambda: mine.handle.flatten("dp", "nope")),
    }
    result["skipped"] = "skipped" if rank == 3 else _error(lambda: mine.handle.flatten("pp", "tp", name="late"))
    dist.barrier()
    result["counters"] = _gathered(group_counter())
    destroy_shards(shards)
    return result


def _gathered(value: int) -> list[int]:
    return all_gather_objects(value)
