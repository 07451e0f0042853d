"""Grid: the rank formula, rank_enum partitions, group_ranks equals its rank_enum row."""

from __future__ import annotations

from math import prod

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcore import Grid, LayoutError

NAMES = ("tp", "cp", "dp", "pp", "ep", "a", "b")


@st.composite
def grids_and_dims(draw: st.DrawFn) -> tuple[Grid, str | list[str]]:
    """A grid of 1-5 dims (sizes 1-4) at a random offset, and a dim subset (str or list, any order)."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=5, unique=True))
    shape = draw(st.lists(st.integers(1, 4), min_size=len(names), max_size=len(names)))
    grid = Grid(shape, names, rank_offset=draw(st.integers(0, 50)))
    dims = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    return grid, dims[0] if len(dims) == 1 and draw(st.booleans()) else dims


@settings(deadline=None, max_examples=300)
@given(grids_and_dims())
def test_rank_enum_partitions_the_grid(case: tuple[Grid, str | list[str]]) -> None:
    grid, dims = case
    names = [dims] if isinstance(dims, str) else dims
    group_size = prod(grid.size_of(name) for name in names)
    groups = grid.rank_enum(dims)
    assert len(groups) == grid.size // group_size
    assert all(len(group) == group_size and group == sorted(group) for group in groups)
    assert sorted(r for group in groups for r in group) == list(range(grid.rank_offset, grid.rank_offset + grid.size))
    assert [group[0] for group in groups] == sorted(group[0] for group in groups)
    row_of = {rank: group for group in groups for rank in group}
    for rank in range(grid.rank_offset, grid.rank_offset + grid.size):
        assert grid.group_ranks(rank, dims) == tuple(row_of[rank])


@settings(deadline=None, max_examples=200)
@given(grids_and_dims())
def test_coords_follow_the_rank_formula(case: tuple[Grid, str | list[str]]) -> None:
    grid, dims = case
    names = [dims] if isinstance(dims, str) else dims
    for rank in range(grid.rank_offset, grid.rank_offset + grid.size):
        coords = grid.coords(rank)
        assert list(coords) == list(grid.dim_names)
        assert rank == grid.rank_offset + sum(coords[n] * prod(grid.shape[:i]) for i, n in enumerate(grid.dim_names))
        assert grid.rank_at(coords) == rank and rank in grid
        for member in grid.group_ranks(rank, dims):  # a group varies only along its dims
            other = grid.coords(member)
            assert all(other[n] == coords[n] for n in grid.dim_names if n not in names)
    assert grid.rank_offset - 1 not in grid and grid.rank_offset + grid.size not in grid


@pytest.mark.parametrize(
    ("shape", "names", "offset", "dims", "expected"),
    [  # the cases of Megatron's tests/unit_tests/test_hyper_comm_grid.py, rows sorted
        ([2, 4], ["tp", "dp"], 0, "tp", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ([2, 4], ["tp", "dp"], 0, "dp", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ([2, 2, 2], ["a", "b", "c"], 0, "c", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ([2, 2, 2], ["tp", "cp", "dp"], 0, ["tp", "cp"], [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ([2, 2, 2], ["tp", "cp", "dp"], 0, ["cp", "dp"], [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ([2, 2], ["tp", "dp"], 4, "tp", [[4, 5], [6, 7]]),
        ([1, 8], ["tp", "dp"], 0, "tp", [[r] for r in range(8)]),
    ],
)
def test_known_enumerations(
    shape: list[int], names: list[str], offset: int, dims: str | list[str], expected: list[list[int]]
) -> None:
    assert Grid(shape, names, offset).rank_enum(dims) == expected


def test_120_rank_grid() -> None:
    grid = Grid([2, 3, 4, 5], ["tp", "cp", "pp", "dp"])
    groups = grid.rank_enum("dp")
    assert len(groups) == 24 and {len(g) for g in groups} == {5}
    assert grid.group_ranks(0, "dp") == (0, 24, 48, 72, 96)
    assert grid.group_ranks(119, ["tp", "cp"]) == tuple(range(114, 120))


def test_group_ranks_does_not_enumerate_a_huge_grid() -> None:
    grid = Grid([8, 1, 1 << 20, 16], ["tp", "cp", "dp", "pp"], rank_offset=3)
    assert grid.size == 8 << 24
    assert grid.group_ranks(grid.size + 2, "tp") == tuple(range(grid.size - 5, grid.size + 3))
    assert grid.group_ranks(3, "pp") == tuple(3 + k * (8 << 20) for k in range(16))
    assert grid.coords(3 + 8 * 5) == {"tp": 0, "cp": 0, "dp": 5, "pp": 0}


@pytest.mark.parametrize(
    ("shape", "names", "offset", "token"),
    [
        ([2, 2], ["tp"], 0, "differ in length"),
        ([2, 2], ["tp", "tp"], 0, "'tp'"),
        ([2, 0], ["tp", "dp"], 0, "dp=0"),
        ([2, True], ["tp", "dp"], 0, "dp=True"),
        ([2, 2.0], ["tp", "dp"], 0, "dp=2.0"),
        ([2], ["tp"], -1, "rank_offset=-1"),
    ],
)
def test_bad_grids(shape: list[object], names: list[str], offset: int, token: str) -> None:
    with pytest.raises(LayoutError) as info:
        Grid(shape, names, offset)  # type: ignore[arg-type]
    assert token in str(info.value)


def test_bad_dims_and_ranks() -> None:
    grid = Grid([2, 2], ["tp", "dp"], rank_offset=4)
    with pytest.raises(LayoutError, match="'ep'"):
        grid.group_ranks(4, "ep")
    with pytest.raises(LayoutError, match="twice"):
        grid.rank_enum(["tp", "tp"])
    with pytest.raises(LayoutError, match="rank 3"):
        grid.group_ranks(3, "tp")
    with pytest.raises(LayoutError, match="rank 8"):
        grid.coords(8)
    with pytest.raises(LayoutError, match="tp=2"):
        grid.rank_at({"tp": 2})


def test_equality_and_repr() -> None:
    assert Grid([2, 2], ["tp", "dp"], 1) == Grid((2, 2), ("tp", "dp"), 1)
    assert Grid([2, 2], ["tp", "dp"], 1) != Grid([2, 2], ["tp", "dp"], 0)
    assert len({Grid([2], ["tp"]), Grid([2], ["tp"])}) == 1
    assert repr(Grid([2, 3], ["tp", "dp"], 5)) == "Grid(tp=2, dp=3, rank_offset=5)"
