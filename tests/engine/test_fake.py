"""Worlds of up to 262,144 ranks, simulated one rank at a time with torch's fake backend.

``fake_world.py`` runs in a subprocess, so no fake world ever lives in pytest's process.
For every simulated rank: each of the 15 names holds a group whose ranks
(``dist.get_process_group_ranks``) equal ``layout.groups_of(rank)``, exactly one process
group per distinct rank set was created, and destroy_shards brings the count back.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from shardcore import GROUP_NAMES, Layout, plan_layout

SCRIPT = Path(__file__).with_name("fake_world.py")
DENSE_WORLDS = (1024, 16384, 262144)
ORDERS = ("tp-cp-dp-pp", "tp-cp-pp-dp")
# 4 shards of 65,536 ranks with different group shapes, then 1,024 idle ranks.
HETERO = (
    "tp=8,cp=2,pp=4,dp=1024,ep=2,expt_tp=8,role=train"
    "+tp=4,pp=2,dp=8192,ep=4,expt_tp=1,role=prefill"
    "+tp=2,cp=2,dp=16384,ep=4,role=prefill"
    "+tp=4,dp=16384,ep=16,expt_tp=2,role=decode"
)
HETERO_WORLD = 262144 + 1024
SMALL = "tp=2,cp=2,pp=2,dp=2,ep=2,role=train+tp=4,dp=4,role=prefill+tp=8,role=decode"


def dense(world: int) -> str:
    return f"tp=8,cp=2,pp=4,dp={world // 64}"


def simulate(*requests: dict[str, Any]) -> list[list[dict[str, Any]]]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(requests)], capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def sample(world: int, count: int = 6) -> list[int]:
    rng = random.Random(world)
    return sorted({0, 1, world // 2 + 3, world - 1, *(rng.randrange(world) for _ in range(count - 4))})


def hetero_ranks(layout: Layout) -> list[int]:
    edges = {plan.rank_offset + plan.size // 3 for plan in layout.shards}
    edges |= {plan.rank_offset + plan.size - 1 for plan in layout.shards}
    return sorted({0, layout.world_size - 1, *edges})


def check(reports: list[dict[str, Any]], layout: Layout, ranks: list[int]) -> None:
    assert [r["rank"] for r in reports] == ranks
    for report in reports:
        rank = report["rank"]
        plan = layout.shard_of(rank)
        assert report["wrong"] == [], f"rank {rank}: {report['wrong']}"
        assert report["shard"] == (None if plan is None else plan.index)
        assert report["names"] == (0 if plan is None else len(GROUP_NAMES))
        assert report["created"] == report["distinct"] == len(layout.distinct_groups(rank)), f"rank {rank}"
        assert report["leftover"] == 0, f"rank {rank}: destroy_shards left groups behind"
        assert report["others_none"], f"rank {rank}: a shard it is not in has groups"
        assert report["has_handle"] == (plan is not None)


@pytest.fixture(scope="module")
def dense_reports() -> dict[int, list[dict[str, Any]]]:
    requests = [{"world": w, "shards": dense(w), "ranks": sample(w), "strategy": "local"} for w in DENSE_WORLDS]
    return dict(zip(DENSE_WORLDS, simulate(*requests)))


@pytest.fixture(scope="module")
def hetero_reports() -> dict[str, list[dict[str, Any]]]:
    requests = [
        {
            "world": HETERO_WORLD,
            "shards": HETERO,
            "order": order,
            "allow_idle": True,
            "strategy": "local",
            "ranks": hetero_ranks(plan_layout(HETERO_WORLD, HETERO, order=order, allow_idle=True)),
        }
        for order in ORDERS
    ]
    return dict(zip(ORDERS, simulate(*requests)))


@pytest.mark.parametrize("world", DENSE_WORLDS)
def test_dense_local(dense_reports: dict[int, list[dict[str, Any]]], world: int) -> None:
    check(dense_reports[world], plan_layout(world, dense(world)), sample(world))


@pytest.mark.parametrize("order", ORDERS)
def test_heterogeneous_local_with_idle_ranks(hetero_reports: dict[str, list[dict[str, Any]]], order: str) -> None:
    layout = plan_layout(HETERO_WORLD, HETERO, order=order, allow_idle=True)
    reports = hetero_reports[order]
    check(reports, layout, hetero_ranks(layout))
    assert {r["shard"] for r in reports} == {None, 0, 1, 2, 3}


def test_world_strategy_small() -> None:
    world, ranks = 64, [0, 5, 31, 32, 47, 48, 60, 63]
    (reports,) = simulate({"world": world, "shards": SMALL, "ranks": ranks, "strategy": "world", "allow_idle": True})
    check(reports, plan_layout(world, SMALL, allow_idle=True), ranks)
