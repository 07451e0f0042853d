"""Rank functions for the fault tests: each returns (outcome, error type, message, elapsed seconds)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from shardcore import build_shards
from shardcore.engine.backends.shards import destroy_shards
from shardcore.errors import ShardcoreError

SPEC = "tp=2+tp=2"
OTHER_SPEC = "tp=4"
BALLAST = 300 << 20
"""What the rank ``held_then_killed`` kills holds first, in bytes."""


def _attempt(world: int, spec: str, timeout: float, **kwargs: Any) -> tuple[str, str, str, float]:
    started = time.monotonic()
    try:
        shards = build_shards(world, spec, timeout=timeout, **kwargs)
    except ShardcoreError as error:
        return "error", type(error).__name__, str(error), time.monotonic() - started
    elapsed = time.monotonic() - started
    destroy_shards(shards)
    return "ok", "", "", elapsed


def different_spec(rank: int, world: int, odd_rank: int, timeout: float) -> tuple[str, str, str, float]:
    """``odd_rank`` plans another layout than the rest."""
    import torch.distributed as dist

    outcome = _attempt(world, OTHER_SPEC if rank == odd_rank else SPEC, timeout)
    dist.barrier()  # rank 0 hosts the store: it must not exit while the others still read why
    return outcome


def never_calls(rank: int, world: int, absent: int, timeout: float, strategy: str) -> tuple[str, str, str, float]:
    """``absent`` runs other code (sleeps) instead of calling build_shards."""
    if rank == absent:
        time.sleep(timeout + 5)
        return "absent", "", "", 0.0
    return _attempt(world, SPEC, timeout, strategy=strategy)


def killed_in_creation(
    rank: int, world: int, victim: int, call: int, timeout: float, strategy: str
) -> tuple[str, str, str, float]:
    """``victim`` dies (os._exit) on its ``call``-th group creation, after the agreement."""
    if rank == victim:
        from shardcore.engine.groups import create as groups

        real, calls = groups._new_group, [0]

        def dying(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == call:
                os._exit(17)
            return real(*args, **kwargs)

        groups._new_group = dying  # type: ignore[assignment]
    return _attempt(world, SPEC, timeout, strategy=strategy)


def slow_in_creation(
    rank: int, world: int, slow: int, delay: float, timeout: float, strategy: str
) -> tuple[str, str, str, float]:
    """``slow`` sleeps ``delay`` seconds before its first group creation, longer than the timeout."""
    if rank == slow:
        from shardcore.engine.groups import create as groups

        real, calls = groups._new_group, [0]

        def sleepy(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                time.sleep(delay)
            return real(*args, **kwargs)

        groups._new_group = sleepy  # type: ignore[assignment]
    return _attempt(world, SPEC, timeout, strategy=strategy)


def build_destroy_cycles(rank: int, world: int, cycles: int, spec: str, strategy: str) -> dict[str, Any]:
    """Build and destroy ``spec`` ``cycles`` times; live groups, open fds and store keys before and after."""
    from torch.distributed import distributed_c10d

    from shardcore.engine.torch_state import live_group_count

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    store = distributed_c10d._get_default_store()
    shards = build_shards(world, spec, strategy=strategy, timeout=60)  # warm-up: shardcore's own store client
    destroy_shards(shards)
    before = {"groups": live_group_count(), "fds": fds(), "keys": store.num_keys()}
    for _ in range(cycles):
        shards = build_shards(world, spec, strategy=strategy, timeout=60)
        destroy_shards(shards)
    after = {"groups": live_group_count(), "fds": fds(), "keys": store.num_keys()}
    ours = sum(1 for key in store.list_keys() if key.startswith("shardcore/"))
    import torch.distributed as dist

    dist.barrier()  # rank 0 hosts the store: it must not exit while the others still read it
    return {"before": before, "after": after, "shardcore_keys": ours}


def held_then_killed(victim: int, on_stage: Callable[[str], None]) -> int:
    """A job of ``launch.run_local_job``: rank ``victim`` holds BALLAST bytes for a few of the parent's memory
    samples, then is killed by SIGKILL, as the kernel's out-of-memory killer kills; the others report at once."""
    import torch.distributed as dist

    from shardcore.engine.live.launch import SAMPLE_SECONDS

    rank = dist.get_rank()
    if rank == victim:
        ballast = b"\x01" * BALLAST  # written, so resident
        on_stage("holding")
        time.sleep(3 * SAMPLE_SECONDS)
        os.kill(os.getpid(), signal.SIGKILL)
        print(len(ballast))  # not reached: kept alive until the kill
    return rank
