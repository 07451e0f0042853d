"""The restore refit: a union of placements, and restore plans simulated element by element (no torch).

Every survivor's local tensors are cut from the global tensors through its OLD shard under its OLD rank
(what it really holds); the restore plan's transfers, addressed by new ranks, are applied; every rank
that needs weights must then hold exactly its new shard's slices, each element written once, and every
other rank of the new layout must already hold them.
"""

from __future__ import annotations

from math import prod

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shardcore import LostWeightsError, NoLayoutError, plan_layout
from shardcore.errors import RefitError
from shardcore.plan.layout import Layout
from shardcore.refit import Manifest, ShardPlacement, TensorSpec, UnionPlacement, preset
from shardcore.refit.boxes import subtract, volume
from shardcore.replan import ReplanOption, replan, restore_plan
from tests.core.test_refit_placement import _local
from tests.core.test_refit_plan import _cells, _flat, _tiny, manifests, shard_specs

FEW = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
TINY = preset("tiny-moe")
DENSE = preset("tiny-dense")
SMALL_MOE = _tiny()
"""Element-by-element simulation needs models of a few thousand elements: 4 layers, 4 experts."""
SMALL = _tiny(experts=0)


# -- boxes and the union ---------------------------------------------------------------------------


boxes = st.lists(st.tuples(st.integers(0, 6), st.integers(1, 4)), min_size=1, max_size=3).map(
    lambda dims: tuple((start, start + size) for start, size in dims)
)


@FEW
@given(boxes, st.data())
def test_subtract_leaves_exactly_the_elements_outside_the_cut(box: tuple[tuple[int, int], ...], data: object) -> None:
    cut = data.draw(boxes.filter(lambda other: len(other) == len(box)))  # type: ignore[attr-defined]
    pieces = subtract(box, cut)
    cells = [cell for piece in pieces for cell in _cells(piece)]
    assert len(cells) == len(set(cells)), "pieces overlap"
    inside = set(_cells(box))
    assert set(cells) == {cell for cell in inside if not all(a <= c < b for c, (a, b) in zip(cell, cut))}
    assert all(volume(piece) > 0 for piece in pieces)


def test_union_merges_coinciding_slices_and_cuts_the_rest() -> None:
    manifest = Manifest((TensorSpec("w", (8, 2), "float32", tp_dim=0, stage=("all",)),))
    halves = ShardPlacement(plan_layout(2, "tp=2").shards[0], manifest)  # ranks 0, 1: [0:4], [4:8]
    quarters = ShardPlacement(plan_layout(8, "tp=4", rank_offset=4).shards[0], manifest)  # ranks 4-7
    more_halves = ShardPlacement(plan_layout(10, "tp=2", rank_offset=8).shards[0], manifest)  # ranks 8, 9
    only_first = halves.restrict({0: 0})  # rank 1, with [4:8], is gone
    union = UnionPlacement([only_first, quarters, more_halves])
    got = [(piece.box[0], piece.offset[0], piece.holders.ranks) for piece in union.slices(0)]
    # [0:4] from rank 0 and rank 8 (same box, same offset: merged); [4:8] from the quarters' ranks 6 and 7;
    # rank 9's [4:8] is cut away, since the quarters come first and hold it
    assert got == [((0, 4), 0, (0, 8)), ((4, 6), 0, (6,)), ((6, 8), 0, (7,))]
    assert sum(volume(piece.box) for piece in union.slices(0)) == manifest.tensors[0].numel
    assert [piece.box[0] for held in union.held(4) for piece in held.slices] == []  # shadowed by rank 0
    assert [held.shape for held in union.held(9)] == [(4, 2)] and next(union.held(9)).slices == ()
    assert [piece.holders.ranks for held in union.held(8) for piece in held.slices] == [(0, 8)]
    assert union.ranks == frozenset({0, 4, 5, 6, 7, 8, 9})
    assert (
        "union of (" in union.describe()
        and union.describe() == UnionPlacement([only_first, quarters, more_halves]).describe()
    )


