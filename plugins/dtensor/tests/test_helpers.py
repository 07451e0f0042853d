"""The plain-DTensor helpers on a live 4-rank gloo world."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from plugins.dtensor.tests import dtensor_workers as workers
from shardcore.engine.ports import free_port
from shardcore.testing import run_world


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(4, workers.helpers, timeout=180)


def test_partitions_and_sizes(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["already"] is False
        assert result["dp"] == result["dp_by_name"] == (2, rank // 2)
        assert result["unsharded"] == result["no_mesh"] == (1, 0)
        assert result["no_tensor"] == result["flat"] == (4, rank)
        assert result["tp"] == result["tp_by_name"] == 2
        assert result["tp_off"] == 1


def test_errors_name_the_bad_value(results: list[dict]) -> None:
    result = results[0]
    assert result["bad_shape"].startswith("LayoutError") and "(3, 2)" in result["bad_shape"]
    assert "dp_mesh_dim is required" in result["nd_without_dim"]
    assert "dp_mesh_dim=5" in result["dim_out_of_range"]
    assert "tp_mesh_dim='ep'" in result["unknown_name"]


def test_ensure_distributed_initialized_starts_a_single_process_world() -> None:
    code = (
        "import torch.distributed as dist; from shardcore_dtensor import ensure_distributed_initialized as e;"
        "first = e(rank=0, world_size=1); second = e(); print(first, second, dist.get_backend());"
        "dist.destroy_process_group()"
    )
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.stdout.split() == ["True", "False", "gloo"], result.stderr
