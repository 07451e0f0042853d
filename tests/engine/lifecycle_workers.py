"""Rank functions for long-lived worlds: failed builds then good rebuilds, a frozen store host, soaks."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shardcore import build_shards
from shardcore.engine.backends import shards as shards_module
from shardcore.engine.backends.shards import Shard, destroy_shards, my_shard
from shardcore.engine.torch_state import default_store, group_keys
from shardcore.errors import BackendUnavailableError, GroupCreationError, ShardcoreError
from shardcore.plan.layout import distinct_groups

GOOD_SPEC = "tp=2+tp=2"
KINDS = ("bad_spec", "backend_import", "mismatch", "absent", "after_groups", "slow_group")


def verify(shards: list[Shard], rank: int) -> int:
    """All-gather global ranks over every distinct group of this rank; each must gather exactly its plan.

    Returns the number of groups verified; raises AssertionError naming the first wrong group.
    """
    import torch
    import torch.distributed as dist

    shard = my_shard(shards)
    if shard is None:
        return 0
    verified = 0
    for ranks, names in distinct_groups(shard.group_ranks):
        group = shard.groups[names[0]]
        assert group is not None, f"rank {rank}: group {names} {ranks} was not created"
        out = [torch.empty(1, dtype=torch.int64) for _ in ranks]
        dist.all_gather(out, torch.tensor([rank], dtype=torch.int64), group=group)
        seen = tuple(int(t.item()) for t in out)
        assert seen == ranks, f"rank {rank}: group {'/'.join(names)} gathered {seen}, planned {ranks}"
        total = torch.tensor([rank], dtype=torch.int64)
        dist.all_reduce(total, group=group)
        assert int(total.item()) == sum(ranks), f"rank {rank}: all_reduce over {names} gave {int(total.item())}"
        verified += 1
    return verified


@contextmanager
def _patched(name: str, replacement: Any) -> Iterator[None]:
    """Replace ``shards_module.<name>`` for one build on this rank only."""
    real = getattr(shards_module, name)
    setattr(shards_module, name, replacement(real))
    try:
        yield
    finally:
        setattr(shards_module, name, real)


def _failing_backend(real: Any) -> Any:
    def get_backend(name: str | None) -> Any:
        raise BackendUnavailableError("backend 'dtensor' failed to import: No module named 'torch.fake'")

    return get_backend


def _failing_after_groups(real: Any) -> Any:
    """Create every group (left in the build's ``created`` list, for it to destroy), then fail."""

    def create_groups(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise GroupCreationError("injected: failed after creating its groups")

    return create_groups


def _looking_late(hold: float, seen: dict[str, bool]) -> Any:
    """Create every group, wait ``hold`` seconds, then note whether rank 1's connect key of the tp group is still
    in the store: what a rank that is slow inside its own ``new_group`` (descheduled) would read then."""

    def wrap(real: Any) -> Any:
        def create_groups(*args: Any, **kwargs: Any) -> Any:
            ranks_by_name, groups = real(*args, **kwargs)
            time.sleep(hold)
            [own] = group_keys(groups["tp"])  # ".../<group rank>"; rank 1 is group rank 1 of [0, 1]
            seen["peer_key"] = bool(default_store().check([own.rpartition("/")[0] + "/1"]))
            return ranks_by_name, groups

        return create_groups

    return wrap


def slow_reader(rank: int, world: int, hold: float, timeout: float) -> dict[str, Any]:
    """Rank 1 fails after creating its groups while rank 0, slower, still creates its own (``_looking_late``):
    every rank's error, when, and (rank 0) whether rank 1's connect key outlived rank 1's failure."""
    import torch.distributed as dist

    seen: dict[str, bool] = {}
    patch = {0: _looking_late(hold, seen), 1: _failing_after_groups}.get(rank)
    started = time.monotonic()
    try:
        if patch is not None:
            with _patched("create_groups", patch):
                destroy_shards(build_shards(world, GOOD_SPEC, timeout=timeout, strategy="local"))
        else:
            destroy_shards(build_shards(world, GOOD_SPEC, timeout=timeout, strategy="local"))
        failure = "built"
    except ShardcoreError as error:
        failure = type(error).__name__
    failed_in = time.monotonic() - started
    dist.barrier()  # rank 0 hosts the store: it must not exit while the others still read why the build failed
    return {"failure": failure, "failed_in": failed_in, **seen}


def _slow_groups(delay: float) -> Any:
    def wrap(real: Any) -> Any:
        def create_groups(*args: Any, **kwargs: Any) -> Any:
            time.sleep(delay)
            return real(*args, **kwargs)

        return create_groups

    return wrap


def failed_attempt(
    rank: int, world: int, kind: str, victim: int, timeout: float, strategy: str, spec: str, other: str
) -> str:
    """One build of ``spec`` that fails in the way ``kind`` says on ``victim`` (``mismatch``: it builds
    ``other``); returns the error type this rank raised."""
    if rank == victim and kind == "bad_spec":
        spec = "tp=3,dp=0"
    if rank == victim and kind == "mismatch":
        spec = other
    if rank == victim and kind == "absent":
        time.sleep(timeout + 2)  # runs other code instead of building
        return "absent"
    patch: Any = None
    if rank == victim:
        patch = {
            "backend_import": _failing_backend,
            "after_groups": _failing_after_groups,
            "slow_group": _slow_groups(timeout + 2),
        }.get(kind)
    try:
        if patch is not None:
            with _patched("get_backend" if kind == "backend_import" else "create_groups", patch):
                shards = build_shards(world, spec, timeout=timeout, strategy=strategy)
        else:
            shards = build_shards(world, spec, timeout=timeout, strategy=strategy)
    except ShardcoreError as error:
        return type(error).__name__
    destroy_shards(shards)
    return "built"


def fail_then_rebuild(rank: int, world: int, kinds: list[str], timeout: float, strategy: str) -> list[dict[str, Any]]:
    """For each failure kind: a failed build, then a good identical rebuild verified by collectives, destroyed."""
    out = []
    for step, kind in enumerate(kinds):
        victim = 1 + step % (world - 1) if kind != "absent" else world - 1
        started = time.monotonic()
        failure = failed_attempt(rank, world, kind, victim, timeout, strategy, GOOD_SPEC, "tp=4")
        failed_in = time.monotonic() - started
        shards = build_shards(world, GOOD_SPEC, timeout=120, strategy=strategy)
        verified = verify(shards, rank)
        destroy_shards(shards)
        out.append({"kind": kind, "victim": victim, "failure": failure, "failed_in": failed_in, "verified": verified})
    return out


def three_way(rank: int, world: int, specs: list[str], timeout: float) -> tuple[str, str]:
    """Each rank builds ``specs[rank]``; returns (error type, message)."""
    return _attempt(world, specs[rank], timeout)


def frozen_store_host(rank: int, world: int, timeout: float, resume_after: float) -> tuple[str, str, float]:
    """Rank 0 (the store's host) stops itself (SIGSTOP) as the others start the agreement; a child process
    resumes it after ``resume_after`` seconds so the test ends cleanly. Returns (error type, message, elapsed)."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        resume = f"import os, time; time.sleep({resume_after}); os.kill({os.getpid()}, {int(signal.SIGCONT)})"
        subprocess.Popen([sys.executable, "-c", resume])
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        time.sleep(0.5)  # rank 0 is stopped by now
    started = time.monotonic()
    try:
        shards = build_shards(world, GOOD_SPEC, timeout=timeout)
    except ShardcoreError as error:
        return type(error).__name__, str(error), time.monotonic() - started
    destroy_shards(shards)
    return "built", "", time.monotonic() - started


def store_keys() -> int:
    return int(default_store().num_keys())


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def soak(rank: int, world: int, cycles: int, layouts: list[str], fail_every: int, seed: int) -> dict[str, Any]:
    """``cycles`` of: build one of ``layouts``, verify every group by collectives, destroy; now and then a
    random rank fails a build (a bad spec, a mismatch, or a failure after its groups) before the good one.

    Every rank draws the same random numbers (same seed), so all agree on the cycle's layout and victim.
    """
    import torch.distributed as dist

    from shardcore.engine.torch_state import live_group_count

    draw = random.Random(seed)
    shards = build_shards(world, layouts[0], timeout=120)  # warm-up: shardcore's store client and the epoch key
    destroy_shards(shards)
    dist.barrier()
    before = {"groups": live_group_count(), "fds": open_fds(), "keys": store_keys()}
    started, verified, failures = time.monotonic(), 0, {}
    for _ in range(cycles):
        layout = draw.choice(layouts)
        if draw.randrange(fail_every) == 0:
            kind, victim = draw.choice(["bad_spec", "mismatch", "after_groups"]), draw.randrange(world)
            other = layouts[(layouts.index(layout) + 1) % len(layouts)]
            failure = failed_attempt(rank, world, kind, victim, 120, "local", layout, other)
            failures[kind] = failures.get(kind, 0) + 1
            assert failure != "built", f"rank {rank}: the {kind} build on rank {victim} did not fail"
        shards = build_shards(world, layout, timeout=120)
        verified += verify(shards, rank)
        destroy_shards(shards)
    elapsed = time.monotonic() - started
    dist.barrier()
    after = {"groups": live_group_count(), "fds": open_fds(), "keys": store_keys()}
    dist.barrier()  # rank 0 hosts the store: it must not exit while the others still read it
    return {"before": before, "after": after, "verified": verified, "failures": failures, "seconds": elapsed}


def strategies(rank: int, world: int, chosen: list[str], timeout: float) -> tuple[str, str]:
    """Each rank builds the same spec with ``chosen[rank]`` as strategy; returns (error type, message)."""
    return _attempt(world, GOOD_SPEC, timeout, strategy=chosen[rank])


def _attempt(world: int, spec: str, timeout: float, **kwargs: Any) -> tuple[str, str]:
    """One build; (error type, message), or ("built", ""). Ends with a barrier: rank 0 hosts the store, and
    must not exit while the others still read why the build failed."""
    import torch.distributed as dist

    try:
        shards = build_shards(world, spec, timeout=timeout, **kwargs)
        destroy_shards(shards)
        outcome = "built", ""
    except ShardcoreError as error:
        outcome = type(error).__name__, str(error)
    dist.barrier()
    return outcome
