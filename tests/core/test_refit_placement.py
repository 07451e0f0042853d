"""Placements (shard, explicit, restricted and renumbered), plans over them, the lower bound, bad arguments.

Plans over any placement are simulated as in ``test_refit_plan``: every source rank's local
tensors are cut from known global tensors through its placement, the transfers are applied, and
every destination rank must end up with exactly what its placement says, each element written once.
"""

from __future__ import annotations

import hashlib
from itertools import combinations
from math import prod

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardcore.errors import LayoutError, RefitError
from shardcore.plan.layout import plan_layout
from shardcore.plan.spec import ShardSpec
from shardcore.refit import (
    ExplicitPlacement,
    HeldBox,
    Manifest,
    Placement,
    RefitPlan,
    RefitStats,
    ShardPlacement,
    TensorSpec,
    Transfer,
    holdings,
    local_shape,
    plan_refit,
    plan_refit_from,
    preset,
)
from shardcore.refit.boxes import meets, volume
from shardcore.refit.cost import lower_bound
from shardcore.refit.part import transfer_order
from tests.core.test_refit_plan import _cells, _flat, manifests, refits, shard_specs

FEW = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


# -- simulating a plan over any placements ------------------------------------------------------


def _local(placement: Placement, rank: int) -> dict[str, list[object]]:
    """``rank``'s local tensors under ``placement``, filled with (name, global flat index) per element."""
    out: dict[str, list[object]] = {}
    for held in placement.held(rank):
        tensor = placement.manifest.tensors[held.position]
        data: list[object] = [None] * prod(held.shape)
        for piece in held.slices:
            assert rank in piece.holders.members
            for cell in _cells(piece.box):
                at = _flat([c - b[0] + o for c, b, o in zip(cell, piece.box, piece.offset)], held.shape)
                assert data[at] is None, "a rank's slices overlap in its local tensor"
                data[at] = (tensor.name, _flat(cell, tensor.shape))
        assert None not in data, "a rank's slices do not fill its local tensor"
        out[tensor.name] = data
    return out


def simulate(plan: RefitPlan) -> list[Transfer]:
    """Apply every transfer, hop 0 first (a relay forwards what it received): exactly-once delivery, right
    values, and for_rank equal to the rank's share; a subset plan delivers its tensors only."""
    world = range(plan.world_size)
    chosen = {t.name for p, t in enumerate(plan.manifest) if plan.tensors is None or p in plan.tensors}
    have = {rank: _local(plan.source_placement, rank) for rank in world}
    want: dict[int, dict[str, list[object]]] = {rank: {} for rank in world}
    for placement in plan.destination_placements:
        for rank in world:
            want[rank].update({name: data for name, data in _local(placement, rank).items() if name in chosen})
    got = {rank: {name: [None] * len(data) for name, data in tensors.items()} for rank, tensors in want.items()}
    shapes = {
        (side, rank, plan.manifest.tensors[held.position].name): held.shape
        for side, placements in (("src", [plan.source_placement]), ("dst", plan.destination_placements))
        for placement in placements
        for rank in world
        for held in placement.held(rank)
        if plan.manifest.tensors[held.position].name in chosen
    }
    transfers = list(plan.transfers())
    for t in sorted(transfers, key=lambda t: t.hop):
        origin = got if t.hop else have
        src_shape, dst_shape = shapes["dst" if t.hop else "src", t.src, t.tensor], shapes["dst", t.dst, t.tensor]
        for cell in _cells(t.box):
            rel = [c - b[0] for c, b in zip(cell, t.box)]
            value = origin[t.src][t.tensor][_flat([r + o for r, o in zip(rel, t.src_offset)], src_shape)]
            assert value == (t.tensor, _flat(cell, plan.manifest.tensor(t.tensor).shape)), (t, cell)
            at = _flat([r + o for r, o in zip(rel, t.dst_offset)], dst_shape)
            assert got[t.dst][t.tensor][at] is None, f"{t}: an element written twice"
            got[t.dst][t.tensor][at] = value
    assert got == want
    key = transfer_order(plan.manifest)
    for rank in world:
        mine = plan.for_rank(rank)
        ours = sorted((t for t in transfers if rank in (t.src, t.dst)), key=key)
        assert [*mine.sends, *mine.recvs, *mine.copies] == [
            *[t for t in ours if t.src == rank != t.dst],
            *[t for t in ours if t.dst == rank != t.src],
            *[t for t in ours if t.src == rank == t.dst],
        ]
        assert mine.source_shapes == {
            name: shape for (side, r, name), shape in shapes.items() if side == "src" and r == rank
        }
        assert mine.destination_shapes == {
            name: shape for (side, r, name), shape in shapes.items() if side == "dst" and r == rank
        }
    return transfers


