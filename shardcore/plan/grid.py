"""Grid: named parallel dims over a contiguous rank window, first dim varying fastest."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from math import prod

from ..errors import LayoutError
from .arguments import MAX_WORLD_SIZE, check_count, shown

Dims = str | Sequence[str]


class Grid:
    """Pure index math equivalent to Megatron-Core's ``HyperCommGrid``.

    ``rank = rank_offset + sum(coord_i * prod(shape[:i]))``. Nothing is enumerated
    unless asked for, so a grid over a million ranks costs a few integers.

    Raises:
        LayoutError: a size outside [1, MAX_WORLD_SIZE], a dim name that is not a unique
            string, or a rank_offset outside [0, MAX_WORLD_SIZE]; and, from the methods, a
            rank, dim or coordinate outside the grid.
    """

    __slots__ = ("_strides", "dim_names", "rank_offset", "shape", "size")

    def __init__(self, shape: Sequence[int], dim_names: Sequence[str], rank_offset: int = 0) -> None:
        for argument, value in (("shape", shape), ("dim_names", dim_names)):
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise LayoutError(f"grid {argument}={shown(value)}: expected a sequence")
        shape, dim_names = tuple(shape), tuple(dim_names)
        if len(shape) != len(dim_names):
            raise LayoutError(f"grid shape {shown(shape)} and dim names {shown(dim_names)} differ in length")
        if not all(isinstance(name, str) and name for name in dim_names):
            raise LayoutError(f"grid dim names {shown(dim_names)}: expected non-empty strings")
        if len(set(dim_names)) != len(dim_names):
            raise LayoutError(f"grid dim names {shown(dim_names)} repeat a name; each dim needs its own name")
        for name, size in zip(dim_names, shape):
            check_count(f"grid dim {name}", size)
        check_count("rank_offset", rank_offset, minimum=0, maximum=MAX_WORLD_SIZE)
        self.shape: tuple[int, ...] = shape
        self.dim_names: tuple[str, ...] = dim_names
        self.rank_offset = rank_offset
        self.size = prod(shape)
        strides, stride = [], 1
        for size in shape:
            strides.append(stride)
            stride *= size
        self._strides: tuple[int, ...] = tuple(strides)

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        return f"Grid({dims}, rank_offset={self.rank_offset})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Grid):
            return NotImplemented
        return (self.shape, self.dim_names, self.rank_offset) == (other.shape, other.dim_names, other.rank_offset)

    def __hash__(self) -> int:
        return hash((self.shape, self.dim_names, self.rank_offset))

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and self.rank_offset <= rank < self.rank_offset + self.size

    def size_of(self, dim: str) -> int:
        """The size of one named dim."""
        return self.shape[self._index(dim)]

    def stride_of(self, dim: str) -> int:
        """Distance in ranks between neighbours along one dim."""
        return self._strides[self._index(dim)]

    def _index(self, dim: str) -> int:
        if isinstance(dim, str) and dim in self.dim_names:
            return self.dim_names.index(dim)
        raise LayoutError(f"unknown grid dim {shown(dim)}: this grid has {', '.join(self.dim_names)}")

    def _dim_indices(self, dims: Dims) -> list[int]:
        if not isinstance(dims, (str, Sequence, set, frozenset)):
            raise LayoutError(f"dims={shown(dims)}: expected a dim name or a sequence of them")
        names = [dims] if isinstance(dims, str) else list(dims)
        indices = sorted({self._index(name) for name in names})
        if len(indices) != len(names):
            raise LayoutError(f"dims {shown(names)} name a dim twice")
        return indices

    def _check_rank(self, rank: int) -> None:
        if rank not in self:
            raise LayoutError(
                f"rank {shown(rank)} is outside this grid's ranks [{self.rank_offset}, {self.rank_offset + self.size})"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along every dim."""
        self._check_rank(rank)
        local = rank - self.rank_offset
        return {name: (local // stride) % size for name, size, stride in zip(self.dim_names, self.shape, self._strides)}

    def rank_at(self, coords: dict[str, int]) -> int:
        """The rank at the given coordinates (missing dims count as 0)."""
        if not isinstance(coords, Mapping):
            raise LayoutError(f"coords={shown(coords)}: expected a mapping of dim name to coordinate")
        rank = self.rank_offset
        for name, value in coords.items():
            index = self._index(name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.shape[index]:
                raise LayoutError(f"coordinate {name}={shown(value)} outside [0, {self.shape[index]})")
            rank += value * self._strides[index]
        return rank

    def _expand(self, base: int, indices: Sequence[int]) -> list[int]:
        """All ranks reached from ``base`` along ``indices``, ascending (strides grow with index).

        Dims that are contiguous in rank order merge into one strided range, and each further
        dim shifts the ranks so far with C-level ``map``: no Python loop per member, so large
        groups (dp, tp_dp_cp of a big world) cost little more than their list.
        """
        runs: list[list[int]] = []  # [stride, size] of merged dims, fastest first
        for index in indices:
            stride, size = self._strides[index], self.shape[index]
            if runs and runs[-1][0] * runs[-1][1] == stride:
                runs[-1][1] *= size
            else:
                runs.append([stride, size])
        if not runs:
            return [base]
        stride, size = runs[0]
        ranks = list(range(base, base + stride * size, stride))
        for stride, size in runs[1:]:
            grown: list[int] = []
            for k in range(size):
                grown.extend(map((k * stride).__add__, ranks))
            ranks = grown
        return ranks

    def group_ranks(self, rank: int, dims: Dims) -> tuple[int, ...]:
        """Sorted ranks of ``rank``'s group along ``dims``, in O(group size)."""
        self._check_rank(rank)
        indices = self._dim_indices(dims)
        local = rank - self.rank_offset
        base = rank - sum(((local // self._strides[i]) % self.shape[i]) * self._strides[i] for i in indices)
        return tuple(self._expand(base, indices))

    def iter_groups(self, dims: Dims) -> Iterator[tuple[int, ...]]:
        """Every group along ``dims``, ordered by first rank (Megatron's enumeration order)."""
        indices = self._dim_indices(dims)
        others = [i for i in range(len(self.shape)) if i not in indices]
        for base in self._expand(self.rank_offset, others):
            yield tuple(self._expand(base, indices))

    def rank_enum(self, dims: Dims) -> list[list[int]]:
        """All groups along ``dims``: the same groups in the same order as ``HyperCommGrid.get_rank_enum``."""
        return [list(group) for group in self.iter_groups(dims)]


__all__ = ["Dims", "Grid"]
