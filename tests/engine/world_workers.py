"""Rank functions for the tests of ``shardcore.testing.run_world`` itself: what a kept world's processes do."""

from __future__ import annotations

import os
import time

from shardcore.engine.transfer import exchange


def pid(rank: int, world: int) -> tuple[int, int, bool]:
    """This rank's process id, the world size torch sees, and whether the exchange is shardcore's own."""
    import torch.distributed as dist

    dist.barrier()  # no rank leaves (ending the store on rank 0) before every rank has joined
    return os.getpid(), dist.get_world_size(), exchange.Exchange.staging_bytes.__module__ == exchange.__name__


def fails_on(rank: int, world: int, culprit: int, how: str) -> int:
    """``culprit`` raises, hangs, dies or patches the exchange and leaves it so; the others return their pid."""
    import torch.distributed as dist

    dist.barrier()
    if rank == culprit:
        if how == "raises":
            raise RuntimeError(f"rank {rank} raises on purpose")
        if how == "hangs":
            time.sleep(3600)
        if how == "dies":
            os._exit(17)
        if how == "patches":
            exchange.Exchange.staging_bytes = lambda self: 0  # type: ignore[method-assign]
    return os.getpid()


def sets_a_variable(rank: int, world: int) -> str | None:
    """Set an environment variable, as a test of torch's TORCH_DIST_INIT_BARRIER does; what it was before."""
    before = os.environ.get("SHARDCORE_TEST_LEFT_BEHIND")
    os.environ["SHARDCORE_TEST_LEFT_BEHIND"] = "1"
    return before
