"""Flattened meshes over shard windows on live gloo worlds: declared, made later, and refused (issue 14)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from plugins.dtensor.tests import flatten_workers as workers
from shardcore import LayoutError, plan_layout
from shardcore.testing import run_world
from shardcore_dtensor import DTensorBackend

TWO = "tp=2,dp=2 + tp=2,dp=2"
TWO_PLAN = {
    0: [("dp_tp_late", ("dp", "tp")), ("w0_tp", ("tp",))],
    1: [("dp_tp_late", ("dp", "tp")), ("w1_dp", ("dp",))],
}
THREE = "tp=2,dp=2 + tp=2 + dp=2"
THREE_PLAN = {
    0: [("same", ("dp", "tp")), ("w0", ("tp",))],
    1: [("same", ("tp",)), ("w1", ("pp", "tp"))],
    2: [("same", ("dp", "tp")), ("w2", ("dp",))],
}
CHECKS = ("matmul", "matmul_sharded", "redistribute", "partial_sum")


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return run_world(8, workers.windows, TWO, TWO_PLAN, timeout=300)


@pytest.fixture(scope="module")
def three() -> list[dict]:
    return run_world(8, workers.windows, THREE, THREE_PLAN, timeout=300)


def expected_members(spec: str, rank: int, dims: tuple[str, ...]) -> list[int]:
    """The ranks of ``rank``'s group along ``dims`` of its shard's grid, from the plan alone."""
    shard = plan_layout(8, spec).shard_of(rank)
    assert shard is not None
    return list(shard.decoder_grid.group_ranks(rank, dims))


def check_flattens(spec: str, plan: dict, results: list[dict], key: str) -> None:
    for rank, result in enumerate(results):
        for name, dims in plan[result["window"]]:
            seen = result[key][name]
            want = expected_members(spec, rank, dims)
            assert seen["members"] == want, (rank, name)
            assert seen["sum"] == sum(want), (rank, name)
            assert all(seen[check] for check in CHECKS), (rank, name, seen)


@pytest.mark.parametrize("world", ["two", "three"])
def test_declared_flatten_is_the_engine_group_and_creates_nothing(world: str, request: pytest.FixtureRequest) -> None:
    spec = TWO if world == "two" else THREE
    for rank, result in enumerate(request.getfixturevalue(world)):
        assert result["declared_created_nothing"] and result["declared_is_engine_group"]
        assert result["by_name_same_group"] and result["dp_cp_is_engine_group"] and result["repeat_is_same"]
        assert result["declared"]["members"] == expected_members(spec, rank, ("dp", "tp"))
        assert all(result["declared"][check] for check in CHECKS)


def test_regression_issue_14_each_window_flattens_alone(two: list[dict]) -> None:
    """Both windows flatten ("dp", "tp") under one name after the build: each group sums only its own window.

    With torch's own _flatten on a plain DeviceMesh this hung, or summed ranks of the other window.
    """
    check_flattens(TWO, TWO_PLAN, two, "undeclared")
    assert [r["undeclared"]["dp_tp_late"]["sum"] for r in two] == [6] * 4 + [22] * 4


def test_three_windows_same_names_on_different_dims(three: list[dict]) -> None:
    check_flattens(THREE, THREE_PLAN, three, "undeclared")


@pytest.mark.parametrize("world", ["two", "three"])
def test_later_world_groups_builds_and_rebuilds_still_work(world: str, request: pytest.FixtureRequest) -> None:
    spec, plan = (TWO, TWO_PLAN) if world == "two" else (THREE, THREE_PLAN)
    results = request.getfixturevalue(world)
    for rank, result in enumerate(results):
        assert len(set(result["counters"])) == 1, "ranks hold different torch group counters"
        assert result["world_sum"] == sum(range(8))
        assert result["second"] == expected_members(spec, rank, ("dp", "tp"))
        assert "was destroyed" in result["closed"]
        assert result["groups_left"] == 1, "only the default group is left after destroy_shards"
    check_flattens(spec, plan, results, "rebuilt")


def test_unflatten_splits_the_flattened_window(two: list[dict]) -> None:
    for rank, result in enumerate(two):
        assert result["unflatten_inner"] == [rank - rank % 2, rank - rank % 2 + 1]


def test_refusals_name_the_safe_way_and_the_absent_rank() -> None:
    results = run_world(4, workers.refusals, timeout=180)
    for result in results:
        assert "was not made by build_shards" in result["bare_flatten"] and "flatten=" in result["bare_flatten"]
        assert result["bare_unflatten"].startswith("GroupCreationError")
        assert "not a member of shard" in result["not_member"]
        assert "not in the window" in result["outside"]
        assert "cannot flatten" in result["unknown_dim"]
        assert len(set(result["counters"])) == 1
    assert results[3]["skipped"] == "skipped"
    assert "ranks [3] (1 rank)" in results[2]["skipped"] and "did not reach" in results[2]["skipped"]
    assert results[0]["skipped"] == results[1]["skipped"] == "no error"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"flatten": ["dp", "tp"]}, "expected a dict"),
        ({"flatten": {"tp": ("dp", "tp")}}, "not a new dim name"),
        ({"flatten": {"x": ("dp", "nope")}}, "expected distinct dims"),
        ({"flatten": {"x": ("dp", "dp")}}, "expected distinct dims"),
        ({"flatten": {"dp_cp": ("dp", "tp")}}, "standard group"),
        ({"expert_flatten": {"x": ("dp",)}}, "expected distinct dims of expt_tp"),
    ],
)
def test_bad_flatten_options_fail_before_any_rank_communicates(options: dict, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        DTensorBackend().validate(plan_layout(2, "tp=2"), options)
