"""Test stand-in for Hyper-Parallel's package root (see ../README.md): DeviceMesh and its factory."""

from .core.dtensor.device_mesh import DeviceMesh, init_device_mesh, split_group

__all__ = ["DeviceMesh", "init_device_mesh", "split_group"]
