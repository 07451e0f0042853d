"""Which accelerator a process would use: cuda, else a working Ascend NPU, else cpu (torch imported lazily)."""

from __future__ import annotations


def npu_status() -> tuple[bool, str]:
    """(usable, why): torch_npu's import fails without Ascend's CANN toolkit, so it is guarded."""
    try:
        import torch_npu  # noqa: F401
    except ImportError as error:
        if "torch_npu" in str(error) and "No module named" in str(error):
            return False, "torch_npu is not installed (pip install torch-npu, with Ascend CANN)"
        return False, f"torch_npu failed to import (is Ascend CANN installed and set_env.sh sourced?): {error}"
    except (OSError, RuntimeError) as error:
        return False, f"torch_npu failed to import (is Ascend CANN installed and set_env.sh sourced?): {error}"
    import torch

    try:
        present = bool(torch.npu.is_available()) and torch.npu.device_count() > 0  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError) as error:
        return False, f"torch_npu imported but cannot query NPUs: {error}"
    return (True, "Ascend NPU present") if present else (False, "torch_npu imported but no NPU is present")


def device_type() -> str:
    """cuda when available, else npu when torch_npu works and an NPU is present, else cpu."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "npu" if npu_status()[0] else "cpu"


def comm_backend(device: str) -> str:
    """The collective library that goes with a device type."""
    return {"cuda": "nccl", "npu": "hccl"}.get(device, "gloo")


__all__ = ["comm_backend", "device_type", "npu_status"]
