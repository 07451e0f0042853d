"""``shardcore replan --check``: an elastic restore on local processes, verified bitwise.

Every rank of the old world builds the old layout and fills its local tensors from the known global
tensors (``refit_check.known_tensor``), and the world meets once more: every rank holds its weights.
The ranks the option leaves out (lost, and released) then end their processes at once (SIGKILL: no
goodbye, their memory gone). The survivors form their world (``form_survivor_world``), build the new
layout, plan the restore (``shardcore.replan.restore_plan``) and execute it from their old tensors;
every rank of the new layout then compares its tensors, bitwise, with its new slices of the global
tensors: the restored ones, and the old ones where its weights did not change.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from math import prod
from typing import TYPE_CHECKING

from ...errors import GroupCreationError
from ...refit.holdings import holds, local_shape_on
from ...refit.manifest import ITEMSIZES
from ...refit.options import ExecuteOptions
from ...replan import ReplanOption, ReplanRequest, restore_plan
from ..agreement import Party, Purpose, barrier
from ..backends.shards import build_shards, destroy_shards
from ..survivors import form_survivor_world
from ..transfer.execute import execute_refit
from .launch import LEAVING, LIVE_CHECK_TIMEOUT, OnEvent, OnHeld, run_local_job
from .refit_check import cut, known_tensor
from .shrinkable import SHRINKABLE_GLOO

if TYPE_CHECKING:
    import torch

    from ...plan.layout import ShardPlan
    from ...refit.manifest import Manifest
    from ...refit.part import RankRefit
    from ...replan import Renumbering
    from ..survivors import SurvivorWorld
    from ..transfer.execute import TransferStats

LOADED = Purpose("restore check", "the restore check's job", GroupCreationError)
PHASES = ("old build", "form", "build", "plan", "restore")
"""What a survivor times, in order."""


@dataclass(frozen=True)
class RestoreCheckOptions:
    """What ``shardcore replan --check`` runs, picklable for workers: the replan (its option planned once in the
    parent, again from the same request on every rank) and the world's knobs."""

    request: ReplanRequest
    option: int = 1
    """Which option of the replan (1: the best)."""
    backend: str | None = None
    """The shardcore backend that builds both layouts."""
    shrink: bool = False
    """Start the world on gloo that can shrink (``SHRINKABLE_GLOO``), so the survivors shrink it."""
    rendezvous_port: int = 0
    """Where the lowest survivor hosts the new store if rank 0 (the store's host) is among the gone."""
    execute: ExecuteOptions = field(default_factory=lambda: ExecuteOptions(timeout=LIVE_CHECK_TIMEOUT))
    """The restore's knobs; its timeout bounds every step: the builds, forming the world, the restore."""

    @property
    def timeout(self) -> float:
        """The executor's timeout in seconds: every step's."""
        return self.execute.wait.total_seconds()


@dataclass
class RestoreReport:
    """What one survivor saw: its old and new rank, the world formed, its times, bytes and mismatches."""

    old_rank: int
    rank: int
    shard: int | None
    """Its shard in the new layout (None: idle)."""
    restored: bool
    """It received weights (else it kept its tensors)."""
    how: str = ""
    store: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    bytes_received: int = 0
    bytes_copied: int = 0
    bytes_sent: int = 0
    checked: int = 0
    mismatches: list[str] = field(default_factory=list)


def choose_option(options: RestoreCheckOptions) -> ReplanOption:
    """The option the check runs, its restore planned once, so that bad input fails in the parent.

    Raises:
        ShardcoreError: a bad spec, loss or model; ``LayoutError`` for an option number out of range;
            ``LostWeightsError`` when a part of a tensor has no surviving copy.
    """
    return options.request.option(options.option)


def check_held_bytes(option: ReplanOption, rank: int, bucket_bytes: int) -> int:
    """About the most old rank ``rank`` holds during ``restore_check_job``, beyond the interpreter and torch: so
    that ``replan --check`` refuses, before any process starts, what the machine cannot hold (no torch needed).

    It counts its old local tensors, its new ones twice (restored into, and drawn again to compare), the
    largest global tensor while it is drawn (in float32, then in its dtype), and a bucket each way of staging.
    """
    manifest = option.manifest

    def local(plan: ShardPlan | None, rank: int) -> int:
        if plan is None:
            return 0
        held = (tensor for tensor in manifest if holds(tensor, plan, rank, manifest))
        return sum(prod(local_shape_on(tensor, plan)) * tensor.itemsize for tensor in held)

    new = option.renumbering.new_of(rank)
    drawn = max((tensor.numel * (ITEMSIZES["float32"] + tensor.itemsize) for tensor in manifest), default=0)
    kept = 0 if new is None else 2 * local(option.layout.shard_of(new), new) + 2 * bucket_bytes
    return local(option.old.shard_of(rank), rank) + drawn + kept


def _weights(manifest: Manifest, plan: ShardPlan | None, rank: int) -> dict[str, torch.Tensor]:
    """``rank``'s local tensors under ``plan``, cut from the known global tensors (none when idle)."""
    if plan is None:
        return {}
    return {
        tensor.name: cut(known_tensor(tensor, position), tensor, plan, rank, manifest)
        for position, tensor in enumerate(manifest.tensors)
        if holds(tensor, plan, rank, manifest)
    }


