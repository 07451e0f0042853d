"""Typing protocols that backends and third parties type-check against."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .grid import Dims
from .spec import ShardSpec


@runtime_checkable
class GridLike(Protocol):
    """What a grid offers: named dims over a rank window, first dim fastest."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    rank_offset: int
    size: int

    def rank_enum(self, dims: Dims) -> list[list[int]]: ...

    def group_ranks(self, rank: int, dims: Dims) -> tuple[int, ...]: ...

    def coords(self, rank: int) -> dict[str, int]: ...


@runtime_checkable
class ShardPlanLike(Protocol):
    """What a planned shard offers: its spec, its window, its grids and a rank's groups."""

    index: int
    spec: ShardSpec
    rank_offset: int
    world_size: int

    @property
    def ranks(self) -> range: ...

    @property
    def decoder_grid(self) -> GridLike: ...

    @property
    def expert_grid(self) -> GridLike: ...

    def groups_of(self, rank: int) -> dict[str, tuple[int, ...] | None]: ...

    def coords(self, rank: int) -> dict[str, int]: ...


__all__ = ["GridLike", "ShardPlanLike"]
