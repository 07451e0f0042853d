"""Typing protocols for what a plan offers: grids and planned shards.

Backends and third parties type-check against these rather than the concrete classes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Protocol, runtime_checkable

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
    def size(self) -> int: ...

    @property
    def ranks(self) -> range: ...

    @property
    def decoder_grid(self) -> GridLike: ...

    @property
    def expert_grid(self) -> GridLike: ...

    def groups_of(self, rank: int, names: Collection[str] = ...) -> dict[str, tuple[int, ...] | None]: ...

    def coords(self, rank: int) -> dict[str, int]: ...

    def grid_of(self, name: str) -> tuple[GridLike, tuple[str, ...]]: ...

    def iter_groups(self, name: str) -> Iterator[tuple[int, ...]]: ...


NamedGrids = Mapping[str, "tuple[GridLike, Dims]"]
"""Named groups a backend adds beyond the standard ones: name -> (a grid over the shard's ranks, its dims)."""


__all__ = ["GridLike", "NamedGrids", "ShardPlanLike"]
