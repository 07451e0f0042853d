"""How ranks appear in messages: one formatter, bounded whatever the number of ranks (shown_ranks)."""

from __future__ import annotations

from shardcore.plan.arguments import shown_ranks


def test_runs_of_three_or_more_are_ranges_and_the_count_follows() -> None:
    assert shown_ranks([3]) == "[3] (1 rank)"
    assert shown_ranks([1, 0]) == "[0, 1] (2 ranks)"
    assert shown_ranks([0, 1, 2, 4, 6, 7]) == "[0-2, 4, 6, 7] (6 ranks)"
    assert shown_ranks(range(8, 16)) == "[8-15] (8 ranks)"


def test_a_huge_scattered_set_stays_short() -> None:
    text = shown_ranks(range(0, 200_000, 2))
    assert text.endswith(", ...] (100000 ranks)") and len(text) < 120
