"""Rank functions for the tests of ``shardcore.engine.KeptPlans``: a loop of calls, each rank's builds logged."""

from __future__ import annotations

from typing import Any

from shardcore.engine import KeptPlans, all_gather_objects


class OnPurpose(RuntimeError):
    """The build failure a test asks for."""


def loop(rank: int, world: int) -> dict[str, Any]:
    """Calls whose keys change on one rank, repeat, exceed the capacity, or whose build fails on one rank.

    Each build all-gathers every rank's key (a collective), so a rank that built alone would hang the test.
    """
    kept: KeptPlans[tuple[Any, ...]] = KeptPlans(capacity=2)
    built: list[str] = []

    def call(label: str, key: Any, fail_on: int | None = None) -> Any:
        def build() -> tuple[Any, ...]:
            everyone = all_gather_objects(key)
            if rank == fail_on:
                raise OnPurpose(f"rank {rank} fails its build on purpose")
            built.append(label)
            return tuple(everyone)

        try:
            return kept.get(key, build)
        except OnPurpose:
            return None

    plans = {
        "a": call("a", "model-a"),
        "a again": call("a again", "model-a"),
        "b on rank 1": call("b on rank 1", "model-b" if rank == 1 else "model-a"),
        "a after b": call("a after b", "model-a"),
        "c": call("c", ("model-c", 1)),
        "b evicted": call("b evicted", "model-b" if rank == 1 else "model-a"),
        "d, rank 0 fails": call("d, rank 0 fails", "model-d", fail_on=0),
        "d again": call("d again", "model-d"),
        "d kept": call("d kept", "model-d"),
    }
    return {"built": built, "plans": plans, "hits": kept.hits, "builds": kept.builds}
