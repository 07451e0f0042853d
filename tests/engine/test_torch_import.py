"""Importing torch through shardcore's one guard: a device extension that breaks ``import torch`` (torch-npu
without Ascend's CANN toolkit) is one line naming both fixes at every entry point, never a traceback; and
on a machine without numpy, torch's "Failed to initialize NumPy" warning is not printed.

The extension is a stand-in made the way torch-npu 2.13.0 is packaged: a distribution whose
``torch.backends`` entry point ``torch_npu`` names a module ``torch_npu`` that cannot import
(``libhccl.so`` missing). Every run is a subprocess with it on ``PYTHONPATH``, so its ``import torch``
is a real one that hits it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from shardcore.engine.torch_state import _extension_failure
from tests.engine.test_check import NO_NUMPY, write_distribution

ROOT = Path(__file__).resolve().parents[2]
CANN_ERROR = "libhccl.so: cannot open shared object file: No such file or directory"
STAND_IN_NPU = textwrap.dedent(
    f"""
    import os

    # what torch_npu does without CANN: its _C extension cannot load libhccl.so
    if os.environ.get("STAND_IN_NPU_FAILS") != "workers" or "RANK" in os.environ:
        raise ImportError({CANN_ERROR!r})


    def _autoload():
        pass
    """
)
ONE_LINE = (
    "import torch fails: torch autoloads its device extension 'torch_npu' (stand-in-npu 2.13.0), which failed "
    f"to load: ImportError: {CANN_ERROR}; to use Ascend NPUs, install Ascend's CANN toolkit and source its "
    "set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh), or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to run "
    "on CPU/CUDA without it"
)


@pytest.fixture
def broken_npu(tmp_path: Path) -> Path:
    """A directory holding the stand-in torch-npu, to put on PYTHONPATH."""
    entry_points = "[torch.backends]\ntorch_npu = torch_npu:_autoload\n"
    write_distribution(tmp_path, "torch_npu", STAND_IN_NPU, "stand-in-npu", entry_points, version="2.13.0")
    return tmp_path


def _run(argv: list[str], path: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    pythonpath = os.pathsep.join([str(path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    environ = {**os.environ, "PYTHONPATH": pythonpath, **env}
    environ.pop("SHARDCORE_BACKEND", None)
    environ.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    environ.update(env)
    return subprocess.run(argv, capture_output=True, text=True, env=environ, timeout=timeout, cwd=ROOT)


def _unwrapped(text: str) -> str:
    """``shardcore backends``' text with its wrapped paragraphs joined again (continuations are indented)."""
    return text.replace("\n  ", " ")


def _shardcore(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardcore", *args]


def test_the_stand_in_breaks_import_torch_as_torch_npu_does(broken_npu: Path) -> None:
    result = _run([sys.executable, "-c", "import torch"], broken_npu)
    assert result.returncode == 1
    assert "RuntimeError: Failed to load the backend extension: torch_npu." in result.stderr
    assert f"ImportError: {CANN_ERROR}" in result.stderr


def test_check_is_one_line_before_any_process_starts(broken_npu: Path) -> None:
    started = time.monotonic()
    result = _run(_shardcore("check", "--nproc", "2", "--shards", "tp=2"), broken_npu)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"shardcore: error: {ONE_LINE}\n"
    assert time.monotonic() - started < 120


def test_each_check_worker_reports_one_line_and_no_traceback(broken_npu: Path) -> None:
    """The parent imports torch fine; every worker's import fails (once, never twice: a second import
    of a half-imported torch dies with "Only a single TORCH_LIBRARY ..." and a traceback)."""
    argv = _shardcore("check", "--nproc", "4", "--shards", "tp=2+tp=2", "--timeout", "60")
    result = _run(argv, broken_npu, STAND_IN_NPU_FAILS="workers")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "TORCH_LIBRARY" not in result.stderr
    errors = result.stderr[result.stderr.index("shardcore: error:") :].splitlines()
    assert errors == ["shardcore: error: shardcore check failed:", f"ranks [0-3] (4 ranks): {ONE_LINE}"]


def test_the_library_entry_points_raise_it_and_never_import_twice(broken_npu: Path) -> None:
    code = textwrap.dedent(
        """
        import shardcore
        from shardcore.engine.torch_state import import_torch

        for attempt in (lambda: import_torch(), lambda: shardcore.build_shards(2, "tp=2")):
            try:
                attempt()
            except shardcore.BackendUnavailableError as error:
                print(type(error).__name__, error)
        try:
            import torch  # what the guard avoids: torch's second import in one process
        except RuntimeError as error:
            print("again:", str(error).split(";")[0])
        """
    )
    result = _run([sys.executable, "-c", code], broken_npu)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"BackendUnavailableError {ONE_LINE}",
        f"BackendUnavailableError {ONE_LINE}",
        "again: Only a single TORCH_LIBRARY can be used to register the namespace triton",
    ]