def _records(placement: Placement, world: int) -> list[HeldBox]:
    """Every rank's boxes under ``placement``, as explicit records."""
    return [
        HeldBox(placement.manifest.tensors[held.position].name, rank, piece.box, piece.offset)
        for rank in range(world)
        for held in placement.held(rank)
        for piece in held.slices
    ]


# -- the shard placement is today's index math --------------------------------------------------


@FEW
@given(manifests(), shard_specs(), shard_specs(), st.integers(0, 3))
def test_shard_placement_gives_the_holdings_of_the_index_math(
    manifest: Manifest, spec: ShardSpec, other: ShardSpec, offset: int
) -> None:
    layout = plan_layout(offset + spec.world_size, [ShardSpec(tp=offset), spec] if offset else [spec])
    plan = layout.shards[-1]
    placement = ShardPlacement(plan, manifest)
    for rank in range(layout.world_size + 1):
        held = {h.position: h for h in placement.held(rank)}
        for position, tensor in enumerate(manifest):
            expected = holdings(tensor, plan, rank, manifest)
            assert bool(expected) == (position in held)
            if expected:
                assert [(s.box, s.offset) for s in held[position].slices] == list(expected)
                assert held[position].shape == local_shape(tensor, plan, rank, manifest)
    probe = ShardPlacement(plan_layout(other.world_size, [other]).shards[0], manifest)
    for position, tensor in enumerate(manifest):
        slices = placement.slices(position)
        by_box = {s.box: set(s.holders.ranks) for s in slices}
        assert len(by_box) == len(slices) and sum(volume(box) for box in by_box) == tensor.numel
        assert not any(meets(a.box, b.box) for a, b in combinations(slices, 2))
        assert by_box == {
            box: {r for r in plan.ranks if any(h[0] == box for h in holdings(tensor, plan, r, manifest))}
            for box in by_box
        }
        for box in [s.box for s in probe.slices(position)] + [tuple((0, 1) for _ in tensor.shape)]:
            assert set(placement.overlapping(position, box)) == {s for s in slices if meets(s.box, box)}


def test_shard_plans_keep_the_recorded_schedule() -> None:
    """The schedules of the planner since each route's tiles are cut as one line (issue 31), as digests of every
    transfer: any change to the plans shows here."""

    def digest(plan: RefitPlan) -> str:
        h = hashlib.sha256()
        for t in plan.transfers():
            h.update(repr((t.tensor, t.src, t.dst, t.box, t.src_offset, t.dst_offset, t.bytes)).encode())
        return h.hexdigest()[:16]

    moe = "tp=2,pp=2,dp=2,ep=2,role=train+tp=4,ep=4,expt_tp=1,role=prefill+tp=1,dp=4,ep=2,role=decode"
    assert digest(plan_refit(plan_layout(16, moe), 0, [1, 2], preset("tiny-moe"), 4)) == "68e5a70a12b6d1e2"
    train, other = (
        plan_layout(8, "tp=2,pp=2,dp=2,ep=2,role=train"),
        plan_layout(8, "tp=4,ep=4,expt_tp=1 + tp=1,dp=4,ep=2"),
    )
    collocated = plan_refit(train, 0, list(other.shards), preset("tiny-moe"), 2, min_piece_bytes=0)
    assert digest(collocated) == "904d2855ec85f7e6"
    dense = plan_refit(plan_layout(6, "tp=2,dp=2,role=train+tp=1+tp=1"), 0, [1, 2], preset("tiny-dense"))
    assert digest(dense) == "5a5d8a80f4658c40"


def test_destination_placement_of_a_rank_is_the_one_it_is_in() -> None:
    """Each destination rank finds its own placement; a rank in no destination (a trainer's) finds none."""
    plan = plan_refit(plan_layout(6, "tp=2,dp=2,role=train+tp=1+tp=1"), 0, [1, 2], preset("tiny-dense"))
    first, second = plan.destination_placements
    assert [plan.destination_placement_of(rank) for rank in range(6)] == [None] * 4 + [first, second]


# -- explicit placements -------------------------------------------------------------------------


