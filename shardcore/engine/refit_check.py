"""``shardcore refit --check``: execute a refit plan on a live world and compare every destination byte.

Every source rank fills its local shards from known global tensors (seeded per tensor, so
every rank computes the same ones without talking), the plan is executed, and every
destination rank compares what it received, bitwise, with the slice of the same global
tensors it must hold. Tests use the same pieces (``known_tensor``, ``cut``, ``check_rank``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..plan.layout import ShardPlan
    from ..refit.manifest import Manifest, TensorSpec


@dataclass
class RefitReport:
    """What one rank saw: its destination shard (None if it has none), bytes, seconds, mismatches."""

    rank: int
    shard: int | None
    bytes_received: int = 0
    bytes_copied: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    checked: int = 0
    mismatches: list[str] = field(default_factory=list)


def known_tensor(tensor: TensorSpec, position: int) -> torch.Tensor:
    """The global tensor every rank agrees on: normal values seeded by the tensor's position."""
    import torch

    generator = torch.Generator().manual_seed(7919 + position)
    return torch.randn(tensor.shape, generator=generator).to(getattr(torch, tensor.dtype))


def cut(full: torch.Tensor, tensor: TensorSpec, plan: ShardPlan, rank: int, manifest: Manifest) -> torch.Tensor:
    """``rank``'s local shard of ``full`` under ``plan`` (each held box copied to its local offset)."""
    import torch

    from ..refit.placement import holdings, local_shape_on

    local = torch.empty(local_shape_on(tensor, plan), dtype=full.dtype)
    for box, offset in holdings(tensor, plan, rank, manifest):
        target = tuple(slice(o, o + stop - start) for o, (start, stop) in zip(offset, box))
        local[target] = full[tuple(slice(start, stop) for start, stop in box)]
    return local


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8)


def check_rank(plan: Any, rank: int, *, bucket_bytes: int | None = None, timeout: float | None = None) -> RefitReport:
    """Fill this rank's sources, execute ``plan``, and compare its destinations bitwise."""
    import torch

    from .refit import DEFAULT_BUCKET_BYTES, execute

    manifest = plan.manifest
    mine = plan.for_rank(rank)
    target_plan = next((p for p in plan.destinations if rank in p), None)
    cache: dict[str, torch.Tensor] = {}

    def full(name: str) -> torch.Tensor:
        if name not in cache:
            cache[name] = known_tensor(manifest.tensor(name), manifest.index(name))
        return cache[name]

    sources = {name: cut(full(name), manifest.tensor(name), plan.source, rank, manifest) for name in mine.source_shapes}
    destinations = {
        name: torch.full(shape, -1.0, dtype=getattr(torch, manifest.tensor(name).dtype))
        for name, shape in mine.destination_shapes.items()
    }
    stats = execute(plan, sources, destinations, timeout=timeout, bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES)
    report = RefitReport(
        rank,
        None if target_plan is None else target_plan.index,
        stats.bytes_received,
        stats.bytes_copied,
        stats.bytes_sent,
        stats.seconds,
    )
    for name, got in destinations.items():
        expected = cut(full(name), manifest.tensor(name), target_plan, rank, manifest)  # type: ignore[arg-type]
        report.checked += 1
        if not torch.equal(_bits(got), _bits(expected)):
            report.mismatches.append(f"rank {rank}: {name} differs from the source's global tensor")
    return report


def plan_from_options(options: dict[str, Any], world_size: int) -> Any:
    """The plan the CLI describes: layout, source and destination shards, model, ranks per node."""
    from ..plan.layout import DEFAULT_ORDER, plan_layout
    from ..refit.models import model_manifest
    from ..refit.planner import plan_refit

    model = options["model"]
    manifest = model_manifest(model)
    layout = plan_layout(world_size, options["shards"], order=options.get("order", DEFAULT_ORDER), allow_idle=True)
    return plan_refit(layout, options["src"], list(options["dst"]), manifest, options.get("ranks_per_node"))


def check_world(options: dict[str, Any]) -> RefitReport:
    """One rank of an initialised world: plan, check, report."""
    import torch.distributed as dist

    plan = plan_from_options(options, dist.get_world_size())
    return check_rank(plan, dist.get_rank(), bucket_bytes=options.get("bucket_bytes"), timeout=options.get("timeout"))


def local_worker(options: dict[str, Any]) -> dict[str, Any]:
    """Entry point of each process the local launcher starts (gloo on CPU)."""
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")
    try:
        return asdict(check_world(options))
    finally:
        dist.destroy_process_group()


def run_local(nproc: int, options: dict[str, Any]) -> list[RefitReport]:
    """``nproc`` local gloo processes under torch's elastic launcher, as ``shardcore check`` starts them."""
    from .check import run_local as launch

    return [RefitReport(**report) for report in launch(nproc, options, worker=local_worker)]


def run_joined(options: dict[str, Any]) -> list[RefitReport] | None:
    """Join the world torchrun set up; rank 0 gets every report, the others None."""
    import torch.distributed as dist

    from .check import _init_from_env

    _init_from_env()
    try:
        report = asdict(check_world(options))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, report)
        return [RefitReport(**r) for r in gathered] if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


__all__ = ["RefitReport", "check_rank", "check_world", "cut", "known_tensor", "run_joined", "run_local"]
