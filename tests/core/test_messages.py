"""How ranks and long texts appear in messages: bounded whatever the input (shown_ranks, shortened)."""

from __future__ import annotations

from shardcore.plan.arguments import shortened, shown_ranks


def test_runs_of_three_or_more_are_ranges_and_the_count_follows() -> None:
    assert shown_ranks([3]) == "[3] (1 rank)"
    assert shown_ranks([1, 0]) == "[0, 1] (2 ranks)"
    assert shown_ranks([0, 1, 2, 4, 6, 7]) == "[0-2, 4, 6, 7] (6 ranks)"
    assert shown_ranks(range(8, 16)) == "[8-15] (8 ranks)"


def test_a_huge_scattered_set_stays_short() -> None:
    text = shown_ranks(range(0, 200_000, 2))
    assert text.endswith(", ...] (100000 ranks)") and len(text) < 120


def test_a_long_text_is_shortened_at_whole_items_and_says_what_was_left_out() -> None:
    items = [f"destination tensor 'layer.{i}.weight' has shape [385, 64], expected [384, 64]" for i in range(40)]
    text = shortened("; ".join(items), 500)
    *whole, rest = text.split("; ")
    assert whole == items[: len(whole)] and rest == f"... ({len(items) - len(whole)} more left out)", text
    assert len(text) <= 500
    assert shortened("tensor a is missing; tensor b is missing; tensor c is missing", 50) == (
        "tensor a is missing; ... (2 more left out)"
    )
    assert shortened("short; enough", 500) == "short; enough"


def test_one_long_item_is_cut_at_a_space_and_anything_stays_short() -> None:
    words = " ".join(f"word{i}" for i in range(1000))
    text = shortened(words, 200)
    kept, _, said = text.partition(" ... (")
    assert words.startswith(kept + " ") and said == f"{len(words) - len(kept)} characters left out)", text
    assert len(text) <= 200
    for huge in ("x" * 10**6, "; " * 10**5, "a;" * 10**5):  # no space, no item, nothing but separators
        assert len(shortened(huge, 200)) <= 200
