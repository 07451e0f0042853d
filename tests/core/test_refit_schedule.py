"""The refit schedule (pure index math): both ends of every message cut it alike and post it in the same
``batch_isend_irecv``, batches stay within ``max_ops`` and ``bucket_bytes``, and no plan can deadlock.

NCCL hangs on large batched point-to-point lists (pytorch/pytorch#174288) and on asymmetric ones
(NVIDIA/nccl#2130); https://github.com/pytorch/pytorch/pull/174942 proposed 256-op chunks with a symmetric
round-robin pairing, which is what the schedule does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcore.refit.schedule import (
    ALIGN,
    Batch,
    aligned,
    fan,
    may_stage,
    rank_batches,
    staging_layout,
    tournament_round,
)
from tests.engine import refit_workers as workers


@pytest.mark.parametrize("world", [*range(1, 18), 64, 101])
def test_the_tournament_pairs_every_two_ranks_once_and_each_rank_once_per_round(world: int) -> None:
    rounds: dict[int, list[tuple[int, int]]] = {}
    for i in range(world):
        for j in range(i + 1, world):
            assert tournament_round(i, j, world) == tournament_round(j, i, world)
            rounds.setdefault(tournament_round(i, j, world), []).append((i, j))
    assert len(rounds) <= max(1, world - 1 + world % 2)
    for pairs in rounds.values():
        ranks = [rank for pair in pairs for rank in pair]
        assert len(ranks) == len(set(ranks)), pairs  # a matching: nobody twice in one round


@pytest.mark.parametrize(("bucket_bytes", "max_ops"), [(1 << 12, 8), (1 << 16, 16), (64 << 20, 256)])
def test_both_ends_put_every_message_in_the_same_batch_within_the_bounds(bucket_bytes: int, max_ops: int) -> None:
    moved = 0
    for case in workers.CASES_8:
        plan = workers._plan(8, case)
        placed: dict[tuple[tuple[int, ...], bool], tuple[object, ...]] = {}
        for rank in range(8):
            mine = plan.for_rank(rank)
            shapes = {t.name: t.shape for t in plan.manifest}
            batches = rank_batches(mine, rank, 8, bucket_bytes, max_ops, shapes)
            assert [b.key for b in batches] == sorted({b.key for b in batches}), case[0]
            for batch in batches:
                assert len(batch.messages) <= max_ops, (case[0], rank, len(batch.messages))
                staged = [aligned(m.nbytes) for m in batch.messages if may_stage(m, shapes)]
                largest = max(staged, default=0)
                assert sum(staged) <= bucket_bytes + fan(8, max_ops) * largest, (case[0], rank)
                for message in batch.messages:
                    pieces = tuple((p.tensor, p.shape, p.src_offset, p.dst_offset, at) for p, at in message.pieces)
                    placed[(message.key, message.send)] = (batch.key, message.nbytes, pieces, message.ledger)
            payload = sum(m.payload for batch in batches for m in batch.messages)
            assert payload == mine.bytes_sent + mine.bytes_received, case[0]
        for (key, send), value in placed.items():
            assert placed[(key, not send)] == value, (case[0], key)
        moved += len(placed)
    assert moved > 0


@dataclass(frozen=True, order=True)
class _Transfer:
    """A stand-in transfer: what the schedule reads (tensor, src, dst, box, offsets, bytes)."""

    tensor: str
    src: int
    dst: int
    box: tuple[tuple[int, int], ...]
    src_offset: tuple[int, ...]
    dst_offset: tuple[int, ...]
    bytes: int
    hop: int = 0


@dataclass
class _Part:
    sends: list[_Transfer]
    recvs: list[_Transfer]


def _random_plan(world: int, pairs: int, seed: int) -> list[_Part]:
    """Any plan: random transfers between random ranks, sizes from one byte to a few MB, a third of them
    forwarded (hop 1), so that a pair may exchange both hops, in both directions."""
    rng = random.Random(seed)
    parts = [_Part([], []) for _ in range(world)]
    for index in range(pairs):
        src, dst = rng.sample(range(world), 2)
        rows = rng.choice([1, 3, 64, 4096])
        size = rows * rng.choice([1, 4, 512])
        transfer = _Transfer(f"t{index}", src, dst, ((0, rows),), (0,), (0,), size, int(rng.random() < 1 / 3))
        parts[src].sends.append(transfer)
        parts[dst].recvs.append(transfer)
    return parts


def _completes(batches: list[list], ahead: list[list[bool]] | None = None) -> bool:
    """Simulate every rank posting its batches in its order and landing (waiting for) each in that order: a
    rank posts batch k+1 before it lands batch k where ``ahead[rank][k+1]`` says so (two in flight), else
    after; a posted batch lands once each of its partners has posted the same batch (now, or earlier: then
    it completed the ops they share). True when every rank finishes; False when some wait on each other."""
    posted = [0] * len(batches)
    landed = [0] * len(batches)

    def has_posted(rank: int, key: object) -> bool:
        return any(batch.key == key for batch in batches[rank][: posted[rank]])

    while any(landed[rank] < len(mine) for rank, mine in enumerate(batches)):
        moved = False
        for rank, mine in enumerate(batches):
            next_ = posted[rank]
            ahead_ok = ahead is not None and next_ < len(mine) and ahead[rank][next_] and next_ == landed[rank] + 1
            if next_ < len(mine) and (next_ == landed[rank] or ahead_ok):
                posted[rank] += 1
                moved = True
                continue
            if landed[rank] < posted[rank] and all(
                has_posted(p, mine[landed[rank]].key) for p in mine[landed[rank]].peers
            ):
                landed[rank] += 1
                moved = True
        if not moved:
            return False
    return True


def test_the_simulation_finds_a_cycle() -> None:
    """Three ranks that post the batches they share in a rotated order wait on each other forever."""

    @dataclass
    class Batch:
        key: tuple[int, int]
        peers: set[int]

    x, y, z = (0, 0), (0, 1), (0, 2)  # x: ranks 0-1, y: ranks 0-2, z: ranks 1-2
    assert not _completes(
        [[Batch(x, {1}), Batch(y, {2})], [Batch(z, {2}), Batch(x, {0})], [Batch(y, {0}), Batch(z, {1})]]
    )
    assert _completes([[Batch(x, {1}), Batch(y, {2})], [Batch(x, {0}), Batch(z, {2})], [Batch(y, {0}), Batch(z, {1})]])
    rotated = [[Batch(x, {1}), Batch(y, {2})], [Batch(z, {2}), Batch(x, {0})], [Batch(y, {0}), Batch(z, {1})]]
    assert not _completes(rotated, [[False, False]] * 3)  # waiting in order, the rotation deadlocks
    assert _completes(rotated, [[False, True]] * 3)  # all posted at once it would not: the check can tell


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(2, 24),
    pairs=st.integers(1, 400),
    seed=st.integers(0, 10**6),
    max_ops=st.sampled_from([2, 8, 256]),
)
def test_no_plan_deadlocks(world: int, pairs: int, seed: int, max_ops: int) -> None:
    parts = _random_plan(world, pairs, seed)
    shapes = {f"t{index}": (1 << 20,) for index in range(pairs)}
    batches = [rank_batches(part, rank, world, 1 << 16, max_ops, shapes) for rank, part in enumerate(parts)]
    assert _completes(batches)
    rng = random.Random(seed)  # two in flight: each rank posts ahead where its own staging (random here) allows
    layouts = [staging_layout(mine, [ALIGN * rng.randrange(4096) for _ in mine], 1 << 16) for mine in batches]
    assert _completes(batches, [[slot.overlaps for slot in layout.slots] for layout in layouts])
    assert _completes(batches, [[True] * len(mine) for mine in batches])  # every rank always ahead
    for mine in batches:  # every message in a batch of its own hop; all of a rank's hop 0 before its hop 1
        assert all(message.hop == batch.key[0] for batch in mine for message in batch.messages)
        hops = [batch.key[0] for batch in mine]
        assert hops == sorted(hops)


FANOUT_CASES = [
    ("two destinations sliced alike on one node", "tiny-dense", "tp=4 + tp=2 + tp=2", 0, None, [1, 2]),
    ("replicas of one destination on three nodes", "tiny-moe", "tp=2 + tp=1,dp=6,ep=2", 0, None, [1]),
]


@pytest.mark.parametrize("case", FANOUT_CASES, ids=[case[0] for case in FANOUT_CASES])
@pytest.mark.parametrize(("bucket_bytes", "max_ops"), [(1 << 12, 8), (64 << 20, 256)])
def test_a_relay_forwards_only_what_an_earlier_batch_brought_it(case: tuple, bucket_bytes: int, max_ops: int) -> None:
    """On fan-out plans: both ends of every message in the same batch, and each forward (hop 1) reads rows of its
    relay's destination that the relay's own hop-0 batches, all earlier, received whole."""
    per_node = 4 if case[0].startswith("two") else 2
    plan = workers._plan(8, (*case, {"ranks_per_node": per_node, "fan_out": True}))
    placed: dict[tuple[tuple[int, ...], bool], tuple[object, ...]] = {}
    forwards = 0
    for rank in range(8):
        shapes = {t.name: t.shape for t in plan.manifest}
        batches = rank_batches(plan.for_rank(rank), rank, 8, bucket_bytes, max_ops, shapes)
        landed: dict[str, set[tuple[int, ...]]] = {}
        for batch in batches:
            for message in batch.messages:
                pieces = tuple((p.tensor, p.shape, p.src_offset, p.dst_offset) for p, _ in message.pieces)
                placed[(message.key, message.send)] = (batch.key, message.nbytes, pieces)
                if message.send and message.hop:
                    for piece, _ in message.pieces:
                        assert _cells(piece.src_offset, piece.shape) <= landed.get(piece.tensor, set()), (rank, piece)
                        forwards += 1
            for message in batch.messages:  # what this batch lands, usable by later batches only
                if not message.send and not message.hop:
                    for piece, _ in message.pieces:
                        landed.setdefault(piece.tensor, set()).update(_cells(piece.dst_offset, piece.shape))
    for (key, send), value in placed.items():
        assert placed[(key, not send)] == value, key
    assert forwards > 0


def _cells(offset: tuple[int, ...], shape: tuple[int, ...]) -> set[tuple[int, ...]]:
    """The local indices a piece covers (small test tensors only)."""
    cells: set[tuple[int, ...]] = {()}
    for start, size in zip(offset, shape):
        cells = {(*cell, i) for cell in cells for i in range(start, start + size)}
    return cells


@settings(max_examples=200, deadline=None)
@given(
    staged=st.lists(st.integers(0, 64).map(lambda n: n * ALIGN), max_size=12),
    hops=st.lists(st.integers(0, 1), min_size=12, max_size=12),
    bucket=st.integers(1, 80).map(lambda n: n * ALIGN),
)
def test_two_batches_in_flight_never_share_staging_and_stay_within_the_bucket(
    staged: list[int], hops: list[int], bucket: int
) -> None:
    batches = [Batch((hop, 0, index)) for index, hop in enumerate(sorted(hops[: len(staged)]))]
    layout = staging_layout(batches, staged, bucket)
    assert [slot.nbytes for slot in layout.slots] == staged
    assert layout.nbytes <= max([bucket, *staged])  # the bucket, or one batch that alone holds more
    for k, slot in enumerate(layout.slots):
        assert slot.offset % ALIGN == 0 and slot.offset + slot.nbytes <= layout.nbytes
        if not slot.overlaps:
            continue
        before = layout.slots[k - 1]
        assert k > 0 and batches[k].key[0] == batches[k - 1].key[0]  # never across a hop: relays read what landed
        assert before.nbytes + slot.nbytes <= bucket
        assert before.offset + before.nbytes <= slot.offset or slot.offset + slot.nbytes <= before.offset
    within = [k for k in range(1, len(staged)) if hops and batches[k].key[0] == batches[k - 1].key[0]]
    assert all(layout.slots[k].overlaps == (staged[k - 1] + staged[k] <= bucket) for k in within)
