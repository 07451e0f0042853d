"""Rank-group math (no processes): the engine's groups for each mesh dim equal Hyper-Parallel's reshapes."""

from __future__ import annotations

import random

import pytest

from plugins.hyperparallel.tests.hp_expected import group_along, hp_meshes, stage_window
from shardcore import plan_layout
from shardcore.engine.groups.create import requested_groups
from shardcore_hyperparallel import HyperParallelBackend, resolve_sizes, shard_sizes
from shardcore_hyperparallel.backend import MESH_GROUPS


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _random_case(rng: random.Random) -> tuple[str, dict, dict]:
    tp, cp, dp, pp = (rng.choice([1, 2, 3, 4]) for _ in range(4))
    dense = tp * cp * dp
    ep = rng.choice(_divisors(dense))
    dp_shard = rng.choice(_divisors(dp * cp))
    edp_shard = rng.choice(_divisors(dense // ep))
    lead = rng.choice([0, 1, 2, 6])
    hp = f"tp={tp},cp={cp},dp={dp},pp={pp},ep={ep},expt_tp=1"
    spec = f"dp={lead}+{hp}" if lead else hp
    sizes = dict(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, dp_shard=dp_shard, edp_shard=edp_shard)
    return spec, {"dp_shard": {1 if lead else 0: dp_shard}, "edp_shard": edp_shard}, sizes


@pytest.mark.parametrize("seed", range(60))
def test_mesh_groups_equal_hyper_parallel_reshapes(seed: int) -> None:
    spec, options, s = _random_case(random.Random(seed))
    layout = plan_layout(_world(spec), spec)
    backend = HyperParallelBackend()
    backend.validate(layout, options)
    plan = layout.shards[-1]
    sizes = shard_sizes(plan, options)
    expected = hp_meshes(s["tp"], s["cp"], s["dp"], s["pp"], s["ep"], s["dp_shard"], s["edp_shard"])
    produced = {"device_mesh": sizes.device_mesh(), "fsdp_non_moe_mesh": sizes.fsdp_non_moe_mesh()}
    if sizes.fsdp_moe_mesh() is not None:
        produced["fsdp_moe_mesh"] = sizes.fsdp_moe_mesh()
    assert produced == expected
    extras = backend.extra_groups(plan, options)
    for rank in plan.ranks:
        groups = requested_groups(plan, rank, extras)
        window = stage_window(plan.rank_offset, s["tp"], s["cp"], s["dp"], rank)
        for kind, (shape, names) in expected.items():
            for dim, name in enumerate(names):
                assert list(groups[MESH_GROUPS[kind][name]]) == group_along(window, shape, rank, dim), (
                    kind,
                    name,
                    rank,
                )


def _world(spec: str) -> int:
    from shardcore import parse_shards

    return sum(shard.world_size for shard in parse_shards(spec))


def test_keeps_extended_ep_distinct_from_tp() -> None:
    """Hyper-Parallel's example: tp=2, ep=4 on 8 ranks -> (4,1,2), (2,2,2) dense, (2,4) expert."""
    sizes = resolve_sizes(world_size=8, dp=4, cp=1, tp=2, pp=1, ep=4, dp_shard=2, edp_shard=2)
    assert sizes.device_mesh() == ((4, 1, 2), ("dp", "cp", "tp"))
    assert sizes.fsdp_non_moe_mesh() == ((2, 2, 2), ("fsdp_replicate", "fsdp_shard", "tp"))
    assert sizes.fsdp_moe_mesh() == ((2, 4), ("edp_shard", "ep"))


def test_size_one_dense_axes_are_kept_and_no_expert_mesh_without_ep() -> None:
    sizes = resolve_sizes(world_size=4, dp=2, cp=1, tp=2, pp=1, dp_replicate=2)
    assert sizes.fsdp_non_moe_mesh() == ((2, 1, 2), ("fsdp_replicate", "fsdp_shard", "tp"))
    assert sizes.fsdp_moe_mesh() is None
    extras = HyperParallelBackend().extra_groups(plan_layout(4, "tp=2,dp=2").shards[0], {"dp_replicate": 2})
    assert set(extras) == {"fsdp_replicate", "fsdp_shard"}


def test_defaults_and_one_sided_options() -> None:
    assert (resolve_sizes(world_size=8, dp=2, cp=2, tp=2, pp=1).dp_replicate,) == (1,)
    assert resolve_sizes(world_size=8, dp=2, cp=2, tp=2, pp=1).dp_shard == 4
    assert resolve_sizes(world_size=8, dp=2, cp=2, tp=2, pp=1, dp_replicate=2).dp_shard == 2
    assert resolve_sizes(world_size=8, dp=2, cp=2, tp=2, pp=1, dp_shard=1).dp_replicate == 4
