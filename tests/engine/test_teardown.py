"""100 build/destroy cycles on a live 4-rank world leave groups, file descriptors and store keys as they were, and
destroying the world, or leaving a refit group open, ends its threads by the time the interpreter goes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


ROOT = Path(__file__).resolve().parents[2]


def _with_checkout() -> dict[str, str]:
    """The environment with this checkout first on the path (a spawned child does not run from the cwd)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


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


LEAVES_A_GROUP_OPEN = """
import atexit, multiprocessing, os, sys


def threads(side):
    tasks = "/proc/self/task"
    sys.stdout.write(f"{side} {sorted(open(f'{tasks}/{t}/comm').read() for t in os.listdir(tasks))}\\n")


def job(side, address):
    atexit.register(threads, side)
    import torch  # here: without numpy, torch keeps the frame that first imports it, with its locals, for good
    from shardcore import connect_refit

    connect_refit(address, side=side, rank=0, trainer_ranks=1, engine_ranks=1, timeout=60)  # never closed


if __name__ == "__main__":
    spawn = multiprocessing.get_context("spawn")
    jobs = [spawn.Process(target=job, args=(side, sys.argv[1])) for side in ("trainer", "engine")]
    for process in jobs:
        process.start()
    for process in jobs:
        process.join(120)
    sys.exit(max(abs(process.exitcode or 0) for process in jobs))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads from /proc")
def test_a_refit_group_left_open_ends_its_gloo_threads_at_exit(tmp_path: Path) -> None:
    # Two jobs of one process each connect a refit group and exit without closing it: shardcore closes it at
    # exit, before the interpreter goes, so neither process keeps a gloo thread into its shutdown.
    script = tmp_path / "leaves_open.py"
    script.write_text(LEAVES_A_GROUP_OPEN)
    argv = [sys.executable, str(script), f"127.0.0.1:{free_port()}"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=ROOT, env=_with_checkout())
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith(("trainer", "engine"))]
    assert len(lines) == 2 and not any("gloo" in line for line in lines), result.stdout