@FEW
@given(refits())
def test_explicit_placements_of_shards_deliver_what_the_shard_plan_does(refit: RefitPlan) -> None:
    world = refit.world_size

    def explicit(placement: Placement) -> ExplicitPlacement:
        return ExplicitPlacement(refit.manifest, reversed(_records(placement, world)), index=placement.index)

    def planned() -> RefitPlan:
        return plan_refit_from(
            explicit(refit.source_placement),
            [explicit(p) for p in refit.destination_placements],
            refit.ranks_per_node,
            min_piece_bytes=refit.min_piece_bytes,
            fan_out=refit.fan_out,
            world_size=world,
        )

    if any(tensor.scale_of is not None for tensor in refit.manifest):  # fp8 scales need shards' index math
        with pytest.raises(RefitError, match="scales, which are planned between shards' placements only"):
            planned()
        return
    plan = planned()
    if refit.tensors is not None:
        plan = plan.subset([refit.manifest.tensors[p].name for p in refit.tensors])
    transfers = simulate(plan)
    shard, ours = RefitStats.of(refit), RefitStats.of(plan)
    assert (ours.total_bytes, ours.local_bytes, ours.received) == (shard.total_bytes, shard.local_bytes, shard.received)
    assert ours.lower_bound == shard.lower_bound and ours.busiest_sent >= ours.lower_bound
    assert sum(t.bytes for t in transfers if not t.is_local) == ours.total_bytes


def _grid_manifest() -> Manifest:
    return Manifest(
        (
            TensorSpec("w", (6, 4), "float32", stage="all"),
            TensorSpec("b", (5,), "bfloat16", stage="all"),
        )
    )


def test_explicit_placement_splits_that_no_shard_has() -> None:
    # source: w as a 2x2 grid of boxes, each on two replicas (ranks k and k + 4); b on ranks 1 and 5 as
    # two boxes in the other order locally ([2, 5) first, then [0, 2)). Destination: w in three uneven
    # columns, b whole, on ranks 8, 1 and 10 (rank 1 is on both sides).
    manifest = _grid_manifest()
    grid = [((0, 3), (0, 2)), ((0, 3), (2, 4)), ((3, 6), (0, 2)), ((3, 6), (2, 4))]
    b_parts = [HeldBox("b", r, ((2, 5),), (0,)) for r in (1, 5)] + [HeldBox("b", r, ((0, 2),), (3,)) for r in (1, 5)]
    source = ExplicitPlacement(
        manifest, [HeldBox("w", k + r, box) for k, box in enumerate(grid) for r in (0, 4)] + b_parts, label="grid"
    )
    assert [h.shape for h in source.held(1)] == [(3, 2), (5,)]
    assert len(source.slices(1)) == 2 and {s.holders.ranks for s in source.slices(1)} == {(1, 5)}
    columns = zip((8, 1, 10), [(0, 1), (1, 3), (3, 4)])
    target = ExplicitPlacement(
        manifest,
        [HeldBox("w", r, ((0, 6), cols)) for r, cols in columns] + [HeldBox("b", r, ((0, 5),)) for r in (8, 1, 10)],
        label="columns",
    )
    with pytest.raises(RefitError, match="share rank"):
        plan_refit_from(source, [target, target])
    plan = plan_refit_from(source, target, min_piece_bytes=0)
    assert plan.world_size == 11
    transfers = simulate(plan)
    assert any(t.is_local and t.tensor == "w" and t.dst == 1 for t in transfers)
    assert {t.src for t in transfers if t.tensor == "w" and t.dst == 8} == {0, 4, 2, 6}  # split over replicas
    assert RefitStats.of(plan).shards[0].spec == "columns"


def test_explicit_placement_that_does_not_tile_is_a_clear_error() -> None:
    manifest = _grid_manifest()
    with pytest.raises(RefitError, match=r"tensor w \[6, 4\]: its boxes cover 18 of its 24 elements"):
        ExplicitPlacement(manifest, [HeldBox("w", 0, ((0, 3), (0, 4))), HeldBox("w", 1, ((3, 6), (0, 2)))])
    with pytest.raises(RefitError, match=r"box \[\[0, 4\], \[0, 4\]\] \(ranks 0\) and box \[\[3, 6\], \[0, 4\]\]"):
        ExplicitPlacement(manifest, [HeldBox("w", 0, ((0, 4), (0, 4))), HeldBox("w", 1, ((3, 6), (0, 4)))])
    with pytest.raises(RefitError, match="the same box at the same local offset"):  # one box, two offsets
        ExplicitPlacement(manifest, [HeldBox("b", 0, ((0, 5),)), HeldBox("b", 1, ((0, 5),), (1,))])
    with pytest.raises(RefitError, match=r"rank 2's boxes of tensor b do not fill a local tensor .* gap"):
        ExplicitPlacement(manifest, [HeldBox("b", 2, ((0, 2),), (0,)), HeldBox("b", 2, ((2, 5),), (3,))])


