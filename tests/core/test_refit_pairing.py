"""The pairing tally: over every rank it sums to 0 when both ends of every message agree, and not otherwise;
when it does not, each rank's note and its peers' name the pairs that disagree."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from shardcore.refit import pairing
from shardcore.refit.schedule import Batch, rank_batches
from tests.engine import refit_workers as workers

WORLD = 8
CASES = [*workers.CASES_8, *workers.CASES_OPTIONS_8]


def _batches(plan: Any, parts: dict[int, Any] | None = None) -> list[list[Batch]]:
    shapes = {t.name: t.shape for t in plan.manifest}
    parts = parts or {}
    return [
        rank_batches(parts.get(rank, plan.for_rank(rank)), rank, WORLD, 1 << 14, 16, shapes) for rank in range(WORLD)
    ]


def _named(batches: list[list[Batch]]) -> list[pairing.Disagreement]:
    notes = [pairing.note(b) for b in batches]
    theirs = [pairing.decode(pairing.encode(n)) for n in notes]
    return [
        found
        for rank, mine in enumerate(notes)
        for found in pairing.disagreements(rank, mine, {peer: theirs[peer] for peer in mine})
    ]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_parts_of_one_plan_tally_to_zero_and_no_pair_disagrees(case: tuple) -> None:
    batches = _batches(workers._plan(WORLD, case))
    assert sum(pairing.tally(b) for b in batches) % pairing.MODULUS == 0
    assert not _named(batches)


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_a_send_one_end_lacks_leaves_the_tally_and_both_ends_are_named(case: tuple) -> None:
    plan = workers._plan(WORLD, case)
    culprit = next((rank for rank in range(WORLD) if plan.for_rank(rank).sends), None)
    if culprit is None:
        pytest.skip("every transfer of this plan is a local copy")
    part = plan.for_rank(culprit)
    dropped = part.sends[0]
    batches = _batches(plan, {culprit: replace(part, sends=part.sends[1:])})
    assert sum(pairing.tally(b) for b in batches) % pairing.MODULUS != 0
    named = _named(batches)
    pair = {(culprit, dropped.dst), (dropped.dst, culprit)}  # a pair's two directions share its batches
    assert named and (culprit, dropped.dst) in {(d.sender, d.receiver) for d in named} <= pair, named
    said = next(d.said for d in named if d.sender == culprit)
    assert f"rank {culprit} sends" in said and f"rank {dropped.dst} expects" in said, said


def test_messages_alike_in_count_and_size_but_batched_apart_are_named_so() -> None:
    """One rank puts every message one batch later: its messages are the same, their batches are not."""
    plan = workers._plan(WORLD, workers.CASES_8[0])
    batches = _batches(plan)
    culprit = next(rank for rank in range(WORLD) if batches[rank])
    for batch in batches[culprit]:
        hop, superround, chunk = batch.key
        batch.key = (hop, superround, chunk + 1)
    assert sum(pairing.tally(b) for b in batches) % pairing.MODULUS != 0
    named = _named(batches)
    assert named and all(culprit in (d.sender, d.receiver) for d in named), named
    assert all("key or batch them apart" in d.said for d in named), named


def test_a_message_stays_short_whatever_the_number_of_pairs() -> None:
    found = [pairing.Disagreement(0, peer, "rank 0 sends 1 message of 16 B, rank 1 expects 0") for peer in range(1000)]
    text = pairing.shown(found)
    assert len(text) < 400 and text.endswith("and 997 more"), text


def test_a_note_survives_the_store() -> None:
    plan = workers._plan(WORLD, workers.CASES_8[1])
    for batches in _batches(plan):
        notes = pairing.note(batches)
        assert pairing.decode(pairing.encode(notes)) == notes
