"""The strategy decision: ``auto`` picks ``world`` where torch creates groups with every rank, else
``local``; an explicit ``local`` is refused there; TORCH_DIST_INIT_BARRIER is read as torch reads it."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from shardcore.engine.groups.strategy import Strategy, check_strategy_early, choose_strategy, init_barrier_enabled
from shardcore.errors import GroupCreationError
from shardcore.testing import run_world
from shardcore_dtensor.helpers import local_device_index
from tests.engine import engine_workers as workers


@pytest.mark.parametrize(
    ("value", "enabled"), [(None, False), ("0", False), ("1", True), (" 1", True), ("01", True), ("2", False)]
)
def test_init_barrier_is_read_as_an_integer_like_torch(
    monkeypatch: pytest.MonkeyPatch, value: str | None, enabled: bool
) -> None:
    if value is None:
        monkeypatch.delenv("TORCH_DIST_INIT_BARRIER", raising=False)
    else:
        monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", value)
    assert init_barrier_enabled() is enabled


def test_a_non_integer_init_barrier_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "true")
    with pytest.raises(GroupCreationError, match="TORCH_DIST_INIT_BARRIER='true'"):
        check_strategy_early("auto")


def test_explicit_local_is_refused_early_under_the_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "1")
    with pytest.raises(GroupCreationError, match="strategy='local' cannot work here: TORCH_DIST_INIT_BARRIER=1"):
        check_strategy_early("local")
    check_strategy_early("auto")
    check_strategy_early("world")
    with pytest.raises(GroupCreationError, match="strategy='members'"):
        check_strategy_early("members")


def _decide(rank: int, world: int, env: dict[str, str], bind: bool) -> dict[str, Any]:
    """The decision for each requested strategy on a live gloo world, with the default group
    optionally marked as device-bound (what init_process_group(device_id=cuda:N) leaves)."""
    import os

    import torch
    from torch.distributed import distributed_c10d

    os.environ.update(env)
    default = distributed_c10d._get_default_group()
    if bind:
        default.bound_device_id = torch.device("cuda", rank)
    try:
        decided: dict[str, Any] = {}
        for requested in Strategy:
            try:
                strategy, why = choose_strategy(requested)
                decided[requested] = (str(strategy), why)
            except GroupCreationError as error:
                decided[requested] = ("refused", str(error))
        return decided
    finally:
        default.bound_device_id = None
        for key in env:
            del os.environ[key]


@pytest.fixture(scope="module")
def decisions() -> list[dict[str, Any]]:
    cases = [({}, False), ({"TORCH_DIST_INIT_BARRIER": "1"}, False), ({}, True)]
    return [run_world(2, _decide, env, bind, timeout=180)[0] for env, bind in cases]


def test_auto_is_local_where_groups_are_created_lazily(decisions: list[dict[str, Any]]) -> None:
    lazy = decisions[0]
    assert lazy["auto"] == ("local", "groups are created lazily here: members create only their own groups")
    assert lazy["local"][0] == "local" and lazy["world"][0] == "world"


@pytest.mark.parametrize(("case", "reason"), [(1, "TORCH_DIST_INIT_BARRIER=1"), (2, "bound to cuda:0")])
def test_auto_is_world_where_torch_creates_with_every_rank(
    decisions: list[dict[str, Any]], case: int, reason: str
) -> None:
    decided = decisions[case]
    assert decided["auto"][0] == "world" and reason in decided["auto"][1]
    assert "every rank creates every group" in decided["auto"][1]
    assert decided["local"][0] == "refused" and reason in decided["local"][1]
    assert "use strategy='world' or 'auto'" in decided["local"][1]
    assert decided["world"][0] == "world"


def _build_under_barrier(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import os

    os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
    return workers.build_verify_destroy(rank, world, cases)


def test_auto_under_the_barrier_builds_and_verifies_every_group() -> None:
    """With TORCH_DIST_INIT_BARRIER=1 members-only creation would hang; auto builds with world."""
    cases = [{"shards": "tp=2+tp=1,dp=2", "kwargs": {"timeout": 60}}]
    reports = run_world(4, _build_under_barrier, cases, timeout=180)
    for rank, [report] in enumerate(reports):
        assert report["seen"] == report["planned"] and report["planned"], f"rank {rank}"


def test_local_rank_names_the_gpu() -> None:
    assert local_device_index(None, 8) is None
    assert local_device_index("3", 8) == 3
    with pytest.raises(GroupCreationError, match="LOCAL_RANK=8 but 8 GPU"):
        local_device_index("8", 8)
    with pytest.raises(GroupCreationError, match="LOCAL_RANK='x'"):
        local_device_index("x", 8)