@pytest.mark.parametrize(
    ("record", "match"),
    [
        (("w", 0), "is not a HeldBox"),
        ("w", "is not a HeldBox"),
        (HeldBox(3, 0, ((0, 6), (0, 4))), "expected the name of a tensor"),  # type: ignore[arg-type]
        (HeldBox("x", 0, ((0, 6), (0, 4))), "no tensor named 'x'"),
        (HeldBox("w", -1, ((0, 6), (0, 4))), "rank=-1"),
        (HeldBox("w", True, ((0, 6), (0, 4))), "rank=True"),
        (HeldBox("w", 0, ((0, 6),)), "each of its 2 dims"),
        (HeldBox("w", 0, ((0, 6), (0, 4, 1))), "each of its 2 dims"),
        (HeldBox("w", 0, ((0, 7), (0, 4))), "outside the tensor"),
        (HeldBox("w", 0, ((2, 2), (0, 4))), "empty"),
        (HeldBox("w", 0, ((0, 6), (0, "4"))), "box stop='4'"),  # type: ignore[arg-type]
        (HeldBox("w", 0, ((0, 6), (0, 4)), (0,)), "one start per dim"),
        (HeldBox("w", 0, ((0, 6), (0, 4)), (0, -2)), "offset=-2"),
        (HeldBox("w" * 10_000, 0, ((0, 6), (0, 4))), "characters"),
        (HeldBox("w", 10**5000, ((0, 6), (0, 4))), "digits"),
    ],
)
def test_bad_records_are_named(record: object, match: str) -> None:
    with pytest.raises(RefitError, match=match) as caught:
        ExplicitPlacement(_grid_manifest(), [HeldBox("b", 0, ((0, 5),)), record], label="mine")  # type: ignore[list-item]
    assert str(caught.value).startswith("mine, record 1") and len(str(caught.value)) < 1024


# -- restricted and renumbered -------------------------------------------------------------------


def test_survivors_renumbered_keep_their_holdings_and_plan() -> None:
    manifest = preset("tiny-dense")
    old = plan_layout(8, "tp=2,dp=4,role=train")
    base = ShardPlacement(old.shards[0], manifest)
    survivors = {0: 0, 1: 1, 4: 2, 5: 3, 6: 4, 7: 5}  # ranks 2 and 3 (dp replica 1) are gone
    kept = base.restrict(survivors)
    assert set(kept.ranks) == set(range(6))
    for old_rank, new_rank in survivors.items():
        before, after = list(base.held(old_rank)), list(kept.held(new_rank))
        assert [(h.position, h.shape, [(s.box, s.offset) for s in h.slices]) for h in before] == [
            (h.position, h.shape, [(s.box, s.offset) for s in h.slices]) for h in after
        ]
        for h_before, h_after in zip(before, after):
            for s_before, s_after in zip(h_before.slices, h_after.slices):
                assert s_after.holders.ranks == tuple(
                    sorted(survivors[r] for r in s_before.holders.ranks if r in survivors)
                )
    assert list(kept.held(6)) == []
    target = ShardPlacement(plan_layout(10, "tp=4,dp=1,role=train", allow_idle=True).shards[0], manifest)
    plan = plan_refit_from(kept, [target.restrict({r: r + 6 for r in range(4)})], min_piece_bytes=0)
    transfers = simulate(plan)
    assert {t.src for t in transfers} <= set(range(6)) and {t.dst for t in transfers} == set(range(6, 10))
    # losing every replica of tp rank 1: its half of each split tensor has no holder left
    lost = base.restrict({0: 0, 2: 1})
    with pytest.raises(RefitError, match=r"tensor embedding.word_embeddings.weight: .* holds only 0 of its"):
        plan_refit_from(lost, [target])


@pytest.mark.parametrize(
    ("renumber", "match"),
    [
        ([0, 1], "expected a mapping"),
        ({0: 0, 1: 0}, "maps ranks 0 and 1 both to 0"),
        ({-1: 0}, "old rank=-1"),
        ({0: "1"}, r"renumber\[0\]='1'"),
    ],
)
def test_bad_renumbering_is_named(renumber: object, match: str) -> None:
    base = ShardPlacement(plan_layout(2, "tp=2").shards[0], preset("tiny-dense"))
    with pytest.raises(RefitError, match=match):
        base.restrict(renumber)  # type: ignore[arg-type]


