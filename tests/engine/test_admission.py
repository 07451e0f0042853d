"""Admissions (``agreement.admit``) on a real TCPStore, each member with a store client and line of its own, as
the processes of two jobs have: a party whose members are counted as they arrive completes at the store's epoch;
a second claim of a rank is refused at once, naming the holder; values that differ end the attempt at once and
the conflict stands for its timeout, then the next attempt meets afresh; a timeout names the ranks that never
came; and a completed admission deletes the keys of those before it, whoever wrote them."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("torch")

from shardcore.engine.agreement import Admission, Party, Purpose, admit
from shardcore.engine.live.ports import free_port
from shardcore.engine.torch_state import OwnStore
from shardcore.errors import GroupCreationError

PURPOSE = Purpose("admission", "admit", GroupCreationError)


@pytest.fixture
def store() -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", free_port(), None, True, timedelta(seconds=30), wait_for_workers=False)


def _admit(store: Any, rank: int, size: int, value: str, claimant: str, seconds: float = 10.0) -> Admission:
    """One process's arrival at the party ``join/test`` of ``size`` ranks, on a store line of its own."""
    own = OwnStore(store, rank, "the test's store")
    try:
        return admit(Party("join/test", range(size), None, own), PURPOSE, value, claimant, timedelta(seconds=seconds))
    finally:
        own.close()


def _together(*arrivals: tuple[Any, ...]) -> list[Admission]:
    """Arrivals at once, each in a thread of its own (their waits overlap, as two jobs' processes do)."""
    with ThreadPoolExecutor(len(arrivals)) as pool:
        return list(pool.map(lambda arrival: _admit(*arrival), arrivals))


def _left(store: Any, epoch: int) -> list[str]:
    """The keys of the admission at ``epoch`` still in the store, once queued cleanup has had a moment."""
    keys = [f"shardcore/join/test/{epoch}/open/{key}" for key in ("reference", "members", "arrived", "result")]
    keys += [f"shardcore/join/test/{epoch}/open/value/{rank}" for rank in range(2)]
    deadline = time.monotonic() + 10
    while (left := [key for key in keys if store.check([key])]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_admissions_complete_refuse_a_second_claim_stand_on_a_conflict_and_clean_up(store: Any) -> None:
    first = _together((store, 0, 2, "terms:a", "trainer 0"), (store, 1, 2, "terms:a", "engine 0"))
    assert [(a.epoch, a.complete) for a in first] == [(0, True), (0, True)], first

    # rank 0 claimed by another process while the holder waits for rank 1: refused at once, naming the holder
    with ThreadPoolExecutor(2) as pool:
        holder = pool.submit(_admit, store, 0, 2, "terms:a", "trainer 0")
        time.sleep(0.5)
        started = time.monotonic()
        twice = _admit(store, 0, 2, "terms:a", "trainer 0 again")
        refused = time.monotonic() - started
        other = pool.submit(_admit, store, 1, 2, "terms:a", "engine 0")
        second = [holder.result(), other.result()]
    assert twice == Admission(1, False, holder="trainer 0") and refused < 5, (twice, refused)
    assert [(a.epoch, a.complete) for a in second] == [(1, True), (1, True)], second
    assert _left(store, 0) == []  # epoch 1's decider deleted epoch 0's keys, its members' too

    # other values: the attempt ends at once for both, and a latecomer within the timeout hears the same
    started = time.monotonic()
    conflict = _together((store, 0, 2, "terms:a", "trainer 0", 3.0), (store, 1, 3, "terms:b", "engine 0", 3.0))
    late = _admit(store, 1, 2, "terms:a", "engine 0", 3.0)
    heard = time.monotonic()  # the conflict was decided before: it stands until 3 s after that at most
    assert heard - started < 3.0
    pairs = {a.conflict for a in [*conflict, late]}
    assert len(pairs) == 1 and {a.epoch for a in [*conflict, late]} == {2}, (conflict, late)
    (claimant, brought), (first_claimant, reference) = pairs.pop()  # type: ignore[misc]
    assert {(claimant, brought), (first_claimant, reference)} == {("trainer 0", "terms:a"), ("engine 0", "terms:b")}

    # once the conflict no longer stands, the next attempt meets afresh; then one that a rank misses times out
    time.sleep(3.1)
    third = _together((store, 0, 2, "terms:a", "trainer 0"), (store, 1, 2, "terms:a", "engine 0"))
    assert [(a.epoch, a.complete) for a in third] == [(3, True), (3, True)], third
    assert _left(store, 2) == [] and _left(store, 1) == []  # the conflict's, and those of the last completed
    assert _admit(store, 1, 2, "terms:a", "engine 0", 1.0) == Admission(4, False, missing=(0,))
