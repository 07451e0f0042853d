"""Test stand-in: Hyper-Parallel's DTensor core holds its DeviceMesh."""
