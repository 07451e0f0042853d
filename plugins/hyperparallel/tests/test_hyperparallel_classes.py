"""Which classes the handle is made of: Hyper-Parallel's own (the stand-in) when its current layout is
installed, the fallbacks over torch's DeviceMesh when nothing is, and a clear error for anything older.
Every test here chooses what is installed itself, so none depends on what this machine has."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from plugins.hyperparallel.tests.hyperparallel_workers import FIELDS, MESHES, STAND_IN
from shardcore import BackendUnavailableError, get_backend
from shardcore_hyperparallel import (
    CURRENT_LAYOUT,
    DistributedSetup,
    HyperParallelBackend,
    MeshContext,
    distributed_setup,
    mesh_classes,
)
from shardcore_hyperparallel.context import build_through_shardcore

MESH_FIELDS = [*MESHES, *FIELDS]
SETUP_FIELDS = [
    "mesh_context",
    "strategy_config",
    "pipeline_config",
    "moe_parallel_config",
    "activation_checkpointing",
    "plan_overrides",
    "module_replacements",
    "low_precision_config",
    "fp32_main_params",
]

Install = Callable[..., None]
PACKAGES = ("hyper_parallel", "hyper_models")


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Iterator[Install]:
    """``install(*paths)``: Hyper-Parallel's packages are importable from ``paths`` only (none: from nowhere),
    whatever this machine has installed."""

    def choose(*paths: Path) -> None:
        for name in [n for n in sys.modules if n.split(".")[0] in PACKAGES]:
            monkeypatch.delitem(sys.modules, name)
        for name in PACKAGES:
            if not any((path / name).is_dir() for path in paths):
                monkeypatch.setitem(sys.modules, name, None)  # find_spec and import then see nothing
        for path in paths:
            monkeypatch.syspath_prepend(str(path))
        mesh_classes.cache_clear()

    yield choose
    mesh_classes.cache_clear()
    for name in [n for n in sys.modules if n.split(".")[0] in PACKAGES]:
        del sys.modules[name]  # the stand-in's modules must not outlive the test


def _write(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_fallback_has_hyper_parallels_fields_and_defaults(install: Install) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    install()
    classes = mesh_classes()
    assert (classes.mesh_context, classes.distributed_setup, classes.device_mesh) == (
        MeshContext,
        DistributedSetup,
        DeviceMesh,
    )
    assert [f.name for f in dataclasses.fields(MeshContext)] == MESH_FIELDS
    assert [f.name for f in dataclasses.fields(DistributedSetup)] == SETUP_FIELDS
    context = MeshContext()
    assert (context.pp_enabled, context.dp_cp_mesh, context.cp_mesh) == (False, None, None)
    assert MeshContext(pp_size=2).pp_enabled
    setup = distributed_setup(context, fp32_main_params=True)
    assert setup.mesh_context is context and setup.fp32_main_params
    assert HyperParallelBackend().unavailable_reason() is None


def test_build_meshs_runs_the_same_checks() -> None:
    with pytest.raises(ValueError, match=r"must equal the world of 8 ranks"):
        MeshContext(dp_size=2, tp_size=2).build_meshs("cpu", 8)


def test_hyper_parallels_classes_are_used_when_its_current_layout_is_installed(install: Install) -> None:
    install(STAND_IN)
    from hyper_parallel import DeviceMesh
    from hyper_parallel.distributed import mesh as hp

    classes = mesh_classes()
    assert issubclass(classes.mesh_context, hp.MeshContext)
    assert classes.distributed_setup is hp.DistributedSetup and classes.device_mesh is DeviceMesh
    assert classes.source == str(STAND_IN / "hyper_parallel")
    assert [f.name for f in dataclasses.fields(hp.MeshContext)] == MESH_FIELDS  # the stand-in's are the real ones
    context = classes.mesh_context(tp_size=2)
    context._dp_cp_mesh = "prebuilt"
    assert context.dp_cp_mesh == "prebuilt"  # shardcore's mesh, not Hyper-Parallel's flatten()
    assert classes.mesh_context.build_meshs is build_through_shardcore  # never Hyper-Parallel's own creation
    assert isinstance(distributed_setup(context), hp.DistributedSetup)
    assert HyperParallelBackend().unavailable_reason() is None


OLD_LAYOUTS = {
    "hyper_models stub": (
        {
            "hyper_models/__init__.py": "",
            "hyper_models/components/__init__.py": "",
            "hyper_models/components/distributed/__init__.py": "",
            "hyper_models/components/distributed/infrastructure.py": "class MeshContext: ...\n",
        },
        "the old 'hyper_models' stub package (",
        "hyper_models/components/distributed/infrastructure.py",
    ),
    "auto_models layout": (
        {
            "hyper_parallel/__init__.py": "",
            "hyper_parallel/auto_models/components/distributed/infrastructure.py": "class MeshContext: ...\n",
        },
        "Hyper-Parallel's older 'auto_models' layout (",
        "hyper_parallel/auto_models/components/distributed/infrastructure.py",
    ),
    "before MeshContext": (
        {"hyper_parallel/__init__.py": "", "hyper_parallel/core/device_mesh.py": "class DeviceMesh: ...\n"},
        "a package 'hyper_parallel' at ",
        "without distributed/mesh.py",
    ),
}


@pytest.mark.parametrize("case", list(OLD_LAYOUTS))
def test_an_older_layout_is_refused_naming_what_was_found(install: Install, tmp_path: Path, case: str) -> None:
    files, found, where = OLD_LAYOUTS[case]
    install(_write(tmp_path, files))
    reason = HyperParallelBackend().unavailable_reason()
    assert reason is not None and found in reason and where in reason
    assert f"needs Hyper-Parallel's current layout, {CURRENT_LAYOUT}" in reason and len(reason) < 1024
    with pytest.raises(BackendUnavailableError, match="is installed but unavailable here: found "):
        get_backend("hyperparallel")
    with pytest.raises(BackendUnavailableError, match="needs Hyper-Parallel's current layout"):
        mesh_classes()


def test_the_current_layout_beside_an_old_stub_is_used(install: Install, tmp_path: Path) -> None:
    stub, _, _ = OLD_LAYOUTS["hyper_models stub"]
    install(_write(tmp_path, stub), STAND_IN)  # the current layout wins
    assert mesh_classes().source == str(STAND_IN / "hyper_parallel")


@pytest.mark.parametrize(
    ("mesh_py", "message"),
    [
        ("raise OSError('libhccl.so: cannot open shared object file')\n", "failed to import: OSError: libhccl.so"),
        (
            "class MeshContext: ...\n",
            "lacks hyper_parallel.distributed.mesh.DistributedSetup, hyper_parallel.DeviceMesh",
        ),
    ],
)
def test_a_broken_current_install_is_an_error_not_a_silent_fallback(
    install: Install, tmp_path: Path, mesh_py: str, message: str
) -> None:
    files = {"hyper_parallel/__init__.py": "", "hyper_parallel/distributed/__init__.py": ""}
    install(_write(tmp_path, {**files, "hyper_parallel/distributed/mesh.py": mesh_py}))
    with pytest.raises(BackendUnavailableError, match=message) as info:
        mesh_classes()
    assert str(tmp_path / "hyper_parallel") in str(info.value) and "pip install ." in str(info.value)


def test_loading_the_plugin_and_its_checks_import_neither_torch_nor_hyper_parallel() -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(STAND_IN)!r}); import shardcore;"
        "backend = shardcore.get_backend('hyperparallel'); assert backend.unavailable_reason() is None;"
        "bad = [m for m in ('torch', 'torch_npu', 'hyper_parallel', 'shardcore_dtensor', 'shardcore_megatron')"
        " if m in sys.modules];"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
