"""Device selection with torch_npu present (simulated), absent, and broken (no CANN)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from shardcore_hyperparallel import HyperParallelBackend, select_device

CANN_MESSAGE = (
    "libhccl.so: cannot open shared object file: No such file or directory. Please check that the cann "
    "package is installed. Please run 'source set_env.sh' in the CANN installation path."
)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """What importing torch_npu does on an Ascend host: a module, and torch.npu reporting devices."""
    npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 8)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return npu


def test_npu_present_gives_npu_and_hccl(no_cuda: None, fake_npu: types.SimpleNamespace) -> None:
    choice = select_device()
    assert (choice.device_type, choice.comm_backend) == ("npu", "hccl")
    assert "Ascend NPU present" in choice.reason


def test_npu_wins_over_cuda(monkeypatch: pytest.MonkeyPatch, fake_npu: types.SimpleNamespace) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_device().device_type == "npu"


def test_torch_npu_without_devices_falls_back(no_cuda: None, fake_npu: types.SimpleNamespace) -> None:
    fake_npu.is_available = lambda: False
    choice = select_device()
    assert (choice.device_type, choice.comm_backend) == ("cpu", "gloo")
    assert "no NPU is present" in choice.reason


def test_torch_npu_absent_gives_cuda_or_cpu(monkeypatch: pytest.MonkeyPatch, no_cuda: None) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError, as when not installed
    choice = select_device()
    assert (choice.device_type, choice.comm_backend) == ("cpu", "gloo")
    assert "torch_npu" in choice.reason and "no CUDA" in choice.reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (select_device().device_type, select_device().comm_backend) == ("cuda", "nccl")


@pytest.mark.parametrize("error", ["OSError", "RuntimeError", "ImportError"])
def test_broken_torch_npu_is_a_reason_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_cuda: None, error: str
) -> None:
    """torch_npu installed without CANN: its import fails inside torch_npu._C."""
    (tmp_path / "torch_npu.py").write_text(f"raise {error}({CANN_MESSAGE!r})\n")
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    choice = select_device()
    assert (choice.device_type, choice.comm_backend) == ("cpu", "gloo")
    assert "CANN" in choice.reason and "libhccl.so" in choice.reason
    assert "would use cpu+gloo" in HyperParallelBackend().device_note()


def test_backend_is_available_with_torch_on_cpu() -> None:
    assert HyperParallelBackend().unavailable_reason() is None
