"""Megatron extra groups created after the build by one window alone (add_group), on a live gloo world."""

from __future__ import annotations

from plugins.megatron.tests import megatron_recipe  # noqa: F401  # skips this module without megatron-core
from plugins.megatron.tests import megatron_window_workers as workers
from shardcore import plan_layout
from shardcore.testing import run_world

SPEC = "tp=2,dp=2 + tp=2"
DIMS = {0: ("tp", "dp"), 1: ("tp",)}


def test_each_window_adds_its_own_group_under_one_name() -> None:
    results = run_world(6, workers.extra_groups, SPEC, DIMS, timeout=240)
    layout = plan_layout(6, SPEC)
    for rank, result in enumerate(results):
        shard = layout.shard_of(rank)
        assert shard is not None
        assert result["extra_sum"] == sum(shard.decoder_grid.group_ranks(rank, DIMS[shard.index]))
        assert result["on_handle"]
        assert result["tp_sum"] == sum(shard.decoder_grid.group_ranks(rank, "tp"))
        assert len(set(result["counters"])) == 1
        assert result["world_sum"] == sum(range(6))
