"""Hyper-Parallel's own classes are used when they import; the fallback has the same surface."""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from shardcore_hyperparallel import DistributedSetup, MeshContext, distributed_setup, mesh_classes

MESH_FIELDS = [
    "device_mesh",
    "fsdp_non_moe_mesh",
    "fsdp_moe_mesh",
    "dp_size",
    "dp_replicate_size",
    "dp_shard_size",
    "edp_shard_size",
    "tp_size",
    "cp_size",
    "pp_size",
    "ep_size",
    "dp_rank",
    "tp_rank",
    "cp_rank",
    "pp_rank",
    "ep_rank",
    "sequence_parallel",
    "loss_parallel",
]
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


@pytest.fixture
def fresh_classes() -> Iterator[None]:
    mesh_classes.cache_clear()
    yield
    mesh_classes.cache_clear()


def test_fallback_has_hyper_parallels_fields_and_defaults(fresh_classes: None) -> None:
    assert mesh_classes()[0] is MeshContext
    assert [f.name for f in dataclasses.fields(MeshContext)] == MESH_FIELDS
    assert [f.name for f in dataclasses.fields(DistributedSetup)] == SETUP_FIELDS
    context = MeshContext()
    assert (context.pp_enabled, context.dp_cp_mesh, context.cp_mesh) == (False, None, None)
    assert MeshContext(pp_size=2).pp_enabled
    assert callable(MeshContext.build_meshs)
    setup = distributed_setup(context, fp32_main_params=True)
    assert setup.mesh_context is context and setup.fp32_main_params


def test_build_meshs_runs_the_same_checks() -> None:
    with pytest.raises(ValueError, match=r"must equal the world of 8 ranks"):
        MeshContext(dp_size=2, tp_size=2).build_meshs("cpu", 8)


def _fake_hyper_parallel(monkeypatch: pytest.MonkeyPatch) -> tuple[type, type]:
    def flatten_only(self: Any) -> Any:
        raise AttributeError("torch DeviceMesh has no flatten")

    # Upstream's class: the same fields (MESH_FIELDS checks ours against them), its own dp_cp_mesh.
    HPMeshContext = dataclasses.make_dataclass(
        "HPMeshContext",
        [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(MeshContext)],
        namespace={"dp_cp_mesh": property(flatten_only)},
    )

    @dataclasses.dataclass
    class HPSetup:
        mesh_context: Any = None
        strategy_config: Any = None

    names = ["hyper_parallel", "hyper_parallel.distributed", "hyper_parallel.distributed.mesh"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = sys.modules[names[-1]]
    module.MeshContext, module.DistributedSetup = HPMeshContext, HPSetup  # type: ignore[attr-defined]
    return HPMeshContext, HPSetup


def test_hyper_parallels_classes_are_used_when_importable(monkeypatch: pytest.MonkeyPatch, fresh_classes: None) -> None:
    hp_mesh, hp_setup = _fake_hyper_parallel(monkeypatch)
    context_cls, setup_cls, where = mesh_classes()
    assert issubclass(context_cls, hp_mesh) and setup_cls is hp_setup
    assert where == "hyper_parallel.distributed.mesh"
    context = context_cls(tp_size=2)
    context._dp_cp_mesh = "prebuilt"
    assert context.dp_cp_mesh == "prebuilt"  # shardcore's mesh, not HP's flatten()
    assert isinstance(distributed_setup(context), hp_setup)


def test_broken_hyper_parallel_import_falls_back(monkeypatch: pytest.MonkeyPatch, fresh_classes: None) -> None:
    import builtins

    real_import = builtins.__import__

    def failing(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith(("hyper_parallel", "hyper_models")):
            raise OSError("libhccl.so: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing)
    monkeypatch.setattr("importlib.import_module", lambda name: failing(name))
    assert mesh_classes()[0] is MeshContext


def test_loading_the_plugin_imports_neither_torch_nor_other_backends() -> None:
    import subprocess

    code = (
        "import sys, shardcore; shardcore.get_backend('hyperparallel');"
        "bad = [m for m in ('torch', 'torch_npu', 'shardcore_dtensor', 'shardcore_megatron') if m in sys.modules];"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
