"""``shardcore refit --check``: execute a refit plan on a live world and compare every destination byte.

Every source rank fills its local shards from known global tensors (seeded per tensor, so
every rank computes the same ones without talking), the plan is executed, and every
destination rank compares what it received, bitwise, with the slice of the same global
tensors it must hold: converted as the manifest says (``reference``: the global tensor cast, or
quantized to fp8 with the scales of the global tensor, which are checked too). Tests use the same
pieces (``known_tensor``, ``cut``, ``reference``, ``check_refit``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from math import prod
from typing import TYPE_CHECKING, Any

from ...plan.layout import ShardPlan
from ...refit.options import ExecuteOptions
from ...refit.request import RefitRequest
from .launch import LIVE_CHECK_TIMEOUT, OnEvent, OnHeld, run_joined_job, run_local_job
from .layout_check import through_map

if TYPE_CHECKING:
    import torch

    from ...refit.manifest import Manifest, TensorSpec


@dataclass
class RefitReport:
    """What one rank saw: its destination shard (None if it has none), bytes, seconds, mismatches.

    The bytes and seconds are the last refit's; ``laps`` holds every refit's (a delta check's dense refit, then
    its delta refits) as (bytes received, bytes copied, wire bytes received, seconds)."""

    rank: int
    shard: int | None
    bytes_received: int = 0
    bytes_copied: int = 0
    bytes_sent: int = 0
    wire_bytes_received: int = 0
    seconds: float = 0.0
    checked: int = 0
    mismatches: list[str] = field(default_factory=list)
    laps: list[tuple[int, int, int, float]] = field(default_factory=list)


def known_tensor(tensor: TensorSpec, position: int) -> torch.Tensor:
    """The global tensor every rank agrees on: normal values seeded by the tensor's position."""
    import torch

    generator = torch.Generator().manual_seed(7919 + position)
    return torch.randn(tensor.shape, generator=generator).to(getattr(torch, tensor.dtype))


def changed_step(values: torch.Tensor, position: int, step: int, fraction: float) -> torch.Tensor:
    """``values`` after one step of a simulated optimizer: about ``fraction`` of its elements (chosen by a
    generator seeded by the tensor's position and the step, alike on every rank) move by up to half their
    magnitude, enough to change them in any float dtype; the others keep their bits."""
    import torch

    if fraction <= 0:
        return values
    generator = torch.Generator().manual_seed(104729 * (step + 1) + position)
    chosen = torch.rand(values.shape, generator=generator) < fraction
    update = torch.randn(values.shape, generator=generator)
    moved = values.float() * (1 + 0.5 * update.clamp(-1, 1)) + 0.01 * update.sign()
    return torch.where(chosen, moved.to(values.dtype), values)


class KnownWeights:
    """The global tensors every rank agrees on (``known_tensor``), after the steps of a simulated optimizer
    every rank applies alike (``changed_step``): what a delta refit's sources hold step after step. A tensor is
    made when first asked for, with every step so far."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.steps: list[float] = []
        self._made: dict[str, torch.Tensor] = {}

    def full(self, name: str) -> torch.Tensor:
        """Tensor ``name`` now."""
        if name not in self._made:
            spec, position = self.manifest.tensor(name), self.manifest.index(name)
            values = known_tensor(spec, position)
            for step, fraction in enumerate(self.steps):
                values = changed_step(values, position, step, fraction)
            self._made[name] = values
        return self._made[name]

    def step(self, fraction: float) -> None:
        """One optimizer step changing about ``fraction`` of every tensor's elements."""
        for name, values in self._made.items():
            self._made[name] = changed_step(values, self.manifest.index(name), len(self.steps), fraction)
        self.steps.append(fraction)


def cut(full: torch.Tensor, tensor: TensorSpec, plan: ShardPlan, rank: int, manifest: Manifest) -> torch.Tensor:
    """``rank``'s local shard of ``full`` under ``plan`` (each held box copied to its local offset)."""
    import torch

    from ...refit.holdings import holdings, local_shape_on

    local = torch.empty(local_shape_on(tensor, plan), dtype=full.dtype)
    for box, offset in holdings(tensor, plan, rank, manifest):
        target = tuple(slice(o, o + stop - start) for o, (start, stop) in zip(offset, box))
        local[target] = full[tuple(slice(start, stop) for start, stop in box)]
    return local