# -- the lower bound -----------------------------------------------------------------------------


def test_lower_bound_takes_the_largest_of_its_bounds() -> None:
    a, b, c = frozenset({0, 1}), frozenset({1, 2}), frozenset({0})
    assert lower_bound({a: 10, b: 10}) == 20 / 3  # averaging: 20 bytes over ranks 0-2, above 10 / 2 per set
    assert lower_bound({a: 2, c: 9}) == 9  # a single rank's own bytes
    assert lower_bound({a: 10, c: 9}) == 19 / 2  # a with the set inside it
    big, inner, rest = frozenset(range(4)), frozenset({0, 1}), frozenset(range(4, 12))
    assert lower_bound({big: 8, inner: 4, rest: 1}) == 3  # big with the set inside it: 12 / 4
    assert lower_bound({a: 0}) == lower_bound({}) == 0.0


@FEW
@given(st.dictionaries(st.frozensets(st.integers(0, 5), min_size=1), st.integers(0, 50), max_size=6))
def test_lower_bound_is_valid_and_at_least_the_simple_bounds(must_move: dict[frozenset[int], int]) -> None:
    bound = lower_bound(must_move)
    moving = {h: n for h, n in must_move.items() if n}
    ranks = sorted(set().union(*moving)) if moving else []
    exact = max(  # the fractional optimum: max over rank sets R of the bytes that only R can send, / |R|
        (
            sum(n for h, n in moving.items() if h <= set(r)) / len(r)
            for k in range(1, len(ranks) + 1)
            for r in combinations(ranks, k)
        ),
        default=0.0,
    )
    assert bound <= exact + 1e-9
    assert bound >= max((n / len(h) for h, n in moving.items()), default=0.0) - 1e-9
    assert bound >= (sum(moving.values()) / len(ranks) if ranks else 0.0) - 1e-9


def test_lower_bound_averages_over_crossing_replica_sets() -> None:
    # dense replicas over dp and expert replicas over expt_dp cross: each training rank is in both,
    # so the per-set bound is low; every source rank holds bytes that must move, so the average is tight
    spec = "tp=2,dp=4,ep=4,expt_tp=1,role=train + tp=2,dp=1,ep=2,expt_tp=1 + tp=1,dp=2,ep=2,expt_tp=1"
    plan = plan_refit(plan_layout(12, spec), 0, [1, 2], preset("tiny-moe"), min_piece_bytes=0)
    stats = RefitStats.of(plan)
    per_set: dict[frozenset[int], int] = {}
    for tile, _ in plan.tiles():
        remote = sum(1 for d in tile.needers.ranks if d not in tile.sources.members)
        per_set[tile.sources.members] = per_set.get(tile.sources.members, 0) + remote * tile.rows * tile.row_bytes
    average = stats.total_bytes / 8
    assert max(n / len(h) for h, n in per_set.items()) < average == stats.lower_bound <= stats.busiest_sent
    assert stats.balance < 1.01


# -- bad arguments -------------------------------------------------------------------------------


def _layout_and_manifest() -> tuple[object, Manifest]:
    return plan_layout(4, "tp=2,role=train + tp=2"), preset("tiny-dense")


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((None, 0, 1), "layout=None: expected a Layout"),
        (("tp=2+tp=2", 0, 1), r"layout='tp=2\+tp=2': expected a Layout; build one with shardcore.plan_layout"),
        (("LAYOUT", None, 1), "source shard None"),
        (("LAYOUT", 0, None), "dst=None"),
        (("LAYOUT", 0, "1"), "dst='1'"),
        (("LAYOUT", 0, 1.0), "dst=1.0"),
        (("LAYOUT", 0, {1}), "dst={1}"),
        (("LAYOUT", 0, []), "no destination shard"),
        (("LAYOUT", 0, [1, 1]), "overlap"),
        (("LAYOUT", 0, [7]), r"destination shard 7: expected a shard index in \[0, 2\)"),
        (("LAYOUT", True, 1), "source shard True"),
    ],
)
def test_bad_plan_refit_arguments_are_refit_errors(args: tuple[object, ...], match: str) -> None:
    layout, manifest = _layout_and_manifest()
    given_args = tuple(layout if a == "LAYOUT" else a for a in args)
    with pytest.raises(RefitError, match=match):
        plan_refit(*given_args, manifest)  # type: ignore[arg-type]


