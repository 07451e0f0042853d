"""The torch.distributed internals shardcore relies on, read and written only here.

``strategy="local"`` names each group by setting torch's world-wide default-mode group
counter (``_world.group_count``) before creating it; see ``shardcore.engine.groups``.
That counter, the live group names (``_world.pg_names``), the default group's bound
device and the default store are private to torch, so one probe checks, on first use,
that this torch still has them in the shape relied on.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

from ..errors import GroupCreationError

if TYPE_CHECKING:
    from torch.distributed import Store


def c10d() -> Any:
    """torch's ``distributed_c10d`` module (imported on first use)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d


@cache
def probe() -> None:
    """Check once per process that this torch names default-mode groups by a settable counter.

    Raises:
        GroupCreationError: torch changed the internals members-only creation depends on.
    """
    import torch

    world = getattr(c10d(), "_world", None)
    count = getattr(world, "group_count", None)
    if world is None or not isinstance(count, int) or not isinstance(getattr(world, "pg_names", None), dict):
        raise GroupCreationError(
            f"torch {torch.__version__} no longer keeps a default-mode group counter (_world.group_count) and "
            f"live group names (_world.pg_names) as shardcore expects (tested on torch 2.13): "
            f"use strategy='world', which relies on no torch internals"
        )
    try:
        world.group_count = count  # a property with a setter on torch >= 2.1
    except AttributeError:
        raise GroupCreationError(
            f"torch {torch.__version__} does not let the group counter be set: use strategy='world'"
        ) from None


def live_group_count() -> int:
    """Process groups this process holds, the default group included."""
    return len(c10d()._world.pg_names)


def group_counter() -> int:
    """torch's counter that names default-mode groups; every rank must hold the same value."""
    return int(c10d()._world.group_count)


def set_group_counter(value: int) -> None:
    """Set the counter that names the next default-mode group (see ``probe``)."""
    probe()
    c10d()._world.group_count = value


def bound_device() -> Any:
    """The device the default group is bound to (``init_process_group(device_id=...)``), or None."""
    return c10d()._get_default_group().bound_device_id


def torchcomms_enabled() -> bool:
    """Whether torch routes ``new_group`` through TorchComms (``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1`` with
    torchcomms installed), where every group is a split of the whole world."""
    enabled = getattr(c10d(), "_use_torchcomms_enabled", None)
    return bool(enabled()) if callable(enabled) else False


def default_store() -> Store:
    """The default group's store: every rank reaches it, whatever the backend."""
    return c10d()._get_default_store()


__all__ = [
    "bound_device",
    "c10d",
    "default_store",
    "group_counter",
    "live_group_count",
    "probe",
    "set_group_counter",
    "torchcomms_enabled",
]