def _compare(
    manifest: Manifest, plan: ShardPlan | None, rank: int, held: dict[str, torch.Tensor]
) -> tuple[int, list[str]]:
    """(tensors compared, what differs), bitwise, between ``held`` and ``rank``'s tensors under ``plan``."""
    import torch

    expected = _weights(manifest, plan, rank)
    problems = [f"rank {rank}: {name} is missing" for name in sorted(set(expected) - set(held))]
    for name, tensor in expected.items():
        got = held.get(name)
        if got is not None and not torch.equal(_bits(got), _bits(tensor)):
            problems.append(f"rank {rank}: {name} differs from its slice of the global tensor")
    return len(expected), problems


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8)


class _Laps:
    """Each phase's seconds since the one before (the report's ``seconds``), telling ``on_stage`` as each ends."""

    def __init__(self, on_stage: Callable[[str], None]) -> None:
        self.on_stage = on_stage
        self.seconds: dict[str, float] = {}
        self.clock = time.monotonic()

    def __call__(self, phase: str) -> None:
        now = time.monotonic()
        self.seconds[phase], self.clock = now - self.clock, now
        self.on_stage(phase)


def restore_check_job(options: RestoreCheckOptions, on_stage: Callable[[str], None] = lambda stage: None) -> object:
    """One rank of the old world: build, fill, lose the gone ranks, re-form, build, restore, compare."""
    import torch.distributed as dist

    rank, wait = dist.get_rank(), options.execute.wait
    option = choose_option(options)
    old, manifest, numbering = option.old, option.manifest, option.renumbering
    lap = _Laps(on_stage)
    shards = build_shards(old.world_size, old, backend=options.backend, timeout=wait)
    sources = _weights(manifest, old.shard_of(rank), rank)
    _meet_loaded(numbering, rank, wait)
    lap("old build")
    if numbering.is_gone(rank):
        on_stage(LEAVING)
        os.kill(os.getpid(), signal.SIGKILL)
    world = form_survivor_world(
        numbering.gone, shards=shards, rendezvous=("127.0.0.1", options.rendezvous_port), timeout=wait
    )
    lap("form")
    built = build_shards(option.layout.world_size, option.layout, backend=options.backend, timeout=wait)
    lap("build")
    plan = restore_plan(option)
    mine = plan.for_rank(world.rank)
    lap("plan")
    destinations = _unwritten(manifest, mine)
    stats = execute_refit(plan, sources, destinations, options=options.execute)
    lap("restore")
    held = destinations if mine.destination_shapes else sources
    report = _survivor_report(option, rank, world, bool(mine.destination_shapes), stats, lap.seconds)
    report.checked, report.mismatches = _compare(manifest, option.layout.shard_of(world.rank), world.rank, held)
    destroy_shards(built)
    return report


def _meet_loaded(numbering: Renumbering, rank: int, wait: timedelta) -> None:
    """Meet the whole old world once every rank holds its weights, so that no rank leaves before all
    have loaded; a survivor goes on when rank 0 left first."""
    try:
        barrier(Party.world(), LOADED, wait, linger=True)
    except GroupCreationError:
        if numbering.is_gone(rank) or not numbering.is_gone(0):
            raise
        # rank 0, the store's host, lingered (a moment) and left: a survivor that had not yet read that
        # every rank arrived loses the store, as after any failure, and goes on to form its world


def _unwritten(manifest: Manifest, mine: RankRefit) -> dict[str, torch.Tensor]:
    """The rank's destination tensors, filled with -1 so that a piece the restore misses shows as a mismatch."""
    import torch

    return {
        name: torch.full(shape, -1.0).to(getattr(torch, manifest.tensor(name).dtype))
        for name, shape in mine.destination_shapes.items()
    }


def _survivor_report(
    option: ReplanOption,
    old_rank: int,
    world: SurvivorWorld,
    restored: bool,
    stats: TransferStats,
    seconds: dict[str, float],
) -> RestoreReport:
    """A survivor's report before the comparison: its ranks, new shard, world formed, times and bytes."""
    target = option.layout.shard_of(world.rank)
    report = RestoreReport(old_rank, world.rank, None if target is None else target.index, restored)
    report.how, report.store, report.seconds = world.how, world.store, seconds
    report.bytes_received, report.bytes_copied, report.bytes_sent = (
        stats.bytes_received,
        stats.bytes_copied,
        stats.bytes_sent,
    )
    return report


def run_local(
    options: RestoreCheckOptions, on_event: OnEvent | None = None, on_held: OnHeld | None = None
) -> list[RestoreReport]:
    """The check on one local process per old rank; the survivors' reports, in old rank order (``on_held``: each
    running rank's resident bytes, every ``launch.SAMPLE_SECONDS``)."""
    backend = SHRINKABLE_GLOO if options.shrink else "gloo"
    world, timeout = options.request.world, options.timeout
    reports = run_local_job(world, restore_check_job, options, timeout, on_event, backend, on_held)
    return [report for report in reports if report is not None]


__all__ = [
    "PHASES",
    "RestoreCheckOptions",
    "RestoreReport",
    "check_held_bytes",
    "choose_option",
    "restore_check_job",
    "run_local",
]
