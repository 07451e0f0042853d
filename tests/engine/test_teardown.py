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
        # shardcore's rendezvous leaves one phase in the store (its rank values, reference, arrived, done),
        # not 100 cycles' worth. (torch's own per-group gloo keys do grow: torch never deletes them.)
        assert report["shardcore_keys"] <= 4 + 3, (rank, report)
