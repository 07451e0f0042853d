"""Against the real Hyper-Parallel, when a user has installed it from source; skipped, saying so, otherwise.

The same checks as the stand-in's live test (``hp_checks``): the handle's meshes are
Hyper-Parallel's DeviceMesh, equal to its own ``build_meshs`` for one stage, and over two
pipeline stages they wrap shardcore's groups (each dim all-reduced and all-gathered).
"""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("torch")

from plugins.hyperparallel.tests import hyperparallel_workers as workers
from plugins.hyperparallel.tests.hp_checks import COMPARE, STAGED, check_matches_build_meshs, check_pipelined
from shardcore.testing import run_world

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("hyper_parallel") is None,
    reason="Hyper-Parallel is not installed (it is not on PyPI: pip install . in a clone of "
    "https://gitcode.com/mindspore/hyper-parallel to run these)",
)


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_world(8, workers.installed_probe, COMPARE, STAGED, timeout=400)


def test_the_meshes_are_hyper_parallels_device_mesh(reports: list[dict]) -> None:
    from hyper_parallel import DeviceMesh

    assert {r["mesh_class"] for r in reports} == {f"{DeviceMesh.__module__}.{DeviceMesh.__name__}"}


@pytest.mark.parametrize("rank", range(8))
def test_the_handle_matches_hyper_parallels_own_build_meshs(reports: list[dict], rank: int) -> None:
    check_matches_build_meshs(reports[rank]["compare"], rank, reports[rank]["mesh_class"])


@pytest.mark.parametrize("rank", range(8))
def test_two_pipeline_stages_wrap_shardcores_groups(reports: list[dict], rank: int) -> None:
    check_pipelined(reports[rank]["staged"], rank, reports[rank]["mesh_class"])
