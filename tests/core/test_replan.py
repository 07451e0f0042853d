"""replan: options on small worlds checked by hand and against brute force (moves, group fates, missing copies)."""

from __future__ import annotations

import pickle
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcore import LayoutError, ManifestError, NoLayoutError, plan_layout
from shardcore.errors import RefitError
from shardcore.plan import GROUP_NAMES, Layout
from shardcore.plan.topology import BANDWIDTH_GROUPS
from shardcore.refit import Footprint, Manifest, holdings, preset
from shardcore.replan import Renumbering, ReplanOption, ReplanRequest, replan

TINY = preset("tiny-moe")
DENSE = preset("tiny-dense")


@settings(deadline=None, max_examples=200)
@given(st.data())
def test_renumbering_keeps_the_survivors_in_order(data: st.DataObject) -> None:
    world = data.draw(st.integers(1, 64))
    lost = data.draw(st.sets(st.integers(0, world - 1)))
    released = data.draw(st.sets(st.sampled_from([r for r in range(world) if r not in lost] or [0])))
    released -= lost
    added = data.draw(st.integers(0, 5))
    renumbering = Renumbering(world, tuple(sorted(lost)), tuple(sorted(released)), added)
    staying = [rank for rank in range(world) if rank not in lost | released]
    assert renumbering.new_world == len(staying) + added
    for new, old in enumerate(staying):
        assert renumbering.new_of(old) == new and renumbering.old_of(new) == old
        assert new == old - sum(1 for gone in lost | released if gone < old)
    assert all(renumbering.new_of(rank) is None for rank in lost | released)
    window = range(data.draw(st.integers(0, renumbering.new_world)), renumbering.new_world)
    assert renumbering.old_ranks(window) == [renumbering.old_of(new) for new in window]
    first = data.draw(st.integers(0, world))
    shard = range(first, data.draw(st.integers(first, world)))
    assert renumbering.lost_within(shard) == tuple(sorted(rank for rank in lost if rank in shard))


@settings(deadline=None, max_examples=200)
@given(st.data())
def test_replacements_keep_every_survivors_number_and_place(data: st.DataObject) -> None:
    """Added ranks that replace lost ones take their numbers and places; survivors keep theirs where nothing
    closes up below them; a replacement holds nothing (old_of None) and every new rank has one distinct place."""
    world = data.draw(st.integers(1, 64))
    lost = sorted(data.draw(st.sets(st.integers(0, world - 1), max_size=world - 1)))
    replaced = sorted(data.draw(st.sets(st.sampled_from(lost))) if lost else set())
    added = len(replaced) + data.draw(st.integers(0, 3))
    numbering = Renumbering(world, tuple(lost), (), added, tuple(replaced))
    assert numbering.new_world == world - len(lost) + added
    closed = [rank for rank in lost if rank not in replaced]
    for old in range(world):
        if old not in lost:
            assert numbering.new_of(old) == old - sum(gap < old for gap in closed)
            assert numbering.old_of(numbering.new_of(old)) == old  # type: ignore[arg-type]
    for rank in replaced:
        new = rank - sum(gap < rank for gap in closed)
        assert numbering.old_of(new) is None and numbering.physical(new) == rank
    places = [numbering.physical(new) for new in range(numbering.new_world)]
    assert len(set(places)) == len(places) and not set(places) & set(closed)
    window = range(data.draw(st.integers(0, numbering.new_world)), numbering.new_world)
    assert numbering.old_ranks(window) == [numbering.old_of(new) for new in window]


def _held(plan: object, rank: int, manifest: Manifest) -> set[tuple[str, object]]:
    return {(t.name, box) for t in manifest for box, _ in holdings(t, plan, rank, manifest)}  # type: ignore[arg-type]


