"""Collectives the engine's own jobs use on the default group: where their tensors live, and an object all-gather.

Reports and records travel as pickled bytes in uint8 tensors, so no numpy is needed (torch's
``all_gather_object`` needs it).
"""

from __future__ import annotations

import pickle
from typing import Any


def collective_device() -> str:
    """Where collective tensors live: cpu under gloo, else the accelerator."""
    import torch.distributed as dist

    from .device import device_type

    return "cpu" if str(dist.get_backend()) == "gloo" else device_type()


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank of the default group.

    Pickled into uint8 tensors: lengths are all-gathered first, then every payload padded to
    the longest. Unlike torch's ``all_gather_object`` this needs no numpy. Only for values
    the ranks of one job exchange with each other (pickle trusts its input).
    """
    import torch
    import torch.distributed as dist

    device, world = collective_device(), dist.get_world_size()
    data = pickle.dumps(value)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    payload = torch.zeros(max(int(t.item()) for t in lengths), dtype=torch.uint8)
    payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    payload = payload.to(device)
    payloads = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(payloads, payload)
    return [pickle.loads(bytes(p[: int(n.item())].cpu().tolist())) for p, n in zip(payloads, lengths)]


__all__ = ["all_gather_objects", "collective_device"]