def test_union_offsets_address_the_holders_own_local_tensors() -> None:
    manifest = Manifest((TensorSpec("w", (8, 3), "float32", tp_dim=0, blocks=(4, 4), stage=("all",)),))
    whole = ShardPlacement(plan_layout(1, "tp=1").shards[0], manifest)
    halves = ShardPlacement(plan_layout(3, "tp=2", rank_offset=1).shards[0], manifest)
    union = UnionPlacement([halves.restrict({1: 1}), whole])  # rank 1 holds rows [0:2] and [4:6]
    assert [(piece.box[0], piece.offset[0]) for piece in union.slices(0)] == [
        ((0, 2), 0),
        ((4, 6), 2),
        ((2, 4), 2),  # rank 0's rows [2:4] start at 2 of its local tensor, [6:8] at 6
        ((6, 8), 6),
    ]
    for piece in union.slices(0):
        (rank,) = piece.holders.ranks
        part = halves if rank == 1 else whole
        local = _local(part, rank)["w"]
        shape = next(part.held(rank)).shape
        for cell in _cells(piece.box):
            at = _flat([c - b[0] + o for c, b, o in zip(cell, piece.box, piece.offset)], shape)
            assert local[at] == ("w", _flat(cell, (8, 3)))


@pytest.mark.parametrize(
    ("parts", "match"),
    [
        ([], "non-empty list of placements"),
        ("tp=2", "non-empty list of placements"),
        ([object()], "expected a Placement"),
        ("same ranks", "share rank 0"),
        ("two manifests", "build every part of a union from the same Manifest"),
    ],
)
def test_bad_unions_are_named(parts: object, match: str) -> None:
    shard = plan_layout(2, "tp=2").shards[0]
    if parts == "same ranks":
        parts = [ShardPlacement(shard, DENSE), ShardPlacement(shard, DENSE)]
    elif parts == "two manifests":
        parts = [ShardPlacement(shard, DENSE), ShardPlacement(plan_layout(4, "tp=2", rank_offset=2).shards[0], TINY)]
    with pytest.raises(RefitError, match=match):
        UnionPlacement(parts)  # type: ignore[arg-type]


# -- restore plans, simulated ----------------------------------------------------------------------


def simulate_restore(option: ReplanOption) -> int:
    """Apply the restore plan to what the survivors really hold; returns the bytes it moved."""
    plan, old, numbering, manifest = (
        restore_plan(option, min_piece_bytes=0),
        option.old,
        option.renumbering,
        option.manifest,
    )
    held: dict[int, dict[str, list[object]]] = {}
    for new in range(option.layout.world_size):
        before = numbering.old_of(new)
        shard = None if before is None else old.shard_of(before)
        held[new] = {} if shard is None else _local(ShardPlacement(shard, manifest), before)  # type: ignore[arg-type]
    shapes = {(new, name): (len(data),) for new, tensors in held.items() for name, data in tensors.items()}
    moved = 0
    got: dict[int, dict[str, list[object]]] = {}
    for plan_of_shard in option.layout.shards:
        placement = ShardPlacement(plan_of_shard, manifest)
        for rank in plan_of_shard.ranks:
            want = _local(placement, rank)
            mine = plan.for_rank(rank)
            if rank not in {move.new for move in option.needing_weights(plan_of_shard.index)}:
                assert held[rank] == want, f"rank {rank} keeps its weights but they are not its new ones"
                assert not mine.destination_shapes and not mine.recvs
                continue
            assert set(mine.destination_shapes) == set(want)
            got[rank] = {name: [None] * len(data) for name, data in want.items()}
            for transfer in (*mine.recvs, *mine.copies):
                src_shape = next(
                    h.shape
                    for h in plan.source_placement.held(transfer.src)
                    if manifest.tensors[h.position].name == transfer.tensor
                )
                dst_shape = mine.destination_shapes[transfer.tensor]
                assert prod(src_shape) == shapes[transfer.src, transfer.tensor][0]
                for cell in _cells(transfer.box):
                    rel = [c - b[0] for c, b in zip(cell, transfer.box)]
                    value = held[transfer.src][transfer.tensor][
                        _flat([r + o for r, o in zip(rel, transfer.src_offset)], src_shape)
                    ]
                    assert value == (transfer.tensor, _flat(cell, manifest.tensor(transfer.tensor).shape)), transfer
                    at = _flat([r + o for r, o in zip(rel, transfer.dst_offset)], dst_shape)
                    assert got[rank][transfer.tensor][at] is None, f"{transfer}: an element written twice"
                    got[rank][transfer.tensor][at] = value
                moved += transfer.bytes
            assert got[rank] == want, f"rank {rank} did not get its new weights"
    return moved


