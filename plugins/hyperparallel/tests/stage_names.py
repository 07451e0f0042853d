"""Which torch group names each pipeline stage's mesh groups get: Hyper-Parallel's own ``build_meshs``
(the stand-in) against shardcore's, one simulated rank per stage under torch's fake backend.

``python stage_names.py '{"world": 8, "sizes": {...}, "spec": "...", "ranks": [0, 4]}'`` prints one
JSON line: ``{"hyper_parallel": {rank: groups}, "shardcore": {rank: groups}}``, where ``groups`` maps
``mesh/dim`` to ``[group name, ranks]``. Run in a subprocess: the fake world lives in that process.
"""

from __future__ import annotations

import json
import sys
from typing import Any

MESHES = ("device_mesh", "fsdp_non_moe_mesh", "fsdp_moe_mesh")


def _groups(ctx: Any) -> dict[str, list[Any]]:
    import torch.distributed as dist

    out = {}
    for name in MESHES:
        mesh = getattr(ctx, name)
        for dim in mesh.mesh_dim_names if mesh is not None else ():
            if mesh.size(mesh.mesh_dim_names.index(dim)) > 1:
                group = mesh.get_group(dim)
                out[f"{name}/{dim}"] = [group.group_name, dist.get_process_group_ranks(group)]
    return out


def simulate(world: int, sizes: dict[str, int], spec: str, ranks: list[int]) -> dict[str, dict[int, Any]]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plugins.hyperparallel.tests.hyperparallel_workers import use_stand_in
    from shardcore import build_shards, destroy_shards, my_shard

    result: dict[str, dict[int, Any]] = {"hyper_parallel": {}, "shardcore": {}}
    for rank in ranks:
        use_stand_in()  # a fresh stand-in per simulated rank, as a fresh process would have
        from hyper_parallel.distributed.mesh import MeshContext

        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            own = MeshContext(**sizes)
            own.build_meshs("cpu", world)
            result["hyper_parallel"][rank] = _groups(own)
            built = build_shards(world, spec, backend="hyperparallel", dp_shard=sizes["dp_shard_size"])
            result["shardcore"][rank] = _groups(my_shard(built).handle)
            destroy_shards(built)
        finally:
            dist.destroy_process_group()
    return result


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    print(json.dumps(simulate(request["world"], request["sizes"], request["spec"], request["ranks"])))
