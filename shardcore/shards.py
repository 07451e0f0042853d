"""build_shards: from a spec to every rank's live groups and its backend's handle."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from . import groups as engine
from .errors import GroupCreationError, LayoutError
from .layout import GROUP_NAMES, Layout, ShardPlan, plan_layout
from .plugins import get_backend
from .spec import ShardSpec, ShardsInput

log = logging.getLogger("shardcore")


@dataclass
class Shard:
    """One shard as this rank sees it: groups and handle are set only on member ranks."""

    index: int
    spec: ShardSpec
    rank_offset: int
    world_size: int
    plan: ShardPlan = field(repr=False)
    groups: dict[str, Any] = field(default_factory=dict, repr=False)
    group_ranks: dict[str, tuple[int, ...] | None] = field(default_factory=dict, repr=False)
    handle: Any = None
    is_member: bool = False
    _created: list[Any] = field(default_factory=list, repr=False)

    @property
    def ranks(self) -> range:
        """The shard's global ranks."""
        return self.plan.ranks


def _require_world(total_world_size: int) -> tuple[int, int]:
    try:
        import torch.distributed as dist
    except ImportError:
        raise GroupCreationError("build_shards needs torch: pip install torch") from None
    if not dist.is_available() or not dist.is_initialized():
        raise GroupCreationError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() first "
            "(or shardcore_dtensor.ensure_distributed_initialized())"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if total_world_size != world:
        raise GroupCreationError(
            f"total_world_size={total_world_size} but the torch world has {world} ranks: plan the whole world "
            f"(pass {world}, with allow_idle=True for ranks outside every shard)"
        )
    return rank, world


def build_shards(
    total_world_size: int,
    shards: ShardsInput | Layout,
    *,
    backend: str | None = None,
    order: str = "tp-cp-dp-pp",
    rank_offset: int = 0,
    allow_idle: bool = False,
    strategy: str = "local",
    timeout: float | timedelta | None = None,
    groups: Sequence[str] | None = None,
    **backend_options: Any,
) -> list[Shard]:
    """Plan the layout, create this rank's groups and build its backend handle.

    Every rank of the world calls it, idle ranks too. ``groups`` names the standard
    groups to create (default: those the backend's handle uses, ``Backend.group_names``);
    the others stay None, so no rank pays for communicators nobody uses. Before any group
    is created the ranks check they planned the same layout; the call ends with a world
    sync so that no rank (least of all the store's host) tears down while others still create.
    """
    rank, _ = _require_world(total_world_size)
    chosen = get_backend(backend)
    names = _group_names(groups if groups is not None else chosen.group_names)
    layout = shards if isinstance(shards, Layout) else plan_layout(
        total_world_size, shards, order=order, rank_offset=rank_offset, allow_idle=allow_idle
    )
    if layout.world_size != total_world_size:
        raise LayoutError(f"the layout plans {layout.world_size} ranks but total_world_size={total_world_size}")
    chosen.validate(layout, backend_options)
    wait = engine.as_timedelta(timeout)
    if strategy not in engine.STRATEGIES:
        raise GroupCreationError(f"strategy={strategy!r}: expected one of {', '.join(engine.STRATEGIES)}")
    if strategy == "local":
        engine.check_local_strategy()
    fake = engine.is_fake_world()
    # Both phase names now, so a rank that fails in between stays in step with the others.
    agree, built = engine.next_phase("agree"), engine.next_phase("built")
    if fake:
        log.info("shardcore: fake backend, ranks cannot see each other: agreement checks skipped")
    else:
        plan_id = f"{layout.fingerprint()}:{chosen.name}:{','.join(names)}"
        engine.rendezvous(agree, f"{plan_id}|{strategy}|{engine.group_counter()}", wait)
    extras = {plan.index: chosen.extra_groups(plan, backend_options) for plan in layout.shards}
    try:
        planned, created_by_name, created = engine.create_groups(layout, rank, extras, strategy, wait, names)
    except BaseException as error:
        if not fake:
            engine.report_failure(built, error)
        raise
    result = []
    try:
        for plan in layout.shards:
            shard = Shard(plan.index, plan.spec, plan.rank_offset, plan.world_size, plan, dict.fromkeys(GROUP_NAMES))
            if rank in plan:
                shard.is_member, shard.group_ranks, shard._created = True, planned, created
                shard.groups.update(created_by_name)
                shard.handle = chosen.make_handle(plan, rank, shard.groups, backend_options)
            result.append(shard)
        if not fake:
            engine.rendezvous(built, "built", wait)
    except BaseException:
        engine.destroy_groups(created)
        raise
    return result


def _group_names(names: Sequence[str] | None) -> tuple[str, ...]:
    """The standard group names to create, in creation order; None means all 15."""
    if names is None:
        return GROUP_NAMES
    if isinstance(names, str):
        names = [names]
    unknown = [name for name in names if name not in GROUP_NAMES]
    if unknown:
        raise LayoutError(f"unknown group name {unknown[0]!r}: choose from {', '.join(GROUP_NAMES)}")
    return tuple(name for name in GROUP_NAMES if name in names)


def my_shard(shards: Sequence[Shard]) -> Shard | None:
    """This rank's shard, or None on an idle rank."""
    return next((shard for shard in shards if shard.is_member), None)


def destroy_shards(shards: Sequence[Shard]) -> None:
    """Destroy exactly the groups ``build_shards`` created on this rank."""
    for shard in shards:
        engine.destroy_groups(shard._created)
        shard._created = []
        shard.groups = {name: None for name in shard.groups}
        shard.handle = None


__all__ = ["Shard", "build_shards", "destroy_shards", "my_shard"]
