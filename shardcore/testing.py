"""A real local gloo world for tests of shardcore and its plugins (spawned processes on 127.0.0.1).

``run_world(4, fn, arg)`` runs ``fn(rank, world_size, arg)`` on every rank after
``init_process_group("gloo")`` and returns the results in rank order. ``fn`` must be a
module-level function (it is pickled into spawned processes). A rank that raises, or a
world that outlives ``timeout``, fails the call with a message naming the ranks.
``backend=SHRINKABLE_GLOO`` starts the world on gloo that can shrink instead (a stand-in for
NCCL's communicator shrink, so that ``torch.distributed.shrink_group`` runs on CPU).
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .engine.live.ports import free_port
from .engine.live.shrinkable import SHRINKABLE_GLOO, register_shrinkable_gloo
from .engine.torch_state import import_torch
from .errors import WorldError


def _bootstrap(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    pg_timeout: float,
    backend: str,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch = import_torch()
    import torch.distributed as dist

    torch.set_num_threads(1)  # as torchrun does: many ranks share few cores, extra threads only contend
    if backend == SHRINKABLE_GLOO:
        register_shrinkable_gloo()
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 180.0,
    pg_timeout: float = 60.0,
    allow_failures: bool = False,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn`` on a fresh local gloo world; with ``allow_failures`` a failed rank yields its traceback
    and a dead one ``"died (exit code N)"``; ``backend``: ``gloo`` or ``SHRINKABLE_GLOO``."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [
        context.Process(
            target=_bootstrap, args=(r, world_size, port, fn, args, results, pg_timeout, backend), daemon=True
        )
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(set(range(world_size)) - set(outcome))
                raise WorldError(f"ranks {late} of a {world_size}-rank world did not finish within {timeout:g}s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode not in (None, 0)]
                if dead and not allow_failures:
                    raise WorldError(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})") from None
                outcome.update({r: (False, f"died (exit code {procs[r].exitcode})") for r in dead})
                continue
            outcome[rank] = (ok, value)
    finally:
        for proc in procs:
            proc.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
            if proc.is_alive():
                proc.kill()
                proc.join()
    failed = {rank: value for rank, (ok, value) in outcome.items() if not ok}
    if failed and not allow_failures:
        first = min(failed)
        raise WorldError(f"ranks {sorted(failed)} failed; rank {first}:\n{failed[first]}")
    return [outcome[rank][1] for rank in range(world_size)]


__all__ = ["SHRINKABLE_GLOO", "run_world"]