def reference(manifest: Manifest, name: str, full: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """What a destination of a converting refit must hold of tensor ``name``, as a global tensor: the source's
    global tensor (``full(name)``) cast to the destination dtype, or quantized to float8_e4m3fn with the
    scales of the global tensor; for a scale tensor, those scales."""
    import torch

    from ..transfer.convert import amax_of, block_amax, quantize, scale_inv_of

    spec = manifest.tensor(name)
    weight = manifest.tensor(spec.scale_of) if spec.scale_of is not None else spec
    if weight.scale is None:
        return full(name).to(getattr(torch, spec.destination_dtype))
    values = full(weight.name)
    scale_inv = scale_inv_of(amax_of(values) if weight.scale == "tensor" else block_amax(values))
    return scale_inv if spec.scale_of is not None else quantize(values, scale_inv, (0,) * values.dim())


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, on the CPU where the references are made (a GPU destination's are copied there)."""
    import torch

    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def check_refit(plan: Any, rank: int, *, changes: Sequence[float] = (), **execute_options: Any) -> RefitReport:
    """Fill this rank's sources, execute ``plan`` (with ``execute_options`` for ``execute_refit``), and compare
    its destinations bitwise with the slices of the same known global tensors.

    The sources and destinations lie where the default group moves tensors (``collective_device``: a GPU
    under NCCL, so ``refit --check`` under torchrun checks the GPU path); the known tensors and the
    references are made on the CPU, the same on every rank whatever its device.

    With ``changes``, one more refit follows per entry, each after a simulated optimizer step that changes
    about that fraction of the elements (``KnownWeights``), at the next version: what a delta refit checks.
    The report counts every refit's mismatches and the last refit's bytes and time.
    """
    import torch
    import torch.distributed as dist

    from ..device import collective_device
    from ..transfer.execute import execute_refit

    manifest = plan.manifest
    mine = plan.for_rank(rank)
    target_plan = next((p for p in plan.destinations if rank in p), None)
    weights = KnownWeights(manifest)
    device = collective_device(dist.get_backend())
    sources = {
        name: cut(weights.full(name), manifest.tensor(name), plan.source, rank, manifest).to(device)
        for name in mine.source_shapes
    }
    destinations = {
        name: torch.full(
            shape, -1.0, dtype=getattr(torch, plan.destination_tensor(name).destination_dtype), device=device
        )
        for name, shape in mine.destination_shapes.items()
    }
    mapped = through_map(plan, rank)
    options = ExecuteOptions.merged(execute_options.pop("options", None), **execute_options)  # once, for every refit
    report = RefitReport(rank, None if target_plan is None else target_plan.index)
    for refit, fraction in enumerate([None, *changes]):
        if fraction is not None:
            weights.step(fraction)
            for name, local in sources.items():
                local.copy_(cut(weights.full(name), manifest.tensor(name), plan.source, rank, manifest))
        if refit and options.version is not None:  # each refit after the first at the next version
            options = replace(options, version=options.version + 1)
        stats = execute_refit(plan, sources, destinations, options=options)
        report.bytes_received, report.bytes_copied, report.bytes_sent = (
            stats.bytes_received,
            stats.bytes_copied,
            stats.bytes_sent,
        )
        report.wire_bytes_received, report.seconds = stats.wire_bytes_received, stats.seconds
        report.laps.append((stats.bytes_received, stats.bytes_copied, stats.wire_bytes_received, stats.seconds))
        at = f" after refit {refit + 1}" if changes else ""
        report.mismatches += [f"{text}{at}" for text in mismatches(plan, rank, destinations, weights, mapped)]
        report.checked += len(destinations)
    return report


def mismatches(
    plan: Any, rank: int, destinations: dict[str, torch.Tensor], weights: KnownWeights, mapped: Any
) -> list[str]:
    """This rank's destinations that differ, bitwise, from the known global tensors' slices (converted, or put
    through the weight map, as the plan says)."""
    import torch

    manifest = plan.manifest
    target_plan = next((p for p in plan.destinations if rank in p), None)
    found = []
    for name, got in destinations.items():
        if mapped is not None:  # another layout: the source's tensors put through the weight map
            if not torch.equal(_bits(got), _bits(mapped(name, weights.full))):
                found.append(f"rank {rank}: {name} differs from the source's tensors through the map")
            continue
        spec = manifest.tensor(name)
        wanted = reference(manifest, name, weights.full) if manifest.converts else weights.full(name)
        expected = cut(wanted, spec, target_plan, rank, manifest)  # type: ignore[arg-type]
        if not torch.equal(_bits(got), _bits(expected)):
            what = "global tensor" if spec.to_dtype is None and spec.scale_of is None else "converted global tensor"
            found.append(f"rank {rank}: {name} differs from the source's {what}")
    return found


def check_held_bytes(plan: Any, rank: int, bucket_bytes: int) -> int:
    """About the most ``rank`` holds during ``check_refit`` of ``plan``, beyond the interpreter and torch: so
    that ``refit --check`` refuses, before any process starts, what the machine cannot hold (no torch needed).

    It counts the known global tensors the rank makes whole and keeps (``KnownWeights``: every source tensor it
    sends from or checks a destination against, in its dtype), the largest of them once more in float32 (drawn
    before the cast), its local sources and destinations, and the executor's staging (a bucket each way).
    """
    from ...refit.manifest import ITEMSIZES
    from ...refit.weightmap import MappedPlacement

    manifest, mine = plan.manifest, plan.for_rank(rank)
    placement = plan.destination_placement_of(rank)
    if isinstance(placement, MappedPlacement):  # an engine's tensor is checked against the tensors feeding it
        checked = {link.source for name in mine.destination_shapes for link in placement.weights.into(name)}
    else:  # a scale tensor is checked through the weight it scales
        checked = {manifest.tensor(name).scale_of or name for name in mine.destination_shapes}
    wanted = checked | set(mine.source_shapes)
    known = [tensor for tensor in manifest if tensor.name in wanted]
    drawn = max((tensor.numel * ITEMSIZES["float32"] for tensor in known), default=0)
    sources = sum(prod(shape) * manifest.tensor(name).itemsize for name, shape in mine.source_shapes.items())
    destinations = sum(
        prod(shape) * ITEMSIZES[plan.destination_tensor(name).destination_dtype]
        for name, shape in mine.destination_shapes.items()
    )
    staging = 2 * bucket_bytes if mine.source_shapes or mine.destination_shapes else 0
    return sum(tensor.nbytes for tensor in known) + drawn + sources + destinations + staging


@dataclass(frozen=True)
class RefitCheckOptions:
    """What ``shardcore refit --check`` runs, picklable for workers: the refit (planned once in the parent,
    again from the same request on every rank) and the executor's knobs, both checked when made."""

    request: RefitRequest
    execute: ExecuteOptions = field(default_factory=lambda: ExecuteOptions(timeout=LIVE_CHECK_TIMEOUT))
    """Its timeout is also how long a rank waits for the others to join the world."""
    changes: tuple[float, ...] = ()
    """One more refit per entry, after an optimizer step changing that fraction of the elements (``check_refit``):
    what a delta refit checks."""

    @property
    def timeout(self) -> float:
        """The executor's timeout in seconds: the world's timeout too."""
        return self.execute.wait.total_seconds()


def refit_check_job(options: RefitCheckOptions, on_stage: Callable[[str], None] = lambda stage: None) -> RefitReport:
    """One rank of an initialised world: plan, fill, execute, compare; the job of ``refit --check``."""
    import torch.distributed as dist

    plan = options.request.plan(dist.get_world_size())
    on_stage("planned")
    report = check_refit(plan, dist.get_rank(), changes=options.changes, options=options.execute)
    on_stage("executed")
    return report


def run_local(
    nproc: int, options: RefitCheckOptions, on_event: OnEvent | None = None, on_held: OnHeld | None = None
) -> list[RefitReport]:
    """``refit --check`` on ``nproc`` local gloo processes, reports in rank order (``on_held``: each running
    rank's resident bytes, every ``launch.SAMPLE_SECONDS``)."""
    return run_local_job(nproc, refit_check_job, options, options.timeout, on_event, on_held=on_held)


def run_joined(options: RefitCheckOptions, on_event: OnEvent | None = None) -> list[RefitReport] | None:
    """``refit --check`` on the world torchrun set up; rank 0 gets every report, the others None."""
    return run_joined_job(refit_check_job, options, on_event)


__all__ = [
    "KnownWeights",
    "RefitCheckOptions",
    "RefitReport",
    "changed_step",
    "check_held_bytes",
    "check_refit",
    "cut",
    "known_tensor",
    "mismatches",
    "reference",
    "refit_check_job",
    "run_joined",
    "run_local",
]
