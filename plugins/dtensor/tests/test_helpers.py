"""The plain-DTensor helpers on a live 4-rank gloo world."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from plugins.dtensor.tests import dtensor_workers as workers
from shardcore import LayoutError
from shardcore.engine.live.ports import free_port
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


def test_ensure_distributed_initialized_prints_no_numpy_warning() -> None:
    """torch's CPU wheel has no numpy, and importing torch warns "Failed to initialize NumPy" when it
    builds its first CPU tensor; the helper imports torch through shardcore's guard, which silences it."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("numpy is installed: torch has nothing to warn about")
    code = (
        "from shardcore_dtensor import ensure_distributed_initialized as e; assert e(rank=0, world_size=1);"
        "import torch.distributed as dist; dist.destroy_process_group()"
    )
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and "NumPy" not in result.stderr, result.stderr


HUGE = 10**5000


@pytest.mark.parametrize(
    ("call", "token"),
    [
        (lambda h: h.ensure_distributed_initialized(backend=5), "backend=5"),
        (lambda h: h.ensure_distributed_initialized(init_method=b"tcp://"), "init_method=b'tcp://'"),
        (lambda h: h.ensure_distributed_initialized(rank=-1), "rank=-1"),
        (
            lambda h: h.ensure_distributed_initialized(rank=4, world_size=4),
            "rank=4: expected a whole number from 0 to 3",
        ),
        (lambda h: h.ensure_distributed_initialized(world_size=HUGE), "world_size=100000000000... (5001 digits)"),
        (lambda h: h.build_device_mesh(5), "device_type=5"),
        (lambda h: h.build_device_mesh("cpu", 4), "mesh_shape=4"),
        (lambda h: h.build_device_mesh("cpu", (2, "2")), "mesh_shape size='2'"),
        (lambda h: h.build_device_mesh("cpu", (2, HUGE)), "(5001 digits)"),
        (lambda h: h.build_device_mesh("cpu", (2, 2), ("dp",)), "mesh_dim_names=('dp',)"),
        (lambda h: h.build_device_mesh("cpu", (2, 2), ("dp", "dp")), "one distinct name per dim"),
        (lambda h: h.resolve_data_parallel_partition(None, 0, "yes"), "sharded_by_data_parallel='yes'"),
        (lambda h: h.resolve_tensor_parallel_group_size(None, 0, 1), "tensor_parallel_enabled=1"),
    ],
)
def test_bad_arguments_are_refused_before_torch_distributed(call: object, token: str) -> None:
    import shardcore_dtensor as helpers

    with pytest.raises(LayoutError) as info:
        call(helpers)  # type: ignore[operator]
    assert token in str(info.value) and len(str(info.value)) < 400
