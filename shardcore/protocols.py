"""Typing protocols that backends and third parties type-check against."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from .grid import Dims
from .spec import ShardSpec


@runtime_checkable
class GridLike(Protocol):
    """What a grid offers: named dims over a rank window, first dim fastest."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dim_names(self) -> tuple[str, ...]: ...

    @property
    def rank_offset(self) -> int: ...

    @property
    def size(self) -> int: ...

    def iter_groups(self, dims: Dims) -> Iterator[tuple[int, ...]]: ...

    def rank_enum(self, dims: Dims) -> list[list[int]]: ...

    def group_ranks(self, rank: int, dims: Dims) -> tuple[int, ...]: ...

    def coords(self, rank: int) -> dict[str, int]: ...


@runtime_checkable
class ShardPlanLike(Protocol):
    """What a planned shard offers: its spec, its window, its grids and a rank's groups."""

    @property
    def index(self) -> int: ...

    @property
    def spec(self) -> ShardSpec: ...

    @property
    def rank_offset(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def ranks(self) -> range: ...

    @property
    def decoder_grid(self) -> GridLike: ...

    @property
    def expert_grid(self) -> GridLike: ...

    def groups_of(self, rank: int, names: Collection[str] = ...) -> dict[str, tuple[int, ...] | None]: ...

    def coords(self, rank: int) -> dict[str, int]: ...


NamedGrids = Mapping[str, "tuple[GridLike, Dims]"]


@runtime_checkable
class Backend(Protocol):
    """What a backend plugin implements; subclass it to inherit the defaults.

    The engine creates every group (the 15 standard names plus ``extra_groups``) and
    hands them to ``make_handle``; a backend never creates process groups itself.
    """

    name: str
    description: str
    group_names: tuple[str, ...] | None = None
    """The standard groups the handle uses (None: all 15); build_shards creates only these by default."""

    def unavailable_reason(self) -> str | None:
        """None when the backend can work here, else why not and the command that fixes it."""
        return None

    def device_note(self) -> str | None:
        """Which device and collective library this backend would use here, and why (for listings)."""
        return None

    def validate(self, layout: Any, options: Mapping[str, Any]) -> None:
        """Raise a ShardcoreError for layouts or options this backend cannot serve (runs on every rank)."""
        return None

    def extra_groups(self, plan: ShardPlanLike, options: Mapping[str, Any]) -> NamedGrids:
        """Named groups beyond the standard 15, each as (grid over the shard's ranks, dims)."""
        return {}

    def make_handle(self, plan: ShardPlanLike, rank: int, groups: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
        """The framework object for a member rank, from its groups (name -> ProcessGroup or None)."""
        ...


__all__ = ["Backend", "GridLike", "NamedGrids", "ShardPlanLike"]
