"""Live gloo worlds: heterogeneous shards, both orders and strategies, every group all-gathered."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from shardcore import GROUP_NAMES, plan_layout
from shardcore.testing import run_world
from shardcore_dtensor import DTensorBackend
from tests.engine import engine_workers as workers

HETERO = "tp=2,pp=2,role=prefill+tp=4,dp=2,ep=2,expt_tp=2,role=decode"
WITH_TRAIN = "tp=2,role=train+" + HETERO


def _cases() -> list[dict]:
    cases = []
    for order in ("tp-cp-dp-pp", "tp-cp-pp-dp"):
        for strategy in ("local", "world"):
            kwargs = {"order": order, "strategy": strategy, "allow_idle": True, "timeout": 60, "groups": GROUP_NAMES}
            cases.append({"shards": WITH_TRAIN, "kwargs": kwargs})
    cases.append({"shards": "tp=2,cp=2,pp=2,dp=2,ep=2", "kwargs": {"timeout": 60}})  # the backend's own groups
    return cases


@pytest.fixture(scope="module")
def reports_16() -> list[list[dict]]:
    return run_world(16, workers.build_verify_destroy, _cases(), timeout=600)


@pytest.mark.parametrize("case_index", range(len(_cases())))
def test_every_group_matches_the_plan(reports_16: list[list[dict]], case_index: int) -> None:
    case = _cases()[case_index]
    layout = plan_layout(16, case["shards"], order=case["kwargs"].get("order", "tp-cp-dp-pp"), allow_idle=True)
    for rank in range(16):
        report = reports_16[rank][case_index]
        plan = layout.shard_of(rank)
        if plan is None:
            assert report["shard"] is None and report["seen"] == {} and report["created"] == 0
            continue
        wanted = case["kwargs"].get("groups", DTensorBackend.group_names)
        expected = {k: list(v) for k, v in plan.groups_of(rank).items() if v is not None and k in wanted}
        assert report["shard"] == plan.index
        assert report["planned"] == expected
        assert report["seen"] == expected, f"rank {rank}"
        assert report["handle"] == "DTensorShard"
        assert report["non_member_all_none"]


@pytest.mark.parametrize("case_index", range(len(_cases())))
def test_each_distinct_rank_set_created_once_and_destroyed(reports_16: list[list[dict]], case_index: int) -> None:
    for rank in range(16):
        report = reports_16[rank][case_index]
        assert report["created"] == report["distinct"]
        assert report["leftover"] == 0


def test_idle_ranks_after_the_shards_get_nothing(reports_16: list[list[dict]]) -> None:
    idle = [rank for rank in range(16) if reports_16[rank][0]["shard"] is None]
    assert idle == [14, 15]


@pytest.mark.parametrize("strategy", ["local", "world"])
def test_extra_members_only_group_on_one_rank_is_handled(strategy: str) -> None:
    results = run_world(4, workers.extra_group_then_build, strategy, True, timeout=120)
    assert results == ["ok: tp=[0, 1]", "ok: tp=[0, 1]", "ok: tp=[2, 3]", "ok: tp=[2, 3]"]


def test_rank_that_advanced_torchs_group_counter_is_caught_up() -> None:
    """Every rank builds from the highest counter any rank brings, so group names still agree."""
    results = run_world(4, workers.extra_group_then_build, "local", False, timeout=120)
    assert results == ["ok: tp=[0, 1]", "ok: tp=[0, 1]", "ok: tp=[2, 3]", "ok: tp=[2, 3]"]


def test_dtensor_distribute_and_redistribute_on_two_shards() -> None:
    results = run_world(8, workers.dtensor_roundtrip, timeout=300)
    for rank, result in enumerate(results):
        index = 0 if rank < 4 else 1
        tp = 2 if index == 0 else 4
        position = rank % tp if index == 0 else rank - 4
        full = [float(v + 100 * index) for v in range(8)]
        chunk = 8 // tp
        assert result["shard"] == index
        assert result["local"] == full[position * chunk : (position + 1) * chunk]
        assert result["replicated"] == full
        assert result["tp_group_is_engine_group"]
    assert results[0]["mesh_dims"] == ["pp", "dp", "cp", "tp"] and results[0]["mesh_shape"] == [1, 2, 1, 2]
    assert results[0]["expert_dims"] == ["pp", "expt_dp", "ep", "expt_tp"]
    assert results[1]["dp_cp_ranks"] == [1, 3]
    assert results[4]["dp_cp_ranks"] == [4]