SCENARIOS = [
    ("tp=2,pp=2,ep=2,dp=2,role=train+tp=4,dp=2,role=prefill", 16, SMALL_MOE, (0, 9)),
    ("tp=2,pp=2,dp=2,role=train+tp=2,dp=4,role=prefill", 16, SMALL_MOE, (1, 2)),
    ("tp=2,pp=2,role=train+tp=2,dp=2,role=prefill", 8, SMALL, (0,)),  # train's slice 0 of stage 0: only in prefill
    ("tp=2,dp=4,role=train+tp=2,dp=2,role=decode", 16, SMALL, (4, 5)),
]


@pytest.mark.parametrize(("spec", "world", "manifest", "lost"), SCENARIOS)
def test_every_restore_gives_every_moving_rank_its_new_weights(
    spec: str, world: int, manifest: Manifest, lost: tuple[int, ...]
) -> None:
    result = replan(plan_layout(world, spec, allow_idle=True), manifest, lost=lost)
    for option in result.options:
        moved = simulate_restore(option)
        assert moved <= option.restore_bytes  # the whole new weights of the moving ranks, at most
        assert (moved > 0) == any(move.needs_weights for move in option.moves)


def test_a_new_shard_takes_what_its_old_shard_lost_from_another_shard() -> None:
    old = plan_layout(8, "tp=2,pp=2,role=train+tp=2,dp=2,role=prefill")
    option = replan(old, SMALL, lost=[0]).best  # train's only copy of stage 0, tp slice 0 is gone
    plan = restore_plan(option)
    prefill = {option.renumbering.new_of(rank) for rank in old.shards[1].ranks}
    train_ranks = set(option.layout.shards[0].ranks)
    into_train = [t for rank in train_ranks for t in plan.for_rank(rank).recvs]
    assert {t.src for t in into_train if t.tensor == "emb"} & prefill
    simulate_restore(option)


def test_restore_sources_come_from_the_surviving_copies_replan_lists() -> None:
    option = replan(plan_layout(16, SCENARIOS[0][0]), TINY, lost=[0, 9]).best
    plan = restore_plan(option)
    for shard in option.layout.shards:
        copies = option.restore_sources(shard.index)
        for move in option.needing_weights(shard.index):
            for transfer in plan.for_rank(move.new).recvs:
                assert any(transfer.src in copy.ranks for copy in copies[transfer.tensor]), transfer


def test_a_shrink_restores_nothing_and_still_plans() -> None:
    option = replan(plan_layout(12, "tp=2,pp=2,dp=2,role=train+tp=2,dp=2,role=decode"), DENSE, lost=[2]).best
    plan = restore_plan(option)
    assert option.moves == () and plan.world_size == 8
    assert all(not plan.for_rank(rank).recvs and not plan.for_rank(rank).sends for rank in range(8))


