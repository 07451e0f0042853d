"""A live 8-rank gloo world: heterogeneous shards, every field of every collection used in a collective."""

from __future__ import annotations

from typing import Any

import pytest

from plugins.megatron.tests import megatron_recipe  # noqa: F401  # skips this module without megatron-core
from plugins.megatron.tests import megatron_workers as workers
from shardcore import plan_layout
from shardcore.testing import run_world

WORLD = 8
HETERO = "tp=2,role=train+tp=2,pp=2,ep=2,expt_tp=1,role=prefill+tp=1,cp=2,role=decode"
CASES: list[dict[str, Any]] = [
    {"call": "shards", "kwargs": {"total_world_size": WORLD, "shards": HETERO, "timeout": 60}},
    {
        "call": "shards",
        "kwargs": {
            "total_world_size": WORLD,
            "shards": HETERO,
            "use_tp_pp_dp_mapping": True,
            "strategy": "world",
            "timeout": 60,
        },
    },
    {
        "call": "shards",
        "kwargs": {
            "total_world_size": WORLD,
            "timeout": 60,
            "rank_offset": 2,
            "allow_idle": True,
            "shards": [{"tp": 2, "ep": 2, "expt_tp": 1, "role": "prefill"}, {"tp": 1, "dp": 2, "role": "decode"}],
        },
    },
    {
        "call": "single",
        "kwargs": {
            "world_size": 4,
            "tp_size": 2,
            "pp_size": 1,
            "cp_size": 2,
            "ep_size": 2,
            "expt_tp_size": 1,
            "rank_offset": 3,
            "timeout": 60,
        },
    },
]


def _layout(case: dict[str, Any]) -> Any:
    kw = case["kwargs"]
    order = "tp-cp-pp-dp" if kw.get("use_tp_pp_dp_mapping") else "tp-cp-dp-pp"
    if case["call"] == "single":
        spec = {
            "tp": kw["tp_size"],
            "pp": kw["pp_size"],
            "cp": kw["cp_size"],
            "ep": kw["ep_size"],
            "expt_tp": kw["expt_tp_size"],
        }
        spec["dp"] = kw["world_size"] // (spec["tp"] * spec["pp"] * spec["cp"])
        return plan_layout(WORLD, [spec], order=order, rank_offset=kw["rank_offset"], allow_idle=True)
    return plan_layout(WORLD, kw["shards"], order=order, rank_offset=kw.get("rank_offset", 0), allow_idle=True)


@pytest.fixture(scope="module")
def reports() -> list[list[dict[str, Any]]]:
    return run_world(WORLD, workers.live_collections, CASES, timeout=240)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_every_field_all_reduces_and_gathers_its_planned_ranks(reports: Any, index: int) -> None:
    layout = _layout(CASES[index])
    for rank in range(WORLD):
        report, plan = reports[rank][index], layout.shard_of(rank)
        if plan is None:
            assert report["shard"] is None and report["created"] == 0
            assert all(value is None for value in report["fields"].values())  # single: a None-filled collection
            continue
        assert report["shard"] == plan.index and report["type"] == "ProcessGroupCollection"
        for name, ranks in plan.groups_of(rank).items():
            seen = report["fields"][name]
            if ranks is None:
                assert seen is None, (rank, name)
            else:
                assert seen == {"sum": len(ranks), "size": len(ranks), "ranks": list(ranks)}, (rank, name)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_identical_rank_sets_share_one_communicator_and_are_destroyed(reports: Any, index: int) -> None:
    layout = _layout(CASES[index])
    for rank in range(WORLD):
        report = reports[rank][index]
        assert report["leftover"] == 0
        if layout.shard_of(rank) is None:
            continue
        assert report["distinct"] == len(layout.distinct_groups(rank))
        if CASES[index]["kwargs"].get("strategy", "local") == "local":
            assert report["created"] == report["distinct"]  # members create only their own, once each


def test_each_rank_belongs_to_at_most_one_shard(reports: Any) -> None:
    for rank in range(WORLD):
        assert reports[rank][0]["n_members"] == 1
        assert reports[rank][2]["n_members"] == (1 if 2 <= rank < 6 else 0)
