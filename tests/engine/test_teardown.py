"""100 build/destroy cycles on a live 4-rank world leave groups, file descriptors and store keys as they were."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from shardcore.testing import run_world
from tests.engine import fault_workers as workers


@pytest.mark.parametrize("strategy", ["local", "world"])
def test_hundred_build_destroy_cycles_leave_nothing_behind(strategy: str) -> None:
    results = run_world(4, workers.build_destroy_cycles, 100, "tp=2,pp=2", strategy, timeout=600)
    for rank, report in enumerate(results):
        before, after = report["before"], report["after"]
        assert after["groups"] == before["groups"], (rank, report)
        assert after["fds"] <= before["fds"], (rank, report)
        # The store returns to its size after the first cycle: torch's gloo keys of every destroyed group
        # are deleted, and the agreement holds one build's keys (the last 'built' meeting) at a time.
        assert after["keys"] <= before["keys"] + 4 + 2, (rank, report)
        assert report["shardcore_keys"] <= 1 + 4 + 2 * 4, (rank, report)  # epoch; last meetings' keys
