"""Who creates each group: its members only (``local``) or every rank of the world (``world``).

``auto`` (the default) picks one for the world it finds (``choose_strategy``): ``world``
where torch makes every group creation world-collective (a device-bound default group,
``TORCH_DIST_INIT_BARRIER=1``, TorchComms), else ``local``, and says why.
"""

from __future__ import annotations

import os
from enum import StrEnum

from ...errors import GroupCreationError
from ...plan.arguments import shown
from ..torch_state import bound_device, torchcomms_enabled


class Strategy(StrEnum):
    """Who calls ``new_group`` for a group: its members only, or every rank of the world."""

    AUTO = "auto"
    """Choose for the world found: ``world`` where torch creates groups with every rank, else ``local``."""
    LOCAL = "local"
    WORLD = "world"


def init_barrier_enabled() -> bool:
    """Whether torch adds a world barrier to every group creation: ``int($TORCH_DIST_INIT_BARRIER) == 1``.

    torch 2.13 reads the variable as ``int(os.getenv("TORCH_DIST_INIT_BARRIER", "0")) == 1``,
    so ``" 1"`` and ``"01"`` turn the barrier on and ``"true"`` or ``"2"`` do not.

    Raises:
        GroupCreationError: the value is not an integer (torch's own ``new_group`` would fail on it).
    """
    value = os.environ.get("TORCH_DIST_INIT_BARRIER", "0")
    try:
        return int(value) == 1
    except ValueError:
        raise GroupCreationError(
            f"TORCH_DIST_INIT_BARRIER={shown(value)}: torch reads it as an integer (1 turns on a barrier after every "
            "group creation, 0 or unset turns it off): set it to 0 or 1"
        ) from None


def _environment_reason() -> str | None:
    """Why torch's settings (not its default group) make every rank take part in each group creation."""
    if torchcomms_enabled():
        return "TorchComms is enabled (TORCH_DISTRIBUTED_USE_TORCHCOMMS=1): new_group splits the whole world"
    if init_barrier_enabled():
        return "TORCH_DIST_INIT_BARRIER=1 makes every group creation a world barrier"
    return None


def world_collective_reason() -> str | None:
    """Why torch makes every rank take part in each group creation here, or None when it does not."""
    reason = _environment_reason()
    if reason is not None:
        return reason
    device = bound_device()
    if device is not None:
        return (
            f"the default group is bound to {device} (init_process_group(device_id=...)), so torch splits "
            "communicators with every rank taking part"
        )
    return None


def _parse(requested: str | Strategy) -> Strategy:
    try:
        return Strategy(requested)
    except ValueError:
        raise GroupCreationError(f"strategy={shown(requested)}: expected one of {', '.join(Strategy)}") from None


def _refuse_local(reason: str) -> GroupCreationError:
    return GroupCreationError(
        f"strategy='local' cannot work here: {reason}, so members-only creation would hang; "
        "use strategy='world' or 'auto' (the default), which picks 'world' here"
    )


def check_strategy_early(requested: str | Strategy) -> None:
    """What can be decided before any process joins a world: the name, ``TORCH_DIST_INIT_BARRIER``'s
    value, and an explicit ``local`` where torch's settings make it hang (``shardcore check`` calls
    it before starting workers).

    Raises:
        GroupCreationError: as ``choose_strategy`` would on every rank.
    """
    if _parse(requested) == Strategy.LOCAL:
        reason = _environment_reason()
        if reason is not None:
            raise _refuse_local(reason)
    else:
        init_barrier_enabled()


def choose_strategy(requested: str | Strategy) -> tuple[Strategy, str]:
    """The strategy to build with and why; ``auto`` resolves to ``world`` or ``local`` here.

    Args:
        requested: ``auto``, ``local`` or ``world``.

    Returns:
        (``local`` or ``world``, a sentence saying why).

    Raises:
        GroupCreationError: an unknown strategy, or ``local`` asked for explicitly in a world where
            members-only creation would hang (naming the reason and ``strategy='world'`` or ``'auto'``).
    """
    strategy = _parse(requested)
    if strategy == Strategy.WORLD:
        return strategy, "asked for: every rank creates every group"
    reason = world_collective_reason()
    if strategy == Strategy.LOCAL:
        if reason is not None:
            raise _refuse_local(reason)
        return strategy, "asked for: members create their own groups"
    if reason is not None:
        return Strategy.WORLD, f"{reason}: every rank creates every group (Megatron's pattern)"
    return Strategy.LOCAL, "groups are created lazily here: members create only their own groups"


__all__ = [
    "Strategy",
    "check_strategy_early",
    "choose_strategy",
    "init_barrier_enabled",
    "world_collective_reason",
]
