"""plan_layout properties: windows tile, groups partition each shard, sizes, embd rules, round trips."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcore import GROUP_NAMES, Layout, LayoutError, ShardPlan, ShardSpec, plan_layout
from shardcore.plan.layout import distinct_groups

# Each grid group name: (grid, its dims), written out here independently of layout.py.
GRID_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tp": ("decoder", ("tp",)),
    "cp": ("decoder", ("cp",)),
    "pp": ("decoder", ("pp",)),
    "dp": ("decoder", ("dp",)),
    "mp": ("decoder", ("tp", "pp")),
    "tp_cp": ("decoder", ("tp", "cp")),
    "dp_cp": ("decoder", ("cp", "dp")),
    "tp_dp_cp": ("decoder", ("tp", "cp", "dp")),
    "ep": ("expert", ("ep",)),
    "expt_tp": ("expert", ("expt_tp",)),
    "expt_dp": ("expert", ("expt_dp",)),
    "tp_ep": ("expert", ("expt_tp", "ep")),
    "tp_ep_pp": ("expert", ("expt_tp", "ep", "pp")),
}
ORDERS = ("tp-cp-dp-pp", "tp-cp-pp-dp")


def expected_size(spec: ShardSpec, name: str) -> int:
    sizes = {
        "tp": spec.tp,
        "cp": spec.cp,
        "pp": spec.pp,
        "dp": spec.dp,
        "ep": spec.ep,
        "expt_tp": spec.expt_tp,
        "expt_dp": spec.expt_dp,
    }
    size = 1
    for dim in GRID_GROUPS[name][1]:
        size *= sizes[dim]  # type: ignore[operator]
    return size


@st.composite
def shard_specs(draw: st.DrawFn, order: str) -> ShardSpec:
    tp, cp, pp, dp = (draw(st.integers(1, 4)) for _ in range(4))
    per_stage = tp * cp * dp
    expt_tp = draw(st.sampled_from([d for d in range(1, per_stage + 1) if per_stage % d == 0]))
    rest = per_stage // expt_tp
    if order == "tp-cp-pp-dp" and pp > 1 and draw(st.booleans()):  # pp groups of both grids equal: expt_tp*ep == tp*cp
        expt_tp = draw(st.sampled_from([d for d in range(1, tp * cp + 1) if tp * cp % d == 0]))
        ep = tp * cp // expt_tp
    else:
        ep = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
    return ShardSpec(
        tp=tp,
        cp=cp,
        pp=pp,
        dp=dp,
        ep=ep,
        expt_tp=expt_tp,
        role=draw(st.sampled_from([None, "train", "prefill", "decode"])),
    )


def _pp_groups_agree(spec: ShardSpec, order: str) -> bool:
    return order == "tp-cp-dp-pp" or spec.pp == 1 or spec.tp * spec.cp == spec.expt_tp * spec.ep  # type: ignore[operator]


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    """1-3 shards at a random offset, sometimes with idle ranks after them, in either order."""
    order = draw(st.sampled_from(ORDERS))
    specs = draw(st.lists(shard_specs(order).filter(lambda s: _pp_groups_agree(s, order)), min_size=1, max_size=3))
    offset, tail = draw(st.integers(0, 5)), draw(st.sampled_from([0, 0, 1, 3]))
    world = offset + sum(spec.world_size for spec in specs) + tail
    return plan_layout(world, specs, order=order, rank_offset=offset, allow_idle=tail > 0)


@settings(deadline=None, max_examples=150)
@given(layouts())
def test_windows_tile_exactly(layout: Layout) -> None:
    start = layout.rank_offset
    for index, plan in enumerate(layout.shards):
        assert (plan.index, plan.rank_offset, plan.size) == (index, start, plan.spec.world_size)
        assert plan.ranks == range(start, start + plan.size)
        assert plan.decoder_grid.rank_offset == plan.expert_grid.rank_offset == start
        assert plan.decoder_grid.size == plan.expert_grid.size == plan.size
        start += plan.size
    expected_idle = [w for w in (range(0, layout.rank_offset), range(start, layout.world_size)) if w]
    assert list(layout.idle) == expected_idle
    assert layout.idle_ranks == [r for w in expected_idle for r in w]
    idle = set(layout.idle_ranks)
    for rank in range(layout.world_size):
        owner = layout.shard_of(rank)
        if rank in idle:
            assert owner is None and layout.groups_of(rank) == {} and layout.distinct_groups(rank) == ()
        else:
            assert owner is not None and rank in owner.ranks and rank in owner
    for bad in (-1, layout.world_size):
        with pytest.raises(LayoutError, match=str(bad)):
            layout.shard_of(bad)


def _check_partition(plan: ShardPlan, name: str, groups: dict[int, Any]) -> None:
    """The groups of one name partition the shard, each of the expected size and shape."""
    size = expected_size(plan.spec, name)
    grid_key, dims = GRID_GROUPS[name]
    grid = plan.decoder_grid if grid_key == "decoder" else plan.expert_grid
    for rank in plan.ranks:
        group = groups[rank]
        assert isinstance(group, tuple) and list(group) == sorted(group) and len(group) == size, (name, group)
        assert rank in group
        coords = grid.coords(rank)
        for member in group:
            assert groups[member] == group  # every member sees the same group: a partition
            assert all(grid.coords(member)[d] == coords[d] for d in grid.dim_names if d not in dims)
        assert group == grid.group_ranks(rank, list(dims))


@settings(deadline=None, max_examples=80)
@given(layouts())
def test_each_rank_in_exactly_one_group_per_name(layout: Layout) -> None:
    for plan in layout.shards:
        by_rank = {rank: layout.groups_of(rank) for rank in plan.ranks}
        assert all(list(groups) == list(GROUP_NAMES) for groups in by_rank.values())
        for name in GRID_GROUPS:
            _check_partition(plan, name, {rank: groups[name] for rank, groups in by_rank.items()})
        # the two grids share their pp groups: tp_ep_pp contains the whole pp group
        assert all(set(g["pp"]) <= set(g["tp_ep_pp"]) for g in by_rank.values())  # type: ignore[arg-type]


@settings(deadline=None, max_examples=150)
@given(layouts())
def test_embedding_groups(layout: Layout) -> None:
    for plan in layout.shards:
        for rank in plan.ranks:
            groups = layout.groups_of(rank)
            pp = groups["pp"]
            assert pp is not None
            embd = (pp[0], pp[-1]) if plan.spec.pp > 1 else (pp[0],)
            assert groups["embd"] == (embd if rank in embd else None)
            assert groups["pos_embd"] == ((pp[0],) if rank == pp[0] else None)
            if plan.spec.pp == 1:
                assert groups["embd"] == groups["pos_embd"] == (rank,)


@settings(deadline=None, max_examples=150)
@given(layouts())
def test_distinct_groups(layout: Layout) -> None:
    for rank in range(layout.world_size):
        groups = layout.groups_of(rank)
        distinct = layout.distinct_groups(rank)
        assert distinct == distinct_groups(groups)
        assert len({d.ranks for d in distinct}) == len(distinct)
        names = [name for d in distinct for name in d.names]
        assert sorted(names) == sorted(name for name, ranks in groups.items() if ranks is not None)
        assert all(groups[name] == d.ranks for d in distinct for name in d.names)
        # creation order: by GROUP_NAMES, each rank set at its first name
        firsts = [GROUP_NAMES.index(d.names[0]) for d in distinct]
        assert firsts == sorted(firsts)
        assert all(list(d.names) == [n for n in GROUP_NAMES if n in d.names] for d in distinct)


@settings(deadline=None, max_examples=150)
@given(layouts())
def test_to_dict_json_round_trip(layout: Layout) -> None:
    data = json.loads(layout.to_json())
    assert data == layout.to_dict()
    assert (data["world_size"], data["order"], data["rank_offset"]) == (
        layout.world_size,
        layout.order,
        layout.rank_offset,
    )
    assert [tuple(w) for w in data["idle"]] == [(w.start, w.stop) for w in layout.idle]
    rebuilt = plan_layout(
        data["world_size"],
        [shard["spec"] for shard in data["shards"]],
        order=data["order"],
        rank_offset=data["rank_offset"],
        allow_idle=True,
    )
    assert rebuilt == layout and rebuilt.fingerprint() == layout.fingerprint()
    for shard, plan in zip(data["shards"], layout.shards, strict=True):
        assert shard["ranks"] == [plan.ranks.start, plan.ranks.stop]
        assert shard["decoder_grid"]["shape"] == list(plan.decoder_grid.shape)


def test_worked_example_world_8() -> None:
    """World 8, tp=2, pp=2, dp=2 in both of Megatron's orders (RankGenerator in megatron/core/parallel_state.py)."""
    layout = plan_layout(8, "tp=2,pp=2,dp=2")
    assert layout.groups_of(0)["tp"] == (0, 1)
    assert layout.groups_of(0)["dp"] == (0, 2)
    assert layout.groups_of(0)["pp"] == (0, 4)
    assert layout.groups_of(1)["mp"] == (0, 1, 4, 5)
    assert layout.groups_of(2)["embd"] == (2, 6) and layout.groups_of(2)["pos_embd"] == (2,)
    assert layout.groups_of(6)["pos_embd"] is None
    deep = plan_layout(8, "tp=2,pp=4")
    assert deep.groups_of(6)["embd"] == (0, 6) and deep.groups_of(2)["embd"] is None
    mapped = plan_layout(8, "tp=2,pp=2,dp=2", order="tp-pp-dp")
    assert mapped.groups_of(0)["pp"] == (0, 2) and mapped.groups_of(0)["dp"] == (0, 4)