def _check_against_brute_force(old: Layout, option: ReplanOption, manifest: Manifest, per_node: int | None) -> None:
    """Every rank's move, every group's fate and every missing part, recomputed the slow way."""
    numbering = option.renumbering
    moves = {move.new: move for move in option.moves}
    for plan in option.layout.shards:
        for rank in plan.ranks:
            before = numbering.old_of(rank)
            was = None if before is None else old.shard_of(before)
            needs = was is None or _held(was, before, manifest) != _held(plan, rank, manifest)  # type: ignore[arg-type]
            if needs or was.index != plan.index:  # type: ignore[union-attr]
                assert moves.pop(rank).needs_weights == needs, rank
        for name in GROUP_NAMES:
            fate = next(f for f in option.fates if f.shard == plan.index and f.name == name)
            groups = list(plan.iter_groups(name))
            kept = crossing = 0
            for group in groups:
                olds = tuple(numbering.old_of(rank) for rank in group)
                where = None if None in olds else old.shard_of(olds[0])  # type: ignore[arg-type]
                kept += where is not None and where.groups_of(olds[0], (name,))[name] == olds  # type: ignore[arg-type]
                places = [numbering.physical(rank) for rank in group]
                crossing += (
                    per_node is not None and name in BANDWIDTH_GROUPS and len({p // per_node for p in places}) > 1
                )
            assert (fate.total, fate.kept, fate.crossing) == (len(groups), kept, crossing), (plan.index, name)
    assert not moves, f"moves of ranks that do not move: {sorted(moves)}"
    gone = set(numbering.gone)
    for tensor in manifest:
        dim = tensor.tp_dim or 0
        alive = {
            i
            for plan in old.shards
            for rank in plan.ranks
            if rank not in gone
            for box, _ in holdings(tensor, plan, rank, manifest)
            for i in range(*box[dim])
        }
        missing = {i for proof in option.missing if proof.tensor == tensor.name for i in range(*proof.box[dim])}
        assert missing == set(range(tensor.shape[dim])) - alive, tensor.name


SCENARIOS = [
    ("tp=2,pp=2,dp=2,role=train+tp=2,dp=2,role=decode", 12, DENSE, (2,), {}),
    ("tp=2,pp=2,dp=2,ep=2,role=train+tp=2,dp=2,ep=2,role=prefill+tp=1,dp=4,ep=2,role=decode", 16, TINY, (0, 1), {}),
    ("tp=2,pp=2,dp=2,ep=2,role=train+tp=2,dp=2,ep=2,role=prefill+tp=1,dp=4,ep=2,role=decode", 16, TINY, (9,), {}),
    ("tp=2,dp=4,role=train+tp=2,dp=2,role=decode", 16, DENSE, (4, 5), {"world_size": 18}),
    ("tp=2,dp=2,role=train+tp=4,role=decode", 12, DENSE, (1, 5), {}),
    ("tp=2,pp=2,role=train+tp=2,dp=2,role=decode", 12, DENSE, (), {"world_size": 10}),
    ("tp=1,dp=4,ep=2,role=train+tp=2,dp=2,ep=2,role=decode", 8, TINY, (3,), {"keep": (1,)}),
    ("tp=1,dp=4,ep=2,role=train+tp=2,dp=2,ep=2,role=decode", 8, TINY, (5,), {"keep": (1,)}),  # borrow from before
    ("tp=2,dp=2,role=train+tp=2,dp=4,role=prefill+tp=2,pp=2,role=decode", 16, DENSE, (2, 3), {"keep": (0,)}),
    ("tp=2,pp=2,dp=2,role=train+tp=2,dp=2,role=decode", 12, DENSE, (1, 6), {"world_size": 13}),  # 2 replaced, 1 more
]


@pytest.mark.parametrize(("spec", "world", "manifest", "lost", "options"), SCENARIOS)
def test_every_option_against_brute_force(
    spec: str, world: int, manifest: Manifest, lost: tuple[int, ...], options: dict[str, object]
) -> None:
    old = plan_layout(world, spec, allow_idle=True)
    result = replan(old, manifest, lost=lost, ranks_per_node=4, **options)  # type: ignore[arg-type]
    assert result.options
    for option in result.options:
        assert [plan.spec.role for plan in option.layout.shards] == [plan.spec.role for plan in old.shards]
        _check_against_brute_force(old, option, manifest, 4)
    keys = [option.rank_key() for option in result.options]
    assert keys == sorted(keys)


def test_shrink_drops_the_replica_that_lost_a_rank() -> None:
    old = plan_layout(12, "tp=2,pp=2,dp=2,role=train+tp=2,dp=2,role=decode")
    best = replan(old, DENSE, lost=[2]).best
    assert best.kind == "shrink" and best.renumbering.released == (3, 6, 7)
    assert [str(plan.spec) for plan in best.layout.shards] == ["tp=2,pp=2,role=train", "tp=2,dp=2,role=decode"]
    assert best.layout.world_size == 8 and best.moves == () and best.restore_bytes == 0 and best.missing == ()
    fates = {(f.shard, f.name): (f.kept, f.total) for f in best.fates}
    assert fates[0, "tp"] == (2, 2) and fates[0, "pp"] == (2, 2) and fates[0, "embd"] == (2, 2)
    assert fates[0, "dp"] == (0, 4) and fates[0, "tp_dp_cp"] == (0, 2)  # the replicas shrank
    assert all(kept == total for (shard, _), (kept, total) in fates.items() if shard == 1)  # decode untouched


def test_shift_keeps_every_spec_and_says_who_moves() -> None:
    old = plan_layout(20, "tp=2,dp=4,role=train+tp=2,dp=2,role=decode", allow_idle=True)
    result = replan(old, DENSE, lost=[4, 5])
    shift = next(option for option in result.options if option.kind == "shift")
    assert [plan.spec for plan in shift.layout.shards] == [plan.spec for plan in old.shards]
    # survivors move down by 2: old decode ranks 8, 9 (new 6, 7) join train, with the same weights (tp=2 both);
    # decode (new [8, 12)) takes old 10, 11 at the same tp coordinates and the idle old 12, 13: those need weights
    moves = {move.new: (move.old, move.old_shard, move.new_shard, move.needs_weights) for move in shift.moves}
    assert moves == {6: (8, 1, 0, False), 7: (9, 1, 0, False), 10: (12, None, 1, True), 11: (13, None, 1, True)}
    assert result.best.kind == "shrink"


def test_a_slice_with_no_surviving_copy_has_a_proof() -> None:
    old = plan_layout(4, "tp=2,role=train+tp=2,role=decode")
    result = replan(old, DENSE, lost=[0, 2])  # tp slice 0 of both shards
    proofs = result.best.missing
    split = [t for t in DENSE if t.tp_dim is not None]
    assert {proof.tensor for proof in proofs} == {t.name for t in split}
    fc1 = next(p for p in proofs if p.tensor == "decoder.layers.0.mlp.linear_fc1.weight")
    assert fc1.box == ((0, 256), (0, 128)) and fc1.lost == (0, 2) and fc1.released == ()
    assert "no surviving copy; held only by lost ranks 0, 2" in fc1.describe()
    norms = [t.name for t in DENSE if t.tp_dim is None]
    assert norms and not {p.tensor for p in proofs} & set(norms)


def test_restore_sources_cover_what_the_moving_ranks_need() -> None:
    old = plan_layout(16, "tp=2,pp=2,dp=2,ep=2,role=train+tp=2,dp=2,ep=2,role=prefill+tp=1,dp=4,ep=2,role=decode")
    for option in replan(old, TINY, lost=[4]).options:
        for plan in option.layout.shards:
            sources = option.restore_sources(plan.index)
            for move in option.needing_weights(plan.index):
                for tensor in TINY:
                    for box, _ in holdings(tensor, plan, move.new, TINY):
                        copies = sources[tensor.name]
                        dim = tensor.tp_dim or 0
                        need = set(range(*box[dim]))
                        have = {i for c in copies for held, _ in c.boxes for i in range(*held[dim])}
                        assert need <= have, (tensor.name, move)
                        for copy in copies:  # the holders hold it: old holdings, new numbering
                            for new, before in zip(copy.ranks, copy.old_ranks):
                                assert option.renumbering.old_of(new) == before
                                assert holdings(tensor, old.shards[copy.old_shard], before, TINY) == copy.boxes
    with pytest.raises(LayoutError, match="shard 5"):
        option.restore_sources(5)


def test_a_kept_shard_shifts_borrows_or_there_is_no_layout() -> None:
    old = plan_layout(8, "tp=1,dp=4,ep=2,role=train+tp=2,dp=2,ep=2,role=decode")
    with pytest.raises(NoLayoutError) as caught:  # both kept: nothing to borrow from
        replan(old, TINY, lost=[5], keep=[0, 1])
    message = str(caught.value)
    assert "shard 1 ('tp=2,dp=2,ep=2,role=decode') lost 1 of 4 ranks and must keep its spec" in message
    assert (
        "nearest: without keep" in message and "with 1 more rank (world_size 8) every shard keeps its spec" in message
    )
    borrowed = replan(old, TINY, lost=[5], keep=[1])  # the train shard gives a replica block: dp 4 -> 2
    assert "borrow" in {option.kind for option in borrowed.options}
    shifted = replan(old, TINY, lost=[5], keep=[1], world_size=8)  # one rank added: shift, or it takes rank 5's place
    assert {option.kind for option in shifted.options} == {"shift", "replace"}
    assert shifted.best.kind == "replace" and [m.new for m in shifted.best.moves if m.needs_weights] == [5]


MIXED = "tp=4,dp=2,role=train + tp=2,dp=4,role=prefill + tp=4,dp=2,role=decode"
"""24 ranks on three 8-rank nodes: a trainer, and two engines."""


def test_replacements_take_the_lost_places_when_that_moves_fewer_bytes() -> None:
    """Two ranks lost and two added: shift slides every window after the loss (16 ranks need weights, groups
    cross nodes); replace puts the new ranks in the lost places, so only they need weights and no group moves to
    another node, and it ranks above shift. Survivors keep their numbers and their physical places."""
    old = plan_layout(24, MIXED)
    result = replan(old, preset("llama3-8b"), lost=[2, 3], world_size=24, ranks_per_node=8)
    kinds = [option.kind for option in result.options]
    replace, shift = (result.options[kinds.index(kind)] for kind in ("replace", "shift"))
    assert kinds.index("replace") < kinds.index("shift") and replace.restore_bytes < shift.restore_bytes
    assert [m.new for m in replace.moves if m.needs_weights] == [2, 3] and replace.crossing == 0 < shift.crossing
    assert sum(m.needs_weights for m in shift.moves) == 16
    numbering = replace.renumbering
    assert replace.layout.to_dict() == old.to_dict() and numbering.replaced == (2, 3)
    assert all(numbering.new_of(r) == r and numbering.physical(r) == r for r in range(24) if r not in (2, 3))
    assert numbering.old_of(2) is None and numbering.physical(2) == 2  # a new process, in the lost one's place
    assert replace.restore_sources(0)  # the survivors hold what the replacements need
    fewer = replan(old, preset("llama3-8b"), lost=[2, 3], world_size=23)
    assert "replace" not in {option.kind for option in fewer.options}  # one added rank cannot take two places


def test_a_kept_shard_borrows_a_replica_from_another() -> None:
    """--keep 0 after losing 2 training ranks, no ranks added: the prefill shard gives one of its dp=4 replicas
    (the ranks next to the trainer), so the trainer keeps its spec; the prefill's other replicas keep their
    weights. Without keep, the trainer itself shrinks."""
    old = plan_layout(24, MIXED)
    result = replan(old, preset("llama3-8b"), lost=[2, 3], keep=[0], ranks_per_node=8)
    borrow = result.best
    assert borrow.kind == "borrow" and [str(plan.spec) for plan in borrow.layout.shards] == [
        "tp=4,dp=2,role=train", "tp=2,dp=3,role=prefill", "tp=4,dp=2,role=decode"
    ]  # fmt: skip
    assert not borrow.renumbering.released and not borrow.missing
    assert not borrow.needing_weights(1) and not borrow.needing_weights(2)  # only the trainer restores
    assert "shard 0 ('tp=4,dp=2,role=train') keeps its spec on 2 ranks shard 1 gives up" in borrow.notes[0]
    assert replan(old, preset("llama3-8b"), lost=[2, 3]).best.kind == "shrink"


def test_a_training_shard_holds_its_optimizer_state() -> None:
    """The memory check of a train shard counts train_bytes_per_param bytes a parameter (16 by default: weights,
    master weights, Adam's moments, gradients); an engine shard, its weights alone; a bad factor is named."""
    old = plan_layout(8, "tp=2,dp=2,role=train+tp=4,role=decode")
    footprint = Footprint(DENSE)
    train = footprint.weight_bytes(old.shards[0].spec)  # float32 weights: 4 bytes a parameter
    room = train * 2  # the weights fit twice over, weights and optimizer state (16 / 4 = 4x) do not
    with pytest.raises(NoLayoutError, match=r"nearest: with [\d.]+ MB per rank"):
        replan(old, DENSE, lost=[1], memory_bytes=room)  # the trainer, re-laid out, must hold its state
    assert replan(old, DENSE, lost=[1], memory_bytes=room, train_bytes_per_param=8).options
    assert replan(old, DENSE, lost=[1], memory_bytes=train * 4).options
    with pytest.raises(LayoutError, match="train_bytes_per_param=0: expected a positive number of bytes"):
        replan(old, DENSE, lost=[5], train_bytes_per_param=0)


def test_memory_is_a_constraint_with_the_nearest_memory_named() -> None:
    old = plan_layout(8, "tp=2,dp=2,role=train+tp=4,role=decode")
    with pytest.raises(NoLayoutError, match=r"nearest: with [\d.]+ MB per rank"):
        replan(old, DENSE, lost=[5], memory_bytes=1.5e6)
    footprint = Footprint(DENSE)
    options = replan(old, DENSE, lost=[5], memory_bytes=6e6).options
    assert all(footprint.weight_bytes(plan.spec) <= 6e6 for option in options for plan in option.layout.shards)


def test_world_size_alone_loses_the_tail_or_adds_ranks() -> None:
    old = plan_layout(12, "tp=2,pp=2,role=train+tp=2,dp=2,role=decode", allow_idle=True)
    assert replan(old, DENSE, world_size=10).renumbering.lost == (10, 11)
    grown = replan(old, DENSE, world_size=14)
    assert grown.renumbering.added == 2 and grown.renumbering.lost == ()
    best = grown.best
    assert best.kind == "keep" and best.moves == () and best.layout.world_size == 14
    grow = next(option for option in grown.options if option.kind.endswith("+grow"))
    assert grow.layout.shards[1].spec.dp == 5  # the 4 idle ranks and the 2 added ones join decode
    assert [(move.new, move.old) for move in grow.moves] == [(8, 8), (9, 9), (10, 10), (11, 11), (12, None), (13, None)]
    assert all(move.old_shard is None and move.needs_weights for move in grow.moves)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"lost": [12]}, LayoutError, r"lost rank 12 is outside the world \[0, 12\)"),
        ({"lost": [-1]}, LayoutError, "lost rank -1"),
        ({"lost": "3"}, LayoutError, "expected a collection of ranks"),
        ({"lost": [1], "world_size": 5}, LayoutError, "world_size=5 is less than the 11 survivors"),
        ({"lost": list(range(12))}, NoLayoutError, "every one of the 12 ranks is lost"),
        ({"keep": [2]}, LayoutError, "keep=\\[2\\]: expected shard indices from 0 to 1"),
        ({"memory_bytes": -1}, LayoutError, "memory_bytes=-1"),
        ({"ranks_per_node": 0}, LayoutError, "ranks_per_node=0"),
    ],
)
def test_bad_input(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    old = plan_layout(12, "tp=2,pp=2,dp=2,role=train+tp=2,dp=2,role=decode")
    with pytest.raises(error, match=message):
        replan(old, DENSE, **kwargs)  # type: ignore[arg-type]


def test_a_model_that_does_not_split_and_a_wrong_manifest() -> None:
    with pytest.raises(ManifestError, match="does not split into 3"):
        replan(plan_layout(3, "tp=3"), DENSE, lost=[0])
    with pytest.raises(RefitError, match="Manifest"):
        replan(plan_layout(4, "tp=2,dp=2"), "tiny-dense", lost=[0])  # type: ignore[arg-type]


def test_a_whole_shard_lost_needs_more_ranks() -> None:
    old = plan_layout(12, "tp=2,pp=2,dp=2,role=train+tp=2,dp=2,role=decode")
    with pytest.raises(NoLayoutError, match=r"lost 4 of 4 ranks.*with 4 more ranks"):
        replan(old, DENSE, lost=range(8, 12))


def test_a_large_layout_in_seconds() -> None:
    old = plan_layout(3072, "tp=8,pp=4,dp=64,role=train+tp=8,dp=128,role=decode")
    started = time.perf_counter()
    result = replan(old, preset("llama3-70b"), lost=range(800, 808), ranks_per_node=8, memory_bytes=80e9)
    assert time.perf_counter() - started < 30
    best = result.best
    assert best.kind == "shrink" and best.moves == () and not best.missing
    assert best.layout.shards[0].spec.dp == 63 and len(best.renumbering.released) == 24
    assert best.kept_groups > 10 * best.rebuilt_groups


def test_a_request_replans_as_replan_does_and_numbers_its_options() -> None:
    request = ReplanRequest("tiny-dense", "tp=2,dp=2,role=train+tp=2,dp=2,role=decode", 8, (1,))
    alone = replan(plan_layout(8, request.shards), preset("tiny-dense"), lost=(1,))
    assert [str(o.layout.shards[0].spec) for o in request.result().options] == [
        str(o.layout.shards[0].spec) for o in alone.options
    ]
    again = pickle.loads(pickle.dumps(request))  # what replan --check's workers get, and plan
    assert again.option(2).layout.fingerprint() == alone.options[1].layout.fingerprint()
    with pytest.raises(LayoutError, match=f"--option 9: the replan has options 1 to {len(alone.options)}"):
        request.option(9)
