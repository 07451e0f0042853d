"""A soak on a live 8-rank gloo world (slow: run with --run-slow): 500 cycles of build one of several
layouts, collectives on every group, destroy; now and then a random rank fails a build first. At the end
live groups, open file descriptors and store keys are back where they started, and every cycle's groups
were right (``lifecycle_workers.verify`` raises on the first wrong one)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from shardcore.testing import run_world
from tests.engine import lifecycle_workers as workers

WORLD = 8
CYCLES = 500
LAYOUTS = ["tp=2,pp=2+tp=2,dp=2", "tp=4,dp=2", "tp=2,cp=2,dp=2", "tp=1,dp=4+tp=2+tp=2", "tp=2,ep=2,dp=4"]
FAIL_EVERY = 10  # one cycle in ten, on average, starts with a failed build on a random rank
STORE_SLACK = 4 + 2 * WORLD  # the last meetings' keys, which the next build deletes


@pytest.mark.slow
def test_soak_500_cycles_on_8_ranks() -> None:
    results = run_world(WORLD, workers.soak, CYCLES, LAYOUTS, FAIL_EVERY, 2024, timeout=3600)
    for rank, report in enumerate(results):
        before, after = report["before"], report["after"]
        assert after["groups"] == before["groups"], (rank, report)
        assert after["fds"] <= before["fds"], (rank, report)
        assert after["keys"] <= before["keys"] + STORE_SLACK, (rank, report)
        assert report["verified"] >= CYCLES, (rank, report)
        assert sum(report["failures"].values()) > 0, (rank, report)
    print(f"\nsoak: {results[0]}")