def test_multi_shard_windows() -> None:
    layout = plan_layout(12, "tp=4,pp=2,role=train+tp=2,role=prefill+tp=1,dp=2,role=decode")
    assert [plan.ranks for plan in layout.shards] == [range(0, 8), range(8, 10), range(10, 12)]
    assert layout.groups_of(9)["tp"] == (8, 9) and layout.groups_of(11)["dp"] == (10, 11)
    assert layout.shard_of(7).index == 0 and layout.shard_of(8).index == 1  # type: ignore[union-attr]


def test_mapping_order_rejects_mismatched_pp_groups() -> None:
    with pytest.raises(LayoutError, match="tp-cp-pp-dp"):
        plan_layout(8, "tp=2,pp=2,dp=2,ep=2,expt_tp=2", order="tp-cp-pp-dp")
    assert plan_layout(8, "tp=2,pp=2,dp=2,ep=2,expt_tp=2").shards[0].spec.expt_dp == 1


def test_rank_offset_and_idle() -> None:
    layout = plan_layout(10, "tp=4", rank_offset=3, allow_idle=True)
    assert layout.idle == (range(0, 3), range(7, 10))
    assert layout.shard_of(2) is None and layout.shard_of(3).rank_offset == 3  # type: ignore[union-attr]
    assert layout.groups_of(6)["tp"] == (3, 4, 5, 6)
    assert plan_layout(7, "tp=4", rank_offset=3).idle == (range(0, 3),)


def test_plans_and_grids_satisfy_the_protocols() -> None:
    from shardcore import GridLike, ShardPlanLike

    plan = plan_layout(8, "tp=2,dp=2,ep=2,pp=2").shards[0]
    assert isinstance(plan, ShardPlanLike)
    assert isinstance(plan.decoder_grid, GridLike) and isinstance(plan.expert_grid, GridLike)
