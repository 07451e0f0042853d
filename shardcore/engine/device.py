"""Which accelerator a process would use: cuda, else a working Ascend NPU, else cpu (torch imported lazily)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from ..errors import BackendUnavailableError
from .torch_state import EXTENSION_FIXES, import_torch

if TYPE_CHECKING:
    import torch

COLLECTIVE_DEVICES = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}
"""The collective libraries shardcore moves tensors with, and the device type each moves tensors on: the one map
between them (a process's library for its device, a refit group's libraries, the executor's device check)."""


def npu_status() -> tuple[bool, str]:
    """(usable, why): torch_npu's import fails without Ascend's CANN toolkit, so it is guarded.

    torch is imported first, through the guard: with autoloading on, ``import torch`` itself
    loads torch_npu, and its failure is then torch's to report (``import_torch``).

    Raises:
        BackendUnavailableError: ``import torch`` fails (see ``import_torch``).
    """
    torch = import_torch()
    try:
        import torch_npu  # noqa: F401
    except ImportError as error:
        if "torch_npu" in str(error) and "No module named" in str(error):
            return False, "torch_npu is not installed (pip install torch-npu, with Ascend CANN)"
        return False, _broken_torch_npu(error)
    except (OSError, RuntimeError) as error:
        return False, _broken_torch_npu(error)
    try:
        present = bool(torch.npu.is_available()) and torch.npu.device_count() > 0
    except (AttributeError, RuntimeError) as error:
        return False, f"torch_npu imported but cannot query NPUs: {error}"
    return (True, "Ascend NPU present") if present else (False, "torch_npu imported but no NPU is present")


def _broken_torch_npu(error: BaseException) -> str:
    return f"torch_npu is installed but does not import: {error}; {EXTENSION_FIXES['torch_npu']}"


def device_type() -> str:
    """cuda when available, else npu when torch_npu works and an NPU is present, else cpu.

    Raises:
        BackendUnavailableError: ``import torch`` fails (see ``import_torch``).
    """
    torch = import_torch()
    if torch.cuda.is_available():
        return "cuda"
    return "npu" if npu_status()[0] else "cpu"


def comm_backend(device: str) -> str:
    """The collective library that goes with a device type (``COLLECTIVE_DEVICES``; gloo for any other)."""
    return next((library for library, served in COLLECTIVE_DEVICES.items() if served == device), "gloo")


def device_notes() -> list[str]:
    """What ``shardcore backends`` adds below its table: why torch does not import here, or why an
    installed torch_npu cannot serve (the CANN toolkit missing, no NPU); nothing when all is well."""
    try:
        import_torch()
    except BackendUnavailableError as error:
        return [f"torch: {error}"]
    except ImportError:
        return []
    if importlib.util.find_spec("torch_npu") is None:
        return []
    usable, why = npu_status()
    return [] if usable else [f"npu: {why}"]


def served_devices(backend: str) -> list[str]:
    """The device types a group of ``backend`` moves tensors on (``dist.get_backend()``'s answer, one library or
    several as in ``'cpu:gloo,cuda:nccl'``), in ``COLLECTIVE_DEVICES``' order."""
    return [device for library, device in COLLECTIVE_DEVICES.items() if library in backend]


def collective_device(backend: str) -> torch.device:
    """Where a process puts the tensors a group of ``backend`` moves (``dist.get_backend()``'s answer, which names
    several libraries for a group made with ``'cpu:gloo,cuda:nccl'``): the CPU when a library of it moves CPU
    tensors, else its accelerator's current device (torchrun's ``LOCAL_RANK`` one, ``init_from_env``). Asked where a
    group exists, so torch is imported already."""
    import torch

    served = served_devices(backend)
    if not served or "cpu" in served:
        return torch.device("cpu")
    return torch.device(served[0], getattr(torch, served[0]).current_device())


__all__ = [
    "COLLECTIVE_DEVICES",
    "collective_device",
    "comm_backend",
    "device_notes",
    "device_type",
    "npu_status",
    "served_devices",
]
