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

from shardcore.engine.transfer.schedule import aligned, fan, may_stage, rank_batches, tournament_round
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
        placed: dict[tuple[tuple[int, int, int], bool], tuple[object, ...]] = {}
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


@dataclass
class _Part:
    sends: list[_Transfer]
    recvs: list[_Transfer]


def _random_plan(world: int, pairs: int, seed: int) -> list[_Part]:
    """Any plan: random transfers between random ranks, sizes from one byte to a few MB."""
    rng = random.Random(seed)
    parts = [_Part([], []) for _ in range(world)]
    for index in range(pairs):
        src, dst = rng.sample(range(world), 2)
        rows = rng.choice([1, 3, 64, 4096])
        transfer = _Transfer(f"t{index}", src, dst, ((0, rows),), (0,), (0,), rows * rng.choice([1, 4, 512]))
        parts[src].sends.append(transfer)
        parts[dst].recvs.append(transfer)
    return parts


def _completes(batches: list[list]) -> bool:
    """Simulate every rank posting its batches in its order and waiting for each: a rank's batch completes once
    each of its partners has posted the same batch (now, or earlier: then it completed the ops they share).
    True when every rank finishes; False when some ranks wait on each other in a cycle."""
    position = [0] * len(batches)

    def posted(rank: int, key: object) -> bool:
        return any(batch.key == key for batch in batches[rank][: position[rank] + 1])

    while any(position[rank] < len(mine) for rank, mine in enumerate(batches)):
        ready = [
            rank
            for rank, mine in enumerate(batches)
            if position[rank] < len(mine)
            and all(posted(p, mine[position[rank]].key) for p in mine[position[rank]].peers)
        ]
        if not ready:
            return False
        for rank in ready:
            position[rank] += 1
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
