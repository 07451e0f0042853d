"""Backend discovery and selection through pluggy entry points."""

from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

import shardcore
from shardcore.engine.backends import hookspecs
from shardcore.engine.backends.plugins import (
    BACKEND_ENV,
    SHIPPED_BACKENDS,
    get_backend,
    list_backends,
    register_backend,
    unregister_backend,
)
from shardcore.errors import BackendNotFoundError, BackendUnavailableError


class _Broken(shardcore.Backend):
    name = "broken-here"
    description = "needs a device this machine lacks"

    def unavailable_reason(self) -> str | None:
        return "no such device: pip install nothing-real"


def test_default_is_dtensor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert get_backend().name == "dtensor"


def test_env_var_beats_default_and_explicit_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    register_backend(_Broken())
    try:
        monkeypatch.setenv(BACKEND_ENV, "broken-here")
        assert get_backend(require_available=False).name == "broken-here"
        assert get_backend("dtensor").name == "dtensor"
    finally:
        unregister_backend("broken-here")


def test_unknown_backend_lists_the_installed_ones() -> None:
    with pytest.raises(BackendNotFoundError) as error:
        get_backend("no-such-backend")
    assert "no-such-backend" in str(error.value) and "dtensor" in str(error.value)


def test_unavailable_backend_is_listed_with_reason_and_refused() -> None:
    register_backend(_Broken())
    try:
        info = {i.name: i for i in list_backends()}["broken-here"]
        assert not info.available and "pip install" in (info.reason or "")
        with pytest.raises(BackendUnavailableError, match="no such device"):
            get_backend("broken-here")
    finally:
        unregister_backend("broken-here")


def test_listing_reports_distribution_and_version() -> None:
    info = {i.name: i for i in list_backends()}["dtensor"]
    assert (info.distribution, info.available) == ("shardcore-dtensor", True)
    assert info.version.count(".") >= 1


def test_loading_one_backend_imports_no_other_plugin_or_framework() -> None:
    code = (
        "import sys, shardcore; shardcore.get_backend('dtensor');"
        "bad = [m for m in ('shardcore_megatron', 'shardcore_hyperparallel', 'shardcore_toy', 'megatron', 'torch_npu',"
        " 'hyper_parallel') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hookspecs_are_documented() -> None:
    specs = [f for name, f in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("shardcore_")]
    assert specs and all(inspect.getdoc(f) for f in specs)


def test_cli_backends_lists_dtensor() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardcore", "backends"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    assert "dtensor" in result.stdout and "available" in result.stdout


def test_cli_backends_lists_shipped_backends_to_install_in_100_columns() -> None:
    argv = [sys.executable, "-m", "shardcore", "backends"]
    text = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
    assert max(map(len, text.splitlines())) <= 100, text
    listed = json.loads(subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=120).stdout)
    entries = {entry["name"]: entry for entry in listed["backends"]}
    assert set(SHIPPED_BACKENDS) <= set(entries)
    assert entries["dtensor"]["installed"] and entries["dtensor"]["available"]
    for name in SHIPPED_BACKENDS:
        if importlib.util.find_spec(f"shardcore_{name}") is None:  # shipped, not installed in this env
            assert entries[name] == {**entries[name], "installed": False, "install": f"pip install ./plugins/{name}"}
            row = next(line for line in text.splitlines() if line.startswith(f"{name} "))
            assert row.split()[2:4] == ["not", "installed"]
            assert f"{name} (not installed): install: pip install ./plugins/{name}" in text


def test_refit_execute_is_the_executor_under_its_old_name() -> None:
    import shardcore.refit

    with pytest.warns(DeprecationWarning, match="use shardcore.execute_refit"):
        execute = shardcore.refit.execute
    assert execute is shardcore.execute_refit
    with pytest.warns(DeprecationWarning, match="use shardcore.TransferStats"):
        assert shardcore.refit.TransferStats is shardcore.TransferStats
