"""The backend contract: what a backend plugin implements (subclass ``Backend`` to inherit the defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ...plan.protocols import NamedGrids, ShardPlanLike

if TYPE_CHECKING:
    from ...plan.layout import Layout


@runtime_checkable
class Backend(Protocol):
    """What a backend plugin implements; subclass it to inherit the defaults.

    The engine creates every group (the 15 standard names plus ``extra_groups``) and
    hands them to ``make_handle``; a backend never creates process groups itself, since
    members-only creation is safe only with the engine's naming (see ``engine.groups``).
    """

    name: str
    """The name users select it by (``build_shards(backend=...)``, ``$SHARDCORE_BACKEND``)."""
    description: str
    """One line for ``shardcore backends``: what a member rank gets."""
    group_names: tuple[str, ...] | None = None
    """The standard groups the handle uses (None: all 15); build_shards creates only these by default."""
    options: tuple[str, ...] = ()
    """The keyword options ``build_shards(..., **options)`` accepts for this backend; others are rejected."""

    def unavailable_reason(self) -> str | None:
        """Why the backend cannot work here, with the command that fixes it; None when it can.

        Must not import the framework at module import time: it runs for every listing.
        """
        return None

    def device_note(self) -> str | None:
        """Which device and collective library this backend would use here, and why (for listings)."""
        return None

    def load_framework(self) -> None:
        """Import the framework the handle needs (e.g. megatron.core), ahead of building.

        ``shardcore check`` calls it before ``build_shards`` and reports its time apart, so a
        framework that takes seconds to import is not counted as group creation.
        """
        return None

    def validate(self, layout: Layout, options: Mapping[str, Any]) -> None:
        """Reject layouts or option values this backend cannot serve, before any group is created.

        Runs on every rank with the same arguments, so every rank raises alike.

        Args:
            layout: the planned layout.
            options: the backend options given to ``build_shards`` (names already checked
                against ``options``).

        Raises:
            ShardcoreError: a subclass naming the shard or option and the fix.
        """
        return None

    def extra_groups(self, plan: ShardPlanLike, options: Mapping[str, Any]) -> NamedGrids:
        """Named groups beyond the standard 15, each as (grid over the shard's ranks, dims).

        The engine creates them with the rest, in its safe order, and passes them to ``make_handle``.
        """
        return {}

    def make_handle(self, plan: ShardPlanLike, rank: int, groups: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
        """The framework object for a member rank.

        Args:
            plan: the rank's planned shard.
            rank: this rank's global rank.
            groups: group name -> ProcessGroup (None where not created or not a member),
                the standard names and the ``extra_groups``.
            options: the backend options given to ``build_shards``.

        Returns:
            What ``Shard.handle`` holds on this rank (e.g. a ProcessGroupCollection).
        """
        ...


__all__ = ["Backend"]
