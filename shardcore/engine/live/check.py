"""The live side of ``shardcore check``: build a layout on a world, verify every group with a collective.

The world comes from ``shardcore.engine.live.launch``: N local gloo processes, or the world
torchrun set up.

``prepare`` checks in the calling process what can be checked before any worker starts:
the timeout, the strategy, the backend (name, availability, options) and the layout against
the backend. It resolves the backend's name there (``--backend``, ``$SHARDCORE_BACKEND`` or the
default) and the workers build with that name; each worker resolves ``auto`` once, for the
world it joined (a default group bound to a device makes it ``world``), and builds with the
strategy it resolved, which ``build_shards`` takes as asked.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ...errors import GroupCreationError
from ...plan.arguments import as_timedelta
from ...plan.layout import DEFAULT_ORDER, Layout, plan_layout
from ..agreement import OPEN, Party, Purpose, arrive_failed, barrier
from ..collectives import collective_device
from ..torch_state import torch_import_seconds
from .launch import LIVE_CHECK_TIMEOUT, OnEvent, run_joined_job, run_local_job

CHECK = Purpose("check", "shardcore check's job (check_groups)", GroupCreationError)


@dataclass(frozen=True)
class CheckOptions:
    """What ``shardcore check`` builds: the arguments of ``build_shards``, picklable for workers."""

    shards: str
    backend: str | None = None
    order: str = DEFAULT_ORDER
    allow_idle: bool = False
    strategy: str = "auto"
    timeout: float = LIVE_CHECK_TIMEOUT
    """Seconds a rank waits for the others (joining, agreeing, creating a group)."""
    backend_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Prepared:
    """What the parent learned before starting anything: the layout and the backend actually used."""

    layout: Layout
    options: CheckOptions
    """The check's options with the backend's name resolved: what every rank runs (``check_groups``)."""
    backend_source: str
    """Where the name came from: ``--backend``, ``$SHARDCORE_BACKEND`` or ``default``."""

    @property
    def backend(self) -> str:
        """The backend's name."""
        return str(self.options.backend)


@dataclass
class RankReport:
    """What one rank saw: its shard, how many groups it verified, its times, and anything wrong."""

    rank: int
    shard: int | None
    verified: int = 0
    import_seconds: float = 0.0
    """Importing torch (the worker's ``import_torch``) and the backend's framework (``Backend.load_framework``),
    apart from group creation."""
    build_seconds: float = 0.0
    verify_seconds: float = 0.0
    strategy: str = ""
    """The strategy ``auto`` resolved to on this rank, and why."""
    failures: list[str] = field(default_factory=list)


def prepare(options: CheckOptions, world_size: int) -> Prepared:
    """Check everything that needs no other process, before any worker starts.

    Args:
        options: the check's arguments.
        world_size: ranks in the world to be checked.

    Returns:
        The planned layout, the options with the backend's name resolved, and where the name came from.

    Raises:
        ShardcoreError: a subclass naming the bad timeout, strategy, backend, option or layout.
    """
    from ..backends.plugins import BACKEND_ENV, get_backend
    from ..backends.shards import check_options
    from ..groups.strategy import check_strategy_early

    as_timedelta(options.timeout)
    check_strategy_early(options.strategy)
    backend = get_backend(options.backend)
    source = "--backend" if options.backend else f"${BACKEND_ENV}" if os.environ.get(BACKEND_ENV) else "default"
    check_options(backend, options.backend_options)
    layout = plan_layout(world_size, options.shards, order=options.order, allow_idle=options.allow_idle)
    backend.validate(layout, options.backend_options)
    return Prepared(layout, replace(options, backend=backend.name), source)


def _verify(shard: Any, rank: int, device: str) -> tuple[int, list[str]]:
    """All-gather global ranks over each distinct group; the result must equal the planned members."""
    import torch
    import torch.distributed as dist

    from ...plan.layout import distinct_groups

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


def check_groups(options: CheckOptions, on_stage: Callable[[str], None] = lambda stage: None) -> RankReport:
    """Run on one rank of an initialised world: import the framework, build, verify, destroy, meet.

    The last meeting (``engine.agreement``) makes every rank wait until all have verified, and names a
    rank that failed on the way instead of leaving the others in a barrier.

    Args:
        options: the check's arguments, the same on every rank (``Prepared.options``: the backend named).
        on_stage: called with ``imported`` (the backend's framework), ``built`` (its groups) and
            ``verified`` as each is done; the launcher adds ``started`` and ``joined`` before them.

    Returns:
        This rank's report.
    """
    import torch.distributed as dist

    from ..backends.plugins import get_backend
    from ..backends.shards import build_shards, destroy_shards, my_shard
    from ..groups.strategy import choose_strategy

    rank, world = dist.get_rank(), dist.get_world_size()
    backend = get_backend(options.backend)
    started = time.perf_counter()
    load = getattr(backend, "load_framework", None)
    if callable(load):
        load()
    imported = time.perf_counter()
    on_stage("imported")
    strategy, why = choose_strategy(options.strategy)  # once, for this world: build_shards takes it as asked
    shards = build_shards(
        world,
        options.shards,
        backend=backend.name,
        order=options.order,
        allow_idle=options.allow_idle,
        strategy=strategy,
        timeout=options.timeout,
        **options.backend_options,
    )
    built = time.perf_counter()
    on_stage("built")
    mine = my_shard(shards)
    report = RankReport(
        rank,
        None if mine is None else mine.index,
        import_seconds=torch_import_seconds() + imported - started,
        build_seconds=built - imported,
        strategy=f"{strategy}: {why}",
    )
    party, wait = Party.world(), as_timedelta(options.timeout)
    try:
        if mine is not None:
            report.verified, report.failures = _verify(mine, rank, collective_device())
    except BaseException as error:
        destroy_shards(shards)
        arrive_failed(party, CHECK, None, OPEN, error, wait)
        raise
    destroy_shards(shards)
    barrier(party, CHECK, wait, linger=True)
    report.verify_seconds = time.perf_counter() - built
    on_stage("verified")
    return report


def run_local(nproc: int, options: CheckOptions, on_event: OnEvent | None = None) -> list[RankReport]:
    """The check on ``nproc`` local gloo processes (see ``launch.run_local_job``), reports in rank order."""
    return run_local_job(nproc, check_groups, options, options.timeout, on_event)


def run_joined(options: CheckOptions, on_event: OnEvent | None = None) -> list[RankReport] | None:
    """The check on the world torchrun set up; rank 0 gets every report, the others None."""
    return run_joined_job(check_groups, options, on_event)


__all__ = ["CheckOptions", "Prepared", "RankReport", "check_groups", "prepare", "run_joined", "run_local"]
