"""100 build/destroy cycles on a live 4-rank world leave groups, file descriptors and store keys as they were, and
destroying the world ends its threads."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")

from shardcore.engine.live.ports import free_port
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


ENDS_ITS_THREADS = """
import atexit, os
tasks = "/proc/self/task"
atexit.register(lambda: print(sorted(open(f"{{tasks}}/{{t}}/comm").read() for t in os.listdir(tasks))))
import torch.distributed as dist
from shardcore import build_shards
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
build_shards(1, "tp=1", strategy="world")
dist.destroy_process_group()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads from /proc")
def test_destroying_the_world_after_a_build_ends_its_gloo_threads() -> None:
    # A gloo thread still alive when the interpreter shuts down can abort the process ("terminate called"),
    # so nothing shardcore keeps may hold a group of a destroyed world past the last exit handler (which lists
    # the threads: it was registered first, so it runs last).
    script = ENDS_ITS_THREADS.format(port=free_port())
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    threads = result.stdout.strip().splitlines()[-1]
    assert "gloo" not in threads, threads