def test_bad_plan_refit_options_are_refit_errors() -> None:
    layout, manifest = _layout_and_manifest()
    for bad in ("tiny-dense", None, {"tensors": []}):
        with pytest.raises(RefitError, match=r"manifest must be a shardcore\.refit\.Manifest"):
            plan_refit(layout, 0, 1, bad)  # type: ignore[arg-type]
    with pytest.raises(RefitError, match="ranks_per_node='8'"):
        plan_refit(layout, 0, 1, manifest, "8")  # type: ignore[arg-type]
    with pytest.raises(RefitError, match="min_piece_bytes=-1"):
        plan_refit(layout, 0, 1, manifest, min_piece_bytes=-1)
    with pytest.raises(LayoutError, match=r"rank 4 is outside the world \[0, 4\)"):
        plan_refit(layout, 0, 1, manifest).for_rank(4)  # type: ignore[arg-type]


def test_bad_plan_refit_from_arguments_are_refit_errors() -> None:
    layout, manifest = _layout_and_manifest()
    shards = [ShardPlacement(plan, manifest) for plan in layout.shards]  # type: ignore[attr-defined]
    other = ShardPlacement(layout.shards[1], preset("tiny-moe"))  # type: ignore[attr-defined]
    cases: list[tuple[tuple[object, ...], dict[str, object], str]] = [
        ((None, shards[1]), {}, "source=None: expected a Placement"),
        ((shards[0], []), {}, "expected a Placement or a non-empty list"),
        ((shards[0], "tp=2"), {}, "destinations='tp=2'"),
        ((shards[0], [shards[1], 3]), {}, "destination 3: expected a Placement"),
        ((shards[0], [other]), {}, "build every placement of a refit from the same Manifest"),
        ((shards[0], [shards[1], shards[1]]), {}, "share rank 2"),
        ((shards[0], shards[1]), {"world_size": 3}, "the placements hold ranks up to 3; give at least 4"),
        ((shards[0], shards[1]), {"world_size": True}, "world_size=True"),
        ((shards[0], shards[1]), {"min_piece_bytes": 0.5}, "min_piece_bytes=0.5"),
    ]
    for args, options, match in cases:
        with pytest.raises(RefitError, match=match):
            plan_refit_from(*args, **options)  # type: ignore[arg-type]
    with pytest.raises(RefitError, match=r"manifest must be a shardcore\.refit\.Manifest; got str"):
        ExplicitPlacement("tiny-dense", [])  # type: ignore[arg-type]
    assert plan_refit_from(shards[0], shards[1]).world_size == 4


def test_fan_out_shares_tiles_only_between_tensors_seeded_alike() -> None:
    """With fan-out a tile is seeded by its group's first member (``RefitPlan._tile``), so two tensors whose slices
    lie alike in a destination share its tiles only when their groups start alike there. Here ``a`` and ``b`` lie
    alike in the second destination (whole, on four replicas of one node that holds no source), but the first
    destination holds ``a`` whole and ``b`` in halves: ``a``'s group there starts in the first destination, ``b``'s in
    the second. ``b`` planned after ``a`` must move exactly as ``b`` planned alone (relays chosen by its own seed)."""
    manifest = Manifest(tuple(TensorSpec(name, (8,), "float32", stage="all") for name in ("a", "b")))
    source = ExplicitPlacement(manifest, [HeldBox(name, 0, ((0, 8),)) for name in ("a", "b")], label="trainer")
    halves = [HeldBox("b", 4 + k, ((4 * k, 4 * k + 4),)) for k in (0, 1)]
    first = ExplicitPlacement(manifest, [HeldBox("a", 4, ((0, 8),)), *halves], index=1, label="split")
    whole = [HeldBox(name, rank, ((0, 8),)) for name in ("a", "b") for rank in range(8, 12)]
    second = ExplicitPlacement(manifest, whole, index=2, label="whole")
    plan = plan_refit_from(source, [first, second], 4, min_piece_bytes=0, fan_out=True)
    alone = plan.subset(["b"])
    for rank in range(plan.world_size):
        part, part_alone = plan.for_rank(rank), alone.for_rank(rank)
        for direction in ("sends", "recvs", "copies"):
            moved = [t for t in getattr(part, direction) if t.tensor == "b"]
            assert moved == list(getattr(part_alone, direction)), (rank, direction)
    relays = {t.dst for t in plan.transfers() if t.tensor == "b" and t.src == 0 and t.dst >= 8}
    assert len(relays) == 1 and any(t.hop for t in plan.transfers() if t.tensor == "b")  # one relay forwards