def test_backends_explains_the_autoload_trap_and_the_cann_requirement(broken_npu: Path) -> None:
    result = _run(_shardcore("backends"), broken_npu)
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert max(map(len, result.stdout.splitlines())) <= 100
    text = _unwrapped(result.stdout)
    assert next(line for line in text.splitlines() if line.startswith("dtensor ")).split()[2] == "unavailable"
    assert "dtensor (shardcore-dtensor): " in text and "unavailable: torch does not import (see below)" in text
    assert text.rstrip().endswith(f"\n\ntorch: {ONE_LINE}")
    off = _run(_shardcore("backends"), broken_npu, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert off.returncode == 0 and "Traceback" not in off.stderr
    assert "dtensor " in off.stdout and "torch does not import" not in off.stdout
    assert (
        _unwrapped(off.stdout)
        .rstrip()
        .endswith(
            f"\n\nnpu: torch_npu is installed but does not import: {CANN_ERROR}; to use Ascend NPUs, install Ascend's "
            "CANN toolkit and source its set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh)"
        )
    )


def test_only_torchs_autoload_failure_is_translated() -> None:
    error = RuntimeError("Failed to load the backend extension: other_ext. You can disable extension auto-loading")
    error.__cause__ = OSError("libfoo.so: not found")
    failure = _extension_failure(error)
    assert failure is not None and "'other_ext', which failed to load: OSError: libfoo.so: not found" in str(failure)
    assert "to use it, repair the install of other_ext, or set TORCH_DEVICE_BACKEND_AUTOLOAD=0" in str(failure)
    assert _extension_failure(RuntimeError("CUDA error: out of memory")) is None


@pytest.fixture
def no_numpy(tmp_path: Path) -> Path:
    (tmp_path / "sitecustomize.py").write_text(NO_NUMPY)
    return tmp_path


def test_without_numpy_torch_warns_and_shardcore_silences_exactly_that(no_numpy: Path) -> None:
    plain = _run([sys.executable, "-c", "import torch"], no_numpy)
    assert "UserWarning: Failed to initialize NumPy" in plain.stderr  # numpy really is hidden from torch
    code = textwrap.dedent(
        """
        import warnings
        from shardcore.engine.torch_state import import_torch

        before = list(warnings.filters)
        import_torch()
        print(warnings.filters == before)
        warnings.warn("shardcore's own", UserWarning)
        """
    )
    guarded = _run([sys.executable, "-c", code], no_numpy)
    assert guarded.stdout == "True\n"  # no filter outlives the import
    assert "NumPy" not in guarded.stderr and "UserWarning: shardcore's own" in guarded.stderr


def test_the_readme_command_prints_no_warning_without_numpy(no_numpy: Path) -> None:
    argv = _shardcore("check", "--nproc", "4", "--shards", "tp=2,role=train+tp=1,dp=2,role=decode")
    result = _run(argv, no_numpy)
    assert result.returncode == 0, result.stderr
    assert "arning" not in result.stderr and "NumPy" not in result.stderr
    assert result.stdout.rstrip().endswith("all groups match the plan")
