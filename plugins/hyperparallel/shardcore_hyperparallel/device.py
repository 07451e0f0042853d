"""Which device and collective library this backend uses: Ascend NPU first, then CUDA, then CPU.

Hyper-Parallel targets Ascend, so a working NPU wins over CUDA here (the engine's
``shardcore.engine.device.device_type`` prefers CUDA). ``torch_npu``'s import is guarded by
``shardcore.engine.device.npu_status``: without Ascend's CANN toolkit it raises ImportError,
OSError or RuntimeError, which become a reason rather than a crash.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardcore.engine import comm_backend, npu_status


@dataclass(frozen=True)
class DeviceChoice:
    """A device type, its collective library and a one-line reason for the choice."""

    device_type: str
    comm_backend: str
    reason: str

    def __str__(self) -> str:
        return f"{self.device_type}+{self.comm_backend} ({self.reason})"


def select_device() -> DeviceChoice:
    """npu+hccl when torch_npu imports and an NPU is present; else cuda+nccl; else cpu+gloo."""
    npu_ok, npu_reason = npu_status()
    if npu_ok:
        return DeviceChoice("npu", comm_backend("npu"), npu_reason)
    import torch

    if torch.cuda.is_available():
        return DeviceChoice("cuda", comm_backend("cuda"), f"CUDA is available; no NPU: {npu_reason}")
    return DeviceChoice("cpu", comm_backend("cpu"), f"no CUDA device; no NPU: {npu_reason}")


def device_note() -> str:
    """What ``shardcore backends`` shows for this backend: the device it would use here and why."""
    try:
        return f"would use {select_device()}"
    except ImportError as error:
        return f"cannot choose a device: {error}"


__all__ = ["DeviceChoice", "device_note", "select_device"]