def test_a_tensor_with_no_surviving_copy_names_it_and_its_lost_ranks() -> None:
    old = plan_layout(4, "tp=2,role=train+tp=2,role=decode")
    option = replan(old, DENSE, lost=[0, 2]).best  # tp slice 0 of both shards
    with pytest.raises(LostWeightsError) as caught:
        restore_plan(option)
    message = str(caught.value)
    assert "embedding.word_embeddings.weight [0:512, 0:128]: no surviving copy; held only by lost ranks 0, 2" in message
    assert "checkpoint" in message and caught.value.ranks == (0, 2)
    assert len(message) < 1024 and len(option.missing) > 3 and "more parts" in message


def test_bad_restore_argument_is_named() -> None:
    with pytest.raises(RefitError, match="expected a ReplanOption"):
        restore_plan("best")  # type: ignore[arg-type]


@st.composite
def losses(draw: st.DrawFn) -> tuple[Layout, Manifest, tuple[int, ...]]:
    manifest = draw(manifests())
    specs = [draw(shard_specs(max_ranks=8)) for _ in range(draw(st.integers(1, 2)))]
    layout = plan_layout(sum(spec.world_size for spec in specs), specs)
    lost = draw(st.sets(st.integers(0, layout.world_size - 1), min_size=1, max_size=max(1, layout.world_size // 3)))
    return layout, manifest, tuple(sorted(lost))


@FEW
@given(losses())
def test_simulated_restores_of_random_losses(case: tuple[Layout, Manifest, tuple[int, ...]]) -> None:
    layout, manifest, lost = case
    try:
        result = replan(layout, manifest, lost=lost)
    except (NoLayoutError, RefitError):
        assume(False)
        return
    for option in result.options:
        if option.missing:
            with pytest.raises(LostWeightsError):
                restore_plan(option)
            continue
        simulate_restore(option)


def test_a_converting_manifest_restores_the_weights_as_held() -> None:
    layout = plan_layout(16, "tp=2,pp=2,dp=2,role=train+tp=2,dp=4,role=prefill")
    converting = TINY.converted("float8_e4m3fn", "tensor")
    assert any(tensor.scale_of for tensor in converting)
    plan = restore_plan(replan(layout, converting, lost=(1, 2)).best)
    assert plan.manifest == TINY  # the survivors' own dtypes, no scale tensors
    assert plan.fingerprint() == restore_plan(replan(layout, TINY, lost=(1, 2)).best).fingerprint()


@pytest.mark.parametrize(
    ("spec", "world", "lost", "option"),
    [
        ("tp=2,pp=2,dp=2,role=train+tp=2,dp=4,role=prefill", 16, (1, 2), 1),
        ("tp=2,pp=2,ep=2,dp=2,role=train+tp=4,dp=2,role=prefill", 16, (0, 9), 2),
        ("tp=2,pp=2,role=train+tp=2,dp=2,role=prefill", 8, (5,), 2),
    ],
)
def test_each_rank_planning_its_part_alone_agrees_with_every_other(
    spec: str, world: int, lost: tuple[int, ...], option: int
) -> None:
    """Every survivor plans only its own part of the restore, in its own process: what each sends must be what
    its peers receive. A survivor that both sends and receives on a route once cut that route from each of its
    tiles twice, and its peers' messages disagreed in size (the live elastic tests found it)."""
    from collections import Counter

    from shardcore.replan import ReplanRequest

    request = ReplanRequest("tiny-moe", spec, world, lost)
    sent: Counter[tuple[object, ...]] = Counter()
    received: Counter[tuple[object, ...]] = Counter()
    new_world = request.option(option).layout.world_size
    for rank in range(new_world):
        part = restore_plan(request.option(option)).for_rank(rank)  # a fresh plan per rank, as on a live world
        sent.update((t.src, t.dst, t.tensor, t.box, t.hop) for t in part.sends)
        received.update((t.src, t.dst, t.tensor, t.box, t.hop) for t in part.recvs)
    assert sent and sent == received
