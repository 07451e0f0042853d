"""With pp > 1, Hyper-Parallel's own build_meshs names the two stages' groups alike; shardcore's do not.

torch names a default-mode group after a world-wide counter. Each stage of Hyper-Parallel's
``build_meshs`` creates only its own stage's groups, so stage 0's ``[0, 2]`` and stage 1's
``[4, 6]`` are created as the same call of the counter and get the same name: on gloo their
members rendezvous under one key prefix (a hang, or groups answered by the other stage's
ranks). Simulated with the stand-in under torch's fake backend, one rank per stage, so
nothing can hang; ``test_hyperparallel_live`` shows shardcore's groups answering right.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]
REQUEST = {
    "world": 8,
    "sizes": {"dp_size": 2, "tp_size": 2, "pp_size": 2, "ep_size": 2, "dp_shard_size": 2},
    "spec": "tp=2,dp=2,pp=2,ep=2,expt_tp=1",
    "ranks": [0, 4],
}


@pytest.fixture(scope="module")
def names() -> dict[str, dict[str, dict[str, list]]]:
    result = subprocess.run(
        [sys.executable, "-m", "plugins.hyperparallel.tests.stage_names", json.dumps(REQUEST)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,  # -m puts the checkout first on the path: the stand-in and the workers come from it
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def _clashes(by_rank: dict[str, dict[str, list]]) -> list[tuple[str, list[int], list[int]]]:
    """(name, ranks, other ranks) for every group name two different rank sets share."""
    seen: dict[str, list[int]] = {}
    clashes = []
    for groups in by_rank.values():
        for name, ranks in groups.values():
            if seen.setdefault(name, ranks) != ranks:
                clashes.append((name, seen[name], ranks))
    return clashes


def test_hyper_parallels_build_meshs_gives_both_stages_the_same_group_names(names: dict) -> None:
    own = names["hyper_parallel"]
    stage0, stage1 = own["0"], own["4"]
    assert stage0["device_mesh/dp"][1] == [0, 2] and stage1["device_mesh/dp"][1] == [4, 6]
    assert stage0["device_mesh/dp"][0] == stage1["device_mesh/dp"][0]  # one name, two disjoint groups
    assert {dim for dim in stage0 if stage0[dim][0] == stage1[dim][0]} == set(stage0)  # every dim collides


def test_shardcores_groups_have_one_name_per_rank_set(names: dict) -> None:
    ours = names["shardcore"]
    assert set(ours["0"]) == set(names["hyper_parallel"]["0"])  # the same meshes and dims
    assert ours["0"]["device_mesh/dp"][1] == [0, 2] and ours["4"]["device_mesh/dp"][1] == [4, 6]
    assert _clashes(ours) == []
    assert _clashes(names["hyper_parallel"])  # the same check finds the stand-in's
