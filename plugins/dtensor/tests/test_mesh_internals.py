"""The DeviceMesh internals the window meshes rely on, checked when the backend loads its framework.

On the running torch (2.13.0 and 2.14.1 in tox) they all check out; a torch without one of them (here a
real torch with it deleted before the plugin is imported) fails in one line naming it and the tested releases.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch.distributed

from shardcore import get_backend
from shardcore.engine import check_torch_internals
from shardcore_dtensor.window_mesh import MESH_INTERNALS

ROOT = Path(__file__).resolve().parents[3]


def test_the_running_torch_has_every_mesh_internal() -> None:
    check_torch_internals("shardcore-dtensor", torch.distributed, MESH_INTERNALS)
    get_backend("dtensor").load_framework()


@pytest.mark.parametrize(
    ("removal", "named"),
    [
        (
            "del device_mesh.DeviceMesh._create_flatten_mesh",
            "torch.distributed.device_mesh.DeviceMesh._create_flatten_mesh,",
        ),
        ("del _mesh_layout._MeshLayout.collapse", "torch.distributed._mesh_layout._MeshLayout (collapse"),
    ],
)
def test_loading_the_backend_names_a_missing_internal_in_one_line(removal: str, named: str) -> None:
    code = textwrap.dedent(
        f"""
        from torch.distributed import _mesh_layout, device_mesh

        {removal}  # as a torch without it
        from shardcore import TorchInternalsError, get_backend

        try:
            get_backend("dtensor").load_framework()
        except TorchInternalsError as error:
            print(error)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    assert f"lacks or changed {named}" in lines[0]
    assert "which shardcore-dtensor relies on (tested on torch 2.13.0 and 2.14.1)" in lines[0]
