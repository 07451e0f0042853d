"""Parity with the real megatron-core (0.16.1, 0.19.2) ``HyperCommGrid`` and its inference group recipe.

Megatron's grids need only ``WORLD_SIZE`` in the environment (no process group) and einops.
The group recipe is ``build_inference_pg_collection`` in Megatron-Core 0.19
(https://github.com/NVIDIA/Megatron-LM/blob/core_v0.19.0/megatron/core/inference/shards.py).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("einops")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Transformer Engine / Apex / absl missing
    pytest.importorskip("megatron.core")
    from megatron.core.hyper_comm_grid import HyperCommGrid

from plugins.megatron.tests.megatron_fields import DECODER_FIELDS, EXPERT_FIELDS
from shardcore import Grid, LayoutError, ShardSpec, plan_layout

NAMES = ("tp", "cp", "dp", "pp", "ep", "x")

# Megatron's expert grid reuses the names tp / dp; shardcore's calls them expt_tp / expt_dp
EXPERT_NAME = {"tp": "expt_tp", "ep": "ep", "dp": "expt_dp", "pp": "pp"}


@contextmanager
def _world(size: int) -> Iterator[None]:
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(size)
    try:
        yield
    finally:
        if old is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = old


def megatron_grid(shape: list[int], names: list[str], offset: int) -> HyperCommGrid:
    with _world(offset + max(1, _prod(shape))):
        return HyperCommGrid(shape, names, rank_offset=offset)


def _prod(values: list[int]) -> int:
    out = 1
    for value in values:
        out *= value
    return out


def _sorted_rows(enum: list[list[int]]) -> list[list[int]]:
    return [sorted(row) for row in enum]


@st.composite
def grid_cases(draw: st.DrawFn) -> tuple[list[int], list[str], int, str | list[str]]:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=5, unique=True))
    shape = draw(st.lists(st.integers(1, 4), min_size=len(names), max_size=len(names)))
    dims = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    single = len(dims) == 1 and draw(st.booleans())
    return shape, names, draw(st.integers(0, 40)), dims[0] if single else dims


@settings(deadline=None, max_examples=300)
@given(grid_cases())
def test_rank_enum_equals_hyper_comm_grid(case: tuple[list[int], list[str], int, str | list[str]]) -> None:
    shape, names, offset, dims = case
    expected = _sorted_rows(megatron_grid(shape, names, offset).get_rank_enum(dims))
    grid = Grid(shape, names, offset)
    assert grid.rank_enum(dims) == expected  # same groups, same group order
    for row in expected:
        for rank in row:
            assert grid.group_ranks(rank, dims) == tuple(row)


@st.composite
def shard_cases(draw: st.DrawFn) -> tuple[list[ShardSpec], bool, int]:
    """1-2 shards of random (tp, cp, pp, dp, ep, expt_tp) with a tiling expert grid, an order and an offset."""
    shards = []
    for _ in range(draw(st.integers(1, 2))):
        tp, cp = draw(st.integers(1, 4)), draw(st.integers(1, 2))
        pp, dp = draw(st.integers(1, 3)), draw(st.integers(1, 4))
        per_stage = tp * cp * dp
        expt_tp = draw(st.sampled_from([d for d in range(1, per_stage + 1) if per_stage % d == 0]))
        rest = per_stage // expt_tp
        ep = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
        shards.append(ShardSpec(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, expt_tp=expt_tp))
    return shards, draw(st.booleans()), draw(st.integers(0, 6))


def megatron_groups(spec: ShardSpec, offset: int, tp_pp_dp: bool) -> tuple[dict[str, list[list[int]]], bool]:
    """Every field's enumeration as build_inference_pg_collection makes it, and whether its pp check passes."""
    tp, cp, pp, dp, ep, expt_tp, expt_dp = spec.tp, spec.cp, spec.pp, spec.dp, spec.ep, spec.expt_tp, spec.expt_dp
    if tp_pp_dp:
        decoder = megatron_grid([tp, cp, pp, dp], ["tp", "cp", "pp", "dp"], offset)
        expert = megatron_grid([expt_tp, ep, pp, expt_dp], ["tp", "ep", "pp", "dp"], offset)  # type: ignore[list-item]
    else:
        decoder = megatron_grid([tp, cp, dp, pp], ["tp", "cp", "dp", "pp"], offset)
        expert = megatron_grid([expt_tp, ep, expt_dp, pp], ["tp", "ep", "dp", "pp"], offset)  # type: ignore[list-item]
    enums = {field: decoder.get_rank_enum(dims) for field, dims in DECODER_FIELDS.items()}
    enums.update({field: expert.get_rank_enum(dims) for field, dims in EXPERT_FIELDS.items()})
    enums["embd"] = [[p[0], p[-1]] if len(p) > 1 else [p[0]] for p in enums["pp"]]
    enums["pos_embd"] = [[p[0]] for p in enums["pp"]]
    return enums, decoder.get_rank_enum("pp") == expert.get_rank_enum("pp")


@settings(deadline=None, max_examples=200)
@given(shard_cases())
def test_named_groups_equal_build_inference_pg_collection(case: tuple[list[ShardSpec], bool, int]) -> None:
    shards, tp_pp_dp, offset = case
    world = offset + sum(spec.world_size for spec in shards)
    order = "tp-pp-dp" if tp_pp_dp else "tp-dp-pp"
    expected, starts = [], offset
    for spec in shards:
        expected.append((starts, *megatron_groups(spec, starts, tp_pp_dp)))
        starts += spec.world_size
    if not all(pp_ok for _, _, pp_ok in expected):
        with pytest.raises(LayoutError, match="pp groups"):
            plan_layout(world, shards, order=order, rank_offset=offset)
        return
    layout = plan_layout(world, shards, order=order, rank_offset=offset)
    for rank in range(offset):
        assert layout.groups_of(rank) == {}
    for plan, (start, enums, _) in zip(layout.shards, expected, strict=True):
        assert plan.rank_offset == start
        for field in (*DECODER_FIELDS, *EXPERT_FIELDS):
            rows = _sorted_rows(enums[field])
            grid, dims = (
                (plan.decoder_grid, DECODER_FIELDS[field])
                if field in DECODER_FIELDS
                else (plan.expert_grid, _expert_dims(EXPERT_FIELDS[field]))
            )
            assert grid.rank_enum(dims) == rows, field
            for row in rows:
                for rank in row:
                    assert layout.groups_of(rank)[field] == tuple(row), (field, rank)
        for field in ("embd", "pos_embd"):
            members = {rank: tuple(row) for row in enums[field] for rank in row}
            for rank in plan.ranks:
                assert layout.groups_of(rank)[field] == members.get(rank), (field, rank)


def _expert_dims(dims: str | list[str]) -> str | list[str]:
    return EXPERT_NAME[dims] if isinstance(dims, str) else [EXPERT_NAME[d] for d in dims]


def test_mapping_order_pp_mismatch_matches_megatron() -> None:
    """§4.4: under tp-pp-dp, dp != expt_dp makes Megatron's pp check fail; shardcore says so up front."""
    spec = ShardSpec(tp=2, pp=2, dp=2, ep=2)
    _, pp_ok = megatron_groups(spec, 0, tp_pp_dp=True)
    assert not pp_ok
    with pytest.raises(LayoutError):
        plan_layout(8, [spec], order="tp-pp-dp")
    assert megatron_groups(spec, 0, tp_pp_dp=False)[1]
