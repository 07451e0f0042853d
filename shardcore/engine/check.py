"""The live side of ``shardcore check``: build a layout on a world, verify every group with a collective."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import GroupCreationError
from ..plan.layout import DEFAULT_ORDER


@dataclass
class RankReport:
    """What one rank saw: its shard, how many groups it verified, and anything wrong."""

    rank: int
    shard: int | None
    verified: int = 0
    build_seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


def _verify(shard: Any, rank: int, device: str) -> tuple[int, list[str]]:
    """All-gather global ranks over each distinct group; the result must equal the planned members."""
    import torch
    import torch.distributed as dist

    from ..plan.layout import distinct_groups

    verified, failures = 0, []
    for ranks, names in distinct_groups(shard.group_ranks):
        group = shard.groups.get(names[0])
        if group is None:
            failures.append(f"rank {rank}: group {'/'.join(names)} {list(ranks)} was not created")
            continue
        out = [torch.empty(1, dtype=torch.int64, device=device) for _ in ranks]
        dist.all_gather(out, torch.tensor([rank], dtype=torch.int64, device=device), group=group)
        seen = tuple(int(t.item()) for t in out)
        if seen != ranks:
            failures.append(f"rank {rank}: group {'/'.join(names)} gathered {list(seen)}, planned {list(ranks)}")
        verified += 1
    return verified, failures


def check_rank(options: dict[str, Any]) -> RankReport:
    """Run on one rank of an initialised world: build, verify, destroy, sync."""
    import torch.distributed as dist

    from .device import device_type
    from .shards import build_shards, destroy_shards, my_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cpu" if str(dist.get_backend()) == "gloo" else device_type()
    started = time.perf_counter()
    shards = build_shards(
        world,
        options["shards"],
        backend=options.get("backend"),
        order=options.get("order", DEFAULT_ORDER),
        allow_idle=options.get("allow_idle", False),
        strategy=options.get("strategy", "local"),
        timeout=options.get("timeout"),
    )
    mine = my_shard(shards)
    report = RankReport(rank, None if mine is None else mine.index, build_seconds=time.perf_counter() - started)
    try:
        if mine is not None:
            report.verified, report.failures = _verify(mine, rank, device)
    finally:
        destroy_shards(shards)
    dist.barrier()
    return report


def _init_from_env() -> None:
    import torch
    import torch.distributed as dist

    from .device import comm_backend, device_type

    device = device_type()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    elif device == "npu":
        torch.npu.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # type: ignore[attr-defined]  # registered by torch_npu
    dist.init_process_group(backend=os.environ.get("SHARDCORE_COMM_BACKEND") or comm_backend(device))


def local_worker(options: dict[str, Any]) -> dict[str, Any]:
    """Entry point of each process started by the local launcher (gloo on CPU)."""
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")
    try:
        return asdict(check_rank(options))
    finally:
        dist.destroy_process_group()


def _failure_text(message: Any) -> str:
    """The error line of a worker's failure record (a dict with 'message', or plain text)."""
    return str(message.get("message", message)) if isinstance(message, dict) else str(message)


def run_local(nproc: int, options: dict[str, Any], worker: Callable[[dict[str, Any]], Any] = local_worker) -> list[Any]:
    """Start ``nproc`` local gloo processes with torch's elastic launcher running ``worker`` (by default,
    the group check), and collect their reports (``RankReport``s for the group check, else what ``worker`` returned)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .ports import free_port

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"shardcore-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        results = elastic_launch(config, worker)(options)
    except ChildFailedError as error:
        messages = [f"rank {r}: {_failure_text(failure.message)}" for r, failure in sorted(error.failures.items())]
        raise GroupCreationError("shardcore check failed:\n" + "\n".join(messages)) from None
    if worker is not local_worker:
        return [results[rank] for rank in sorted(results)]
    return [RankReport(**results[rank]) for rank in sorted(results)]


def run_joined(options: dict[str, Any]) -> list[RankReport] | None:
    """Join the world torchrun set up (RANK, WORLD_SIZE); rank 0 gets every report, others None."""
    import torch.distributed as dist

    _init_from_env()
    try:
        report = asdict(check_rank(options))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, report)
        return [RankReport(**r) for r in gathered] if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


__all__ = ["RankReport", "check_rank", "local_worker", "run_joined", "run_local"]
