"""Test stand-in for Hyper-Parallel's device choice: CUDA first, then a working NPU, then CPU."""

from __future__ import annotations

import torch


def get_device_type() -> str:
    """``"cuda"`` when CUDA is available, else ``"npu"`` when torch_npu imports and sees an NPU, else ``"cpu"``."""
    if torch.cuda.is_available():
        return "cuda"
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return "cpu"
    return "npu" if torch.npu.is_available() else "cpu"
