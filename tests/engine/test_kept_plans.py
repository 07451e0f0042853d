"""``shardcore.engine.KeptPlans`` on a live gloo world: a kept plan serves a call only where every rank brings
the key it was made under, and the decision is the world's, so no rank plans alone."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from shardcore.errors import RefitInputError
from shardcore.testing import run_world
from tests.engine import kept_plans_workers as workers


def test_plans_are_kept_per_world_key_and_rebuilt_together() -> None:
    results = run_world(3, workers.loop)
    # capacity 2: "c" pushed out b's plan (used least recently), "b evicted" then a's; rank 0's build of d
    # failed while ranks 1 and 2 kept theirs, so at the next call the kept sets differ and every rank plans d
    # again, the call after that keeps it everywhere
    built = ["a", "b on rank 1", "c", "b evicted", "d, rank 0 fails", "d again"]
    assert [r["built"] for r in results] == [[label for label in built if label != "d, rank 0 fails"], built, built]
    assert [(r["builds"], r["hits"]) for r in results] == [(5, 3), (6, 3), (6, 3)]
    for result in results:
        plans = result["plans"]
        assert plans["a"] == plans["a again"] == plans["a after b"] == ("model-a",) * 3
        assert plans["b on rank 1"] == plans["b evicted"] == ("model-a", "model-b", "model-a")
        assert plans["d again"] == plans["d kept"] == ("model-d",) * 3
    assert results[0]["plans"]["d, rank 0 fails"] is None


def test_a_capacity_below_one_is_refused() -> None:
    from shardcore.engine import KeptPlans

    for capacity in (0, -1, True, 1.5, "x" * 10_000, -(10**5000)):
        with pytest.raises(RefitInputError, match="capacity must be a positive int") as caught:
            KeptPlans(capacity)  # type: ignore[arg-type]
        assert len(str(caught.value)) < 200  # short whatever the input
